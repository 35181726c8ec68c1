"""DeepGEMM's FP4 logits (sm100 only; DeepGEMM's csrc/apis/attention.hpp at commit 54e2261, docs/v4.md): the
packing of the FP4 operands, the adapters of ``fp8_fp4_mqa_logits`` (ragged, FP4 keys ``keys="fp4"``) and
``fp8_fp4_paged_mqa_logits`` (the 68-byte pages), each with the matching reference kernel's signature and result, and
their self-tests against the reference (run by the factories on the GPU). Nothing here imports ``deep_gemm``: the
factories in `backends/cuda/__init__.py` pass the module in. The vendor-free FP4 packing (e2m1 nibbles, ue8m0 bytes,
the 68-byte cache layout) lives in `contract/cache.py`."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

import torch

from ...contract.cache import E2M1_GRID  # noqa: F401 (re-exported)
from ...contract.cache import FP4_BYTES_PER_TOKEN, FP4_VALUE_BYTES, PAGE_SIZE
from ...contract.cache import pack_e2m1 as pack_fp4_bytes
from ...contract.validate import IndexerInputError, ranges_checked
from .deepgemm_api import FP4_LOGITS_BLOCK, METADATA, PAGED_NEW, RAGGED_NEW, DeepGemmApi
from ...contract.step import StepContext, step_scratch
from .deepgemm_kernels import device_sm_count, mask_tail_, ue8m0_bytes

def pack_ue8m0_rows(scales: torch.Tensor) -> torch.Tensor:
    """fp32 power-of-two block scales [..., B] (B <= 4) as one int32 per row (contiguous), the ``q_sf`` / ``kv_sf``
    of DeepGEMM's FP4 logits: block b's ue8m0 byte in byte b (little-endian); missing blocks hold 127 (2^0), as
    DeepGEMM's own quantizer pads them (they cover no elements)."""
    blocks = scales.shape[-1]
    if blocks > 4:
        raise ValueError(f"one int32 packs at most 4 block scales, got {blocks} per row")
    padded = torch.full((*scales.shape[:-1], 4), 127, dtype=torch.uint8, device=scales.device)
    padded[..., :blocks] = ue8m0_bytes(scales)
    return padded.view(torch.int32).squeeze(-1)


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """fp32 values on the e2m1 grid [..., D] as DeepGEMM's packed FP4 (int8 [..., D / 2]): the bytes of
    `contract.cache.pack_e2m1` (element 2i in the low nibble, ``sign << 3 | code``), as the int8 DeepGEMM takes."""
    return pack_fp4_bytes(values).view(torch.int8)


def unfold_fp4_rows(x_fp8: torch.Tensor, block: int = FP4_LOGITS_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of the fold (`fp4.fold_fp4_to_fp8`) for q: fp8 rows [..., D] that hold FP4 values times one
    power-of-two row scale, back to ``(e2m1 values [..., D] fp32, block scales [..., D / block] fp32)`` whose product
    is the fp8 rows (the row scale stays where the library keeps q's, in the head weights).

    Each block's scale is ``2^(floor(log2(max |x|)) - 2)`` (the smallest power of two that brings the block's
    largest value to at most 6; 1 for an all-zero block). Exact for every block the fold kept exact; a block more than
    2^14 below its row's largest (e4m3 subnormals after the fold) takes the nearest e2m1 values (a change below 2^-14
    of the row)."""
    from ..reference.kernels import round_to_e2m1

    shape = x_fp8.shape
    xf = x_fp8.float().reshape(*shape[:-1], shape[-1] // block, block)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    _, exponent = torch.frexp(amax)  # amax = m * 2^exponent, m in [0.5, 1): floor(log2(amax)) = exponent - 1
    scale = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), exponent - 3), torch.ones_like(amax))
    values = round_to_e2m1((xf / scale).clamp(-6.0, 6.0))
    if ranges_checked(xf) and not torch.equal(values * scale, xf):
        raise IndexerInputError("the fp8 rows do not hold FP4 values (key_quant='fp4_e2m1' folds them so): the FP4 "
                                "logits would change them; use the fp8 logits")
    return values.reshape(shape), scale.squeeze(-1)


def fp4_q_operand(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The library's folded fp8 q [..., H, 128] as DeepGEMM's FP4 q: (packed e2m1 int8 [..., H, 64], int32
    [..., H] of four ue8m0 block scales), both contiguous."""
    if q.shape[-1] != 4 * FP4_LOGITS_BLOCK:
        raise IndexerInputError(f"DeepGEMM's FP4 logits take q with head dim {4 * FP4_LOGITS_BLOCK} (4 blocks of "
                                f"{FP4_LOGITS_BLOCK}), got {q.shape[-1]}")
    values, blocks = unfold_fp4_rows(q)
    return pack_e2m1(values).contiguous(), pack_ue8m0_rows(blocks).contiguous()


def fp4_key_operand(k: torch.Tensor, k_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ragged op's FP4 keys (k uint8 [N, 64] packed e2m1, k_scales uint8 [N, 4] ue8m0 bytes: the 68-byte pages'
    bytes) as DeepGEMM's kv: the same bytes, as int8 [N, 64] and one int32 per row (the four bytes little-endian,
    block b in byte b, as the pages store them). No value is read or changed."""
    if k.dtype != torch.uint8 or k.dim() != 2 or k.shape[1] != FP4_VALUE_BYTES:
        raise IndexerInputError(f"k must be FP4 keys, uint8 [N, {FP4_VALUE_BYTES}] packed e2m1 (keys='fp4'), got "
                                f"{str(k.dtype).replace('torch.', '')} {list(k.shape)}")
    if k_scales.dtype != torch.uint8 or tuple(k_scales.shape) != (k.shape[0], 4):
        raise IndexerInputError(f"k_scales must be uint8 [{k.shape[0]}, 4] (one ue8m0 byte per block of "
                                f"{FP4_LOGITS_BLOCK} of each key), got {str(k_scales.dtype).replace('torch.', '')} "
                                f"{list(k_scales.shape)}")
    return k.contiguous().view(torch.int8), k_scales.contiguous().view(torch.int32).reshape(-1)


def make_fp4_ragged_mqa_logits(module: ModuleType, api: DeepGemmApi) -> Callable[..., torch.Tensor]:
    """Prefill logits over FP4 keys (``keys="fp4"``) through DeepGEMM's ``fp8_fp4_mqa_logits`` with q's scales given
    (FP4 q; DeepGEMM runs it on sm100 only). Same signature and result as the `ragged_mqa_logits` op's FP4 form:
    k uint8 [N, 64] and k_scales uint8 [N, 4] (the pages' bytes, `IndexKCache.gather_packed`) are passed as they are
    (`fp4_key_operand`); q [S, H, 128] is the library's folded fp8 q (its row scale in ``weights``), unfolded exactly
    (`fp4_q_operand`). -inf outside ``[ks, ke)`` is DeepGEMM's (``clean_logits=True``); its result is a view with a
    padded row stride, returned as a contiguous copy (the op's contract, as the fp8 adapter)."""
    if api.ragged_fn != RAGGED_NEW:
        raise RuntimeError(f"{api.describe()} has no FP4 ragged logits ({RAGGED_NEW}, DeepGEMM 2.x)")
    kernel = getattr(module, RAGGED_NEW)
    # max_seqlen_k stays at its default 0: a positive value switches DeepGEMM to logits indexed from ks.

    def ragged_mqa_logits_fp4(q: torch.Tensor, k: torch.Tensor, k_scales: torch.Tensor, weights: torch.Tensor,
                              ks: torch.Tensor, ke: torch.Tensor) -> torch.Tensor:
        kv_arg = fp4_key_operand(k, k_scales)
        q_arg = fp4_q_operand(q)
        logits = kernel(q_arg, kv_arg, weights.float().contiguous(), ks.contiguous(), ke.contiguous(),
                        clean_logits=True, logits_dtype=torch.float32)
        return logits.contiguous()

    ragged_mqa_logits_fp4.api = api  # type: ignore[attr-defined]
    return ragged_mqa_logits_fp4


def make_fp4_paged_mqa_logits(module: ModuleType, api: DeepGemmApi) -> Callable[..., torch.Tensor]:
    """Decode logits over V4's FP4 pages (``paged64_fp4_e2m1``, 68 bytes per token: DeepGEMM's own paged FP4 layout,
    passed as is) through ``fp8_fp4_paged_mqa_logits`` with q's scales given (FP4 q; DeepGEMM runs it on sm100 only).
    Same signature and result as the `paged_mqa_logits` op: q [B, N, H, 128] is the library's folded fp8 q (its row
    scale in ``weights``), unfolded exactly (`fp4_q_operand`) into packed e2m1 int8 [B, N, H, 64] and one int32 of
    four ue8m0 block scales per (row, head). 2-D context lengths, schedule metadata once per step (shared with the
    layers through the step's context), the tail past each row's length masked here (``clean_logits=False``, as the fp8
    adapter: DeepGEMM leaves garbage there)."""
    if api.paged_fn != PAGED_NEW:
        raise RuntimeError(f"{api.describe()} has no FP4 paged logits ({PAGED_NEW} with {METADATA}, DeepGEMM 2.x)")
    kernel = getattr(module, PAGED_NEW)
    metadata = getattr(module, METADATA)
    extra: dict[str, Any] = {}
    if "clean_logits" in api.paged_params:
        extra["clean_logits"] = False
    if "logits_dtype" in api.paged_params:
        extra["logits_dtype"] = torch.float32

    def schedule(context_lens: torch.Tensor, device: torch.device, context: StepContext | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        num_sms = device_sm_count(module, device)

        def compute() -> tuple[torch.Tensor, torch.Tensor]:
            # Rows with no visible key would make DeepGEMM fault: one key to read; the mask below uses the true ones.
            lens = context_lens.contiguous().clamp_min(1)
            return lens, metadata(lens, PAGE_SIZE, num_sms)

        return step_scratch(context, ("deepgemm_fp4_paged_schedule", num_sms), compute)

    def paged_mqa_logits_fp4(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                             context_lens: torch.Tensor, block_table: torch.Tensor, max_context_len: int, *,
                             context: StepContext | None = None) -> torch.Tensor:
        if kv_cache.shape[-1] != FP4_BYTES_PER_TOKEN:
            raise IndexerInputError(f"the FP4 paged logits adapter reads the paged64_fp4_e2m1 pages "
                                    f"({FP4_BYTES_PER_TOKEN} bytes per token), got {kv_cache.shape[-1]} per token")
        if ranges_checked(context_lens) and not bool((context_lens[:, -1:] >= context_lens).all()):
            raise IndexerInputError(f"{api.describe()} computes keys up to context_lens[b, -1] for every row of "
                                    "request b: context_lens[b, j] must be <= context_lens[b, -1]")
        q_arg = fp4_q_operand(q)
        lens, meta = schedule(context_lens, q.device, context)
        logits = kernel(q_arg, kv_cache, weights.float().contiguous(), lens, block_table, meta, max_context_len,
                        **extra)
        mask_tail_(logits, context_lens.reshape(-1))
        return logits if logits.is_contiguous() else logits.contiguous()

    paged_mqa_logits_fp4.api = api  # type: ignore[attr-defined]
    return paged_mqa_logits_fp4


def _self_test_inputs(rows: int, heads: int, keys: int):
    """Fresh random inputs for a self-test (a new seed each time): the library's folded FP4 q [rows, heads, 128] with
    its weights (row scale folded in), and FP4 keys (``quant_fp4_e2m1`` values and scales, [keys, 128] / [keys, 4]),
    their blocks' scales spread over 2^-5..2^3 so that every scale byte matters."""
    from ..reference import kernels as ref

    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    x = torch.randn(keys, 128, generator=gen)
    x = x * torch.exp2(torch.randint(-5, 4, (keys, 4, 1), generator=gen).float()).repeat_interleave(32, 1)[..., 0]
    key_values, key_scales = ref.quant_fp4_e2m1(x, FP4_LOGITS_BLOCK)
    q, row_scale = ref.rotate_quant_fp4(torch.randn(rows, heads, 128, generator=gen), FP4_LOGITS_BLOCK)
    weights = torch.randn(rows, heads, generator=gen) * row_scale
    return gen, q, weights, key_values, key_scales


def _require_match(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """The self-tests' verdict: the same shape and -inf pattern as the reference, and the visible logits within
    2e-3 of the largest one (fp32 sums of exact products in another order; an FP4 layout mistake is O(1))."""
    if got.shape != want.shape or not torch.equal(torch.isneginf(got), torch.isneginf(want)):
        raise RuntimeError(f"the DeepGEMM FP4 {what} logits differ from the reference in shape or -inf pattern")
    visible = ~torch.isneginf(want)
    if not bool(visible.any()):
        return
    diff = float((got[visible] - want[visible]).abs().max())
    bound = 2e-3 * float(want[visible].abs().max())
    if not diff <= bound:
        raise RuntimeError(f"the DeepGEMM FP4 {what} logits differ from the reference: max |diff| {diff:.3g} > "
                           f"{bound:.3g}")


def check_fp4_paged_adapter(adapter: Callable[..., torch.Tensor], device: torch.device | str) -> None:
    """Run ``adapter`` once on fresh random FP4 keys and folded FP4 q against the reference (the factory's self-test
    on the GPU: the adapter has never run on a real sm100; a failure rejects it and resolution moves on)."""
    from ...contract.cache import IndexKCache, store_fp4_rows
    from ..reference import kernels as ref

    pages, batch, next_n, heads = 6, 2, 2, 64
    gen, q, weights, values, scales = _self_test_inputs(batch * next_n, heads, pages * 64)
    q = q.view(batch, next_n, heads, 128)
    cache = IndexKCache.allocate(pages, layout="paged64_fp4_e2m1")
    store_fp4_rows(cache.data, torch.arange(pages * 64), values, scales)
    table = torch.randperm(pages, generator=gen).to(torch.int32).view(batch, 3)
    lens = torch.tensor([[99, 100], [190, 191]], dtype=torch.int32)
    args = [t.to(device) for t in (q, cache.data, weights, lens, table)]
    got = adapter(*args, 192).cpu()
    _require_match(got, ref.paged_mqa_logits(q, cache.data, weights, lens, table, 192), "paged")


def check_fp4_ragged_adapter(adapter: Callable[..., torch.Tensor], device: torch.device | str) -> None:
    """Run ``adapter`` once on fresh random FP4 keys (the ragged op's FP4 form: packed e2m1 bytes and ue8m0 bytes)
    and folded FP4 q against the reference (the factory's self-test on the GPU, as `check_fp4_paged_adapter`)."""
    from ..reference import kernels as ref

    rows, heads, keys = 7, 64, 300
    _, q, weights, values, scales = _self_test_inputs(rows, heads, keys)
    k, k_scales = pack_fp4_bytes(values), ue8m0_bytes(scales)
    # Windows of prefill rows (causal over a second chunk), one row that sees one key and one that sees none.
    ks = torch.tensor([0, 0, 17, 100, 150, 299, 64], dtype=torch.int32)
    ke = torch.tensor([1, 200, 230, 250, 300, 300, 64], dtype=torch.int32)
    args = [t.to(device) for t in (q, k, k_scales, weights, ks, ke)]
    got = adapter(*args).cpu()
    _require_match(got, ref.ragged_mqa_logits(q, k, k_scales, weights, ks, ke), "ragged")


# What the factories build and self-test, by op (`backends/cuda/__init__.py`).
FP4_ADAPTERS = {"paged_mqa_logits": (make_fp4_paged_mqa_logits, check_fp4_paged_adapter),
                "ragged_mqa_logits": (make_fp4_ragged_mqa_logits, check_fp4_ragged_adapter)}
