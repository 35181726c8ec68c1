"""The decode metadata kernel (`backends/triton/metadata.py`) against the reference op, exactly, on random batches
(interpreter on a CPU, compiled on a GPU): padding requests (seq_lens 0), lengths below next_n, next_n 1 and 2,
V3.2 (ratio 1) and C4 (ratio 4), page columns past the table (clamped), a strided block table. Outputs are
pre-filled with a sentinel: every element written. (`DecodeBuffers.derive` against `DecodeBatch.build`, through the
op: tests/backends/test_cuda_backend_cpu.py.)"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not importable")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SENTINEL = -7777


def _random_batch(batch: int, pages: int, generator: torch.Generator, strided: bool):
    seq_lens = torch.randint(0, pages * 64 * 8 + 64, (batch,), generator=generator, dtype=torch.int32)
    seq_lens[torch.rand(batch, generator=generator) < 0.25] = 0  # padding requests
    seq_lens[0] = 1  # below next_n = 2: its first row is padding
    wide = torch.randint(0, 1 << 20, (batch, pages + 3), generator=generator, dtype=torch.int32)
    table = wide[:, :pages] if strided else wide[:, :pages].contiguous()
    state_slots = torch.randperm(batch * 2, generator=generator)[:batch]
    return seq_lens, table, state_slots


@pytest.mark.parametrize("next_n", [1, 2])
@pytest.mark.parametrize("ratio", [1, 4])
@pytest.mark.parametrize("batch, pages, strided", [(1, 1, False), (37, 5, True), (300, 3, False)])
def test_decode_metadata_kernel_equals_reference(next_n, ratio, batch, pages, strided):
    from dsa_indexer.backends.reference import kernels as reference
    from dsa_indexer.backends.triton import metadata

    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    seq_lens, table, state_slots = _random_batch(batch, pages, g, strided)
    want = reference.decode_metadata(seq_lens, table, state_slots, next_n, ratio)
    rows = batch * next_n
    out = (torch.full((batch, next_n), SENTINEL, dtype=torch.int32, device=DEVICE),
           *(torch.full((rows,), SENTINEL, dtype=torch.int64, device=DEVICE) for _ in range(3)))
    got = metadata.decode_metadata(seq_lens.to(DEVICE), table.to(DEVICE), state_slots.to(DEVICE), next_n, ratio,
                                   out=out)
    for name, g_t, w_t in zip(("context_lens", "positions", "slot_mapping", "state_slot"), got, want):
        assert not bool((g_t == SENTINEL).any()), f"{name}: an element was not written"
        assert torch.equal(g_t.cpu(), w_t), name
    if batch > 1:  # the cases exercise padding rows (slot -1) and real positions
        assert bool((want[2] == -1).any()) and bool((want[1] > 0).any())
    clamped = (want[1] // ratio) // 64 >= pages
    assert batch == 1 or bool(clamped.any()), "no row overran the table: the clamp went untested"
