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

import threading

import torch

from ...contract import validate as v
from .api import INDEXER, QUANT_INDEXER, NpuApi


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
        api: NpuApi = api_of()
        rows = q.shape[0]
        int8 = q.dtype == torch.int8
        kernel, name = (api.quant_indexer, QUANT_INDEXER) if int8 else (api.indexer, INDEXER)
        if kernel is None:
            raise RuntimeError(f"{api.why_not(name)}: lightning_indexer_ragged.npu.torch_npu cannot run")
        # The weights in a dtype every release and SoC takes, checked after the cast (fp16 overflows to inf above
        # 65504): fp16 for the quant kernel; the query's dtype for the bf16 one (op-plugin 7.3.0 takes no other, and
        # Ascend 950PR / 950DT no fp32; A2 / A3 take fp32 weights from 26.0.0 on: docs/backends-amd-npu.md, Numerics).
        w = weights.to(torch.float16 if int8 else q.dtype).contiguous()
        require_finite("weights", w)
        if int8:
            scales = q_scales.to(torch.float16).contiguous()
            require_finite("q_scales", scales)
            # op-plugin's doc: weights * query_dequant_scale must stay within the fp16 range.
            require_finite("weights * q_scales", (w.float() * scales.float()).to(torch.float16))
        else:
            require_finite("q", q)
        STORE_CHECKS.raise_pending(key_cache)
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
