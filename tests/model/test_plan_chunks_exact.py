"""`PrefillBatch.plan_chunks` against a brute-force planner written here: for every batch shape (requests with and
without prefixes, compress ratio 1 and 4), budget (one row per chunk up to one chunk for all) and byte model
(key_bytes 0 / 4, row_bytes 0 / large), the planner returns exactly the chunks of a row-by-row scan, and each
chunk fits the budget while one more row would not (at least one row per chunk)."""

import dataclasses
import random

import pytest
import torch

from dsa_indexer import PrefillBatch
from dsa_indexer.contract.validate import IndexerInputError


def _scan_plan(ks: list[int], ke: list[int], budget: int, row_bytes: int, key_bytes: int) -> list[tuple]:
    """Grow each chunk one row at a time while the chunk's bytes (rows x its key window x key_bytes, plus rows x
    row_bytes) stay within the budget; a chunk always takes its first row."""
    plan, start = [], 0
    while start < len(ks):
        stop = start + 1
        while stop < len(ks):
            window = ke[stop] - ks[start]
            if (stop + 1 - start) * (window * key_bytes + row_bytes) > budget:
                break
            stop += 1
        plan.append((start, stop, ks[start], ke[stop - 1]))
        start = stop
    return plan


def _chunk_bytes(ks, ke, start, stop, row_bytes, key_bytes):
    return (stop - start) * ((ke[stop - 1] - ks[start]) * key_bytes + row_bytes)


def _check_fit_and_maximal(plan, ks, ke, budget, row_bytes, key_bytes):
    assert plan[0][0] == 0 and plan[-1][1] == len(ks)
    for (start, stop, lo, hi), following in zip(plan, plan[1:] + [None]):
        assert following is None or following[0] == stop  # chunks tile the rows
        assert (lo, hi) == (ks[start], ke[stop - 1])
        assert stop - start == 1 or _chunk_bytes(ks, ke, start, stop, row_bytes, key_bytes) <= budget
        if stop < len(ks):
            assert _chunk_bytes(ks, ke, start, stop + 1, row_bytes, key_bytes) > budget


def _random_batch(rng: random.Random, ratio: int) -> PrefillBatch:
    requests = rng.randrange(1, 6)
    prefix = [rng.choice([0, 0, rng.randrange(1, 5000)]) for _ in range(requests)]
    extend = [rng.choice([1, rng.randrange(1, 40), rng.randrange(1, 3000)]) for _ in range(requests)]
    pages = max(1, max(-(-((p + e) // ratio) // 64) for p, e in zip(prefix, extend)))
    table = torch.arange(requests * pages, dtype=torch.int32).view(requests, pages)
    return PrefillBatch.build(prefix, extend, table, compress_ratio=ratio)


def _budgets(rng: random.Random, ks, ke, row_bytes, key_bytes):
    widest = max(e - s for s, e in zip(ks, ke)) * key_bytes + row_bytes
    whole = len(ks) * ((max(ke) - min(ks)) * key_bytes + row_bytes)
    return [0, 1, widest, rng.randrange(1, 2 * widest + 2), rng.randrange(1, max(2, whole // 7)),
            rng.randrange(1, max(2, whole // 2)), whole, whole + rng.randrange(0, 1000), 1 << 62]


@pytest.mark.parametrize("ratio", [1, 4])
def test_plan_equals_a_row_by_row_scan_on_random_batches(ratio):
    seed = int(torch.randint(0, 1 << 30, ()))
    rng = random.Random(seed)
    for _ in range(40):
        batch = _random_batch(rng, ratio)
        ks, ke = batch.ks.tolist(), batch.ke.tolist()
        for row_bytes in (0, rng.randrange(1, 64), rng.randrange(50_000, 200_000)):
            for key_bytes in (0, 4, rng.randrange(1, 9)):
                for budget in _budgets(rng, ks, ke, row_bytes, key_bytes):
                    plan = batch.plan_chunks(budget, row_bytes, key_bytes)
                    want = _scan_plan(ks, ke, budget, row_bytes, key_bytes)
                    assert plan == want, (seed, ratio, budget, row_bytes, key_bytes)
                    _check_fit_and_maximal(plan, ks, ke, budget, row_bytes, key_bytes)


def test_plan_equals_the_scan_on_bounds_that_grow_irregularly():
    """Bounds that no `build` makes (ke jumping by random amounts, ks steps anywhere): the closed-form estimate is
    then wrong in both directions, and the plan must still equal the scan."""
    seed = int(torch.randint(0, 1 << 30, ()))
    rng = random.Random(seed)
    base = PrefillBatch.build([0], [8], torch.zeros(1, 1, dtype=torch.int32))
    for _ in range(60):
        rows = rng.randrange(1, 2000)
        ks, ke, low, high = [], [], 0, 0
        for _ in range(rows):
            low += rng.choice([0] * 30 + [rng.randrange(0, 500)])
            high = max(high, low) + rng.choice([0, 0, 1, 1, 1, 2, rng.randrange(0, 300)])
            ks.append(low)
            ke.append(high)
        bounds = (torch.tensor(ks), torch.tensor(ke))
        batch = dataclasses.replace(base, ks=bounds[0].int(), ke=bounds[1].int(), host_bounds=bounds,
                                    compress_ratio=rng.choice([1, 4]))
        for row_bytes in (0, rng.randrange(1, 100_000)):
            for key_bytes in (0, 4):
                for budget in _budgets(rng, ks, ke, row_bytes, key_bytes):
                    assert batch.plan_chunks(budget, row_bytes, key_bytes) == \
                        _scan_plan(ks, ke, budget, row_bytes, key_bytes), (seed, budget, row_bytes, key_bytes)


@pytest.mark.parametrize("ratio, row_bytes", [(1, 97792), (4, 61952)], ids=["v3.2", "v4-c4"])
def test_plan_of_a_million_token_prefill_equals_the_scan(ratio, row_bytes):
    """The case the plan's speed is for: one request of 2^20 tokens, the Indexer's default 2 GiB budget and q-path
    bytes; and with a prefix."""
    tokens, budget = 1 << 20, 2 << 30
    for prefix in (0, 12345):
        pages = (prefix + tokens) // ratio // 64 + 2
        batch = PrefillBatch.build([prefix], [tokens], torch.arange(pages).view(1, pages).int(), compress_ratio=ratio)
        ks, ke = batch.ks.tolist(), batch.ke.tolist()
        plan = batch.plan_chunks(budget, row_bytes, 4)
        assert len(plan) > 100
        assert plan == _scan_plan(ks, ke, budget, row_bytes, 4)
        _check_fit_and_maximal(plan, ks, ke, budget, row_bytes, 4)


def test_plan_rejects_sizes_that_are_not_byte_counts():
    batch = PrefillBatch.build([0], [16], torch.zeros(1, 1, dtype=torch.int32))
    for args, name in [((-1,), "budget_bytes"), ((1.5e9,), "budget_bytes"), ((1 << 20, -4), "row_bytes"),
                       ((1 << 20, 0, "4"), "key_bytes")]:
        with pytest.raises(IndexerInputError, match=name):
            batch.plan_chunks(*args)
