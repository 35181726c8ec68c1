"""Every public entry point rejects bad input with an error that names the offending argument.

Each case starts from a valid call (checked to succeed in ``test_baseline_is_valid``), changes one thing, and
expects `IndexerInputError` (a ValueError) or a TypeError / ValueError whose message names the argument
(matched as a whole word). The 'meta' device stands in for "a second device". For `k_prologue_store` and
`Indexer.forward` a rejected call must leave the cache bytes untouched.
"""

from __future__ import annotations

import functools
import re
from typing import Callable

import pytest
import torch

from dsa_indexer import (DecodeBatch, IndexerConfig, IndexerInputError, IndexKCache, Indexer, PrefillBatch, ops)
from dsa_indexer.rope import cos_sin_table

BF16, F32, I32, I64 = torch.bfloat16, torch.float32, torch.int32, torch.int64
FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
META = torch.device("meta")
ERRORS = (IndexerInputError, TypeError, ValueError)


def meta(t: torch.Tensor) -> torch.Tensor:
    return t.to(META)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def fp8(shape, seed=0, dtype=FN) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen(seed)) * 4).to(dtype)


def random_cache(num_pages: int, seed: int = 0) -> IndexKCache:
    cache = IndexKCache.allocate(num_pages)
    cache.data.copy_(torch.randint(0, 256, cache.data.shape, generator=gen(seed), dtype=torch.uint8))
    return cache


def assert_names(exc: BaseException, names: tuple[str, ...]) -> None:
    msg = str(exc)
    assert any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", msg) for n in names), (
        f"{type(exc).__name__} message does not name any of {names}: {msg!r}")


# ------------------------------------------------------------------------------------------------------------
# Valid baselines: op name -> (make args dict, call with args dict).
def _quant_args():
    return dict(x=torch.randn(4, 256, generator=gen(1)).to(BF16), group_size=128, ue8m0=False, fp8_dtype=None)


def _quant_call(a):
    return ops.quant_fp8_groups(a["x"], a["group_size"], ue8m0=a["ue8m0"], fp8_dtype=a["fp8_dtype"])


def _rms_args():
    return dict(x=torch.randn(3, 256, generator=gen(2)).to(BF16), weight=torch.ones(256, dtype=BF16), eps=1e-6,
                group_size=128, fp8_dtype=None)


def _rms_call(a):
    return ops.rmsnorm_quant_fp8(a["x"], a["weight"], a["eps"], a["group_size"], fp8_dtype=a["fp8_dtype"])


T, H = 3, 4
MAX_POS = 256


def _q_args():
    return dict(q=torch.randn(T, H, 128, generator=gen(3)).to(BF16), positions=torch.tensor([0, 5, 255]),
                cos_sin=cos_sin_table(64, MAX_POS), head_weights=torch.randn(T, H, generator=gen(4)).to(BF16),
                weight_scale=0.01, rope_offset=0, interleaved=False, fp8_dtype=None)


def _q_call(a):
    return ops.q_prologue(a["q"], a["positions"], a["cos_sin"], a["head_weights"], a["weight_scale"],
                          rope_offset=a["rope_offset"], interleaved=a["interleaved"], fp8_dtype=a["fp8_dtype"])


K_PAGES = 2


def _k_args():
    return dict(k=torch.randn(T, 128, generator=gen(5)).to(BF16), norm_weight=torch.ones(128, dtype=BF16),
                norm_bias=torch.zeros(128, dtype=BF16), eps=1e-6, positions=torch.tensor([1, 2, 3]),
                cos_sin=cos_sin_table(64, MAX_POS), kv_cache=random_cache(K_PAGES, 6).data,
                slot_mapping=torch.tensor([0, -1, K_PAGES * 64 - 1]), rope_offset=0, fp8_dtype=None,
                norm="layernorm")


def _k_call(a):
    return ops.k_prologue_store(a["k"], a["norm_weight"], a["norm_bias"], a["eps"], a["positions"], a["cos_sin"],
                                a["kv_cache"], a["slot_mapping"], rope_offset=a["rope_offset"],
                                fp8_dtype=a["fp8_dtype"], norm=a["norm"])


def _gemm_args():
    return dict(a=fp8((5, 320), 7), a_scales=torch.rand(5, 3) + 0.1, b=fp8((200, 320), 8),
                b_scales=torch.rand(2, 3) + 0.1, out_dtype=BF16)


def _gemm_call(a):
    return ops.gemm_fp8_blockscale(a["a"], a["a_scales"], a["b"], a["b_scales"], a["out_dtype"])


S, N = 4, 50


def _ragged_args():
    return dict(q=fp8((S, H, 128), 9), k=fp8((N, 128), 10), k_scales=torch.rand(N) + 0.1,
                weights=torch.randn(S, H, generator=gen(11)), ks=torch.tensor([0, 0, 10, 50], dtype=I32),
                ke=torch.tensor([1, 20, 30, 50], dtype=I32))


def _ragged_call(a):
    return ops.ragged_mqa_logits(a["q"], a["k"], a["k_scales"], a["weights"], a["ks"], a["ke"])


B, NEXT_N, P_PAGES = 2, 2, 4


def _paged_args():
    return dict(q=fp8((B, NEXT_N, H, 128), 12), kv_cache=random_cache(P_PAGES, 13).data,
                weights=torch.randn(B * NEXT_N, H, generator=gen(14)),
                context_lens=torch.tensor([[69, 70], [9, 10]], dtype=I32),
                block_table=torch.tensor([[3, 1], [0, -1]], dtype=I32), max_context_len=100, k=8)


def _paged_call(a):
    return ops.paged_mqa_logits(a["q"], a["kv_cache"], a["weights"], a["context_lens"], a["block_table"],
                                a["max_context_len"])


def _lightning_call(a):
    return ops.lightning_indexer(a["q"], a["kv_cache"], a["weights"], a["context_lens"], a["block_table"],
                                 a["max_context_len"], a["k"])


R, C = 3, 100


def _topk_args():
    return dict(logits=torch.randn(R, C, generator=gen(15)), k=8, ends=torch.tensor([100, 10, 64], dtype=I32),
                starts=torch.tensor([0, 2, 60], dtype=I32), block_table=None, row_request=None)


def _topk_call(a):
    return ops.topk_indices(a["logits"], a["k"], a["ends"], a["starts"], block_table=a["block_table"],
                            row_request=a["row_request"])


def _topk_slots_args():
    a = _topk_args()
    a.update(block_table=torch.tensor([[5, 2], [0, 7]], dtype=I32), row_request=torch.tensor([1, 0, 1], dtype=I32))
    return a


def _decode_args():
    return dict(seq_lens=[70, 5], block_table=[[3, 1], [0, -1]], next_n=1, num_cache_pages=4, compress_ratio=1,
                max_context_len=None)


def _decode_call(a):
    return DecodeBatch.build(a["seq_lens"], a["block_table"], next_n=a["next_n"], num_cache_pages=a["num_cache_pages"],
                             compress_ratio=a["compress_ratio"], max_context_len=a["max_context_len"])


def _prefill_args():
    return dict(prefix_lens=[0, 60], extend_lens=[3, 10], block_table=[[2, -1], [0, 1]], num_cache_pages=4,
                compress_ratio=1)


def _prefill_call(a):
    return PrefillBatch.build(a["prefix_lens"], a["extend_lens"], a["block_table"], num_cache_pages=a["num_cache_pages"],
                              compress_ratio=a["compress_ratio"])


def _alloc_args():
    return dict(num_pages=4, device="cpu", fp8_dtype=FN)


def _alloc_call(a):
    return IndexKCache.allocate(a["num_pages"], device=a["device"], fp8_dtype=a["fp8_dtype"])


@functools.lru_cache(maxsize=1)
def _indexer() -> Indexer:
    return Indexer(IndexerConfig.deepseek_v32(max_position=4096)).init_random(0)


def _fwd_args():
    cfg = _indexer().config
    batch = DecodeBatch.build([5, 70], [[0, -1], [1, 2]], num_cache_pages=4)
    g = gen(16)
    return dict(x=(torch.randn(2, cfg.hidden_size, generator=g)).to(BF16),
                q_lora=(torch.randn(2, cfg.q_lora_rank, generator=g)).to(BF16), positions=batch.positions,
                batch=batch, cache=random_cache(4, 17), q_lora_quant=None)


def _fwd_call(a):
    return _indexer()(a["x"], a["q_lora"], a["positions"], a["batch"], a["cache"], q_lora_quant=a["q_lora_quant"])


OPS: dict[str, tuple[Callable[[], dict], Callable[[dict], object]]] = {
    "quant_fp8_groups": (_quant_args, _quant_call),
    "rmsnorm_quant_fp8": (_rms_args, _rms_call),
    "q_prologue": (_q_args, _q_call),
    "k_prologue_store": (_k_args, _k_call),
    "gemm_fp8_blockscale": (_gemm_args, _gemm_call),
    "ragged_mqa_logits": (_ragged_args, _ragged_call),
    "paged_mqa_logits": (_paged_args, _paged_call),
    "lightning_indexer": (_paged_args, _lightning_call),
    "topk_indices": (_topk_args, _topk_call),
    "topk_indices_slots": (_topk_slots_args, _topk_call),
    "DecodeBatch.build": (_decode_args, _decode_call),
    "PrefillBatch.build": (_prefill_args, _prefill_call),
    "IndexKCache.allocate": (_alloc_args, _alloc_call),
    "Indexer.forward": (_fwd_args, _fwd_call),
}


@pytest.mark.parametrize("op", list(OPS))
def test_baseline_is_valid(op):
    make, call = OPS[op]
    call(make())


# ------------------------------------------------------------------------------------------------------------
# The cases: (op, id, mutation of the args dict, names any of which the message must contain).
def setter(**changes) -> Callable[[dict], None]:
    """A mutation that replaces arguments; a callable value is applied to the current args dict."""
    def mutate(a: dict) -> None:
        for key, value in changes.items():
            a[key] = value(a) if callable(value) else value
    return mutate


def case(op, cid, mutate, *names, marks=()):
    return pytest.param(op, mutate, names, id=f"{op}-{cid}", marks=marks)


def _ragged_bad_order(a):
    a["ks"] = torch.tensor([0, 25, 10, 50], dtype=I32)  # row 1: ks 25 > ke 20


def _paged_ctx_past_table(a):
    # context 130 needs 3 pages; the table has 2 columns (128 positions)
    a["context_lens"] = torch.tensor([[129, 130], [9, 10]], dtype=I32)
    a["max_context_len"] = 130


def _decode_batch_wrong_ratio(a):
    a["batch"] = DecodeBatch.build([8, 16], [[0], [1]], num_cache_pages=4, compress_ratio=4)


def _fwd_cache_too_small(a):
    # A batch validated without the cache size whose slots fall in pages 5 and 6 of a 4-page cache.
    a["batch"] = DecodeBatch.build([5, 70], [[5, -1], [1, 6]])
    a["positions"] = a["batch"].positions


def _fwd_token_mismatch(a):
    a["batch"] = DecodeBatch.build([5, 70, 9], [[0, -1], [1, 2], [3, -1]], num_cache_pages=4)


QUANT = [
    case("quant_fp8_groups", "x-int32", setter(x=lambda a: a["x"].to(I32)), "x"),
    case("quant_fp8_groups", "x-float64", setter(x=lambda a: a["x"].double()), "x"),
    case("quant_fp8_groups", "x-fp8", setter(x=lambda a: a["x"].to(FN)), "x"),
    case("quant_fp8_groups", "x-list", setter(x=[[1.0] * 128]), "x"),
    case("quant_fp8_groups", "x-width-not-multiple", setter(x=lambda a: a["x"][:, :200]), "x"),
    case("quant_fp8_groups", "x-0dim", setter(x=torch.tensor(1.0, dtype=BF16)), "x"),
    case("quant_fp8_groups", "group_size-0", setter(group_size=0), "group_size"),
    case("quant_fp8_groups", "group_size-negative", setter(group_size=-128), "group_size"),
    case("quant_fp8_groups", "group_size-float", setter(group_size=128.0), "group_size"),
    case("quant_fp8_groups", "fp8_dtype-bf16", setter(fp8_dtype=BF16), "fp8_dtype"),
    case("quant_fp8_groups", "fp8_dtype-e5m2", setter(fp8_dtype=torch.float8_e5m2), "fp8_dtype"),
]

RMS = [
    case("rmsnorm_quant_fp8", "x-float32", setter(x=lambda a: a["x"].float()), "x"),
    case("rmsnorm_quant_fp8", "x-int", setter(x=lambda a: a["x"].to(I32)), "x"),
    case("rmsnorm_quant_fp8", "x-3d", setter(x=lambda a: a["x"][None]), "x"),
    case("rmsnorm_quant_fp8", "x-width-not-multiple", setter(x=lambda a: a["x"][:, :192],
                                                             weight=torch.ones(192, dtype=BF16)), "x", "group_size"),
    case("rmsnorm_quant_fp8", "weight-shape", setter(weight=torch.ones(128, dtype=BF16)), "weight"),
    case("rmsnorm_quant_fp8", "weight-meta", setter(weight=lambda a: meta(a["weight"])), "weight"),
    case("rmsnorm_quant_fp8", "weight-list", setter(weight=[1.0] * 256), "weight"),
    case("rmsnorm_quant_fp8", "eps-zero", setter(eps=0.0), "eps"),
    case("rmsnorm_quant_fp8", "eps-negative", setter(eps=-1e-6), "eps"),
    case("rmsnorm_quant_fp8", "group_size-0", setter(group_size=0), "group_size"),
    case("rmsnorm_quant_fp8", "fp8_dtype-f16", setter(fp8_dtype=torch.float16), "fp8_dtype"),
]

Q = [
    case("q_prologue", "q-int", setter(q=lambda a: a["q"].to(I32)), "q"),
    case("q_prologue", "q-fp8", setter(q=lambda a: a["q"].to(FN)), "q"),
    case("q_prologue", "q-2d", setter(q=lambda a: a["q"][:, 0]), "q"),
    case("q_prologue", "q-head-dim-96", setter(q=lambda a: a["q"][..., :96]), "q"),
    case("q_prologue", "positions-float", setter(positions=lambda a: a["positions"].float()), "positions"),
    case("q_prologue", "positions-shape", setter(positions=torch.tensor([0, 1])), "positions"),
    case("q_prologue", "positions-meta", setter(positions=lambda a: meta(a["positions"])), "positions"),
    case("q_prologue", "positions-past-table", setter(positions=torch.tensor([0, 5, MAX_POS])), "positions"),
    case("q_prologue", "positions-negative", setter(positions=torch.tensor([0, -1, 3])), "positions"),
    case("q_prologue", "cos_sin-float64", setter(cos_sin=lambda a: a["cos_sin"].double()), "cos_sin"),
    case("q_prologue", "cos_sin-1d", setter(cos_sin=lambda a: a["cos_sin"][0]), "cos_sin"),
    case("q_prologue", "cos_sin-meta", setter(cos_sin=lambda a: meta(a["cos_sin"])), "cos_sin"),
    case("q_prologue", "cos_sin-odd-width", setter(cos_sin=lambda a: a["cos_sin"][:, :63]), "cos_sin"),
    case("q_prologue", "rope_offset-past-head", setter(rope_offset=100), "rope_offset"),
    case("q_prologue", "rope_offset-negative", setter(rope_offset=-2), "rope_offset"),
    case("q_prologue", "head_weights-int", setter(head_weights=lambda a: a["head_weights"].to(I32)), "head_weights"),
    case("q_prologue", "head_weights-shape", setter(head_weights=lambda a: a["head_weights"][:, :2]), "head_weights"),
    case("q_prologue", "head_weights-meta", setter(head_weights=lambda a: meta(a["head_weights"])), "head_weights"),
    case("q_prologue", "fp8_dtype-bf16", setter(fp8_dtype=BF16), "fp8_dtype"),
    case("q_prologue", "weight_scale-None", setter(weight_scale=None), "weight_scale"),
]

KS = [
    case("k_prologue_store", "k-int", setter(k=lambda a: a["k"].to(I32)), "k"),
    case("k_prologue_store", "k-3d", setter(k=lambda a: a["k"][None]), "k"),
    case("k_prologue_store", "k-head-dim-64", setter(k=lambda a: a["k"][:, :64]), "k"),
    case("k_prologue_store", "norm-unknown", setter(norm="batchnorm"), "norm"),
    case("k_prologue_store", "norm_weight-None", setter(norm_weight=None), "norm_weight"),
    case("k_prologue_store", "norm_weight-shape", setter(norm_weight=torch.ones(64, dtype=BF16)), "norm_weight"),
    case("k_prologue_store", "norm_weight-meta", setter(norm_weight=lambda a: meta(a["norm_weight"])), "norm_weight"),
    case("k_prologue_store", "norm_bias-None", setter(norm_bias=None), "norm_bias"),
    case("k_prologue_store", "norm_bias-shape", setter(norm_bias=torch.zeros(127, dtype=BF16)), "norm_bias"),
    case("k_prologue_store", "norm_bias-meta", setter(norm_bias=lambda a: meta(a["norm_bias"])), "norm_bias"),
    case("k_prologue_store", "positions-float", setter(positions=lambda a: a["positions"].float()), "positions"),
    case("k_prologue_store", "positions-shape", setter(positions=torch.tensor([1, 2])), "positions"),
    case("k_prologue_store", "positions-meta", setter(positions=lambda a: meta(a["positions"])), "positions"),
    case("k_prologue_store", "positions-past-table", setter(positions=torch.tensor([1, MAX_POS + 3, 2])), "positions"),
    case("k_prologue_store", "cos_sin-float64", setter(cos_sin=lambda a: a["cos_sin"].double()), "cos_sin"),
    case("k_prologue_store", "cos_sin-meta", setter(cos_sin=lambda a: meta(a["cos_sin"])), "cos_sin"),
    case("k_prologue_store", "rope_offset-past-head", setter(rope_offset=65), "rope_offset"),
    case("k_prologue_store", "kv_cache-float-view", setter(kv_cache=lambda a: a["kv_cache"].view(F32)), "kv_cache"),
    case("k_prologue_store", "kv_cache-shape", setter(kv_cache=lambda a: a["kv_cache"].view(K_PAGES, 64, 132)),
         "kv_cache"),
    case("k_prologue_store", "kv_cache-noncontiguous",
         setter(kv_cache=lambda a: torch.cat([a["kv_cache"], a["kv_cache"]], dim=1)[:, ::2]), "kv_cache"),
    case("k_prologue_store", "kv_cache-meta", setter(kv_cache=lambda a: meta(a["kv_cache"])), "kv_cache"),
    case("k_prologue_store", "slot_mapping-float", setter(slot_mapping=lambda a: a["slot_mapping"].float()),
         "slot_mapping"),
    case("k_prologue_store", "slot_mapping-shape", setter(slot_mapping=torch.tensor([0, 1])), "slot_mapping"),
    case("k_prologue_store", "slot_mapping-meta", setter(slot_mapping=lambda a: meta(a["slot_mapping"])),
         "slot_mapping"),
    case("k_prologue_store", "slot_mapping-past-cache", setter(slot_mapping=torch.tensor([0, 1, K_PAGES * 64])),
         "slot_mapping"),
    case("k_prologue_store", "slot_mapping-below-minus1", setter(slot_mapping=torch.tensor([0, -2, 5])),
         "slot_mapping"),
    case("k_prologue_store", "fp8_dtype-bf16", setter(fp8_dtype=BF16), "fp8_dtype"),
    case("k_prologue_store", "eps-negative", setter(eps=-1.0), "eps"),
]

GEMM = [
    case("gemm_fp8_blockscale", "a-bf16", setter(a=lambda a: a["a"].to(BF16)), "a"),
    case("gemm_fp8_blockscale", "a-3d", setter(a=lambda a: a["a"][None]), "a"),
    case("gemm_fp8_blockscale", "a_scales-bf16", setter(a_scales=lambda a: a["a_scales"].to(BF16)), "a_scales"),
    case("gemm_fp8_blockscale", "a_scales-shape", setter(a_scales=lambda a: a["a_scales"][:, :2]), "a_scales"),
    case("gemm_fp8_blockscale", "a_scales-meta", setter(a_scales=lambda a: meta(a["a_scales"])), "a_scales"),
    case("gemm_fp8_blockscale", "b-fnuz-mixed", setter(b=lambda a: a["b"].view(FNUZ)), "b"),
    case("gemm_fp8_blockscale", "b-K-mismatch", setter(b=lambda a: a["b"][:, :256]), "b"),
    case("gemm_fp8_blockscale", "b-meta", setter(b=lambda a: meta(a["b"])), "b"),
    case("gemm_fp8_blockscale", "b_scales-shape", setter(b_scales=torch.ones(1, 3)), "b_scales"),
    case("gemm_fp8_blockscale", "b_scales-f64", setter(b_scales=lambda a: a["b_scales"].double()), "b_scales"),
    case("gemm_fp8_blockscale", "b_scales-meta", setter(b_scales=lambda a: meta(a["b_scales"])), "b_scales"),
    case("gemm_fp8_blockscale", "out_dtype-int8", setter(out_dtype=torch.int8), "out_dtype"),
]

RAGGED = [
    case("ragged_mqa_logits", "q-bf16", setter(q=lambda a: a["q"].to(BF16)), "q"),
    case("ragged_mqa_logits", "q-2d", setter(q=lambda a: a["q"][:, 0]), "q"),
    case("ragged_mqa_logits", "k-fnuz-mixed", setter(k=lambda a: a["k"].view(FNUZ)), "k"),
    case("ragged_mqa_logits", "k-dim-64", setter(k=lambda a: a["k"][:, :64]), "k"),
    case("ragged_mqa_logits", "k-meta", setter(k=lambda a: meta(a["k"])), "k"),
    case("ragged_mqa_logits", "k_scales-bf16", setter(k_scales=lambda a: a["k_scales"].to(BF16)), "k_scales"),
    case("ragged_mqa_logits", "k_scales-shape", setter(k_scales=lambda a: a["k_scales"][:-1]), "k_scales"),
    case("ragged_mqa_logits", "weights-bf16", setter(weights=lambda a: a["weights"].to(BF16)), "weights"),
    case("ragged_mqa_logits", "weights-shape", setter(weights=lambda a: a["weights"][:, :2]), "weights"),
    case("ragged_mqa_logits", "weights-meta", setter(weights=lambda a: meta(a["weights"])), "weights"),
    case("ragged_mqa_logits", "ks-int64", setter(ks=lambda a: a["ks"].long()), "ks"),
    case("ragged_mqa_logits", "ks-shape", setter(ks=lambda a: a["ks"][:2]), "ks"),
    case("ragged_mqa_logits", "ks-meta", setter(ks=lambda a: meta(a["ks"])), "ks"),
    case("ragged_mqa_logits", "ks-negative", setter(ks=torch.tensor([0, -1, 10, 50], dtype=I32)), "ks"),
    case("ragged_mqa_logits", "ke-int64", setter(ke=lambda a: a["ke"].long()), "ke"),
    case("ragged_mqa_logits", "ke-past-keys", setter(ke=torch.tensor([1, 20, 30, N + 1], dtype=I32)), "ke"),
    case("ragged_mqa_logits", "ks-greater-than-ke", _ragged_bad_order, "ks", "ke"),
]


def _paged_cases(op):
    cases = [
        case(op, "q-bf16", setter(q=lambda a: a["q"].to(BF16)), "q"),
        case(op, "q-3d", setter(q=lambda a: a["q"][:, 0]), "q"),
        case(op, "q-head-dim-64", setter(q=lambda a: a["q"][..., :64]), "q"),
        case(op, "kv_cache-float-view", setter(kv_cache=lambda a: a["kv_cache"].view(F32)), "kv_cache"),
        case(op, "kv_cache-shape", setter(kv_cache=lambda a: a["kv_cache"].view(P_PAGES * 2, 32, 1, 132)), "kv_cache"),
        case(op, "kv_cache-meta", setter(kv_cache=lambda a: meta(a["kv_cache"])), "kv_cache"),
        case(op, "weights-bf16", setter(weights=lambda a: a["weights"].to(BF16)), "weights"),
        case(op, "weights-shape", setter(weights=lambda a: a["weights"][:B]), "weights"),
        case(op, "weights-meta", setter(weights=lambda a: meta(a["weights"])), "weights"),
        case(op, "context_lens-int64", setter(context_lens=lambda a: a["context_lens"].long()), "context_lens"),
        case(op, "context_lens-1d", setter(context_lens=torch.tensor([70, 10], dtype=I32)), "context_lens"),
        case(op, "context_lens-meta", setter(context_lens=lambda a: meta(a["context_lens"])), "context_lens"),
        case(op, "context_lens-past-max_context_len", setter(context_lens=torch.tensor([[100, 101], [9, 10]],
                                                                                     dtype=I32)), "context_lens"),
        case(op, "context_lens-negative", setter(context_lens=torch.tensor([[69, 70], [-1, 10]], dtype=I32)),
             "context_lens"),
        case(op, "context_lens-past-block_table", _paged_ctx_past_table, "max_context_len", "block_table",
             "context_lens"),
        case(op, "block_table-int64", setter(block_table=lambda a: a["block_table"].long()), "block_table"),
        case(op, "block_table-1d", setter(block_table=lambda a: a["block_table"][0]), "block_table"),
        case(op, "block_table-rows", setter(block_table=lambda a: a["block_table"][:1]), "block_table"),
        case(op, "block_table-meta", setter(block_table=lambda a: meta(a["block_table"])), "block_table"),
        case(op, "block_table-page-past-cache", setter(block_table=torch.tensor([[3, P_PAGES], [0, -1]], dtype=I32)),
             "block_table"),
        case(op, "block_table-negative-in-use", setter(block_table=torch.tensor([[3, -1], [0, -1]], dtype=I32)),
             "block_table"),
        case(op, "max_context_len-zero", setter(max_context_len=0), "max_context_len"),
        case(op, "max_context_len-past-table", setter(max_context_len=129), "max_context_len"),
        case(op, "max_context_len-float", setter(max_context_len=100.0), "max_context_len"),
    ]
    if op == "lightning_indexer":
        cases += [case(op, "k-zero", setter(k=0), "k"), case(op, "k-negative", setter(k=-4), "k"),
                  case(op, "k-float", setter(k=8.0), "k")]
    return cases


TOPK = [
    case("topk_indices", "logits-bf16", setter(logits=lambda a: a["logits"].to(BF16)), "logits"),
    case("topk_indices", "logits-1d", setter(logits=lambda a: a["logits"][0]), "logits"),
    case("topk_indices", "k-zero", setter(k=0), "k"),
    case("topk_indices", "k-negative", setter(k=-1), "k"),
    case("topk_indices", "k-float", setter(k=8.0), "k"),
    case("topk_indices", "ends-int64", setter(ends=lambda a: a["ends"].long()), "ends"),
    case("topk_indices", "ends-shape", setter(ends=lambda a: a["ends"][:2]), "ends"),
    case("topk_indices", "ends-meta", setter(ends=lambda a: meta(a["ends"])), "ends"),
    case("topk_indices", "ends-past-columns", setter(ends=torch.tensor([C + 1, 10, 64], dtype=I32)), "ends"),
    case("topk_indices", "ends-negative", setter(ends=torch.tensor([100, -1, 64], dtype=I32), starts=None), "ends"),
    case("topk_indices", "starts-int64", setter(starts=lambda a: a["starts"].long()), "starts"),
    case("topk_indices", "starts-shape", setter(starts=lambda a: a["starts"][:1]), "starts"),
    case("topk_indices", "starts-meta", setter(starts=lambda a: meta(a["starts"])), "starts"),
    case("topk_indices", "starts-greater-than-ends", setter(starts=torch.tensor([0, 11, 60], dtype=I32)),
         "starts", "ends"),
    case("topk_indices", "row_request-without-block_table", setter(row_request=torch.tensor([0, 0, 0], dtype=I32)),
         "row_request"),
    case("topk_indices_slots", "block_table-int64", setter(block_table=lambda a: a["block_table"].long()),
         "block_table"),
    case("topk_indices_slots", "block_table-1d", setter(block_table=lambda a: a["block_table"][0]), "block_table"),
    case("topk_indices_slots", "block_table-meta", setter(block_table=lambda a: meta(a["block_table"])),
         "block_table"),
    case("topk_indices_slots", "block_table-rows-without-row_request", setter(row_request=None), "block_table"),
    case("topk_indices_slots", "block_table-too-narrow", setter(block_table=lambda a: a["block_table"][:, :1]),
         "block_table"),
    case("topk_indices_slots", "row_request-int64", setter(row_request=lambda a: a["row_request"].long()),
         "row_request"),
    case("topk_indices_slots", "row_request-shape", setter(row_request=torch.tensor([0, 1], dtype=I32)),
         "row_request"),
    case("topk_indices_slots", "row_request-meta", setter(row_request=lambda a: meta(a["row_request"])),
         "row_request"),
    case("topk_indices_slots", "row_request-past-block_table", setter(row_request=torch.tensor([0, 2, 1], dtype=I32)),
         "row_request"),
]

DECODE = [
    case("DecodeBatch.build", "seq_lens-float", setter(seq_lens=[70.0, 5.0]), "seq_lens"),
    case("DecodeBatch.build", "seq_lens-2d", setter(seq_lens=[[70, 5]]), "seq_lens"),
    case("DecodeBatch.build", "seq_lens-empty", setter(seq_lens=torch.zeros(0, dtype=I64),
                                                       block_table=torch.zeros(0, 2, dtype=I64)), "seq_lens"),
    case("DecodeBatch.build", "seq_lens-below-next_n", setter(seq_lens=[70, 1], next_n=2), "seq_lens", "next_n"),
    case("DecodeBatch.build", "seq_lens-str", setter(seq_lens="70,5"), "seq_lens"),
    case("DecodeBatch.build", "seq_lens-meta", setter(seq_lens=meta(torch.tensor([70, 5]))), "seq_lens"),
    case("DecodeBatch.build", "block_table-1d", setter(block_table=[3, 1]), "block_table"),
    case("DecodeBatch.build", "block_table-float", setter(block_table=[[3.0, 1.0], [0.0, -1.0]]), "block_table"),
    case("DecodeBatch.build", "block_table-rows", setter(block_table=[[3, 1]]), "block_table"),
    case("DecodeBatch.build", "block_table-meta", setter(block_table=meta(torch.tensor([[3, 1], [0, -1]]))),
         "block_table"),
    case("DecodeBatch.build", "seq_lens-past-block_table", setter(seq_lens=[129, 5]), "block_table"),
    case("DecodeBatch.build", "block_table-page-past-cache", setter(block_table=[[3, 4], [0, -1]]), "block_table"),
    case("DecodeBatch.build", "block_table-negative-in-use", setter(block_table=[[3, -1], [0, -1]]), "block_table"),
    case("DecodeBatch.build", "next_n-zero", setter(next_n=0), "next_n"),
    case("DecodeBatch.build", "next_n-float", setter(next_n=1.0), "next_n"),
    case("DecodeBatch.build", "compress_ratio-2", setter(compress_ratio=2), "compress_ratio"),
    case("DecodeBatch.build", "max_context_len-below-longest", setter(max_context_len=64), "max_context_len"),
    case("DecodeBatch.build", "max_context_len-negative", setter(max_context_len=-1), "max_context_len"),
]

PREFILL = [
    case("PrefillBatch.build", "prefix_lens-float", setter(prefix_lens=[0.0, 60.0]), "prefix_lens"),
    case("PrefillBatch.build", "prefix_lens-2d", setter(prefix_lens=[[0, 60]]), "prefix_lens"),
    case("PrefillBatch.build", "prefix_lens-negative", setter(prefix_lens=[0, -1]), "prefix_lens"),
    case("PrefillBatch.build", "prefix_lens-meta", setter(prefix_lens=meta(torch.tensor([0, 60]))), "prefix_lens"),
    case("PrefillBatch.build", "extend_lens-float", setter(extend_lens=[3.0, 10.0]), "extend_lens"),
    case("PrefillBatch.build", "extend_lens-zero", setter(extend_lens=[3, 0]), "extend_lens"),
    case("PrefillBatch.build", "extend_lens-length", setter(extend_lens=[3, 10, 1]), "extend_lens", "prefix_lens"),
    case("PrefillBatch.build", "block_table-1d", setter(block_table=[2, -1]), "block_table"),
    case("PrefillBatch.build", "block_table-rows", setter(block_table=[[0, 1]]), "block_table"),
    case("PrefillBatch.build", "block_table-float", setter(block_table=[[2.0, -1.0], [0.0, 1.0]]), "block_table"),
    case("PrefillBatch.build", "context-past-block_table", setter(prefix_lens=[0, 120]), "block_table"),
    case("PrefillBatch.build", "block_table-page-past-cache", setter(block_table=[[2, -1], [0, 4]]), "block_table"),
    case("PrefillBatch.build", "block_table-negative-in-use", setter(block_table=[[2, -1], [0, -1]]), "block_table"),
    case("PrefillBatch.build", "compress_ratio-3", setter(compress_ratio=3), "compress_ratio"),
]

ALLOC = [
    case("IndexKCache.allocate", "num_pages-zero", setter(num_pages=0), "num_pages"),
    case("IndexKCache.allocate", "num_pages-negative", setter(num_pages=-3), "num_pages"),
    case("IndexKCache.allocate", "num_pages-float", setter(num_pages=4.0), "num_pages"),
    case("IndexKCache.allocate", "num_pages-str", setter(num_pages="4"), "num_pages"),
    case("IndexKCache.allocate", "num_pages-tensor", setter(num_pages=torch.tensor(4)), "num_pages"),
    case("IndexKCache.allocate", "fp8_dtype-bf16", setter(fp8_dtype=BF16), "fp8_dtype"),
]

FWD = [
    case("Indexer.forward", "x-float32", setter(x=lambda a: a["x"].float()), "x"),
    case("Indexer.forward", "x-1d", setter(x=lambda a: a["x"][0]), "x"),
    case("Indexer.forward", "x-hidden", setter(x=lambda a: a["x"][:, :4096]), "x"),
    case("Indexer.forward", "q_lora-f16", setter(q_lora=lambda a: a["q_lora"].half()), "q_lora"),
    case("Indexer.forward", "q_lora-shape", setter(q_lora=lambda a: a["q_lora"][:, :1024]), "q_lora"),
    case("Indexer.forward", "q_lora-meta", setter(q_lora=lambda a: meta(a["q_lora"])), "q_lora"),
    case("Indexer.forward", "positions-float", setter(positions=lambda a: a["positions"].float()), "positions"),
    case("Indexer.forward", "positions-shape", setter(positions=lambda a: a["positions"][:1]), "positions"),
    case("Indexer.forward", "positions-meta", setter(positions=lambda a: meta(a["positions"])), "positions"),
    case("Indexer.forward", "positions-past-max_position", setter(positions=torch.tensor([4, 4096])), "positions"),
    case("Indexer.forward", "batch-wrong-type", setter(batch=lambda a: a["batch"].context_lens), "batch"),
    case("Indexer.forward", "batch-token-count", _fwd_token_mismatch, "batch"),
    case("Indexer.forward", "batch-compress_ratio", _decode_batch_wrong_ratio, "batch", "compress_ratio"),
    case("Indexer.forward", "batch-slots-past-cache", _fwd_cache_too_small, "slot_mapping", "batch", "cache",
         "block_table"),
    case("Indexer.forward", "cache-raw-tensor", setter(cache=lambda a: a["cache"].data), "cache"),
    case("Indexer.forward", "cache-meta", setter(cache=IndexKCache.allocate(4, device="meta")), "cache"),
    case("Indexer.forward", "cache-fp8-fnuz-vs-fn", setter(cache=lambda a: IndexKCache(a["cache"].data, FNUZ)),
         "cache", "fp8_dtype"),
    case("Indexer.forward", "q_lora_quant-tuple", setter(q_lora_quant=lambda a: ops.quant_fp8_groups(a["q_lora"])),
         "q_lora_quant"),
]

CASES = QUANT + RMS + Q + KS + GEMM + RAGGED + _paged_cases("paged_mqa_logits") + _paged_cases("lightning_indexer") \
    + TOPK + DECODE + PREFILL + ALLOC + FWD


def _cache_bytes(args: dict) -> torch.Tensor | None:
    if "kv_cache" in args and isinstance(args["kv_cache"], torch.Tensor) and args["kv_cache"].device.type == "cpu":
        return args["kv_cache"]
    if isinstance(args.get("cache"), IndexKCache) and args["cache"].device.type == "cpu":
        return args["cache"].data
    return None


@pytest.mark.parametrize("op,mutate,names", CASES)
def test_bad_input_names_argument(op, mutate, names):
    make, call = OPS[op]
    args = make()
    original_cache = _cache_bytes(args)  # the baseline cache: must not change when the call is rejected
    before = original_cache.clone() if original_cache is not None else None
    mutate(args)
    with pytest.raises(ERRORS) as info:
        call(args)
    assert_names(info.value, names)
    if before is not None:
        assert torch.equal(original_cache, before), "a rejected call wrote into the cache"


def test_topk_max_len_bound():
    """``max_len``: the same result as without it; a row ending past it, or a bound that is not an int, refused
    naming the argument."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 6000, generator=gen)
    ends = torch.tensor([100, 3000, 2999, 1], dtype=torch.int32)
    want = ops.topk_indices(logits, 64, ends)
    for bound in (3000, 4096, 6000, 10**6):
        assert torch.equal(ops.topk_indices(logits, 64, ends, max_len=bound), want)
    with pytest.raises(ValueError, match="ends.*max_len=2999"):
        ops.topk_indices(logits, 64, ends, max_len=2999)
    for bad in ("4096", 4096.0, -1, True):
        with pytest.raises(ValueError, match="max_len"):
            ops.topk_indices(logits, 64, ends, max_len=bad)
