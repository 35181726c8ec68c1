"""`lightning_indexer_ragged` on torch_npu's fused indexers (logits and top-k in one kernel, no logits in memory).

bf16 keys (layout ``paged64_bf16``): ``torch_npu.npu_lightning_indexer(query [T, 64, 128], key [blocks, 64, 1, 128],
weights [T, 64] (the query's dtype), actual_seq_lengths_query=cumulative row ends [B] (no leading 0),
actual_seq_lengths_key=[B] tokens per request, block_table [B, pages], layout_query="TND", layout_key="PA_BSND",
sparse_count=k (1..2048), sparse_mode=3)``. sparse_mode 3 is the bottom-right-aligned causal mask: query i of n with L
keys sees keys < L - n + i + 1, which is this op's contract (a request's rows are its last tokens). The result is a
tuple whose first element is int32 ``[T, 1, k]``: request-local positions, -1 padded.

int8 keys (layout ``paged64_int8``, V4's C4 indexer): ``torch_npu.npu_quant_lightning_indexer(query int8, key int8,
weights fp16, query_dequant_scale fp16 [T, 64], key_dequant_scale fp16 [blocks, 64, 1], ..., query_quant_mode=0,
key_quant_mode=0, layout_query="TND", layout_key="PA_BSND", sparse_count=k, sparse_mode=3, cmp_ratio=4,
metadata=npu_quant_lightning_indexer_metadata(...))``: score ``sum_h w * relu(sq * sk * (q_int8 . k_int8))``. With
cmp_ratio 4 the key lengths count original tokens and the cache holds one entry per 4 (our reading of the SGLang and
vLLM-Ascend V4 integrations, which pass token lengths with the compressed page table).

Keyword drift is handled by feature detection (`api.detect`). Nothing here has run on Ascend hardware.
"""

from __future__ import annotations

import torch

from .api import NpuApi


def _indices(result, rows: int, k: int) -> torch.Tensor:
    indices = result[0] if isinstance(result, (tuple, list)) else result
    return indices.reshape(rows, k).to(torch.int32)


def make_lightning_indexer_ragged(api_of):
    """The adapter over the API ``api_of()`` returns (looked up per call: the probe may run after registration)."""

    def lightning_indexer_ragged(q: torch.Tensor, q_scales: torch.Tensor, key_cache: torch.Tensor,
                                 key_scales: torch.Tensor, weights: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                 seq_lens_k: torch.Tensor, block_table: torch.Tensor, k: int,
                                 compress_ratio: int = 1) -> torch.Tensor:
        api: NpuApi = api_of()
        rows, heads, dim = q.shape
        lengths = dict(actual_seq_lengths_query=cu_seqlens_q[1:].contiguous(),
                       actual_seq_lengths_key=seq_lens_k.contiguous())
        ratio = {} if compress_ratio == 1 else {"cmp_ratio": compress_ratio}
        if q.dtype != torch.int8:
            result = api.indexer(q, key_cache, weights.to(q.dtype).contiguous(), **lengths,
                                 block_table=block_table.contiguous(), layout_query="TND", layout_key="PA_BSND",
                                 sparse_mode=3, **{api.indexer_count: k}, **ratio)
            return _indices(result, rows, k)
        extra = dict(ratio)
        if api.quant_metadata is not None:  # the kernel's work split, built by torch_npu from the same lengths
            extra["metadata"] = api.quant_metadata(
                num_heads_q=heads, num_heads_k=1, head_dim=dim, query_quant_mode=0, key_quant_mode=0, **lengths,
                batch_size=block_table.shape[0], layout_query="TND", layout_key="PA_BSND", sparse_count=k,
                sparse_mode=3, cmp_ratio=compress_ratio, device=str(q.device))
        result = api.quant_indexer(q, key_cache, weights.to(torch.float16).contiguous(), q_scales.contiguous(),
                                   key_scales, **lengths, block_table=block_table.contiguous(), query_quant_mode=0,
                                   key_quant_mode=0, layout_query="TND", layout_key="PA_BSND", sparse_count=k,
                                   sparse_mode=3, **extra)
        return _indices(result, rows, k)

    return lightning_indexer_ragged
