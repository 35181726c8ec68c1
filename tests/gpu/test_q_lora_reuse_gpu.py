"""q_lora fp8 reuse on the GPU: bit-identical top-k, and exactly one quant kernel fewer per indexer step."""

import pytest
import torch

from dsa_indexer import IndexerConfig, Indexer
from dsa_indexer.testing import cuda_kernels, decode_step

pytestmark = pytest.mark.gpu

CONFIGS = {"v3.2": IndexerConfig.deepseek_v32(max_position=16384),
           "v4-flash": IndexerConfig.deepseek_v4_flash(max_position=16384)}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_reuse_is_bit_identical_and_removes_one_quant_kernel(name):
    cfg = CONFIGS[name]
    indexer = Indexer(cfg, device="cuda").init_random(3)
    x, q_lora, quant, db, cache, state = decode_step(cfg, indexer, batch=8, context=12000, device="cuda", seed=4)
    # One decode token per request reads window positions p-7..p-1 from the state and writes p: re-running the
    # step sees the same state.
    with_reuse = indexer(x, q_lora, db.positions, db, cache, q_lora_quant=quant, compressor_state=state)
    without = indexer(x, q_lora, db.positions, db, cache, compressor_state=state)
    assert torch.equal(with_reuse, without)
    assert indexer.reuse_stats["reused"] == 1
    launched_with = cuda_kernels(lambda: indexer(x, q_lora, db.positions, db, cache, q_lora_quant=quant,
                                             compressor_state=state))
    launched_without = cuda_kernels(lambda: indexer(x, q_lora, db.positions, db, cache, compressor_state=state))
    extra = launched_without - launched_with
    assert sum(extra.values()) == 1 and not (launched_with - launched_without), (extra, launched_with)
    (kernel,) = extra
    assert "quant" in kernel.lower(), kernel
    print(f"{name}: {sum(launched_without.values())} kernels without reuse, {sum(launched_with.values())} with; "
          f"removed: {kernel}")
