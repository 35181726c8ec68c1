"""The AMD q_lora reuse path end to end on the H200, with aiter's REAL fused RMSNorm + fp8 quant (its Triton kernel,
behind the test-only shim of test_rocm_aiter_kernels_on_h200.py) as the producer on a simulated gfx950 target, and
the library's Triton kernels (the AMD consumers: GEMM, prologue, logits, top-k) doing the rest.

Checks: resolution picks aiter's producer; the indexer reuses its PRODUCER_UNROUNDED copy by default on gfx950;
exactly one quant kernel fewer per step; top-k agreement between reusing and re-quantizing over 16 random V3.2-size
decode batches (the at-most-1-fp8-ulp difference) is printed and must be >= 0.99.
NOT checked: HIP/CK kernels, AMD hardware, e4m3fnuz.
"""

import pytest
import torch

from test_rocm_aiter_kernels_on_h200 import AITER_PKG, _aiter_shim

from dsa_indexer import IndexerConfig, Indexer, ops, parse_target
from dsa_indexer.contract.quant import PRODUCER_UNROUNDED
from dsa_indexer.dispatch import Environment
from dsa_indexer.dispatch.plugins import default_registry
from dsa_indexer.testing import cuda_kernels, decode_step

pytestmark = [pytest.mark.gpu,
                        pytest.mark.skipif(not (AITER_PKG / "aiter" / "ops" / "triton").is_dir(),
                                 reason=f"aiter's Python package not found at {AITER_PKG}/aiter")]


@pytest.fixture
def simulated_gfx950():
    registry = default_registry()
    before = registry.environment
    registry.set_environment(Environment.simulated(gpu=True, triton=True, aiter=True))
    with _aiter_shim(AITER_PKG):
        yield registry
    registry.set_environment(before)


def test_aiter_producer_reused_by_default_on_gfx950(simulated_gfx950):
    cfg = IndexerConfig.deepseek_v32(max_position=8192)
    res = simulated_gfx950.resolve("rmsnorm_quant_fp8", parse_target("gfx950"),
                                   ops.problem("rmsnorm_quant_fp8", group_size=128, ue8m0=False, fp8="fn", width=1536))
    assert res.chosen.impl_id == "rmsnorm_quant_fp8.rocm.aiter", res.explain()
    indexer = Indexer(cfg, device="cuda", target="gfx950").init_random(7)
    agree = total = 0
    for seed in range(16):
        x, q_lora_plain, _, db, cache, _ = decode_step(cfg, indexer, batch=8, context=4096, device="cuda", seed=seed)
        gen = torch.Generator().manual_seed(1000 + seed)
        q_a = (torch.randn(8, cfg.q_lora_rank, generator=gen) * 2).to("cuda", torch.bfloat16)
        norm_w = (torch.rand(cfg.q_lora_rank, generator=gen) + 0.5).to("cuda", torch.bfloat16)
        q_lora, quant = ops.rmsnorm_quant_fp8(q_a, norm_w, 1e-6, target="gfx950")
        assert quant.layout.producer == PRODUCER_UNROUNDED
        with_reuse = indexer(x, q_lora, db.positions, db, cache, q_lora_quant=quant)
        without = indexer(x, q_lora, db.positions, db, cache)
        for a, b in zip(with_reuse.tolist(), without.tolist()):
            agree += len(set(a) & set(b))
            total += len(set(b))
    assert indexer.reuse_stats["reused"] == 16 and indexer.reuse_stats["dropped"] == 0
    print(f"gfx950 (simulated on the H200): top-2048 agreement, aiter's copy reused vs re-quantized: "
          f"{agree / total:.5f} over 16 batches x 8 rows")
    assert agree / total >= 0.99
    launched_with = cuda_kernels(lambda: indexer(x, q_lora, db.positions, db, cache, q_lora_quant=quant))
    launched_without = cuda_kernels(lambda: indexer(x, q_lora, db.positions, db, cache))
    extra = launched_without - launched_with
    assert sum(extra.values()) == 1 and not (launched_with - launched_without), (extra, launched_with)
    (kernel,) = extra
    assert "quant" in kernel.lower(), kernel
    print(f"gfx950 step: {sum(launched_without.values())} kernels without reuse, {sum(launched_with.values())} "
          f"with; removed: {kernel}")
