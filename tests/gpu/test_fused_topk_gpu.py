"""The fused ragged logits + top-k on a real GPU at V3.2 prefill sizes (H=64, D=128, topk=2048).

Exact equality (indices and order) with the pure-torch top-k applied to the Triton ragged logits kernel's own
logits, which the fused kernel recomputes bit for bit; and few rows falling back to the unfused path.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu  # skipped without a GPU by tests/conftest.py

pytest.importorskip("triton")

from dsa_indexer.backends.reference import kernels as ref  # noqa: E402
from dsa_indexer.backends.triton import logits as triton_logits  # noqa: E402
from dsa_indexer.backends.triton.fused_topk import fused_ragged_topk  # noqa: E402

FP8 = torch.float8_e4m3fn
DEVICE = "cuda"
TOPK = 2048


def _inputs(s: int, n: int, heads: int = 64, seed: int = 0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(s, heads, 128, generator=gen, device=DEVICE).to(FP8)
    k = torch.randn(n, 128, generator=gen, device=DEVICE).to(FP8)
    k_scales = torch.rand(n, generator=gen, device=DEVICE) + 0.5
    weights = torch.randn(s, heads, generator=gen, device=DEVICE)
    return q, k, k_scales, weights


def _windows(query_lens: list[int], prefix_lens: list[int]):
    ks, ke, first = [], [], 0
    for q_len, p_len in zip(query_lens, prefix_lens):
        i = torch.arange(q_len, dtype=torch.int32)
        ks.append(torch.full((q_len,), first, dtype=torch.int32))
        ke.append(first + p_len + i + 1)
        first += p_len + q_len
    return torch.cat(ks).to(DEVICE), torch.cat(ke).to(DEVICE), first


def _check(q, k, k_scales, weights, ks, ke, max_fallback_frac: float, **kw) -> dict:
    logits = triton_logits.ragged_mqa_logits(q, k, k_scales, weights, ks, ke)
    expected = ref.topk_indices(logits, TOPK, ke, ks)
    del logits
    out = torch.full((q.shape[0], TOPK), -7, dtype=torch.int32, device=DEVICE)
    stats: dict = {}
    fused_ragged_topk(q, k, k_scales, weights, ks, ke, TOPK, out=out, stats=stats, **kw)
    torch.cuda.synchronize()
    if kw.get("sort") == "none":  # the set only
        out, expected = out.sort(dim=1).values, expected.sort(dim=1).values
    if not torch.equal(out, expected):
        bad = (out != expected).any(dim=1).nonzero().flatten()
        r = int(bad[0])
        diff = (out[r] != expected[r]).nonzero().flatten()[:8].tolist()
        raise AssertionError(f"{bad.numel()} rows differ (first {bad[:10].tolist()}); row {r} at slots {diff}: "
                             f"{out[r, diff].tolist()} vs {expected[r, diff].tolist()}; stats {stats}")
    assert stats["fallback_rows"] <= max_fallback_frac * max(1, stats["long_rows"]), stats
    return stats


@pytest.mark.parametrize("sort", ["kernel", "torch", "none"])
def test_last_rows_of_a_32k_prefill(sort):
    """The last 2048 query rows of one 32768-token causal prefill: every row sees 30721..32768 keys."""
    s, n = 2048, 32768
    q, k, k_scales, weights = _inputs(s, n, seed=1)
    ks = torch.zeros(s, dtype=torch.int32, device=DEVICE)
    ke = (n - s + 1 + torch.arange(s, device=DEVICE)).int()
    stats = _check(q, k, k_scales, weights, ks, ke, 0.01, sort=sort)
    assert stats["long_rows"] == s and stats["candidates_max"] <= 4 * TOPK


def test_packed_requests_mixed_row_lengths():
    """Four packed requests (prefix + 512 new tokens each): rows narrower than topk, rows that fit the candidate
    capacity, long rows; programs that straddle two requests."""
    ks, ke, n = _windows([512, 512, 512, 512], [0, 3000, 12000, 14000])
    q, k, k_scales, weights = _inputs(ks.numel(), n, seed=2)
    stats = _check(q, k, k_scales, weights, ks, ke, 0.01)
    assert 0 < stats["long_rows"] < ks.numel()


def test_offset_logits():
    """All-positive head weights: logits far from 0 relative to their spread (value bins, not float-key bins)."""
    s, n = 1024, 32768
    q, k, k_scales, weights = _inputs(s, n, seed=3)
    weights = weights.abs() + 1.0
    ks = torch.zeros(s, dtype=torch.int32, device=DEVICE)
    ke = (n - s + 1 + torch.arange(s, device=DEVICE)).int()
    _check(q, k, k_scales, weights, ks, ke, 0.01)


def test_forced_fallback_and_chunking():
    """A capacity equal to topk (16 slots per sub-buffer for 16 expected candidates) sends most long rows to the
    unfused path; a small budget chunks the rows."""
    s, n = 512, 16384
    q, k, k_scales, weights = _inputs(s, n, seed=4)
    ks = torch.zeros(s, dtype=torch.int32, device=DEVICE)
    ke = (n - s + 1 + torch.arange(s, device=DEVICE)).int()
    stats = _check(q, k, k_scales, weights, ks, ke, 1.0, capacity=TOPK, budget_bytes=64 << 20)
    assert stats["fallback_rows"] > 0
