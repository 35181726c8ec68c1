"""q_lora fp8 reuse: attention's quantized q_lora feeds the indexer's wq_b when (and only when) its layout fits."""

import dataclasses
import logging

import pytest
import torch

from dsa_indexer import (CompressorState, DecodeBatch, Fp8GroupLayout, IndexerConfig, IndexKCache, Indexer, PrefillBatch,
                         QuantizedActivation, ops)
from dsa_indexer.contract.quant import PRODUCER_ROUNDED
from dsa_indexer.plan import StepPlan

V32_TINY = IndexerConfig(name="v32-tiny", hidden_size=256, q_lora_rank=384, n_heads=4, topk=16, max_position=2048,
                         yarn=None)
V4_TINY = dataclasses.replace(IndexerConfig.deepseek_v4_flash(), name="v4-tiny", hidden_size=256, q_lora_rank=256,
                              n_heads=4, topk=8, max_position=2048)


def _setup(cfg, seed, wq_b_fp8=True):
    torch.manual_seed(seed)
    indexer = Indexer(cfg, wq_b_fp8=wq_b_fp8).init_random(seed)
    cache = IndexKCache.allocate(8)
    cache.data.copy_(torch.randint(0, 0x78, cache.data.shape, dtype=torch.uint8))  # finite random fp8 keys
    from dsa_indexer.contract.cache import page_views
    page_views(cache.data)[1].copy_(torch.rand(8, 64) + 0.05)
    table = torch.randperm(8).to(torch.int32).view(2, 4)
    return indexer, cache, table


def _decode_batch(cfg, table):
    return DecodeBatch.build([200, 150], table, num_cache_pages=8, compress_ratio=cfg.compress_ratio,
                             max_context_len=256)


def _inputs(cfg, rows):
    x = torch.randn(rows, cfg.hidden_size, dtype=torch.bfloat16)
    q_a = torch.randn(rows, cfg.q_lora_rank, dtype=torch.bfloat16) * 3
    q_lora, q_lora_quant = ops.rmsnorm_quant_fp8(q_a, torch.rand(cfg.q_lora_rank, dtype=torch.bfloat16) + 0.5)
    return x, q_lora, q_lora_quant


def _run(indexer, cache, batch, x, q_lora, quant):
    work = IndexKCache(cache.data.clone(), cache.fp8_dtype)
    # C4: a fresh compressor state per run, so both runs store the same entries.
    state = CompressorState.allocate(2, indexer.config) if indexer.compressor is not None else None
    return indexer(x, q_lora, batch.positions, batch, work, q_lora_quant=quant, compressor_state=state)


@pytest.mark.parametrize("cfg", [V32_TINY, V4_TINY], ids=["v3.2", "v4-c4"])
def test_reuse_is_bit_identical_and_counted(cfg):
    indexer, cache, table = _setup(cfg, seed=torch.randint(0, 10_000, ()).item())
    batch = _decode_batch(cfg, table)
    x, q_lora, quant = _inputs(cfg, batch.num_tokens)
    assert quant.layout.producer == PRODUCER_ROUNDED and quant.layout.rows == batch.num_tokens
    with_reuse = _run(indexer, cache, batch, x, q_lora, quant)
    assert indexer.reuse_stats["reused"] == 1
    without = _run(indexer, cache, batch, x, q_lora, None)
    assert torch.equal(with_reuse, without)
    assert (with_reuse >= 0).any()
    # Prefill too.
    pb = PrefillBatch.build([0], [120], table[:1], num_cache_pages=8, compress_ratio=cfg.compress_ratio)
    x, q_lora, quant = _inputs(cfg, pb.num_tokens)
    assert torch.equal(_run(indexer, cache, pb, x, q_lora, quant), _run(indexer, cache, pb, x, q_lora, None))
    assert indexer.reuse_stats["reused"] == 2


def _trimmed(q, quant):
    return QuantizedActivation(quant.data[:-1], quant.scales[:-1], dataclasses.replace(quant.layout,
                                                                                        rows=quant.layout.rows - 1))


def _padded(q, quant):
    pad = 4
    data = torch.cat([quant.data, quant.data[:pad]])
    return QuantizedActivation(data, torch.cat([quant.scales, quant.scales[:pad]]),
                               dataclasses.replace(quant.layout, rows=quant.layout.rows + pad))


def _ue8m0(q, quant):
    return ops.rmsnorm_quant_fp8(q, torch.ones(q.shape[1], dtype=torch.bfloat16), ue8m0=True)[1]


def _unrounded(q, quant):
    return QuantizedActivation(quant.data, quant.scales, dataclasses.replace(quant.layout, producer="fp32_unrounded"))


def _packed(q, quant):
    return QuantizedActivation(quant.data, quant.scales, dataclasses.replace(quant.layout, packed_scales=True))


@pytest.mark.parametrize("make, reason", [
    (_trimmed, "rows trimmed"), (_padded, "rows padded"), (_ue8m0, "ue8m0"), (_packed, "packed ue8m0"),
    (_unrounded, "before bf16 rounding"),
], ids=["trimmed-rows", "padded-rows", "ue8m0-scales", "packed-scales", "unrounded-producer"])
def test_each_drop_rule_falls_back_with_the_same_result(make, reason, caplog):
    indexer, cache, table = _setup(V32_TINY, seed=torch.randint(0, 10_000, ()).item())
    batch = _decode_batch(V32_TINY, table)
    x, q_lora, quant = _inputs(V32_TINY, batch.num_tokens)
    bad = make(q_lora, quant)
    with caplog.at_level(logging.DEBUG, logger="dsa_indexer"):
        got = _run(indexer, cache, batch, x, q_lora, bad)
    assert torch.equal(got, _run(indexer, cache, batch, x, q_lora, None))
    assert indexer.reuse_stats["dropped"] == 1 and indexer.reuse_stats["reused"] == 0
    recorded = [key for key in indexer.reuse_stats if key.startswith("dropped: ")]
    assert len(recorded) == 1 and reason in recorded[0]
    assert any("q_lora_quant dropped" in r.getMessage() and reason in r.getMessage() for r in caplog.records)


def test_bf16_wq_b_drops_the_quantized_copy():
    indexer, cache, table = _setup(V32_TINY, seed=3, wq_b_fp8=False)
    batch = _decode_batch(V32_TINY, table)
    x, q_lora, quant = _inputs(V32_TINY, batch.num_tokens)
    assert torch.equal(_run(indexer, cache, batch, x, q_lora, quant), _run(indexer, cache, batch, x, q_lora, None))
    assert any("not block-fp8" in key for key in indexer.reuse_stats)


def test_reuse_removes_exactly_one_quant_call(monkeypatch):
    indexer, cache, table = _setup(V32_TINY, seed=5)
    batch = _decode_batch(V32_TINY, table)
    x, q_lora, quant = _inputs(V32_TINY, batch.num_tokens)
    calls = []
    real = StepPlan.run  # every op a step runs goes through its plan

    def counting(plan, role, op, *args, **kwargs):
        if op == "quant_fp8_groups":
            calls.append(role)
        return real(plan, role, op, *args, **kwargs)

    monkeypatch.setattr(StepPlan, "run", counting)
    _run(indexer, cache, batch, x, q_lora, None)
    without = len(calls)
    calls.clear()
    _run(indexer, cache, batch, x, q_lora, quant)
    assert without - len(calls) == 1 and "q_lora_quant" not in calls


def test_layout_tag_defaults_describe_the_library_producer():
    layout = Fp8GroupLayout()
    assert (layout.group_size, layout.ue8m0, layout.scale_major, layout.packed_scales) == (128, False, "row", False)
    assert layout.producer == PRODUCER_ROUNDED
