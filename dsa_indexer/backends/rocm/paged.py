"""aiter's paged MQA logits as ``paged_mqa_logits`` on AMD, reading this library's 64-token page layout directly.

Checked against ROCm/aiter main e4048607 (source read: `aiter/ops/triton/attention/pa_mqa_logits.py`, its plain Triton
kernel `_triton_kernels/attention/pa_mqa_logits.py` and the Gluon kernels `gluon/pa_mqa_logits.py`) and the PyPI wheel
amd-aiter 0.1.7.post2.dev18.

**Which of aiter's paths honours a 64-token page.** aiter's public ``deepgemm_fp8_paged_mqa_logits(q, kv_cache,
weights, out_logits, context_lens, kv_indices, max_model_len, Preshuffle=False, KVBlockSize=1, ...)`` picks a kernel
by its module flag ``enable_gluon_pa_mqa_logits`` (Triton >= 3.5 and the GPU one of gfx942 / gfx950 / gfx1250, or
the AOT environment variable on older Triton):

* the flag set, ``Preshuffle=False``: ``_gluon_deepgemm_fp8_paged_mqa_logits``. It reads ``kv_indices[b, token]``
  and one key row per entry, i.e. page size 1, whatever ``KVBlockSize`` says (aiter asserts ``KVBlockSize == 1``
  for it on gfx1250 only). On our pages it reads the wrong keys without any error;
* the flag set, ``Preshuffle=True``: the preshuffle kernels, which need ``KVBlockSize % 16 == 0`` and a cache whose
  block holds tiles of 16 tokens x 16 dims (key (t, d) at ``d % 16 + d // 16 * 256 + t % 16 * 16 + t // 16 * 2048``),
  not this library's row-major ``t * 128 + d``;
* the flag clear: the plain Triton kernel ``_deepgemm_fp8_paged_mqa_logits``, which addresses ``block_table[b,
  t // KVBlockSize]`` and token ``t % KVBlockSize`` with the block and token strides it is given: this cache.

So the registered launch is ``"kernel"``: this adapter launches the plain Triton kernel itself, with the strides of
``paged64_fp8_e4m3`` (per page 64 x 128 fp8 values then 64 fp32 scales) and by the kernel's own parameter names, so a
renamed parameter fails loudly. The split over keys comes from this device's compute-unit count (aiter's formula).
aiter's wrapper also passes ``waves_per_eu`` (an AMD occupancy hint); the launch here does not, so that the same
code runs on NVIDIA (the H200 test) and in Triton's interpreter. The ``"wrapper"`` launch is kept for an aiter whose
flag says it routes to the plain kernel, and refuses otherwise (`wrapper_route`).

amd-aiter 0.1.7.post2.dev18 has neither: its ``deepgemm_fp8_paged_mqa_logits`` and kernel have no ``KVBlockSize``
(a page-size-1 cache, ``kv_cache [num_blocks, 1, 1, D + 4]``), so the feature check finds nothing to adapt. Nor does
any release: the plain kernel of every ROCm/aiter tag up to v0.1.20.post1 takes ``stride_k_seq`` (page size 1); it
took block and token strides in main's commit 04907edc (#4825, 2026-08-20), after the last tag.

Semantics, matched here: one length per request (row j of request b sees keys ``t <= context_lens[b] - N + j``,
causal next_n), so the registration takes next_n 1; columns past a row's last chunk are not written, so the
adapter pre-fills the output with -inf (as aiter's tests do). `check_paged_adapter` is the probe's self-test.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any, Callable

import torch

from ...contract.cache import HEAD_DIM, PAGE_BYTES, PAGE_SIZE
from .lookup import find_function

WRAPPER_MODULES = ("aiter.ops.triton.attention.pa_mqa_logits", "aiter.ops.triton.pa_mqa_logits")
WRAPPER_NAME = "deepgemm_fp8_paged_mqa_logits"
KERNEL_MODULES = ("aiter.ops.triton._triton_kernels.attention.pa_mqa_logits",)
KERNEL_NAME = "_deepgemm_fp8_paged_mqa_logits"
CHUNK_K = 256  # keys per inner step (aiter's default); a multiple of the 64-token page
# The plain kernel's parameters this adapter passes (ROCm/aiter e4048607): the block and token strides are what make
# it honour KVBlockSize; 0.1.7's page-size-1 kernel has a single ``stride_k_seq`` instead.
KERNEL_PARAMS = ("batch_size", "next_n", "heads_num", "Q_buffer", "stride_q_batch", "stride_q_next_n",
                 "stride_q_heads", "KV_buffer", "stride_k_block", "stride_k_token", "scale_buffer",
                 "stride_scale_block", "stride_scale_token", "context_len_ptr", "kv_indices", "weights",
                 "stride_w_batch", "OutLogits_buffer", "stride_out_batch", "max_model_len", "max_blk_len", "ChunkQ",
                 "ChunkK", "HiddenDim", "KVBlockSize", "SplitKV")
GLUON_FLAG = "enable_gluon_pa_mqa_logits"  # aiter's own routing decision, set at import of its wrapper module

# The plain kernel's address arithmetic is 32-bit (ROCm/aiter e4048607,
# aiter/ops/triton/_triton_kernels/attention/pa_mqa_logits.py, `_deepgemm_fp8_paged_mqa_logits`): key (block p,
# token t, dim d) is read at ``p * stride_k_block + t * stride_k_token + d``, with p loaded from the int32 block
# table and strides that Triton types int32 (values below 2**31; this kernel declares none of them tl.int64, unlike
# its `_deepgemm_fp8_paged_mqa_logits_stage1` sibling in the same file). With this cache's strides (8448 bytes per
# page, 128 per token) the offset of a page's last key byte, p * 8448 + 8191, passes 2**31 - 1 from p = 254200 on:
# those keys wrap to negative offsets and are read from the wrong place, silently. The scale offsets (p * 2112 + t
# fp32 words, the same byte range) stay below it for every page that passes. So a cache of more pages than this is
# refused (the registration's `pages` capability, and the adapter itself), until aiter widens the arithmetic.
INT32_MAX = 2**31 - 1
MAX_INT32_PAGES = (INT32_MAX - (PAGE_SIZE * HEAD_DIM - 1)) // PAGE_BYTES + 1  # 254200 pages (2,147,481,600 bytes)


def _param_names(fn: Any) -> list[str]:
    names = getattr(fn, "arg_names", None)  # a Triton JITFunction
    if names is not None:
        return list(names)
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def _takes_block_size(fn: Any) -> bool:
    """True for the block-level API (a ``KVBlockSize`` parameter): aiter 0.1.7's page-size-1 version has none."""
    return "KVBlockSize" in _param_names(fn)


def takes_block_layout(kernel: Any) -> bool:
    """The plain kernel takes every parameter the launch passes (block and token strides, KVBlockSize)."""
    return set(KERNEL_PARAMS) <= set(_param_names(kernel))


def find_wrapper() -> tuple[str, Callable] | None:
    found = find_function(WRAPPER_MODULES, WRAPPER_NAME)
    return found if found is not None and _takes_block_size(found[1]) else None


def find_kernel() -> tuple[str, Any] | None:
    found = find_function(KERNEL_MODULES, KERNEL_NAME)
    return found if found is not None and takes_block_layout(found[1]) else None


def wrapper_route(wrapper: Callable) -> str | None:
    """None when aiter's wrapper would launch the plain Triton kernel (which honours KVBlockSize) for
    ``Preshuffle=False``; else why it must not be called with 64-token pages. Reads aiter's own routing flag from
    the wrapper's module (set at import from the Triton version and the GPU arch); without the flag the route
    cannot be known, so the answer is a refusal."""
    module = sys.modules.get(getattr(wrapper, "__module__", "") or "")
    if module is None:
        try:
            module = importlib.import_module(wrapper.__module__)
        except Exception:  # noqa: BLE001 - an unknown module is an unknown route
            module = None
    flag = getattr(module, GLUON_FLAG, None) if module is not None else None
    if flag is None:
        return (f"{getattr(wrapper, '__module__', '?')} has no {GLUON_FLAG} flag: where {WRAPPER_NAME} routes "
                "Preshuffle=False cannot be told, and its Gluon kernel reads page size 1")
    if flag:
        triton_version = getattr(module, "triton_version", "?")
        return (f"aiter routes {WRAPPER_NAME}(Preshuffle=False) to _gluon_deepgemm_fp8_paged_mqa_logits here "
                f"({GLUON_FLAG}=True, Triton {triton_version}), which addresses the cache as page size 1 and ignores "
                f"KVBlockSize={PAGE_SIZE}; the preshuffled path needs another cache layout. Use launch='kernel'")
    return None


def _compute_units(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def row_bucket(rows: int) -> int:
    """The power of two >= ``rows``: the split over keys is chosen per bucket, not per row count."""
    return 1 << max(0, rows - 1).bit_length()


def split_kv(units: int, rows: int) -> int:
    """Programs per query row over the keys: aiter's formula ``(max(1, units // rows) + 4) // 5 * 5`` applied to the
    row count's power-of-two bucket. ``SplitKV`` is a ``tl.constexpr`` of aiter's kernel, so each value is a
    compile of its own: aiter's per-row-count value gives 15 of them over batch sizes 1..304 on 304 compute units,
    each compiled inside the first step (or graph warm-up) of a new size. Per bucket it is at most
    ``log2(units) + 2`` values (7 on 304 units), all compiled by `warm_split_buckets` when the probe runs (before
    any capture). The bucket launches at most half the programs aiter's value would just past a power of two. The
    logits do not depend on it: each program writes its own chunks' columns, nothing is reduced across splits."""
    return (max(1, units // row_bucket(max(1, rows))) + 4) // 5 * 5


def split_buckets(units: int) -> list[int]:
    """One row count per distinct `split_kv` value on a device of ``units`` compute units (from 1 row up to the
    bucket past which the value stays 5)."""
    rows, seen, out = 1, set(), []
    while True:
        value = split_kv(units, rows)
        if value not in seen:
            seen.add(value)
            out.append(rows)
        if units // rows == 0:
            return out
        rows *= 2


def _split_kv(device: torch.device, rows: int) -> int:
    return split_kv(_compute_units(device), rows)


def warm_split_buckets(fn: Callable[..., torch.Tensor], device: torch.device | str,
                       fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> list[int]:
    """Launch the adapter ``fn`` once for every `split_kv` value this device can pick (one page, random finite keys),
    so no decode step or graph capture compiles aiter's kernel later; returns the row counts launched. Run by the
    probe's self-test, i.e. at the first resolution, which must come before any capture."""
    from ...contract.cache import IndexKCache

    device = torch.device(device)
    cache = IndexKCache.allocate(1, device, fp8_dtype).data
    cache.view(-1, PAGE_BYTES)[:, : PAGE_SIZE * HEAD_DIM].view(fp8_dtype).fill_(0.5)
    cache.view(-1, PAGE_BYTES)[:, PAGE_SIZE * HEAD_DIM:].view(torch.float32).fill_(1.0)
    rows_launched = split_buckets(_compute_units(device))
    for rows in rows_launched:
        q = torch.full((rows, 1, 64, HEAD_DIM), 0.5, device=device).to(fp8_dtype)
        fn(q, cache, torch.ones(rows, 64, device=device), torch.ones(rows, 1, dtype=torch.int32, device=device),
           torch.zeros(rows, 1, dtype=torch.int32, device=device), PAGE_SIZE)
    return rows_launched


def make_paged_mqa_logits(launch: str = "kernel", fn: Any = None) -> Callable[..., torch.Tensor]:
    """``paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len)`` (the reference's
    signature) over aiter's plain Triton paged kernel (``launch="kernel"``, the registered one) or aiter's wrapper
    (``launch="wrapper"``, only where `wrapper_route` says it reaches that kernel)."""
    if launch not in ("wrapper", "kernel"):
        raise ValueError(f"launch must be 'wrapper' or 'kernel', got {launch!r}")
    if fn is None:
        found = find_wrapper() if launch == "wrapper" else find_kernel()
        if found is None:
            what = (f"block-level {WRAPPER_NAME} (a KVBlockSize parameter)" if launch == "wrapper" else
                    f"{KERNEL_NAME} taking block and token strides and KVBlockSize")
            raise RuntimeError(f"aiter has no {what} in {', '.join(WRAPPER_MODULES + KERNEL_MODULES)} (amd-aiter "
                               "0.1.7 and every tag up to v0.1.20.post1 read a page-size-1 cache; ROCm/aiter main has "
                               "it from 04907edc on, e4048607 read)")
        fn = found[1]
    if launch == "wrapper":
        reason = wrapper_route(fn)
        if reason is not None:
            raise RuntimeError(reason)
    elif not takes_block_layout(fn):
        raise RuntimeError(f"{KERNEL_NAME} lacks parameters {sorted(set(KERNEL_PARAMS) - set(_param_names(fn)))}: "
                           "not the block-level kernel this launch was written for (ROCm/aiter e4048607)")

    def paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor,
                         block_table: torch.Tensor, max_context_len: int) -> torch.Tensor:
        b, n, heads, dim = q.shape
        if kv_cache.shape[0] > MAX_INT32_PAGES:
            raise ValueError(f"kv_cache has {kv_cache.shape[0]} pages: aiter's plain paged kernel addresses keys in "
                             f"int32 and reads wrong keys past {MAX_INT32_PAGES} pages ({MAX_INT32_PAGES * PAGE_BYTES} "
                             "bytes); use the library's Triton paged_mqa_logits (int64 addresses) for this cache")
        if n != 1:
            raise ValueError("aiter's paged logits derive each row's length from one length per request; this "
                             "adapter takes next_n 1 (the registration routes next_n > 1 elsewhere)")
        out = torch.full((b * n, max_context_len), float("-inf"), dtype=torch.float32, device=q.device)
        if b == 0 or max_context_len == 0:
            return out
        lens = context_lens.reshape(b, n)[:, -1].to(torch.int32).contiguous()
        table = block_table.to(torch.int32).contiguous()
        weights_ = weights.float().contiguous()
        if launch == "wrapper":
            fn(q, kv_cache, weights_, out, lens, table, max_context_len, Preshuffle=False, KVBlockSize=PAGE_SIZE,
               ChunkK=CHUNK_K)
            return out
        blocks = kv_cache.view(kv_cache.shape[0], -1)
        values = blocks[:, : PAGE_SIZE * dim].view(q.dtype).view(-1, PAGE_SIZE, dim)
        scales = blocks[:, PAGE_SIZE * dim:].view(torch.float32).view(-1, PAGE_SIZE)
        split = _split_kv(q.device, b * n)
        fn[(b * n * split,)](
            batch_size=b, next_n=n, heads_num=heads, Q_buffer=q, stride_q_batch=q.stride(0),
            stride_q_next_n=q.stride(1), stride_q_heads=q.stride(2), KV_buffer=values,
            stride_k_block=values.stride(0), stride_k_token=values.stride(1), scale_buffer=scales,
            stride_scale_block=scales.stride(0), stride_scale_token=scales.stride(1), context_len_ptr=lens,
            kv_indices=table, weights=weights_, stride_w_batch=weights_.stride(0), OutLogits_buffer=out,
            stride_out_batch=out.stride(0), max_model_len=max_context_len, max_blk_len=table.shape[1],
            ChunkQ=heads, ChunkK=CHUNK_K, HiddenDim=dim, KVBlockSize=PAGE_SIZE, SplitKV=split)
        return out

    return paged_mqa_logits


# ----------------------------------------------------------------------------------------------------------------
# Self-test (run by the aiter probe on the real device; also used by the tests)
def check_paged_adapter(fn: Callable[..., torch.Tensor], device: torch.device | str,
                        fp8_dtype: torch.dtype = torch.float8_e4m3fn, heads: int = 64, seed: int = 13) -> None:
    """Compare ``fn`` with the reference on 64-token pages: four requests whose lengths are not multiples of 64
    (one shorter than a page, one longer than a 256-key chunk), a shuffled block table over a larger pool of random
    pages, a table wider than the longest request. Raises AssertionError naming the first difference. Tolerance:
    -inf pattern exact; finite values within 2e-3 x the largest |logit| (fp8 MMA accumulation)."""
    from ...contract.cache import IndexKCache, page_views
    from ..reference import kernels as ref

    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor([[37], [130], [301], [64 * 5 + 7]], dtype=torch.int32)
    width = 7  # pages per request in the table: wider than the longest request (6 pages)
    pool = 4 * width + 3
    fmax = ref.fp8_max(fp8_dtype)
    cache = IndexKCache.allocate(pool, "cpu", fp8_dtype).data
    keys, key_scales = page_views(cache, fp8_dtype)
    keys.copy_((torch.randn(keys.shape, generator=gen) * fmax / 8).to(fp8_dtype))  # finite in both fp8 flavours
    key_scales.copy_(torch.rand(key_scales.shape, generator=gen) * 1e-2 + 1e-3)
    table = torch.randperm(pool, generator=gen)[: 4 * width].to(torch.int32).view(4, width)
    q = (torch.randn(4, 1, heads, 128, generator=gen) * fmax / 8).to(fp8_dtype)
    weights = torch.randn(4, heads, generator=gen)
    max_len = width * PAGE_SIZE
    args = (q.to(device), cache.to(device), weights.to(device), lens.to(device), table.to(device), max_len)
    got = fn(*args).cpu()
    want = ref.paged_mqa_logits(q, cache, weights, lens, table, max_len)
    assert got.shape == want.shape and got.dtype == torch.float32, f"shape/dtype {tuple(got.shape)} {got.dtype}"
    visible = torch.isfinite(want)
    bad = torch.isneginf(got) != ~visible
    if bool(bad.any()):
        row = int(bad.any(dim=1).nonzero()[0])
        raise AssertionError(f"request {row} (length {int(lens[row])}): -inf pattern differs from the window at "
                             f"columns {bad[row].nonzero().flatten()[:8].tolist()}")
    scale = float(want[visible].abs().max())
    err = (got[visible] - want[visible]).abs()
    if not bool((err <= 2e-3 * scale).all()):  # also catches NaN
        raise AssertionError(f"max paged logit error {float(err.max()):.3g} (largest |logit| {scale:.3g})")
