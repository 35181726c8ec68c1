"""V4's C4 bounded prefill stores its keys block by block (`CompressionStep.rows`): the compressor's projection is
held for one block, and the cache, the rolled state and the top-k equal the one-pass prefill's."""

import dataclasses

import torch

from dsa_indexer import CompressorState, Indexer, IndexerConfig, IndexKCache, PrefillBatch
from dsa_indexer.compressor import Compressor

CFG = dataclasses.replace(IndexerConfig.deepseek_v4_flash(), name="tiny-c4", hidden_size=256, q_lora_rank=256,
                          n_heads=4, topk=8, max_position=4096)


def _prefill(budget: int, x, q_lora, prefix_state):
    table = torch.arange(24, dtype=torch.int32).view(2, 12)
    pb = PrefillBatch.build([5, 0], [703, 333], table, compress_ratio=4)
    indexer = Indexer(CFG, logits_budget_bytes=budget).init_random(3)
    state = prefix_state.clone()
    cache = IndexKCache.allocate(24)
    projected = []
    real = Compressor.project

    def recording(module, rows):
        projected.append(rows.shape[0])
        return real(module, rows)

    Compressor.project = recording
    try:
        out = indexer(x, q_lora, pb.positions, pb, cache, compressor_state=state)
    finally:
        Compressor.project = real
    return out, cache.data, state.window[:state.num_slots], projected  # the last row is the pool's scratch


def test_bounded_c4_prefill_stores_in_blocks_and_equals_one_pass():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    x = torch.randn(1036, CFG.hidden_size, generator=gen).to(torch.bfloat16)
    q_lora = torch.randn(1036, CFG.q_lora_rank, generator=gen).to(torch.bfloat16)
    prefix_state = CompressorState.allocate(2, CFG)
    prefix_state.window.copy_(torch.randn(prefix_state.window.shape, generator=gen))  # request 0's 5 earlier tokens
    whole = _prefill(1 << 30, x, q_lora, prefix_state)
    bounded = _prefill(256 << 10, x, q_lora, prefix_state)
    assert whole[3] == [1036]  # one pass: the projection of every token at once
    assert len(bounded[3]) > 4 and sum(bounded[3]) == 1036 and max(bounded[3]) < 1036, bounded[3]
    assert torch.equal(bounded[1], whole[1])  # the same keys, byte for byte
    assert torch.equal(bounded[2], whole[2])  # the same rolled state
    assert torch.equal(bounded[0], whole[0])
