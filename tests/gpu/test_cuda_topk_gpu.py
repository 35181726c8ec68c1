"""The CUDA C++ top-k (``topk_indices.cuda.radix``) and the sm90 lightning indexer on the H200, against the
reference.

Tolerance: none for the top-k. It is an exact selection, so the returned index SET must equal the reference's
(`torch.sort`-based, ties to the lower column) on the same logits, bit for bit, and the order is the kernel's
documented one (keys above the k-th value in column order, then the lowest-column keys equal to it), checked
against an order rebuilt from the reference's set. The lightning indexer's logits come from DeepGEMM, so its
sets are compared with the reference top-k of DeepGEMM's own (masked) logits. Inputs are fresh random rows
every run: real indexer logits (the project's k and q paths over random weights and activations), randn, and
adversarial rows; outputs are poisoned before each call to catch unwritten entries.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from dsa_indexer.backends.cuda import topk as cuda_topk  # noqa: E402
from dsa_indexer.backends.reference import kernels as ref  # noqa: E402

DEVICE = "cuda"


@pytest.fixture(scope="module")
def kernel_ready():
    reason = cuda_topk.probe()
    if reason is not None:
        pytest.skip(reason)


def _order_keys(values: torch.Tensor) -> torch.Tensor:
    """The kernel's order of values (NaN largest, -0.0 == +0.0) as int64 keys."""
    return torch.where(torch.isnan(values), torch.full_like(values, float("inf")), values + 0.0).double()


def _check_order(got, logits, k, ends, starts):
    """The documented order: the keys above the threshold class in ascending column order, then the chosen keys
    of the class in ascending column order, every key of the first part above every key of the second; rows
    with <= k visible columns hold them ascending, then -1."""
    got, logits = got.cpu(), logits.cpu()
    for r in range(got.shape[0]):
        s = int(starts[r]) if starts is not None else 0
        e = int(ends[r])
        row = got[r]
        if e - s <= k:
            assert torch.equal(row[: e - s], torch.arange(max(e - s, 0), dtype=torch.int32))
            assert bool((row[max(e - s, 0):] == -1).all())
            continue
        breaks = (row[1:] < row[:-1]).nonzero()
        assert breaks.numel() <= 1, f"row {r}: more than two ascending runs"
        if breaks.numel():
            split = int(breaks[0, 0]) + 1
            keys = _order_keys(logits[r, s:e])
            assert float(keys[row[:split].long()].min()) >= float(keys[row[split:].long()].max()), f"row {r}"


def _check(logits, k, ends, starts=None, table=None, req=None, order=True):
    got = cuda_topk.topk_indices(logits, k, ends, starts, table, req)
    want = ref.topk_indices(logits, k, ends, starts, table, req)
    assert got.shape == want.shape and got.dtype == torch.int32
    assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)
    if order and table is None:
        _check_order(got, logits, k, ends, starts)
    return got


def _real_logits(batch, ctx, seed):
    from dsa_indexer.testing import real_decode_logits

    logits, lens, table, *_ = real_decode_logits(batch, ctx, DEVICE, seed=seed)
    return logits, lens.reshape(-1), table


@pytest.mark.parametrize("batch,ctx", [(1, 8192), (4, 8192), (3, 32768), (2, 131072)])
def test_real_logits_match_reference(kernel_ready, batch, ctx):
    logits, ends, _ = _real_logits(batch, ctx, seed=batch * 31 + ctx)
    _check(logits, 2048, ends)
    # ragged lengths inside the same logits
    ends2 = torch.randint(1, ctx + 1, (batch,), device=DEVICE, dtype=torch.int32)
    _check(logits, 2048, ends2)


@pytest.mark.parametrize("batch,ctx", [(16, 8192), (4, 32768)])
def test_triton_rows_path_on_real_logits(batch, ctx):
    """The portable Triton top-k (what AMD GPUs get) on real logits, whose rows include ones with a negative
    k-th value and a positive maximum (the case its first binning handled slowly): same set as the reference."""
    from dsa_indexer.backends.triton import topk as triton_topk

    logits, ends, _ = _real_logits(batch, ctx, seed=batch * 7 + ctx)
    want = ref.topk_indices(logits, 2048, ends)
    got = triton_topk.topk_indices(logits, 2048, ends)
    assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)


@pytest.mark.parametrize("rows,cols,k", [(64, 8192, 2048), (8, 131072, 2048), (1, 262144, 2048), (5, 3000, 512),
                                         (300, 4096, 64), (2, 70001, 2048)])
def test_randn_rows_match_reference(kernel_ready, rows, cols, k):
    logits = torch.randn(rows, cols, device=DEVICE)
    ends = torch.randint(cols // 2, cols + 1, (rows,), device=DEVICE, dtype=torch.int32)
    ends[0] = cols
    _check(logits, k, ends, order=rows * cols <= 1 << 20)


def test_adversarial_rows(kernel_ready):
    gen = torch.Generator(device=DEVICE).manual_seed(int(torch.randint(0, 1 << 30, ())))
    cols, k = 20000, 2048
    x = torch.randn(10, cols, device=DEVICE, generator=gen)
    x[0] = 3.25  # all equal
    x[1] = torch.randint(0, 3, (cols,), device=DEVICE, generator=gen).float()  # massive ties at the k-th value
    x[2, ::3] = float("-inf")  # visible -inf
    x[3, ::11] = float("nan")  # NaN counts as the largest
    x[4] = torch.where(torch.rand(cols, device=DEVICE, generator=gen) < 0.5, 0.0, -0.0)  # signed zeros tie
    x[5] = torch.exp(torch.randn(cols, device=DEVICE, generator=gen) * 8)  # wide dynamic range
    x[6] = 1e6 + torch.randn(cols, device=DEVICE, generator=gen)  # a narrow band far from zero
    x[7, :] = float("-inf")
    x[8] = torch.randn(cols, device=DEVICE, generator=gen) * 1e-30  # denormal-scale values straddling zero
    ends = torch.full((10,), cols, dtype=torch.int32, device=DEVICE)
    ends[9] = 1500  # shorter than k: every visible column then -1
    starts = torch.zeros(10, dtype=torch.int32, device=DEVICE)
    _check(x, k, ends)
    starts[2], starts[5], starts[6] = 1, 4097, 123  # windows with starts, unaligned
    _check(x, k, ends, starts)


def test_slot_transform_and_row_request(kernel_ready):
    rows, cols, k = 12, 9000, 2048
    logits = torch.randn(rows, cols, device=DEVICE)
    ends = torch.randint(100, cols + 1, (rows,), device=DEVICE, dtype=torch.int32)
    pages = -(-cols // 64)
    table = torch.randperm(4 * pages, device=DEVICE).to(torch.int32).view(4, pages)
    req = torch.randint(0, 4, (rows,), device=DEVICE, dtype=torch.int32)
    _check(logits, k, ends, None, table, req)
    _check(logits, k, ends, None, table[:rows] if rows <= 4 else table.repeat(3, 1), None)


def test_bitwise_repeatable_and_graph_equals_eager(kernel_ready):
    logits, ends, _ = _real_logits(8, 32768, seed=int(torch.randint(0, 1000, ())))
    first = cuda_topk.topk_indices(logits, 2048, ends)
    for _ in range(20):
        assert torch.equal(cuda_topk.topk_indices(logits, 2048, ends), first)
    out = torch.full_like(first, -7)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cuda_topk.topk_indices(logits, 2048, ends)
    captured.fill_(-7)
    graph.replay()
    torch.cuda.synchronize()
    out.copy_(captured)
    assert torch.equal(out, first)


def test_strided_logits_rows(kernel_ready):
    base = torch.randn(6, 8192 + 256, device=DEVICE)
    view = base[:, 1:8193]  # unaligned rows: the scalar-load path
    ends = torch.full((6,), 8192, dtype=torch.int32, device=DEVICE)
    _check(view, 2048, ends)


def test_lightning_indexer_cuda_matches_reference_on_its_logits(kernel_ready):
    from dsa_indexer import default_registry, ops
    from dsa_indexer.dispatch.problem import Problem
    from dsa_indexer.dispatch.target import detect_target

    registry = default_registry()
    res = registry.resolve("lightning_indexer", detect_target("cuda"),
                           Problem(heads=64, dim=128, next_n=1, k=2048, fp8="fn", slots=False))
    if res.chosen is None or res.chosen.impl_id != "lightning_indexer.cuda.deepgemm_radix":
        pytest.skip("lightning_indexer.cuda.deepgemm_radix is not chosen here: " + res.explain().splitlines()[-1])
    logits, lens, table, q, weights, cache = _real_decode_step(16, 8192)
    lens_ragged = torch.randint(1, 8193, (16, 1), device=DEVICE, dtype=torch.int32)
    lens_ragged[0] = 0  # a padding row
    for context_lens in (lens, lens_ragged):
        masked = ops.paged_mqa_logits(q, cache.data, weights, context_lens, table, 8192)
        want = ref.topk_indices(masked, 2048, context_lens.reshape(-1))
        got = ops.lightning_indexer(q, cache.data, weights, context_lens, table, 8192, 2048)
        assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)
        slots = ops.lightning_indexer(q, cache.data, weights, context_lens, table, 8192, 2048, return_slots=True)
        want_slots = ref.indices_to_slots(want, table, torch.arange(16, device=DEVICE, dtype=torch.int32))
        assert torch.equal(slots.sort(dim=1).values, want_slots.sort(dim=1).values)


def _real_decode_step(batch, ctx):
    from dsa_indexer.testing import real_decode_logits

    logits, lens, table, q, weights, cache = real_decode_logits(batch, ctx, DEVICE, seed=batch + ctx)
    return logits, lens, table, q, weights, cache
