"""The fused ragged logits + top-k against the unfused path, exactly (values and order), on tiny shapes.

Without CUDA the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set before triton is imported);
with CUDA the same tests run on the GPU.

The oracle is the pure-torch top-k (`reference.topk_indices`: value descending, ties to the lower column) applied
to the Triton ragged logits kernel's own logits: the fused kernel recomputes those logits bit for bit, whereas
the pure-torch logits sum in another order (and differ at near-ties). Small ``topk`` and ``capacity`` make most
rows "long" (wider than the capacity), so the sampled threshold, the candidate buffer and the exact finish all run;
``stats`` says how many rows fell back to the unfused path. In the interpreter a key block is 16 keys, so a capacity
of 128 is 16 sub-buffers of 8 slots; ``target=40`` keeps them from overflowing (2.5 expected per sub-buffer).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from dsa_indexer.backends.reference import kernels as ref  # noqa: E402
from dsa_indexer.backends.triton import logits as triton_logits  # noqa: E402
from dsa_indexer.backends.triton.fused_topk import fused_ragged_topk  # noqa: E402
from dsa_indexer.contract.validate import IndexerInputError  # noqa: E402

FP8 = torch.float8_e4m3fn
SENTINEL = -7
# The row-count assertions (long rows, fallbacks) are tuned for the interpreter's 16-key blocks; on a GPU (128-key
# blocks, so 8x fewer slots per sub-buffer at the same capacity) only exactness is asserted.
INTERP = not torch.cuda.is_available()


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(s: int, n: int, heads: int, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(s, heads, 128, generator=gen).to(FP8).to(device)
    k = torch.randn(n, 128, generator=gen).to(FP8).to(device)
    k_scales = (torch.rand(n, generator=gen) + 0.5).to(device)
    weights = torch.randn(s, heads, generator=gen).to(device)
    return q, k, k_scales, weights


def _causal_windows(query_lens: list[int], prefix_lens: list[int], device: str):
    """Packed requests: request r has prefix_lens[r] cached keys then query_lens[r] new ones; its query row i
    sees the request's keys [first, first + prefix + i + 1)."""
    ks, ke, first = [], [], 0
    for q_len, p_len in zip(query_lens, prefix_lens):
        for i in range(q_len):
            ks.append(first)
            ke.append(first + p_len + i + 1)
        first += p_len + q_len
    return (torch.tensor(ks, dtype=torch.int32, device=device), torch.tensor(ke, dtype=torch.int32, device=device),
            first)


def _expected(q, k, k_scales, weights, ks, ke, topk):
    logits = triton_logits.ragged_mqa_logits(q, k, k_scales, weights, ks, ke)
    return ref.topk_indices(logits, topk, ke, ks)


def _run(q, k, k_scales, weights, ks, ke, topk, **kw):
    """fused_ragged_topk into a sentinel-filled output: every element must be overwritten."""
    out = torch.full((q.shape[0], topk), SENTINEL, dtype=torch.int32, device=q.device)
    stats: dict = {}
    res = fused_ragged_topk(q, k, k_scales, weights, ks, ke, topk, out=out, stats=stats, **kw)
    assert res is out
    assert not bool((out == SENTINEL).any()), "an output element was not written"
    return out, stats


def _assert_equal(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.shape == expected.shape and out.dtype == torch.int32
    if not torch.equal(out, expected):
        bad = (out != expected).any(dim=1).nonzero().flatten().tolist()
        r = bad[0]
        raise AssertionError(f"rows {bad} differ; row {r}: {out[r].tolist()} vs {expected[r].tolist()}")


def test_causal_requests_match_reference(device):
    """Three packed requests with prefixes, causal rows from 1 to ~560 columns: rows shorter than topk, rows that fit
    the capacity (no threshold) and long rows (sampled threshold), with several rows per program."""
    topk = 16
    ks, ke, n = _causal_windows([6, 20, 12], [0, 300, 540], device)
    q, k, k_scales, weights = _inputs(ks.numel(), n + 5, 64, device, seed=1)
    out, stats = _run(q, k, k_scales, weights, ks, ke, topk, capacity=128, target=40)
    _assert_equal(out, _expected(q, k, k_scales, weights, ks, ke, topk))
    if INTERP:
        assert stats["long_rows"] == 32 and stats["fallback_rows"] <= 4, stats
        assert stats["candidates_max"] <= 128
    # Rows narrower than topk: every visible column (in value order), then -1.
    width = (ke - ks).tolist()
    for r in range(6):
        assert sorted(out[r, :width[r]].tolist()) == list(range(width[r]))
        assert bool((out[r, width[r]:] == -1).all())


def test_empty_rows_short_rows_and_odd_topk(device):
    """Rows with ke == ks (anywhere, also beside a long row in the same program), an all-empty tail, topk not a
    power of two, rows exactly topk wide."""
    s, n, topk = 11, 400, 20
    q, k, k_scales, weights = _inputs(s, n, 64, device, seed=2)
    ks = torch.tensor([0, 0, 5, 5, 100, 37, 0, 399, 0, 0, 0], dtype=torch.int32, device=device)
    ke = torch.tensor([400, 0, 25, 5, 380, 57, 19, 400, 0, 0, 0], dtype=torch.int32, device=device)
    out, stats = _run(q, k, k_scales, weights, ks, ke, topk, capacity=80)
    _assert_equal(out, _expected(q, k, k_scales, weights, ks, ke, topk))
    assert bool((out[[1, 3, 8, 9, 10]] == -1).all())
    if INTERP:
        assert stats["long_rows"] == 2


def test_forced_fallback_tiny_capacity(device):
    """A capacity of one slot per sub-buffer: most rows overflow; a tiny target: the threshold is too high and long
    rows keep fewer than topk candidates. Both fall back to the unfused path, exactly."""
    topk = 16
    ks, ke, n = _causal_windows([9, 8], [150, 60], device)
    q, k, k_scales, weights = _inputs(ks.numel(), n, 64, device, seed=3)
    expected = _expected(q, k, k_scales, weights, ks, ke, topk)
    out, stats = _run(q, k, k_scales, weights, ks, ke, topk, capacity=topk)
    _assert_equal(out, expected)
    if INTERP:
        assert stats["fallback_rows"] > stats["rows"] // 2, stats
    out, stats = _run(q, k, k_scales, weights, ks, ke, topk, capacity=128, target=1.0)
    _assert_equal(out, expected)
    if INTERP:
        assert stats["fallback_rows"] == stats["long_rows"] == 9, stats  # the rows of request 0


def test_ties_and_signed_zeros(device):
    """Keys repeated (equal logits in many columns), most keys scoring exactly 0 (+0.0 and -0.0: ReLU of negative
    dot products times signed weights), so the top-k boundary falls inside large tie groups: the lower columns win,
    in the fused path and in the fallback."""
    s, n, topk = 10, 500, 24
    gen = torch.Generator().manual_seed(4)
    q = torch.rand(s, 64, 128, generator=gen).add(0.1).to(FP8).to(device)  # positive
    base = torch.randn(7, 128, generator=gen).abs().add(0.1)  # positive: positive dot products
    pick = torch.randint(0, 7, (n,), generator=gen)
    k = base[pick]
    k[torch.rand(n, generator=gen) < 0.8] *= -1  # negative: every dot product < 0 -> logit +-0.0
    k = k.to(FP8).to(device)
    k_scales = torch.ones(n, device=device)
    k_scales[pick.to(device) == 3] = 2.0
    k_scales[::3] *= -1  # +0.0 * -1 = -0.0 (the kernel takes any scale; the indexer's are positive)
    weights = torch.randn(s, 64, generator=gen).to(device)
    ks = torch.tensor([0, 0, 10, 0, 200, 0, 0, 300, 1, 2], dtype=torch.int32, device=device)
    ke = torch.tensor([500, 499, 480, 64, 500, 30, 250, 330, 500, 3], dtype=torch.int32, device=device)
    logits = triton_logits.ragged_mqa_logits(q, k, k_scales, weights, ks, ke)
    zero = logits == 0
    assert bool((zero & torch.signbit(logits)).any()) and bool((zero & ~torch.signbit(logits)).any())
    expected = ref.topk_indices(logits, topk, ke, ks)
    for capacity in (96, 40):
        out, stats = _run(q, k, k_scales, weights, ks, ke, topk, capacity=capacity)
        _assert_equal(out, expected)


def test_tied_pairs_through_the_sampled_path(device):
    """Every key twice in adjacent columns (equal logits in pairs) on long rows that take the sampled threshold and
    the candidate buffer (no fallback): where a pair straddles the k-th place, its lower column wins."""
    topk = 15  # odd: the k-th place splits a pair whenever the pairs sit at the boundary
    ks, ke, n = _causal_windows([12], [500], device)
    q, k, k_scales, weights = _inputs(ks.numel(), n // 2, 64, device, seed=10)
    k, k_scales = k.repeat_interleave(2, dim=0), k_scales.repeat_interleave(2)
    k = torch.cat([k, k[:n - k.shape[0]]])
    k_scales = torch.cat([k_scales, k_scales[:n - k_scales.shape[0]]])
    logits = triton_logits.ragged_mqa_logits(q, k, k_scales, weights, ks, ke)
    expected = ref.topk_indices(logits, topk, ke, ks)
    kth = logits.gather(1, (expected[:, -1:] + ks[:, None]).long())
    before = logits.gather(1, (expected[:, -2:-1] + ks[:, None]).long())
    split = ((logits == kth).sum(dim=1) > 1) & (before != kth)[:, 0]
    assert int(split.sum()) >= 3  # rows where the k-th place takes one column of a tied pair
    out, stats = _run(q, k, k_scales, weights, ks, ke, topk, capacity=128, target=40)
    _assert_equal(out, expected)
    if INTERP:
        assert stats["long_rows"] == 12 and stats["fallback_rows"] <= 2, stats


def test_nan_logits_rank_as_neg_inf(device):
    """A NaN key scale makes that column NaN in every row: the NaN rule ranks it as -inf, so with enough finite
    columns it is never selected."""
    topk = 16
    ks, ke, n = _causal_windows([10], [200], device)
    q, k, k_scales, weights = _inputs(ks.numel(), n, 64, device, seed=5)
    k_scales[[3, 150, 201]] = float("nan")
    out, _ = _run(q, k, k_scales, weights, ks, ke, topk, capacity=128, target=40)
    _assert_equal(out, _expected(q, k, k_scales, weights, ks, ke, topk))
    assert not bool(((out == 3) | (out == 150) | (out == 201)).any())


def test_offset_logits_keep_few_fallbacks(device):
    """Logits at a large offset from 0 relative to their spread (all-positive weights): value-space bins keep the
    sampled threshold sharp; row chunking (a small budget) and both sort variants give the same result."""
    topk = 16
    ks, ke, n = _causal_windows([16], [560], device)
    q, k, k_scales, weights = _inputs(ks.numel(), n, 64, device, seed=6)
    weights = weights.abs() + 4.0
    expected = _expected(q, k, k_scales, weights, ks, ke, topk)
    kw = dict(capacity=128, target=40)
    out, stats = _run(q, k, k_scales, weights, ks, ke, topk, budget_bytes=6 * 8 * (128 + 16), **kw)
    _assert_equal(out, expected)
    if INTERP:
        assert stats["fallback_rows"] <= 2, stats
    out, _ = _run(q, k, k_scales, weights, ks, ke, topk, sort="torch", sample_stride=2, **kw)
    _assert_equal(out, expected)
    # sort="none": the same set, in no documented order.
    out, _ = _run(q, k, k_scales, weights, ks, ke, topk, sort="none", **kw)
    assert torch.equal(out.sort(dim=1).values, expected.sort(dim=1).values)


@pytest.mark.parametrize("heads", [16, 128])
def test_other_head_counts(device, heads):
    """8 rows per program (H=16) and 1 (H=128): the logits kernel's tiles."""
    topk = 16
    ks, ke, n = _causal_windows([7, 6], [90, 250], device)
    q, k, k_scales, weights = _inputs(ks.numel(), n, heads, device, seed=7)
    out, _ = _run(q, k, k_scales, weights, ks, ke, topk, capacity=128, target=40)
    _assert_equal(out, _expected(q, k, k_scales, weights, ks, ke, topk))


def test_degenerate_shapes(device):
    q, k, k_scales, weights = _inputs(0, 50, 64, device, seed=8)
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    assert fused_ragged_topk(q, k, k_scales, weights, empty, empty, 8).shape == (0, 8)
    q, k, k_scales, weights = _inputs(3, 0, 64, device, seed=8)
    zeros = torch.zeros(3, dtype=torch.int32, device=device)
    out = fused_ragged_topk(q, k, k_scales, weights, zeros, zeros, 8)
    assert out.shape == (3, 8) and bool((out == -1).all())


def test_bad_inputs_raise_clear_errors(device):
    q, k, k_scales, weights = _inputs(4, 40, 64, device, seed=9)
    ks = torch.zeros(4, dtype=torch.int32, device=device)
    ke = torch.full((4,), 40, dtype=torch.int32, device=device)
    with pytest.raises(IndexerInputError, match="k_fp8"):
        fused_ragged_topk(q, k.float(), k_scales, weights, ks, ke, 8)
    with pytest.raises(IndexerInputError, match="weights"):
        fused_ragged_topk(q, k, k_scales, weights[:3], ks, ke, 8)
    with pytest.raises(IndexerInputError, match="ke"):
        fused_ragged_topk(q, k, k_scales, weights, ks, ke.long(), 8)
    with pytest.raises(IndexerInputError, match="topk"):
        fused_ragged_topk(q, k, k_scales, weights, ks, ke, 0)
    with pytest.raises(IndexerInputError, match="power-of-two"):
        fused_ragged_topk(q[:, :48], k, k_scales, weights[:, :48], ks, ke, 8)
    with pytest.raises(IndexerInputError, match="sort"):
        fused_ragged_topk(q, k, k_scales, weights, ks, ke, 8, sort="bitonic")


def test_the_op_forced_to_the_fused_kernel_gives_the_reference_sets(device):
    """`ops.ragged_mqa_topk` on an NVIDIA target offers `ragged_mqa_topk.triton.fused_topk` (opt-in: the composition
    ranks above it) and, forced, returns per row the set of the unfused path on the same (Triton) logits; rows
    shorter than topk list every visible key."""
    from dsa_indexer import ops
    from dsa_indexer.dispatch.environment import Environment
    from dsa_indexer.dispatch.plugins import default_registry
    from dsa_indexer.dispatch.target import parse_target

    reg = default_registry()
    previous = reg.environment
    reg.set_environment(Environment.simulated(gpu=True, triton=True))
    try:
        q, k, k_scales, weights = _inputs(24, 700, 32 if INTERP else 64, device, seed=21)
        ks, ke, _ = _causal_windows([14, 10], [250, 420], device)
        sm90 = parse_target("sm90")
        res = reg.resolve("ragged_mqa_topk", sm90, ops.problem("ragged_mqa_topk", heads=q.shape[1], dim=128, fp8="fn",
                                                                 k=64))
        assert res.chosen.impl_id == "ragged_mqa_topk.generic.composed"
        fused = [c for c in res.candidates if c.impl.impl_id == "ragged_mqa_topk.triton.fused_topk"][0]
        assert fused.accepted and "lower priority" in fused.reason
        reg.force("ragged_mqa_topk", "ragged_mqa_topk.triton.fused_topk")
        got = ops.ragged_mqa_topk(q, k, k_scales, weights, ks, ke, 64, target=sm90)
        want = ref.topk_indices(triton_logits.ragged_mqa_logits(q, k, k_scales, weights, ks, ke), 64, ke, ks)
        assert [set(r) for r in got.cpu().tolist()] == [set(r) for r in want.cpu().tolist()]
    finally:
        reg.force("ragged_mqa_topk", None)
        reg.set_environment(previous)
