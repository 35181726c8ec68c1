"""The fp8 scale format is part of the recipe (IndexerConfig.scale_fmt): the GEMM inputs are quantized with it, and a
handed-in q_lora_quant is reused only when its scales are in that format (then bit-identical to quantizing again)."""

import dataclasses

import pytest
import torch

from dsa_indexer import DecodeBatch, IndexerConfig, IndexKCache, Indexer, ops
from dsa_indexer.plan import StepPlan
from dsa_indexer.contract.cache import page_views

TINY = IndexerConfig(name="v32-tiny", hidden_size=256, q_lora_rank=384, n_heads=4, topk=16, max_position=2048,
                     yarn=None)


def _setup(scale_fmt: str, seed: int):
    cfg = dataclasses.replace(TINY, scale_fmt=scale_fmt)
    indexer = Indexer(cfg).init_random(seed)
    gen = torch.Generator().manual_seed(seed)
    cache = IndexKCache.allocate(8)
    cache.data.copy_(torch.randint(0, 0x78, cache.data.shape, dtype=torch.uint8, generator=gen))
    page_views(cache.data)[1].copy_(torch.rand(8, 64, generator=gen) + 0.05)
    table = torch.randperm(8, generator=gen).to(torch.int32).view(2, 4)
    batch = DecodeBatch.build([200, 150], table, num_cache_pages=8, max_context_len=256)
    x = torch.randn(2, cfg.hidden_size, generator=gen).to(torch.bfloat16)
    q_a = (torch.randn(2, cfg.q_lora_rank, generator=gen) * 3).to(torch.bfloat16)
    norm_w = (torch.rand(cfg.q_lora_rank, generator=gen) + 0.5).to(torch.bfloat16)
    return indexer, cache, batch, x, q_a, norm_w


def _run(indexer, cache, batch, x, q_lora, quant):
    work = IndexKCache(cache.data.clone(), cache.fp8_dtype)
    return indexer(x, q_lora, batch.positions, batch, work, q_lora_quant=quant)


def test_scale_fmt_is_validated_by_name():
    with pytest.raises(ValueError, match="IndexerConfig.scale_fmt must be one of 'fp32', 'ue8m0'"):
        IndexerConfig.deepseek_v32(scale_fmt="e8m0")
    assert IndexerConfig.deepseek_v32(scale_fmt="ue8m0").gemm_ue8m0


@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
def test_the_gemm_input_is_quantized_in_the_recipe_format(scale_fmt, monkeypatch):
    indexer, cache, batch, x, q_a, norm_w = _setup(scale_fmt, seed=int(torch.randint(0, 10_000, ())))
    seen = []
    real = StepPlan.run  # every op of a step runs through its plan: (x, group_size, ue8m0, fp8_dtype) here

    def recording(plan, role, op, *args, **kwargs):
        if op == "quant_fp8_groups":
            seen.append(args[2])
        return real(plan, role, op, *args, **kwargs)

    monkeypatch.setattr(StepPlan, "run", recording)
    q_lora = ops.rmsnorm_quant_fp8(q_a, norm_w)[0]
    _run(indexer, cache, batch, x, q_lora, None)
    assert seen == [scale_fmt == "ue8m0"]  # one GEMM-input quant (q_lora for wq_b), in the recipe's format


@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
def test_the_recipe_producer_is_reused_bit_identically(scale_fmt):
    indexer, cache, batch, x, q_a, norm_w = _setup(scale_fmt, seed=int(torch.randint(0, 10_000, ())))
    q_lora, quant = indexer.quantize_q_lora(q_a, norm_w)
    assert quant.layout.ue8m0 == (scale_fmt == "ue8m0")
    if scale_fmt == "ue8m0":  # every scale a power of two
        mantissa, _ = torch.frexp(quant.scales)
        assert bool((mantissa == 0.5).all())
    reused = _run(indexer, cache, batch, x, q_lora, quant)
    assert indexer.reuse_stats["reused"] == 1
    assert torch.equal(reused, _run(indexer, cache, batch, x, q_lora, None))
    assert (reused >= 0).all()


@pytest.mark.parametrize("recipe, handed", [("ue8m0", False), ("fp32", True)])
def test_a_quant_in_the_other_format_is_dropped_naming_the_recipe(recipe, handed):
    indexer, cache, batch, x, q_a, norm_w = _setup(recipe, seed=int(torch.randint(0, 10_000, ())))
    q_lora, quant = ops.rmsnorm_quant_fp8(q_a, norm_w, ue8m0=handed)
    got = _run(indexer, cache, batch, x, q_lora, quant)
    assert indexer.reuse_stats["dropped"] == 1 and indexer.reuse_stats["reused"] == 0
    reason = next(k for k in indexer.reuse_stats if k.startswith("dropped: "))
    assert f"scale_fmt={recipe}" in reason
    assert torch.equal(got, _run(indexer, cache, batch, x, q_lora, None))


def test_the_scale_format_changes_the_gemm_input():
    """ue8m0 vs fp32 scales quantize the same q_lora to different fp8 codes (else the recipe would be moot)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 10_000, ())))
    q = (torch.randn(64, 384, generator=gen) * 3).to(torch.bfloat16)
    a, sa = ops.quant_fp8_groups(q, 128, ue8m0=False)
    b, sb = ops.quant_fp8_groups(q, 128, ue8m0=True)
    assert bool((sb >= sa).all()) and not torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    deq_a = a.float().view(64, 3, 128) * sa[..., None]
    deq_b = b.float().view(64, 3, 128) * sb[..., None]
    assert not torch.equal(deq_a, deq_b)
