"""Ascend's fused lightning indexer (``torch_npu.npu_lightning_indexer``) behind a plain function.

The NPU kernel computes, per query token, ``sum_h w[t, h] * relu(q[t, h] . k[s])`` over a bf16 paged key cache
and returns the top-k key positions, request-local, -1 padded. It does NOT take this library's inputs: no fp8,
no per-key scales, no Hadamard-rotated fp8 cache (constant positive scales do not change the top-k, so the
Ascend integrations drop them), and its cache is ``[blocks, block_size, 1, 128]`` bf16, not the 132-byte fp8
pages of ``IndexKCache``. So it cannot serve the op ``lightning_indexer`` (fp8 q, fp8 cache) and is not
registered for it; `npu_lightning_indexer_bf16` calls it with exactly the documented arguments for callers who
keep a bf16 key cache. What registering it would take (a bf16 key-cache layout tag and an NPU pipeline
strategy) is in docs/backends-amd-npu.md.

torch_npu's call (from its documentation and the vLLM-Ascend / SGLang integrations):
``npu_lightning_indexer(query [T, 64, 128], key [blocks, block_size, 1, 128], weights [T, 64] (same dtype as
query), actual_seq_lengths_query [B] int32 (CUMULATIVE ends, no leading 0), actual_seq_lengths_key [B] int32
(per request), block_table [B, max_blocks] int32, layout_query="TND", layout_key="PA_BSND", sparse_count=k
(1..2048), sparse_mode=3)`` with sparse_mode 3 the bottom-right-aligned causal mask: query i of a request with
n queries and L keys sees keys ``< L - n + i + 1``. The result is a tuple whose first element is int32
``[T, 1, k]`` (some builds return the tensor alone; both are accepted).
"""

from __future__ import annotations

import importlib

import torch

from ...contract import validate as v

HEADS = 64  # the kernel's supported query head count
HEAD_DIM = 128
MAX_K = 2048
MAX_BLOCK_SIZE = 1024


def npu_lightning_indexer_bf16(q_bf16: torch.Tensor, key_cache_bf16: torch.Tensor, weights: torch.Tensor,
                               cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, block_table: torch.Tensor,
                               k: int) -> torch.Tensor:
    """Top-k key positions per query token by ``torch_npu.npu_lightning_indexer``: int32 ``[T, k]``, request-local
    positions (0 = the request's first key), -1 padded when a token sees fewer than k keys.

    q_bf16 [T, 64, 128] bf16 (or fp16): RoPE'd index queries, ragged over requests (layout "TND").
    key_cache_bf16 [blocks, block_size, 1, 128], same dtype: the paged index keys; block_size a multiple of 16,
    at most 1024. weights [T, 64]: per-head weights; cast to q's dtype if needed (the kernel takes one dtype),
    which rounds them. cu_seqlens_q [B + 1] int32: query offsets starting at 0 (torch_npu gets
    ``cu_seqlens_q[1:]``). seq_lens_k [B] int32: keys per request, including the request's own new tokens.
    block_table [B, max_blocks] int32. k: 1..2048.
    """
    v.tensor("q_bf16", q_bf16, dtype=(torch.bfloat16, torch.float16), ndim=3)
    t, h, d = q_bf16.shape
    if h != HEADS or d != HEAD_DIM:
        raise v.IndexerInputError(f"q_bf16 must be [T, {HEADS}, {HEAD_DIM}] (the NPU kernel's shape), "
                                  f"got {list(q_bf16.shape)}")
    dev = q_bf16.device
    v.tensor("key_cache_bf16", key_cache_bf16, dtype=q_bf16.dtype, ndim=4, device=dev)
    blocks, block_size, kv_heads, kd = key_cache_bf16.shape
    if kv_heads != 1 or kd != HEAD_DIM:
        raise v.IndexerInputError(f"key_cache_bf16 must be [blocks, block_size, 1, {HEAD_DIM}], "
                                  f"got {list(key_cache_bf16.shape)}")
    if block_size % 16 or block_size > MAX_BLOCK_SIZE:
        raise v.IndexerInputError(f"key_cache_bf16's block size {block_size} must be a multiple of 16, "
                                  f"at most {MAX_BLOCK_SIZE}")
    v.tensor("weights", weights, dtype=v.ACT_DTYPES, shape=(t, h), device=dev)
    v.tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=dev)
    batch = block_table.shape[0]
    v.tensor("cu_seqlens_q", cu_seqlens_q, dtype=torch.int32, shape=(batch + 1,), device=dev)
    v.tensor("seq_lens_k", seq_lens_k, dtype=torch.int32, shape=(batch,), device=dev)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise v.IndexerInputError(f"k must be an int in [1, {MAX_K}] (the NPU kernel's sparse_count), got {k!r}")
    if v.ranges_checked(cu_seqlens_q):
        decreasing = bool((cu_seqlens_q[1:] < cu_seqlens_q[:-1]).any())
        if int(cu_seqlens_q[0]) != 0 or int(cu_seqlens_q[-1]) != t or decreasing:
            raise v.IndexerInputError(f"cu_seqlens_q must start at 0, not decrease and end at T={t}, got "
                                      f"{cu_seqlens_q.tolist()}")
        v.in_range("seq_lens_k", seq_lens_k, 0, block_table.shape[1] * block_size + 1, "keys the block table maps")
    torch_npu = importlib.import_module("torch_npu")
    result = torch_npu.npu_lightning_indexer(
        q_bf16.contiguous(), key_cache_bf16.contiguous(), weights.to(q_bf16.dtype).contiguous(),
        actual_seq_lengths_query=cu_seqlens_q[1:].contiguous(), actual_seq_lengths_key=seq_lens_k.contiguous(),
        block_table=block_table.contiguous(), layout_query="TND", layout_key="PA_BSND", sparse_count=k,
        sparse_mode=3)
    indices = result[0] if isinstance(result, (tuple, list)) else result
    return indices.reshape(t, k).to(torch.int32)
