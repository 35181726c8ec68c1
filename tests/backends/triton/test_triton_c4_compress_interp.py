"""The Triton `c4_compress_pool` (V4 C4 window pooling + state roll) against the pure-torch reference.

Without CUDA it runs in the Triton CPU interpreter; with CUDA compiled on the GPU. Random projections, states and
ape (never zeros), batches that mix a long step (prefill rows beyond the last 8), a request starting at position 0
(missing window tokens), a speculative request whose window spans state and step, and padding rows (slot -1).
Tolerance: the pooled bf16 values within 1 bf16 ulp (exp and the 8-term sums run in another order: one rounding
of the bf16 output may flip); every output row written (finite for every row that completes an entry); the state
after the roll bit-identical (a copy).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not importable")

from dsa_indexer.backends.reference import kernels as ref  # noqa: E402
from dsa_indexer.backends.triton import compressor as tcomp  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    d, slots = 128, 5
    # (request, first position, rows, state slot): a long prefill step, a fresh request, a speculative pair,
    # a request one row long, and two padding rows.
    spans = [(0, 37, 13, 3), (1, 0, 7, 1), (2, 1001, 2, 0), (3, 64, 1, 4), (4, 0, 2, -1)]
    positions, request, state_slot = [], [], []
    for req, first, n, slot in spans:
        positions += list(range(first, first + n))
        request += [req] * n
        state_slot += [slot] * n
    t = len(positions)
    proj = torch.randn(t, 4 * d, generator=g) * 2
    state = torch.randn(slots + 1, 8, 4 * d, generator=g) * 2
    ape = torch.randn(4, 2 * d, generator=g)
    pos = torch.tensor(positions)
    rows = ((pos + 1) % 4 == 0).nonzero().reshape(-1)
    tensors = (proj, state, ape, pos, torch.tensor(request, dtype=torch.int32), torch.tensor(state_slot), rows)
    return [x.to(DEVICE) for x in tensors]


@pytest.mark.parametrize("all_rows", [False, True], ids=["completing_rows", "every_row_like_a_graph"])
def test_c4_compress_pool_matches_the_reference(all_rows):
    seed = int(torch.randint(0, 1 << 30, ()))
    proj, state, ape, pos, req, slot, rows = _batch(seed)
    if all_rows:
        rows = torch.arange(proj.shape[0], device=DEVICE)
    want_state, got_state = state.clone(), state.clone()
    want = ref.c4_compress_pool(proj, want_state, ape, pos, req, slot, rows)
    got = tcomp.c4_compress_pool(proj, got_state, ape, pos, req, slot, rows)
    assert got.shape == want.shape == (rows.shape[0], 128) and got.dtype == torch.bfloat16
    completing = ((pos[rows] + 1) % 4 == 0) & (slot[rows] >= 0)
    assert torch.isfinite(got[completing].float()).all(), "every entry row written"
    finite = torch.isfinite(want.float())
    assert torch.equal(torch.isfinite(got.float()), finite)
    # One bf16 ulp of each value, or fp32 summation error at the row's scale where the softmax-weighted sum cancels
    # to a value far below its terms (seen: -4.1e-6 in a row whose entries are ~1.5, apart by 6e-8 = 2^-24 of them;
    # a relative ulp of such a value says nothing of the kernel).
    row_scale = want.float().nan_to_num(0.0, 0.0, 0.0).abs().amax(dim=1, keepdim=True).expand_as(want)[finite]
    diff = (got.float() - want.float())[finite].abs()
    bound = torch.maximum(want.float()[finite].abs().clamp_min(2 ** -126) * 2 ** -7, row_scale * 2 ** -20)
    assert (diff <= bound).all(), f"seed {seed}: worst {float((diff / bound).max()):.2f} of the bound"
    assert torch.equal(got_state[:-1], want_state[:-1]), "the state roll is a copy"
    assert not torch.equal(want_state[:-1], state[:-1]), "the step wrote into the state"


def test_state_roll_keeps_only_each_requests_last_8_positions():
    proj, state, ape, pos, req, slot, rows = _batch(7)
    rolled = state.clone()
    tcomp.c4_compress_pool(proj, rolled, ape, pos, req, slot, rows)
    # Request 0: rows 0..12 at positions 37..49 -> its slot 3 holds positions 42..49 (ring 2..7, 0, 1).
    for row in range(5, 13):
        assert torch.equal(rolled[3, int(pos[row]) % 8], proj[row])
    # The padding rows (slot -1) left every real slot alone apart from the requests' own.
    untouched = [s for s in range(5) if s not in (3, 1, 0, 4)]
    for s in untouched:
        assert torch.equal(rolled[s], state[s])

