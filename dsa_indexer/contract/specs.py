"""The ops' specs: name, the facts of a call that may change which implementation serves it (`PROBLEM_KEYS`),
the arguments it mutates, and its fake (meta) result for `torch.compile`. `dsa_indexer.ops` builds each custom op,
its fake and its `Problem` from these, once; an implementation takes the same arguments as the op's reference
function (`backends/reference/kernels.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

PIPELINE_OP = "indexer_pipeline"  # the pipeline strategy is resolved like an op (problem: tokens, decode, q_lora_quant)

# The facts of each op's call that may change which implementation serves it, written once: the ops build their
# Problem from these keys, and `problem()` checks callers that build one by hand (the CLI's defaults, the Indexer's
# question "which GEMM would run?").
PROBLEM_KEYS: dict[str, tuple[str, ...]] = {
    "quant_fp8_groups": ('group_size', 'ue8m0', 'fp8', 'width'),
    "rmsnorm_quant_fp8": ('group_size', 'ue8m0', 'fp8', 'width'),
    "q_prologue": ('heads', 'dim', 'rope_dim', 'interleaved', 'ue8m0', 'fp8'),
    "k_prologue_store": ('dim', 'rope_dim', 'interleaved', 'norm', 'ue8m0', 'fp8'),
    "gemm_fp8_blockscale": ('n', 'k', 'out', 'fp8'),
    "ragged_mqa_logits": ('heads', 'dim', 'fp8'),
    "paged_mqa_logits": ('heads', 'dim', 'next_n', 'fp8'),
    "topk_indices": ('k', 'slots', 'starts'),
    "lightning_indexer": ('heads', 'dim', 'next_n', 'k', 'fp8', 'slots'),
    "ragged_mqa_topk": ('heads', 'dim', 'fp8', 'k'),
    "c4_compress_pool": ('dim', 'window'),
    # The plain paged layouts (contract/cache.py: paged64_bf16, paged64_int8), read by fused indexers such as
    # torch_npu's: ``format`` is the key format ("bf16" or "int8"), ``ratio`` the key compression (1, or 4 for C4).
    "q_prologue_plain": ('heads', 'dim', 'rope_dim', 'interleaved', 'format'),
    "k_prologue_store_plain": ('dim', 'rope_dim', 'interleaved', 'norm', 'format'),
    "lightning_indexer_ragged": ('heads', 'dim', 'k', 'format', 'ratio'),
}


def _fake_quant_fp8_groups(x, group_size, ue8m0, fp8_dtype, target=None):
    return (torch.empty_like(x, dtype=fp8_dtype),
            x.new_empty((*x.shape[:-1], x.shape[-1] // group_size), dtype=torch.float32))


def _fake_rmsnorm_quant_fp8(x, weight, eps, group_size, ue8m0, fp8_dtype, target=None):
    return (torch.empty_like(x), torch.empty_like(x, dtype=fp8_dtype),
            x.new_empty((x.shape[0], x.shape[1] // group_size), dtype=torch.float32))


def _fake_q_prologue(q, positions, cos_sin, head_weights, weight_scale, rope_offset, interleaved, ue8m0, fp8_dtype,
                     target=None):
    return torch.empty_like(q, dtype=fp8_dtype), q.new_empty(q.shape[:2], dtype=torch.float32)


def _fake_k_prologue_store(k, norm_weight, norm_bias, eps, positions, cos_sin, kv_cache, slot_mapping, rope_offset,
                           interleaved, ue8m0, fp8_dtype, norm, target=None):
    return None


def _fake_gemm_fp8_blockscale(a, a_scales, b, b_scales, out_dtype, target=None):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def _fake_ragged_mqa_logits(q, k, k_scales, weights, ks, ke, target=None):
    return q.new_empty((q.shape[0], k.shape[0]), dtype=torch.float32)


def _fake_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len, target=None):
    return q.new_empty((q.shape[0] * q.shape[1], max_context_len), dtype=torch.float32)


def _fake_topk_indices(logits, k, ends, starts, block_table, row_request, target=None):
    return logits.new_empty((logits.shape[0], k), dtype=torch.int32)


def _fake_lightning_indexer(q, kv_cache, weights, context_lens, block_table, max_context_len, k, return_slots,
                            target=None):
    return q.new_empty((q.shape[0] * q.shape[1], k), dtype=torch.int32)


def _fake_ragged_mqa_topk(q, k, k_scales, weights, ks, ke, topk, target=None):
    return q.new_empty((q.shape[0], topk), dtype=torch.int32)


def _fake_c4_compress_pool(proj, state, ape, positions, row_request, state_slot, rows, target=None):
    return proj.new_empty((rows.shape[0], ape.shape[1] // 2), dtype=torch.bfloat16)


def _fake_q_prologue_plain(q, positions, cos_sin, head_weights, weight_scale, rope_offset, interleaved, key_format,
                           target=None):
    if key_format == "int8":
        return (torch.empty_like(q, dtype=torch.int8), q.new_empty(q.shape[:2], dtype=torch.float16),
                q.new_empty(q.shape[:2], dtype=torch.float32))
    return torch.empty_like(q), q.new_empty(0, dtype=torch.float16), q.new_empty(q.shape[:2], dtype=torch.float32)


def _fake_k_prologue_store_plain(k, norm_weight, norm_bias, eps, positions, cos_sin, key_cache, key_scales,
                                 slot_mapping, rope_offset, interleaved, norm, key_format, target=None):
    return None


def _fake_lightning_indexer_ragged(q, q_scales, key_cache, key_scales, weights, cu_seqlens_q, seq_lens_k,
                                   block_table, k, compress_ratio, target=None):
    return q.new_empty((q.shape[0], k), dtype=torch.int32)


@dataclass(frozen=True)
class OpSpec:
    name: str
    problem_keys: tuple[str, ...]
    mutates: tuple[str, ...]
    fake: Callable


SPECS: dict[str, OpSpec] = {
    "quant_fp8_groups": OpSpec("quant_fp8_groups", PROBLEM_KEYS["quant_fp8_groups"], (), _fake_quant_fp8_groups),
    "rmsnorm_quant_fp8": OpSpec("rmsnorm_quant_fp8", PROBLEM_KEYS["rmsnorm_quant_fp8"], (), _fake_rmsnorm_quant_fp8),
    "q_prologue": OpSpec("q_prologue", PROBLEM_KEYS["q_prologue"], (), _fake_q_prologue),
    "k_prologue_store": OpSpec("k_prologue_store", PROBLEM_KEYS["k_prologue_store"], ("kv_cache",),
                             _fake_k_prologue_store),
    "gemm_fp8_blockscale": OpSpec("gemm_fp8_blockscale", PROBLEM_KEYS["gemm_fp8_blockscale"], (),
                                _fake_gemm_fp8_blockscale),
    "ragged_mqa_logits": OpSpec("ragged_mqa_logits", PROBLEM_KEYS["ragged_mqa_logits"], (), _fake_ragged_mqa_logits),
    "paged_mqa_logits": OpSpec("paged_mqa_logits", PROBLEM_KEYS["paged_mqa_logits"], (), _fake_paged_mqa_logits),
    "topk_indices": OpSpec("topk_indices", PROBLEM_KEYS["topk_indices"], (), _fake_topk_indices),
    "lightning_indexer": OpSpec("lightning_indexer", PROBLEM_KEYS["lightning_indexer"], (), _fake_lightning_indexer),
    "ragged_mqa_topk": OpSpec("ragged_mqa_topk", PROBLEM_KEYS["ragged_mqa_topk"], (), _fake_ragged_mqa_topk),
    "c4_compress_pool": OpSpec("c4_compress_pool", PROBLEM_KEYS["c4_compress_pool"], ("state",),
                             _fake_c4_compress_pool),
    "q_prologue_plain": OpSpec("q_prologue_plain", PROBLEM_KEYS["q_prologue_plain"], (), _fake_q_prologue_plain),
    "k_prologue_store_plain": OpSpec("k_prologue_store_plain", PROBLEM_KEYS["k_prologue_store_plain"],
                                     ("key_cache", "key_scales"), _fake_k_prologue_store_plain),
    "lightning_indexer_ragged": OpSpec("lightning_indexer_ragged", PROBLEM_KEYS["lightning_indexer_ragged"], (),
                                       _fake_lightning_indexer_ragged),
}
