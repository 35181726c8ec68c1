"""Prefill scoring on the GPU (issue 27): the CUDA prefill top-k kernel against the reference, the bounded prefill
against the one-pass one, its peak memory against the budget, the fused Triton scoring against the composition.

Tolerance: none. The top-k is an exact selection, so its index SET must equal the reference's (`torch.sort`-based,
ties to the lower column) on the same logits with every NaN replaced by -inf, bit for bit; rows with <= k visible
columns must hold the visible positions ascending, then -1. Outputs go into torch.empty (poisoned by whatever the
allocator held), so an unwritten entry shows up as a set mismatch. The bounded and one-pass prefills compute the
same logits for a row whatever its chunk (the logits of a (row, key) pair do not depend on the other rows or keys
of the launch), so their sets are compared exactly too, as are the fused kernel's (its logits are the Triton ragged
kernel's, bit for bit) and the composition of that kernel with the CUDA top-k. Inputs are fresh random every run.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu  # skipped without a GPU by tests/conftest.py

from dsa_indexer import Indexer, IndexerConfig, IndexKCache, PrefillBatch  # noqa: E402
from dsa_indexer.backends.cuda import topk as cuda_topk  # noqa: E402
from dsa_indexer.backends.reference import kernels as ref  # noqa: E402

DEVICE = "cuda"
PREFILL_PLANS = [cuda_topk.Plan("prefill", 1, 256), cuda_topk.Plan("prefill", 1, 512)]


@pytest.fixture(scope="module")
def kernel_ready():
    reason = cuda_topk.probe()
    if reason is not None:
        pytest.skip(reason)


def _seed() -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(int(torch.randint(0, 1 << 30, ())))


def _check(logits, k, ends, starts=None, table=None, req=None, plan=PREFILL_PLANS[0]):
    got = cuda_topk.run_plan(logits, k, ends, starts, table, req, plan)
    want = ref.topk_indices(cuda_topk.nan_as_neg_inf(logits), k, ends, starts, table, req)
    assert got.shape == want.shape and got.dtype == torch.int32
    bad = (got.sort(dim=1).values != want.sort(dim=1).values).any(dim=1)
    assert not bool(bad.any()), f"plan {plan}: {int(bad.sum())} rows differ, first {int(bad.nonzero()[0, 0])}"
    if table is None:
        width = (ends - (starts if starts is not None else 0)).cpu()
        for r in torch.nonzero(width <= k).reshape(-1).tolist():
            w = int(width[r])
            assert torch.equal(got[r, :max(w, 0)].cpu(), torch.arange(max(w, 0), dtype=torch.int32)), f"row {r}"
            assert bool((got[r, max(w, 0):] == -1).all()), f"row {r}"
    return got


def _causal_chunk(rows: int, cols: int, first_width: int):
    """ends of a causal chunk's rows: the first sees first_width keys, each next one one more (starts 0)."""
    ends = torch.arange(first_width, first_width + rows, device=DEVICE, dtype=torch.int32).clamp_max(cols)
    return ends


def test_prefill_chunks_are_planned_on_the_prefill_kernel():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert cuda_topk.plan_for(4096, 32768, sms, 4).kernel == "prefill"
    assert cuda_topk.plan_for(128, 131072, sms, 4).kernel != "prefill"  # a decode grid keeps its plan


@pytest.mark.parametrize("plan", PREFILL_PLANS, ids=str)
def test_causal_chunk_of_randn_rows(kernel_ready, plan):
    # Widths 1000 .. 15000: short rows (<= k), rows the candidate buffer takes whole, rows that take a sample.
    gen = _seed()
    rows, cols = 1400, 16384
    logits = torch.randn(rows, cols, device=DEVICE, generator=gen)
    ends = torch.linspace(1000, cols - 1, rows, device=DEVICE).to(torch.int32)
    _check(logits, 2048, ends, plan=plan)


@pytest.mark.parametrize("plan", PREFILL_PLANS, ids=str)
def test_ragged_logits_of_two_requests_with_unaligned_starts(kernel_ready, plan):
    from dsa_indexer.backends.triton.logits import ragged_mqa_logits

    gen = _seed()
    heads, dim = 64, 128
    n_a, n_b = 9001, 13003  # request b's keys start at 9001: not a multiple of 4
    q = torch.randn(1200, heads, dim, device=DEVICE, generator=gen).to(torch.float8_e4m3fn)
    k = torch.randn(n_a + n_b, dim, device=DEVICE, generator=gen).to(torch.float8_e4m3fn)
    k_scales = torch.rand(n_a + n_b, device=DEVICE, generator=gen) + 0.5
    w = torch.randn(1200, heads, device=DEVICE, generator=gen)
    ks = torch.cat([torch.zeros(600, dtype=torch.int32), torch.full((600,), n_a, dtype=torch.int32)]).to(DEVICE)
    ke = torch.cat([torch.arange(n_a - 599, n_a + 1), torch.arange(n_a + n_b - 599, n_a + n_b + 1)]).to(
        DEVICE, torch.int32)
    logits = ragged_mqa_logits(q, k, k_scales, w, ks, ke)
    _check(logits, 2048, ke, ks, plan=plan)
    _check(logits, 512, ke, ks, plan=plan)  # V4's top-512


@pytest.mark.parametrize("case", ["ties", "all_equal", "nan", "neg_inf", "ascending", "tie_class_over_capacity",
                                  "few_large"])
def test_adversarial_rows(kernel_ready, case):
    gen = _seed()
    rows, cols = 1100, 20000
    if case == "ties":
        logits = torch.randint(0, 5, (rows, cols), device=DEVICE, generator=gen).float()
    elif case == "all_equal":
        logits = torch.full((rows, cols), 0.25, device=DEVICE)
    elif case == "nan":
        logits = torch.randn(rows, cols, device=DEVICE, generator=gen)
        logits[:, ::7] = float("nan")
        logits[::3, 5000:] = float("nan")  # fewer than k finite values in those rows' upper part
    elif case == "neg_inf":
        logits = torch.randn(rows, cols, device=DEVICE, generator=gen)
        logits[:, ::2] = float("-inf")
    elif case == "ascending":  # the top-k at the end of every row
        logits = torch.arange(cols, device=DEVICE, dtype=torch.float32).expand(rows, cols).contiguous()
    elif case == "tie_class_over_capacity":  # k - 100 distinct large values, then 10000 zeros: n_cand > capacity
        logits = torch.zeros(rows, cols, device=DEVICE)
        logits[:, :1948] = torch.rand(rows, 1948, device=DEVICE, generator=gen) + 1.0
        logits = logits[:, torch.randperm(cols, device=DEVICE, generator=gen)].contiguous()
    else:  # a few huge values, the rest tiny: a sample sees almost none of the large ones
        logits = torch.randn(rows, cols, device=DEVICE, generator=gen) * 1e-3
        hot = torch.randint(0, cols, (rows, 300), device=DEVICE, generator=gen)
        logits.scatter_(1, hot, 1e3)
    starts = torch.randint(0, 300, (rows,), device=DEVICE, generator=gen, dtype=torch.int32)
    ends = torch.randint(cols - 8000, cols + 1, (rows,), device=DEVICE, generator=gen, dtype=torch.int32)
    # and windows of 2049-12000 columns: rows kept whole (<= 6144 columns) and sampled ones near the capacity
    short_ends = starts + torch.randint(2049, 12001, (rows,), device=DEVICE, generator=gen, dtype=torch.int32)
    for plan in PREFILL_PLANS:
        _check(logits, 2048, ends, starts, plan=plan)
        _check(logits, 2048, short_ends, starts, plan=plan)


def test_unaligned_rows_and_the_slot_transform(kernel_ready):
    gen = _seed()
    rows, cols = 1030, 9000
    base = torch.randn(rows, cols + 1, device=DEVICE, generator=gen)
    logits = base[:, 1:]  # row stride not a multiple of 4 floats: scalar loads
    ends = torch.randint(1, cols + 1, (rows,), device=DEVICE, generator=gen, dtype=torch.int32)
    _check(logits, 2048, ends)
    pages = -(-cols // 64)
    table = torch.randperm(4 * pages, device=DEVICE, generator=gen).to(torch.int32).view(4, pages)
    req = torch.randint(0, 4, (rows,), device=DEVICE, generator=gen, dtype=torch.int32)
    _check(logits.contiguous(), 2048, ends, None, table, req)


def test_columns_past_two_to_the_twenty(kernel_ready):
    # The top class is tied over every column past 2^20 (more than k of them): the lowest ones win, so the
    # column tie-break must hold columns of more than 20 bits.
    rows, cols = 8, (1 << 20) + 20000
    logits = torch.zeros(rows, cols, device=DEVICE)
    logits[:, 1 << 20:] = 1.0
    logits[1, (1 << 20) + 7] = 2.0
    ends = torch.full((rows,), cols, device=DEVICE, dtype=torch.int32)
    for plan in PREFILL_PLANS:
        _check(logits, 2048, ends, plan=plan)


def test_bitwise_repeatable_and_graph_equals_eager(kernel_ready):
    gen = _seed()
    rows, cols = 2048, 24576
    logits = torch.randn(rows, cols, device=DEVICE, generator=gen)
    ends = _causal_chunk(rows, cols, cols - rows + 1)
    first = cuda_topk.topk_indices(logits, 2048, ends)
    assert cuda_topk.plan_for(rows, cols, torch.cuda.get_device_properties(0).multi_processor_count, 4).kernel \
        == "prefill"
    for _ in range(20):
        assert torch.equal(cuda_topk.topk_indices(logits, 2048, ends), first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cuda_topk.topk_indices(logits, 2048, ends)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, first)


# ---- the Indexer's prefill


def _prefill_inputs(cfg, tokens, gen):
    x = torch.randn(tokens, cfg.hidden_size, device=DEVICE, generator=gen).to(torch.bfloat16)
    q_lora = torch.randn(tokens, cfg.q_lora_rank, device=DEVICE, generator=gen).to(torch.bfloat16)
    pages = tokens // 64 + 2
    table = torch.randperm(pages, device=DEVICE, generator=gen).to(torch.int32).view(1, pages)
    batch = PrefillBatch.build([0], [tokens], table, num_cache_pages=pages, device=DEVICE)
    return x, q_lora, batch, pages


def _agreeing_keys(a: torch.Tensor, b: torch.Tensor) -> int:
    """Keys (not -1) that rows of a and b share: each row's entries are distinct, so a shared key is an equal pair
    of neighbours in the sorted concatenation."""
    both = torch.cat([a, b], dim=1).sort(dim=1).values
    return int(((both[:, 1:] == both[:, :-1]) & (both[:, 1:] >= 0)).sum())


_BOUNDED_RUNS: dict = {}


def _bounded_and_one_pass(scorer: str):
    """(bounded result, one-pass result, batch, peak extra bytes of the bounded call, bound) for ``scorer``, computed
    once per module (two tests read it)."""
    if scorer in _BOUNDED_RUNS:
        return _BOUNDED_RUNS[scorer]
    from dsa_indexer.dispatch.plugins import default_registry

    cfg = IndexerConfig.deepseek_v32()
    gen = _seed()
    tokens = 16384
    x, q_lora, batch, pages = _prefill_inputs(cfg, tokens, gen)
    seed = int(torch.randint(0, 1 << 30, ()))
    registry = default_registry()
    impl = "ragged_mqa_topk.generic.composed" if scorer == "composed" else "ragged_mqa_topk.triton.fused_topk"
    registry.force("ragged_mqa_topk", impl)
    try:
        one_pass = Indexer(cfg, device=DEVICE, logits_budget_bytes=64 << 30).init_random(seed)
        budget = 128 << 20
        bounded = Indexer(cfg, device=DEVICE, logits_budget_bytes=budget).init_random(seed)
        assert len(batch.plan_chunks(budget, *bounded.scoring_plan_bytes())) > 2
        assert len(batch.plan_chunks(64 << 30, *one_pass.scoring_plan_bytes())) == 1
        want = one_pass(x, q_lora, batch.positions, batch, IndexKCache.allocate(pages, DEVICE))
        cache = IndexKCache.allocate(pages, DEVICE)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        got = bounded(x, q_lora, batch.positions, batch, cache)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    finally:
        registry.force("ragged_mqa_topk", None)
    output = tokens * cfg.topk * 4
    keys = tokens * 132  # the gathered fp8 keys and their scales
    print(f"{scorer}: peak {peak / 2**20:.1f} MiB; budget {budget / 2**20:.0f} + output {output / 2**20:.0f} + keys "
          f"{keys / 2**20:.1f} MiB")
    _BOUNDED_RUNS[scorer] = (got, want, batch, peak, budget + output + keys)
    return _BOUNDED_RUNS[scorer]


@pytest.mark.parametrize("scorer", ["composed", "fused"])
def test_bounded_prefill_equals_one_pass(scorer):
    got, want, batch, _, _ = _bounded_and_one_pass(scorer)
    # The q-path GEMMs run on chunks of rows: another M may pick another tiling, so q can differ by one ulp and keys
    # tied at the k-th place may swap (tests/gpu/test_indexer_gpu.py). Every row has as many keys, rows that see
    # at most k keys list all of them, and >= 99.9% of the keys agree.
    assert torch.equal((got >= 0).sum(1), (want >= 0).sum(1))
    short = (batch.ke - batch.ks) <= got.shape[1]
    assert torch.equal(got[short].sort(dim=1).values, want[short].sort(dim=1).values)
    assert _agreeing_keys(got, want) >= 0.999 * int((want >= 0).sum())


# The composition's chunks once overshot the budget (271.5 MiB against the 258.1 MiB bound here; 4.63 GiB against
# 3.02 GiB at 128K tokens): the plan did not count each chunk's [rows, topk] result nor x in fp32 for V3.2's fp32
# weights_proj. `Indexer.q_path_bytes_per_row` counts both now; on the H200 this then passed (it was a strict xfail).
@pytest.mark.parametrize("scorer", ["composed", "fused"])
def test_bounded_prefill_peak_memory_within_budget_output_and_keys(scorer):
    _, _, _, peak, bound = _bounded_and_one_pass(scorer)
    assert peak <= bound, f"peak {peak / 2**20:.1f} MiB > {bound / 2**20:.1f} MiB"


def test_fused_scoring_equals_the_composition_of_its_logits_and_the_cuda_top_k(kernel_ready):
    from dsa_indexer.backends.triton.fused_topk import ragged_mqa_topk as fused
    from dsa_indexer.backends.triton.logits import ragged_mqa_logits

    gen = _seed()
    heads, dim, rows, n = 64, 128, 4096, 24576
    q = torch.randn(rows, heads, dim, device=DEVICE, generator=gen).to(torch.float8_e4m3fn)
    k = torch.randn(n, dim, device=DEVICE, generator=gen).to(torch.float8_e4m3fn)
    k_scales = torch.rand(n, device=DEVICE, generator=gen) + 0.5
    w = torch.randn(rows, heads, device=DEVICE, generator=gen)
    ke = torch.arange(n - rows + 1, n + 1, device=DEVICE, dtype=torch.int32)
    ks = torch.zeros_like(ke)
    composed = cuda_topk.topk_indices(ragged_mqa_logits(q, k, k_scales, w, ks, ke), 2048, ke, ks)
    got = fused(q, k, k_scales, w, ks, ke, 2048)
    assert torch.equal(got.sort(dim=1).values, composed.sort(dim=1).values)
