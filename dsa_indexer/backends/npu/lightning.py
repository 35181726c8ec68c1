"""`lightning_indexer_ragged` on torch_npu's fused indexers (logits and top-k in one kernel, no logits in memory).

The calls follow op-plugin's published schemas (``op_plugin/config/op_plugin_functions.yaml``, master 517f2e7d and
the 7.3.0 / 26.0.0 / 26.1.0 branches; `api.detect` checks the installed schema takes them):

bf16 keys (layout ``paged64_bf16``): ``npu_lightning_indexer(query [T, 64, 128], key [blocks, 64, 1, 128],
weights [T, 64] (the query's dtype), *, actual_seq_lengths_query=cumulative row ends [B] int32 (no leading 0),
actual_seq_lengths_key=[B] int32 tokens per request, block_table [B, pages] int32, layout_query="TND",
layout_key="PA_BSND", sparse_count=k (1..2048), sparse_mode=3) -> (sparse_indices, sparse_values)``. sparse_mode 3
is the bottom-right-aligned causal mask: query i of n with L keys sees keys < L - n + i + 1, which is this op's
contract (a request's rows are its last tokens). ``sparse_indices`` is int32 ``[T, 1, k]``: request-local
positions, -1 padded.

int8 keys (layout ``paged64_int8``): ``npu_quant_lightning_indexer(query int8, key int8, weights fp16,
query_dequant_scale fp16 [T, 64], key_dequant_scale fp16 [blocks, 64, 1], query_quant_mode=0, key_quant_mode=0, *,
<the same keywords>) -> Tensor``: score ``sum_h w * relu(sq * sk * (q_int8 . k_int8))``. No published schema takes
a compression ratio, so compressed (C4) keys are refused here (the registration's supports check says so too).

NaN: the kernels' top-k order of NaN is undefined (op-plugin's npu_quant_lightning_indexer doc says so), and the
library's rule is that a NaN score ranks as -inf; so NaN must never reach the kernel. The keys are checked finite
when k_prologue_store_plain.npu.torch_npu stores them (`prologue.py`), on the device: the store runs inside the
pipeline (on the side stream), where a host read would block the host before the q path is enqueued, so it stores
bad rows as zeros and leaves their flags in `STORE_CHECKS`, which this scoring reads and raises on before its kernel.
Here q, its scales and the weights are checked on the host (this path is never captured in a CUDA-style graph, and
the streams have joined), and under DSA_INDEXER_CHECK_RANGES=1 (or on CPU tensors) the whole key cache too, for
caches that were filled some other way.
"""

from __future__ import annotations

import logging
import threading

import torch

from ...contract import validate as v
from ...contract.cache import decode_row_requests, indices_to_slots, page_views
from .api import INDEXER, PRODUCT_NAMES, QUANT_INDEXER, NpuApi

log = logging.getLogger("dsa_indexer")


def require_finite(name: str, t: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Raise naming ``name`` when ``t`` holds NaN or inf (``rows``: the row numbers to report for t's rows). One
    reduction and a host read: the NPU path is never graph-captured, so the sync is allowed."""
    if not t.numel() or bool(torch.isfinite(t).all()):
        return
    bad = (~torch.isfinite(t)).reshape(t.shape[0], -1).any(dim=1).nonzero().flatten()
    if rows is not None:
        bad = rows[bad]
    shown = bad[:8].tolist()
    raise v.IndexerInputError(
        f"{name} holds NaN or inf in {bad.numel()} of its {t.shape[0]} rows (rows {shown}"
        f"{' ...' if bad.numel() > 8 else ''}): torch_npu's indexers rank NaN in an undefined order and a NaN score "
        "must never be selected, so the NPU path refuses them")


class StoreChecks:
    """The stores' non-finite rows, as device flags per key cache, until the next scoring over that cache reads them
    (`raise_pending`): the store itself never reads the host. A cache stored into many times without a scoring in
    between keeps its last ``KEEP`` stores' rows and one summary flag for the older ones."""

    KEEP = 16

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, list[tuple[str, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]] = {}

    @staticmethod
    def _key(cache: torch.Tensor) -> int:
        return cache.untyped_storage().data_ptr()

    def record(self, cache: torch.Tensor, what: str, bad: torch.Tensor, rows: torch.Tensor | None = None,
               from_input: torch.Tensor | None = None) -> None:
        """``bad`` [N] bool: the stored rows (numbers ``rows``) that were not finite; ``from_input`` [N] bool: those
        whose input row already was (the error then names it)."""
        with self._lock:
            entries = self._pending.setdefault(self._key(cache), [])
            entries.append((what, bad, rows, from_input))
            if len(entries) > self.KEEP:  # fold the oldest into one flag (device ops only)
                old = entries[: len(entries) - self.KEEP + 1]
                flag = torch.stack([e[1].any() for e in old]).any().view(1)
                entries[: len(old)] = [("the keys of an earlier store", flag, None, None)]

    def raise_pending(self, cache: torch.Tensor) -> None:
        """Raise `IndexerInputError` for the first recorded store into ``cache`` that had non-finite rows (a host
        read per store since the last scoring); forget them all either way."""
        with self._lock:
            entries = self._pending.pop(self._key(cache), [])
        for what, bad, rows, from_input in entries:
            if not bad.numel() or not bool(bad.any()):
                continue
            count = int(bad.sum())
            if from_input is not None:
                what = f"{what} (from {'k' if bool((bad & from_input).any()) else 'norm_weight / norm_bias or cos_sin'})"
            where = (f"{count} rows" if rows is None else
                     f"{count} of its {bad.numel()} rows (rows {rows[bad][:8].tolist()}{' ...' if count > 8 else ''})")
            raise v.IndexerInputError(
                f"{what} holds NaN or inf in {where}: torch_npu's indexers rank NaN in an undefined "
                "order and a NaN score must never be selected, so the NPU path refuses them (found on the device by "
                "k_prologue_store_plain.npu.torch_npu, raised at this scoring; those cache rows were written as 0)")

    def clear(self) -> None:
        with self._lock:
            self._pending.clear()


STORE_CHECKS = StoreChecks()


def _indices(result, rows: int, k: int) -> torch.Tensor:
    indices = result[0] if isinstance(result, (tuple, list)) else result
    return indices.reshape(rows, k).to(torch.int32)


# --- fp32 weights for the bf16 indexer (Atlas A2 / A3) ---------------------------------------------------------------
# op-plugin's npu_lightning_indexer docs list float32 weights from 26.0.0 on (26.0.0 6ffd6e22, 26.1.0 09024aa9,
# master 517f2e7d), refused on Ascend 950PR / 950DT; 7.3.0 (b3065ed3) takes only the query's dtype. The schema is the
# same in all four, so the release cannot be read from it: on A2 / A3 one small call with fp32 weights decides, once
# per device, and a kernel that refuses them (or misreads them: the check's answer depends on the weights being read
# as fp32) keeps the weights in the query's dtype, as before (one bf16 rounding of every weight).

def check_fp32_weights(kernel, device: torch.device) -> None:
    """Raise unless ``kernel`` (npu_lightning_indexer) reads fp32 weights as fp32: 64 keys with scores
    ``(j + 1) / 64 * sum_h w_h`` where the weights of heads 0..31 are -1 and of heads 32..63 are +2 (sum +32), so
    the top 8 are keys 56..63; a kernel reading the buffer as 16-bit values would see heads 0..31's halves only
    (0 and -1: a negative sum) and pick keys 0..7."""
    q = torch.zeros(1, 64, 128, dtype=torch.bfloat16, device=device)
    q[:, :, 0] = 1
    key = torch.zeros(1, 64, 1, 128, dtype=torch.bfloat16, device=device)
    key[0, :, 0, 0] = torch.arange(1, 65, device=device, dtype=torch.float32) / 64
    weights = torch.cat([torch.full((1, 32), -1.0), torch.full((1, 32), 2.0)], dim=1).to(device)
    result = kernel(q, key, weights, actual_seq_lengths_query=torch.tensor([1], dtype=torch.int32, device=device),
                    actual_seq_lengths_key=torch.tensor([64], dtype=torch.int32, device=device),
                    block_table=torch.zeros(1, 1, dtype=torch.int32, device=device), layout_query="TND",
                    layout_key="PA_BSND", sparse_count=8, sparse_mode=3)
    got = sorted(_indices(result, 1, 8)[0].tolist())
    if got != list(range(56, 64)):
        raise AssertionError(f"top 8 of the fp32-weights check are {got}, not keys 56..63")


def weights_dtype(api: NpuApi, kernel, query_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """fp32 where this product and release take fp32 weights (checked once per device), else the query's dtype."""
    if api.product not in ("a2", "a3"):
        return query_dtype  # 950 refuses fp32 weights (its docs); other products: not documented
    key = ("fp32 weights", str(device))
    taken = api.checks.get(key)
    if taken is None:
        try:
            check_fp32_weights(kernel, device)
            taken = True
        except Exception as exc:  # noqa: BLE001 - any refusal keeps the weights in the query's dtype
            log.info("dsa_indexer: %s's %s does not take fp32 weights on %s (%s: %s); weights are cast to %s",
                     api.describe(), INDEXER, device, type(exc).__name__, exc, query_dtype)
            taken = False
        api.checks[key] = taken
    return torch.float32 if taken else query_dtype


def make_lightning_indexer_ragged(api_of):
    """The adapter over the API ``api_of()`` returns (looked up per call: the probe may run after registration)."""

    def lightning_indexer_ragged(q: torch.Tensor, q_scales: torch.Tensor, key_cache: torch.Tensor,
                                 key_scales: torch.Tensor, weights: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                 seq_lens_k: torch.Tensor, block_table: torch.Tensor, k: int,
                                 compress_ratio: int = 1) -> torch.Tensor:
        if compress_ratio != 1:
            raise v.IndexerInputError(
                f"compress_ratio={compress_ratio}: no released torch_npu indexer takes compressed (C4) keys; use the "
                "reference (lightning_indexer_ragged.reference.torch)")
        STORE_CHECKS.raise_pending(key_cache)  # before any kernel runs
        api: NpuApi = api_of()
        rows = q.shape[0]
        int8 = q.dtype == torch.int8
        kernel, name = (api.quant_indexer, QUANT_INDEXER) if int8 else (api.indexer, INDEXER)
        if kernel is None:
            raise RuntimeError(f"{api.why_not(name)}: lightning_indexer_ragged.npu.torch_npu cannot run")
        # The weights in a dtype the kernel takes, checked after the cast (fp16 overflows to inf above 65504): fp16
        # for the quant kernel; for the bf16 one fp32 where this A2 / A3 release takes it (`weights_dtype`), else the
        # query's dtype (op-plugin 7.3.0 takes no other, Ascend 950PR / 950DT no fp32).
        w_dtype = torch.float16 if int8 else weights_dtype(api, kernel, q.dtype, q.device)
        w = weights.to(w_dtype).contiguous()
        require_finite("weights", w)
        if int8:
            scales = q_scales.to(torch.float16).contiguous()
            require_finite("q_scales", scales)
            # op-plugin's doc: weights * query_dequant_scale must stay within the fp16 range.
            require_finite("weights * q_scales", (w.float() * scales.float()).to(torch.float16))
        else:
            require_finite("q", q)
        if v.ranges_checked(key_cache):  # the whole cache: only on request (or on the host), it is large
            require_finite("key_scales" if int8 else "key_cache", key_scales if int8 else key_cache)
        keywords = dict(actual_seq_lengths_query=cu_seqlens_q[1:].to(torch.int32).contiguous(),
                        actual_seq_lengths_key=seq_lens_k.to(torch.int32).contiguous(),
                        block_table=block_table.to(torch.int32).contiguous(), layout_query="TND",
                        layout_key="PA_BSND", sparse_count=k, sparse_mode=3)
        if int8:
            result = kernel(q.contiguous(), key_cache, w, scales, key_scales, 0, 0, **keywords)
        else:
            result = kernel(q.contiguous(), key_cache, w, **keywords)
        return _indices(result, rows, k)

    return lightning_indexer_ragged


# --- the library's fp8 pages, read in place (Ascend 950PR / 950DT) ---------------------------------------------------


def make_lightning_indexer_fp8(api_of):
    """`lightning_indexer` over the ``paged64_fp8_e4m3`` cache as it is, through npu_quant_lightning_indexer's fp8
    path (op-plugin 26.1.0 09024aa9 and master 517f2e7d docs, Ascend 950PR / 950DT): float8_e4m3fn query and key,
    PA_BSND key and scales that may be strided on axis 0. So the 132-byte pages are two views, no copy: keys
    ``[pages, 64, 1, 128]`` fp8 with strides (8448, 128, 128, 1) and scales ``[pages, 64, 1]`` fp32 (2112, 1, 1).

    The kernel's score is ``sum_h W[h] * relu(Sq[h] * Sk * (q[h] . k))``; this op's is ``Sk * sum_h w[h] *
    relu(q[h] . k)`` with the q scale already in ``w`` (fp32, any sign). Passing ``W = sign(w)`` (bf16, exact) and
    ``Sq = |w|`` (fp32, the dtype the fp8 path takes with bf16 weights) gives exactly that, since ``Sq, Sk >= 0``:
    no rounding of the weights at all. Each row is its own request (TND, one query each) with its own key count
    ``context_lens[b, j]`` under sparse_mode 3, so any per-row lengths (decode, next_n > 1, padding rows of length
    0) mean what they mean here. Output: request-local positions, -1 padded; slots by the cache contract."""

    def lightning_indexer(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor,
                          block_table: torch.Tensor, max_context_len: int, k: int,
                          return_slots: bool = False) -> torch.Tensor:
        api: NpuApi = api_of()
        if api.quant_indexer is None:
            raise RuntimeError(f"{api.why_not(QUANT_INDEXER)}: lightning_indexer.npu.torch_npu_fp8 cannot run")
        b, n, heads, dim = q.shape
        rows = b * n
        if rows == 0:
            return torch.empty(0, k, dtype=torch.int32, device=q.device)
        keys, scales = page_views(kv_cache, q.dtype)
        w = weights.float()
        require_finite("weights", w)
        # op-plugin: W * query_dequant_scale (= w here) must stay within fp16
        require_finite("weights (within fp16)", w.to(torch.float16))
        query = q.reshape(rows, heads, dim).contiguous()
        require_finite("q", query.float())
        if v.ranges_checked(kv_cache):
            require_finite("the cache's key scales", scales)
        table = block_table.to(torch.int32)
        result = api.quant_indexer(
            query, keys.unsqueeze(2), torch.sign(w).to(torch.bfloat16).contiguous(), w.abs().contiguous(),
            scales.unsqueeze(-1), 0, 0,
            actual_seq_lengths_query=torch.arange(1, rows + 1, dtype=torch.int32, device=q.device),
            actual_seq_lengths_key=context_lens.reshape(rows).to(torch.int32).contiguous(),
            block_table=table.repeat_interleave(n, dim=0).contiguous(), layout_query="TND", layout_key="PA_BSND",
            sparse_count=k, sparse_mode=3)
        out = _indices(result, rows, k)
        if return_slots:
            return indices_to_slots(out, block_table, decode_row_requests(b, n, q.device))
        return out

    return lightning_indexer


def check_fp8_adapter(fn, device: torch.device, seed: int = 17) -> None:
    """The fp8-pages adapter against the reference once, on ``device``: three requests (lengths 37, 130, 301; one
    row of length 0), next_n 2, random fp8 keys and positive scales in a shuffled table over a larger pool, weights
    of both signs. Top-k sets must equal the reference's up to near ties (keys within 1e-4 of the row's largest
    |score| around the k-th score: the two sum in different orders). Raises AssertionError naming the row."""
    from ...contract.cache import IndexKCache
    from ..reference import kernels as ref

    gen = torch.Generator().manual_seed(seed)
    fp8 = torch.float8_e4m3fn
    pool, width, k = 20, 6, 32
    cache = IndexKCache.allocate(pool, "cpu", fp8).data
    keys, key_scales = page_views(cache, fp8)
    keys.copy_((torch.randn(keys.shape, generator=gen) * 40).clamp(-448, 448).to(fp8))
    key_scales.copy_(torch.rand(key_scales.shape, generator=gen) * 1e-2 + 1e-3)
    table = torch.randperm(pool, generator=gen)[: 3 * width].to(torch.int32).view(3, width)
    lens = torch.tensor([[0, 37], [129, 130], [300, 301]], dtype=torch.int32)
    q = (torch.randn(3, 2, 64, 128, generator=gen) * 40).clamp(-448, 448).to(fp8)
    weights = torch.randn(6, 64, generator=gen)
    args = (q, cache, weights, lens, table, width * 64, k)
    got = fn(*(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)).cpu()
    want = ref.lightning_indexer(*args)
    logits = ref.paged_mqa_logits(*args[:6])
    for row in range(6):
        a = {i for i in got[row].tolist() if i >= 0}
        w_ = {i for i in want[row].tolist() if i >= 0}
        if len(a) != len(w_):
            raise AssertionError(f"row {row}: {len(a)} indices, the reference {len(w_)}")
        if a == w_:
            continue
        kth = logits[row, sorted(w_)].min()
        band = 1e-4 * float(logits[row][torch.isfinite(logits[row])].abs().max())
        far = [i for i in a ^ w_ if abs(float(logits[row, i] - kth)) > band]
        if far:
            raise AssertionError(f"row {row}: keys {far[:8]} differ from the reference's top-{k} beyond near ties")


def fp8_supports(api: NpuApi | None) -> list[str]:
    """Why npu_quant_lightning_indexer cannot read fp8 pages on this NPU (an empty list: it can): the Ascend product
    and the release, which the problem cannot say (its shape facts are declared: ``FP8_PAGES_CAPS``)."""
    if api is None:
        return ["the Ascend product is known only after the torch_npu probe (fp8 keys: Ascend 950PR / 950DT, "
                "op-plugin 26.1.0 on); run on the NPU"]
    if api.product != "950":
        where = PRODUCT_NAMES.get(api.product, api.device_name or "this NPU")
        return [f"on {where} npu_quant_lightning_indexer takes int8 keys only (fp8 query / key: Ascend 950PR / "
                f"950DT, op-plugin 26.1.0 on); this cache's fp8 pages are served by the reference there, the plain "
                f"layouts (paged64_bf16 / paged64_int8) by lightning_indexer_ragged.npu.torch_npu"]
    if api.quant_indexer is None:
        return [api.why_not(QUANT_INDEXER)]
    return []
