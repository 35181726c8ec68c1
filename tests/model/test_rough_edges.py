"""Rough edges a new user hit (issue 12), each with the clear error that replaces the surprise."""

import pytest
import torch

from dsa_indexer import DecodeBatch, IndexerConfig, IndexerInputError, IndexKCache, Indexer
from dsa_indexer.plan import StepPlan

CFG = IndexerConfig(name="tiny", hidden_size=256, q_lora_rank=256, n_heads=4, topk=8, max_position=2048)


def _step(rows=2):
    indexer = Indexer(CFG).init_random(0)
    x = torch.randn(rows, 256).to(torch.bfloat16)
    return indexer, x, torch.randn(rows, 256).to(torch.bfloat16)


def test_a_block_table_past_the_cache_is_refused_even_without_num_cache_pages():
    indexer, x, q_lora = _step()
    batch = DecodeBatch.build([100, 30], [[0, 5], [2, 3]])  # page 5 does not exist in a 4-page cache
    with pytest.raises(IndexerInputError, match="uses cache page 5 but the cache has 4 pages"):
        indexer(x, q_lora, batch.positions, batch, IndexKCache.allocate(4))


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_nan_or_inf_inputs_raise_naming_the_argument(bad):
    indexer, x, q_lora = _step()
    q_lora[1, 7] = float(bad)
    batch = DecodeBatch.build([100, 30], [[0, 1], [2, 3]])
    with pytest.raises(IndexerInputError, match="q_lora holds NaN or inf"):
        indexer(x, q_lora, batch.positions, batch, IndexKCache.allocate(4))


def test_to_physical_slots_checks_its_arguments():
    indexer, _, _ = _step()
    batch = DecodeBatch.build([100, 30], [[0, 1], [2, 3]])
    with pytest.raises(IndexerInputError, match="one row per token of the batch \\(2\\)"):
        indexer.to_physical_slots(torch.zeros(3, 8, dtype=torch.int32), batch)
    with pytest.raises(IndexerInputError, match="indices must have dtype int32 or int64"):
        indexer.to_physical_slots(torch.zeros(2, 8), batch)
    with pytest.raises(IndexerInputError, match="indices must lie in \\[-1, 128\\)"):
        indexer.to_physical_slots(torch.full((2, 8), 500, dtype=torch.int32), batch)
    with pytest.raises(IndexerInputError, match="batch must be a DecodeBatch"):
        indexer.to_physical_slots(torch.zeros(2, 8, dtype=torch.int32), object())


def test_a_position_past_the_rope_table_is_refused_naming_the_request():
    """Checked from the batch's host metadata on every device (the GPU prologue kernels would read past the table)."""
    indexer, x, q_lora = _step()
    table = torch.arange(66, dtype=torch.int32).view(2, 33)
    batch = DecodeBatch.build([100, 2049], table)
    with pytest.raises(IndexerInputError, match="request 1 has a token at position 2048, past the RoPE table "
                                                "\\(max_position=2048"):
        indexer(x, q_lora, batch.positions, batch, IndexKCache.allocate(66))


def _greedy_plan(ks, ke, budget):
    """The plan row by row (what the indexer did before): grow a chunk while its fp32 logits fit the budget."""
    plan, start, rows = [], 0, len(ks)
    while start < rows:
        stop, lo, hi = start + 1, ks[start], ke[start]
        while stop < rows:
            nlo, nhi = min(lo, ks[stop]), max(hi, ke[stop])
            if (stop + 1 - start) * (nhi - nlo) * 4 > budget:
                break
            lo, hi, stop = nlo, nhi, stop + 1
        plan.append((start, stop, lo, hi))
        start = stop
    return plan


@pytest.mark.parametrize("ratio", [1, 4])
def test_prefill_chunk_plan_is_vectorized_bounded_and_shared(ratio):
    from dsa_indexer import PrefillBatch

    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    prefix = torch.randint(0, 3000, (5,), generator=gen).tolist()
    extend = torch.randint(1, 1500, (5,), generator=gen).tolist()
    pages = [-(-((p + e) // ratio) // 64) for p, e in zip(prefix, extend)]
    table = torch.arange(5 * max(pages), dtype=torch.int32).view(5, -1)  # pages of their own (issue 34, item 2)
    batch = PrefillBatch.build(prefix, extend, table, compress_ratio=ratio)
    for budget in (4 << 10, 1 << 20, 64 << 20):
        plan = batch.plan_chunks(budget)
        assert plan == _greedy_plan(batch.ks.tolist(), batch.ke.tolist(), budget)
        assert plan[0][0] == 0 and plan[-1][1] == batch.num_tokens
        assert all(a[1] == b[0] for a, b in zip(plan, plan[1:]))
        assert all((stop - start) * (hi - lo) * 4 <= budget or stop - start == 1 for start, stop, lo, hi in plan)
        assert batch.plan_chunks(budget) is plan  # computed once per budget, shared by every layer


@pytest.mark.parametrize("v4", [False, True], ids=["v3.2", "v4-c4"])
def test_prefill_in_chunks_bounds_every_intermediate_and_matches_one_pass(v4, monkeypatch):
    """A budget far below the batch's needs: keys stored first, then the q path and the scoring per planned chunk.
    The result equals the one-pass prefill up to GEMM rounding (another row count per GEMM), and no chunk's logits
    plus q-path bytes exceed the budget."""
    import dataclasses

    from dsa_indexer import CompressorState, PrefillBatch

    base = IndexerConfig.deepseek_v4_flash() if v4 else IndexerConfig.deepseek_v32()
    cfg = dataclasses.replace(base, name="tiny", hidden_size=256, q_lora_rank=256, n_heads=4, topk=8,
                              max_position=4096)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    lengths = [700, 333]
    x = torch.randn(sum(lengths), 256, generator=gen).to(torch.bfloat16)
    q_lora = torch.randn(sum(lengths), 256, generator=gen).to(torch.bfloat16)
    table = torch.arange(24, dtype=torch.int32).view(2, 12)
    outs, widths = [], []
    real = StepPlan.run  # each chunk's scoring runs through the step's plan: ragged_mqa_topk(q, k, ...)

    def recording(plan, role, op, *args, **kwargs):
        if op == "ragged_mqa_topk":
            widths.append((args[0].shape[0], args[1].shape[0]))
        return real(plan, role, op, *args, **kwargs)

    monkeypatch.setattr(StepPlan, "run", recording)
    for budget in (512 << 20, 256 << 10):
        indexer = Indexer(cfg, logits_budget_bytes=budget).init_random(3)
        state = CompressorState.allocate(2, cfg) if v4 else None
        pb = PrefillBatch.build([0, 0], lengths, table, compress_ratio=cfg.compress_ratio)
        widths.clear()
        outs.append(indexer(x, q_lora, pb.positions, pb, IndexKCache.allocate(24), compressor_state=state))
        if budget < (1 << 20):
            assert len(widths) > 4, widths  # really chunked
            per_row = indexer.q_path_bytes_per_row()
            assert all(rows == 1 or rows * (keys * 4 + per_row) <= budget for rows, keys in widths), widths
    assert torch.equal((outs[0] >= 0).sum(1), (outs[1] >= 0).sum(1))  # same visible counts per row
    agree = total = 0
    for a, b in zip(outs[0].tolist(), outs[1].tolist()):
        want = {i for i in a if i >= 0}
        agree += len(want & {i for i in b if i >= 0})
        total += len(want)
    assert agree / total >= 0.99, agree / total


def test_plan_chunks_takes_the_largest_chunk_within_the_budget():
    """Against a brute-force scan: each chunk is the longest run of rows from its start whose fp32 logits plus row
    bytes fit the budget (at least one row), for several requests with prefixes."""
    import random

    from dsa_indexer import PrefillBatch

    rng = random.Random(3)
    for _ in range(20):
        prefix = [rng.randrange(0, 300) for _ in range(3)]
        extend = [rng.randrange(1, 400) for _ in range(3)]
        pages = max(-(-(p + e) // 64) for p, e in zip(prefix, extend))
        batch = PrefillBatch.build(prefix, extend, torch.arange(3 * pages).view(3, pages))
        budget, row_bytes = rng.choice([4096, 50_000, 400_000]), rng.choice([0, 512])
        key_bytes = rng.choice([4, 4, 0, 1])  # 0: a scorer that holds no logits (rows cost row_bytes only)
        if key_bytes == 0 and row_bytes == 0:
            row_bytes = 512
        ks, ke = batch.ks.tolist(), batch.ke.tolist()
        start, want = 0, []
        while start < len(ks):
            stop = start + 1
            while stop < len(ks) and (stop + 1 - start) * ((ke[stop] - ks[start]) * key_bytes + row_bytes) <= budget:
                stop += 1
            want.append((start, stop, ks[start], ke[stop - 1]))
            start = stop
        assert batch.plan_chunks(budget, row_bytes, key_bytes) == want


def test_a_fused_scorer_plans_prefill_chunks_by_its_own_memory():
    """Forced to the fused Triton top-k (no [rows, keys] logits), the Indexer plans chunks by the kernel's declared
    per-row scratch instead of 4 B per key: a 1M-token prefill at the default 2 GiB budget takes ~15x fewer chunks."""
    from dsa_indexer import Indexer, IndexerConfig, PrefillBatch
    from dsa_indexer.dispatch.environment import Environment
    from dsa_indexer.dispatch.plugins import default_registry

    pytest.importorskip("triton")
    reg = default_registry()
    previous = reg.environment
    reg.set_environment(Environment.simulated(gpu=True, triton=True))
    try:
        indexer = Indexer(IndexerConfig.deepseek_v32(), target="sm90")
        tokens = 1 << 20
        pages = tokens // 64 + 1
        batch = PrefillBatch.build([0], [tokens], torch.arange(pages).view(1, pages).int())
        row_bytes, key_bytes = indexer.scoring_plan_bytes()
        assert (row_bytes, key_bytes) == (indexer.q_path_bytes_per_row(), 4)  # the composition: the logits
        composed = batch.plan_chunks(indexer.logits_budget_bytes, row_bytes, key_bytes)
        reg.force("ragged_mqa_topk", "ragged_mqa_topk.triton.fused_topk")
        row_bytes, key_bytes = indexer.scoring_plan_bytes()
        assert key_bytes == 0 and row_bytes == indexer.q_path_bytes_per_row() + 8 * (4 * 2048 + 2048) + 516
        fused = batch.plan_chunks(indexer.logits_budget_bytes, row_bytes, key_bytes)
        assert len(fused) * 10 < len(composed), (len(fused), len(composed))
        assert all((stop - start) * row_bytes <= indexer.logits_budget_bytes for start, stop, _, _ in fused)
    finally:
        reg.force("ragged_mqa_topk", None)
        reg.set_environment(previous)
