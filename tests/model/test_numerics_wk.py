"""V3.2's wk as the checkpoint stores it (block-fp8, an fp8 GEMM with x quantized per the recipe) beside the
dequantized bf16 path, and weights_proj's precision per model (V3.2: fp32)."""

import dataclasses

import pytest
import torch

from dsa_indexer import IndexerConfig, Indexer
from dsa_indexer.indexer import BlockFp8Linear, quantize_block_fp8
from dsa_indexer.pipeline import project_head_weights, project_k, project_x

TINY = IndexerConfig(name="v32-tiny", hidden_size=512, q_lora_rank=256, n_heads=8, topk=16, max_position=2048,
                     yarn=None)


def _x(rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, TINY.hidden_size, generator=gen) * 2).to(torch.bfloat16)


def _x_quant_float64(x: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    """x quantized per 128 as DeepSeek's act_quant does (amax >= 1e-4, s = amax / 448, ue8m0: 2^ceil(log2 s)),
    dequantized, in float64: written from the description, not with the library's quant."""
    g = x.double().view(x.shape[0], -1, 128)
    s = g.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448.0
    if ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    codes = (g / s).clamp(-448, 448).to(torch.float8_e4m3fn).double()
    return (codes * s).view_as(x)


@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
def test_fp8_wk_is_an_fp8_gemm_with_x_quantized_in_the_recipe_format(scale_fmt):
    seed = int(torch.randint(0, 10_000, ()))
    indexer = Indexer(dataclasses.replace(TINY, wk_gemm="fp8", scale_fmt=scale_fmt)).init_random(seed)
    assert isinstance(indexer.wk, BlockFp8Linear) and not indexer.x_projections_fusable
    x = _x(40, seed)
    got = project_k(indexer.step_plan(1, decode=False), x)
    expect = (_x_quant_float64(x, scale_fmt == "ue8m0") @ indexer.wk.dequantize().double().T)
    assert got.dtype == torch.bfloat16 and got.shape == (40, 128) and torch.isfinite(got).all()
    # fp32 accumulation vs float64, then one bf16 rounding: within 1 bf16 ulp (2^-8 relative) plus a tiny floor.
    torch.testing.assert_close(got.double(), expect, rtol=2 ** -8, atol=1e-3)
    # The recipe matters: the other scale format, or the bf16 path on the dequantized weight, give other values.
    other = _x_quant_float64(x, scale_fmt != "ue8m0") @ indexer.wk.dequantize().double().T
    bf16_path = (x.double() @ indexer.wk.dequantize().to(torch.bfloat16).double().T)
    assert (got.double() - other).abs().max() > 1e-2 and (got.double() - bf16_path).abs().max() > 1e-2
    # project_x gives the same k (two GEMMs, not the fused one).
    assert torch.equal(project_x(indexer.step_plan(1, decode=False), x)[1], got)


def test_the_v32_deepseek_recipe_runs_deepseeks_wk_and_weights_proj():
    """``deepseek_v32(recipe="deepseek")`` (sizes shrunk) is DeepSeek's V3.2 code path: wk as an fp8 GEMM on x
    quantized with power-of-two scales, weights_proj in fp32; the comparison of the two tests around this one."""
    seed = int(torch.randint(0, 10_000, ()))
    cfg = dataclasses.replace(IndexerConfig.deepseek_v32(recipe="deepseek"), hidden_size=TINY.hidden_size,
                              q_lora_rank=TINY.q_lora_rank, n_heads=TINY.n_heads, topk=TINY.topk,
                              max_position=TINY.max_position, yarn=None)
    indexer = Indexer(cfg).init_random(seed)
    assert isinstance(indexer.wk, BlockFp8Linear) and cfg.gemm_ue8m0
    x = _x(40, seed)
    got = project_k(indexer.step_plan(1, decode=False), x).double()
    wk = indexer.wk.dequantize().double()
    # fp32 accumulation vs float64, then one bf16 rounding: within 1 bf16 ulp (2^-8 relative) plus a tiny floor.
    torch.testing.assert_close(got, _x_quant_float64(x, ue8m0=True) @ wk.T, rtol=2 ** -8, atol=1e-3)
    assert (got - _x_quant_float64(x, ue8m0=False) @ wk.T).abs().max() > 1e-2  # the serving scales differ
    weights = project_head_weights(indexer.step_plan(1, decode=False), x)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights.double(), x.double() @ indexer.weights_proj.weight.double().T, rtol=1e-5,
                               atol=1e-6)  # fp32 accumulation of 512 terms


def test_the_bf16_wk_path_stays_the_fused_default():
    indexer = Indexer(TINY).init_random(1)
    assert not indexer.wk_is_block_fp8 and indexer.x_projections_fusable
    assert indexer.x_projection_weight().shape == (TINY.n_heads + 128, TINY.hidden_size)


def _fp8_state(seed: int):
    gen = torch.Generator().manual_seed(seed)
    wk = torch.randn(128, TINY.hidden_size, generator=gen) * TINY.hidden_size ** -0.5
    codes, scale = quantize_block_fp8(wk)
    wq, wq_s = quantize_block_fp8(torch.randn(TINY.n_heads * 128, TINY.q_lora_rank, generator=gen) * 0.05)
    return {"wq_b.weight": wq, "wq_b.weight_scale_inv": wq_s, "wk.weight": codes, "wk.weight_scale_inv": scale,
            "k_norm.weight": torch.ones(128), "k_norm.bias": torch.zeros(128),
            "weights_proj.weight": (torch.randn(TINY.n_heads, TINY.hidden_size, generator=gen) * 0.03)
            .to(torch.bfloat16)}


def test_an_fp8_checkpoint_wk_loads_bit_identically_or_dequantized():
    state = _fp8_state(int(torch.randint(0, 10_000, ())))
    fp8 = Indexer(dataclasses.replace(TINY, wk_gemm="fp8")).load_checkpoint(state)
    assert torch.equal(fp8.wk.weight.view(torch.uint8), state["wk.weight"].view(torch.uint8))
    assert torch.equal(fp8.wk.weight_scale_inv, state["wk.weight_scale_inv"])
    deq = Indexer(TINY).load_checkpoint(state)
    assert deq.wk.weight.dtype == torch.bfloat16
    torch.testing.assert_close(deq.wk.weight.float(), fp8.wk.dequantize(), rtol=2 ** -8, atol=0)


def test_a_bf16_wk_under_the_fp8_recipe_is_refused_by_name():
    state = _fp8_state(3)
    state["wk.weight"] = torch.randn(128, TINY.hidden_size).to(torch.bfloat16)
    del state["wk.weight_scale_inv"]
    with pytest.raises(ValueError, match="wk.weight is bfloat16 without a block scale.*wk_gemm='bf16'"):
        Indexer(dataclasses.replace(TINY, wk_gemm="fp8")).load_checkpoint(state)


def test_fp8_wk_is_for_v32_only():
    with pytest.raises(ValueError, match="wk_gemm='fp8' is for V3.2's wk"):
        IndexerConfig.deepseek_v4_flash(wk_gemm="fp8")


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_weights_proj_runs_in_the_recipe_precision(dtype):
    seed = int(torch.randint(0, 10_000, ()))
    indexer = Indexer(dataclasses.replace(TINY, weights_proj_dtype=dtype)).init_random(seed)
    x = _x(24, seed)
    got = project_head_weights(indexer.step_plan(1, decode=False), x)
    exact = x.double() @ indexer.weights_proj.weight.double().T
    if dtype == "fp32":
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-6)  # fp32 accumulation of 512 terms
        assert not indexer.x_projections_fusable
    else:
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), exact, rtol=2 ** -8, atol=1e-3)
        assert (got.double() - exact).abs().max() > 1e-6  # bf16 rounding is visible: the two recipes differ
    assert torch.equal(project_x(indexer.step_plan(1, decode=False), x)[0], got)


def test_v32_preset_runs_weights_proj_in_fp32():
    assert IndexerConfig.deepseek_v32().weights_proj_dtype == "fp32"
    assert IndexerConfig.deepseek_v4_flash().weights_proj_dtype == "bf16"
