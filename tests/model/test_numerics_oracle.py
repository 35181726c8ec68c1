"""A float64 model-level oracle of the indexer's numerics, written from DeepSeek's published inference code (V4-Flash
``inference/model.py`` / ``kernel.py``: act_quant, fp4_act_quant, Indexer, Compressor), with switchable recipes.
Under each recipe the library's top-k (real top-k size, 512) agrees >= 0.99 with the oracle run under the SAME
recipe; deliberate mutations of the oracle's recipe (FP4 rounding mode, block size, fp8 instead of FP4, scale
format) fall below that.

The oracle simulates each rounding the published code makes, in float64 otherwise: bf16 outputs of every GEMM and of
RoPE / Hadamard / RMSNorm, fp8 (e4m3, amax / 448 scales, ue8m0 rounds them up to a power of two) or FP4 (e2m1,
power-of-two scales from amax / 6 floored at 6 * 2^-126, round to nearest even) simulations; logits in float64.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import v4_oracle
from dsa_indexer import CompressorState, IndexerConfig, IndexKCache, Indexer, PrefillBatch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


@dataclasses.dataclass(frozen=True)
class Recipe:
    scale_fmt: str = "ue8m0"        # the GEMM-input act quant (q_lora into wq_b)
    index_quant: str = "fp4"         # "fp4" | "fp8"
    index_ue8m0: bool = True         # fp8 index quant: power-of-two scales
    fp4_block: int = 32
    fp4_rounding: str = "nearest_even"  # | "toward_zero" (a mutation)


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(s)))


def fp8_sim(x: torch.Tensor, group: int, ue8m0: bool) -> torch.Tensor:
    g = x.reshape(*x.shape[:-1], -1, group)
    s = g.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448.0
    if ue8m0:
        s = pow2_ceil(s)
    return ((g / s).clamp(-448, 448).to(torch.float8_e4m3fn).double() * s).reshape(x.shape)


def e2m1_round(y: torch.Tensor, mode: str) -> torch.Tensor:
    """Nearest grid point by exhaustive distance, ties to the even code (codes 0..7: even = 0, 1, 2, 4)."""
    mag = y.abs()
    if mode == "toward_zero":
        idx = (E2M1[None, :] <= mag.reshape(-1, 1)).sum(-1) - 1
        return torch.copysign(E2M1[idx].reshape(y.shape), y)
    dist = (mag.reshape(-1, 1) - E2M1[None, :]).abs()
    best = dist.min(-1, keepdim=True).values
    tie_ok = dist == best
    code = torch.where(tie_ok.sum(-1) > 1, (tie_ok & (torch.arange(8) % 2 == 0)).float().argmax(-1),
                       tie_ok.float().argmax(-1))
    return torch.copysign(E2M1[code].reshape(y.shape), y)


def fp4_sim(x: torch.Tensor, block: int, mode: str) -> torch.Tensor:
    g = x.reshape(*x.shape[:-1], -1, block)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0 ** -126)
    s = pow2_ceil((amax.float() * torch.tensor(1 / 6, dtype=torch.float32)).double())  # fp32 product, as published
    return (e2m1_round((g / s).clamp(-6, 6), mode) * s).reshape(x.shape)


def hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def index_quant(x: torch.Tensor, r: Recipe) -> torch.Tensor:
    x = bf16(x @ hadamard(x.shape[-1]))  # rotate_activation: bf16 in, bf16 out
    if r.index_quant == "fp4":
        return fp4_sim(x, r.fp4_block, r.fp4_rounding)
    return fp8_sim(x, x.shape[-1], r.index_ue8m0)


def v4_logits(indexer: Indexer, x, q_lora, rows, r: Recipe) -> torch.Tensor:
    cfg = indexer.config
    comp = indexer.compressor
    freqs = v4_oracle.yarn_inv_freqs()
    entries = bf16(v4_oracle.compress_vectorized(x, comp.wkv.weight, comp.wgate.weight, comp.ape, comp.norm.weight))
    k = bf16(v4_oracle.rope_trailing_pairs(entries, torch.arange(entries.shape[0]) * 4, freqs))
    k = index_quant(k, r)
    qa = fp8_sim(q_lora[rows].double(), 128, r.scale_fmt == "ue8m0")
    q = bf16(qa @ indexer.wq_b.dequantize().double().T).view(len(rows), cfg.n_heads, cfg.head_dim)
    q = bf16(v4_oracle.rope_trailing_pairs(q, torch.tensor(rows), freqs))
    q = index_quant(q, r)
    w = bf16(x[rows].double() @ indexer.weights_proj.weight.double().T) / math.sqrt(cfg.n_heads * cfg.head_dim)
    return torch.einsum("ths,th->ts", torch.einsum("thd,sd->ths", q, k).clamp_min(0), w)


def agreement(got: torch.Tensor, logits: torch.Tensor, rows, k: int) -> float:
    agree = total = 0
    for i, t in enumerate(rows):
        visible = (t + 1) // 4
        want = torch.topk(logits[i, :visible], min(k, visible)).indices.tolist()
        agree += len(set(got[t].tolist()) & set(want))
        total += len(want)
    return agree / total


LENGTH = 2600  # 650 entries: the last rows see > 512, so the top-512 is a real choice
ROWS = list(range(LENGTH - 48, LENGTH))


def v4_setup(preset: IndexerConfig, seed: int):
    cfg = dataclasses.replace(preset, name="v4-small", hidden_size=512, q_lora_rank=256, max_position=4096)
    indexer = Indexer(cfg).init_random(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(LENGTH, cfg.hidden_size, generator=gen).to(torch.bfloat16)
    q_lora = torch.randn(LENGTH, cfg.q_lora_rank, generator=gen).to(torch.bfloat16)
    pages = -(-LENGTH // 4 // 64)
    table = torch.arange(pages, dtype=torch.int32)[None]
    cache = IndexKCache.allocate(pages)
    state = CompressorState.allocate(1, cfg)
    pb = PrefillBatch.build([0], [LENGTH], table, num_cache_pages=pages, compress_ratio=4)
    got = indexer(x, q_lora, pb.positions, pb, cache, compressor_state=state)
    return indexer, x, q_lora, got


@pytest.fixture(scope="module")
def fp4_run():
    seed = int(torch.randint(0, 10_000, ()))
    # DeepSeek's whole recipe in one argument: FP4 q / keys AND ue8m0 q_lora scales (FP4 alone, with the default
    # fp32 GEMM-input scales, is the oracle's "scale_fmt fp32" mutation below: 0.98).
    return v4_setup(IndexerConfig.deepseek_v4_flash(recipe="deepseek"), seed)


def test_the_fp4_recipe_agrees_with_the_oracle_and_its_mutations_do_not(fp4_run):
    indexer, x, q_lora, got = fp4_run
    results = {}
    for name, recipe in {"same": Recipe(), "rounding toward zero": Recipe(fp4_rounding="toward_zero"),
                         "block 128": Recipe(fp4_block=128), "fp8 instead of fp4": Recipe(index_quant="fp8"),
                         "scale_fmt fp32": Recipe(scale_fmt="fp32")}.items():
        results[name] = agreement(got, v4_logits(indexer, x, q_lora, ROWS, recipe), ROWS, indexer.config.topk)
    print(results)
    assert results["same"] >= 0.99, results
    for name in ("rounding toward zero", "block 128", "fp8 instead of fp4", "scale_fmt fp32"):
        assert results[name] < 0.99 and results[name] < results["same"] - 0.005, results


@pytest.mark.parametrize("key_quant, ue8m0", [("fp8_ue8m0", True), ("fp8_fp32", False)])
def test_the_fp8_recipes_agree_with_the_oracle_and_the_other_scale_format_does_not(key_quant, ue8m0):
    preset = IndexerConfig.deepseek_v4_flash(key_quant=key_quant, scale_fmt="ue8m0")
    indexer, x, q_lora, got = v4_setup(preset, int(torch.randint(0, 10_000, ())))
    same = agreement(got, v4_logits(indexer, x, q_lora, ROWS, Recipe(index_quant="fp8", index_ue8m0=ue8m0)), ROWS,
                     indexer.config.topk)
    other = agreement(got, v4_logits(indexer, x, q_lora, ROWS, Recipe(index_quant="fp8", index_ue8m0=not ue8m0)),
                      ROWS, indexer.config.topk)
    fp4 = agreement(got, v4_logits(indexer, x, q_lora, ROWS, Recipe()), ROWS, indexer.config.topk)
    print(key_quant, {"same": same, "other scale format": other, "fp4": fp4})
    assert same >= 0.99 and other < same and fp4 < 0.99, (same, other, fp4)
