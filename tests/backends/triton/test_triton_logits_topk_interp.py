"""The Triton logits and top-k kernels against the pure-torch reference, on tiny shapes.

Without CUDA the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set here before the kernel
modules are imported, in case tests/conftest.py has not); with CUDA the same tests run on the GPU.

Tolerances: logits are compared with rtol 1e-4 and atol 1e-4 x the row's largest |logit|: the kernels sum
the same fp32 products in another order than torch (dot-product blocking, head reduction tree). On a GPU the
bound is 2e-3 instead: Hopper's fp8 MMA accumulates with fewer than fp32's mantissa bits. Top-k results are
compared exactly, as index sets (the order within the k is not part of the contract).
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
from dsa_indexer.backends.triton import topk as triton_topk  # noqa: E402
from dsa_indexer.contract.cache import PAGE_SIZE, page_views  # noqa: E402

FP8 = torch.float8_e4m3fn


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _fp8(*shape, device) -> torch.Tensor:
    return torch.randn(*shape, device=device).to(FP8)


def _check_logits(out: torch.Tensor, expected: torch.Tensor) -> None:
    """-inf exactly where the reference masks, no NaN, finite values within the stated tolerance."""
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert not torch.isnan(out).any()
    visible = torch.isfinite(expected)
    assert torch.equal(torch.isneginf(out), ~visible)
    tol = 1e-4 if out.device.type == "cpu" else 2e-3
    row_max = torch.where(visible, expected.abs(), torch.zeros_like(expected)).amax(dim=1, keepdim=True)
    # Plus an absolute floor: a row whose few visible logits cancel to near zero (a causal row of one or two keys)
    # still carries the fp32 rounding of its 64 x 128 products, which are of order 1 (seen: 9.2e-5 on a row whose
    # largest logit was below 1). A wrong kernel errs by O(1) and more.
    bound = tol * row_max + tol * expected.abs() + 1e-3
    err = torch.where(visible, (out - expected).abs(), torch.zeros_like(out))
    assert bool((err <= bound).all()), f"max error {float(err.max())}"


def _assert_same_sets(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.shape == expected.shape and out.dtype == torch.int32
    for row in range(out.shape[0]):
        assert sorted(out[row].tolist()) == sorted(expected[row].tolist()), f"row {row}"


# ----------------------------------------------------------------------------------------------------------------
# ragged logits


def _ragged_inputs(s: int, n: int, heads: int, device: str):
    q = _fp8(s, heads, 128, device=device)
    k = _fp8(n, 128, device=device)
    k_scales = torch.rand(n, device=device) + 0.5
    weights = torch.randn(s, heads, device=device)
    return q, k, k_scales, weights


@pytest.mark.parametrize("heads", [64, 32, 128])
def test_ragged_logits_causal_match_reference(device, heads):
    s, n = 21, 150
    q, k, k_scales, weights = _ragged_inputs(s, n, heads, device)
    # Two requests packed: rows 0..9 see keys [0, 40 + i], rows 10..20 see [60, 60 + 8 * (i - 10) + 1).
    rows = torch.arange(s, device=device)
    ks = torch.where(rows < 10, 0, 60).int()
    ke = torch.where(rows < 10, 41 + rows, 61 + 8 * (rows - 10)).clamp(max=n).int()
    ke[4] = ks[4]  # a row that sees nothing
    out = triton_logits.ragged_mqa_logits(q, k, k_scales, weights, ks, ke)
    _check_logits(out, ref.ragged_mqa_logits(q, k, k_scales, weights, ks, ke))


def test_ragged_logits_split_keys(device):
    """Few rows and many keys: the key axis is split over several programs."""
    s, n, heads = 3, 300, 64
    cfg = triton_logits.ragged_config(s, n, heads, torch.device(device))
    assert cfg["splits"] > 1
    q, k, k_scales, weights = _ragged_inputs(s, n, heads, device)
    ks = torch.tensor([0, 37, 200], device=device, dtype=torch.int32)
    ke = torch.tensor([300, 250, 201], device=device, dtype=torch.int32)
    out = triton_logits.ragged_mqa_logits(q, k, k_scales, weights, ks, ke)
    _check_logits(out, ref.ragged_mqa_logits(q, k, k_scales, weights, ks, ke))


# ----------------------------------------------------------------------------------------------------------------
# paged logits


def _paged_inputs(context_lens: list[list[int]], max_context_len: int, heads: int, device: str):
    batch, next_n = len(context_lens), len(context_lens[0])
    max_pages = -(-max_context_len // PAGE_SIZE)
    num_pages = batch * max_pages + 3
    # Random bytes everywhere (fp8 NaN patterns, NaN scales): slots past a context must never leak.
    kv_cache = torch.randint(0, 256, (num_pages, PAGE_SIZE, 1, 132), dtype=torch.uint8, device=device)
    keys, scales = page_views(kv_cache, FP8)
    block_table = torch.full((batch, max_pages), 10**6, dtype=torch.int32, device=device)  # unused: out of range
    perm = torch.randperm(num_pages, device=device)
    for b in range(batch):
        used = -(-max(context_lens[b]) // PAGE_SIZE)
        pages = perm[b * max_pages: b * max_pages + used]
        block_table[b, :used] = pages.int()
        length = max(context_lens[b])
        flat = keys[pages.long()].reshape(-1, 128)
        flat[:length] = _fp8(length, 128, device=device)
        keys[pages.long()] = flat.reshape(-1, PAGE_SIZE, 128)
        sc = scales[pages.long()].reshape(-1)
        sc[:length] = torch.rand(length, device=device) + 0.5
        scales[pages.long()] = sc.reshape(-1, PAGE_SIZE)
    q = _fp8(batch, next_n, heads, 128, device=device)
    weights = torch.randn(batch * next_n, heads, device=device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return q, kv_cache, weights, lens, block_table


@pytest.mark.parametrize("context_lens", [
    [[1], [64], [300], [0]],            # next_n = 1: one token, one full page, a partial page, an empty row
    [[129, 130], [7, 8], [250, 251]],   # next_n = 2 (MTP): the rows of a request differ by one token
    [[70, 71, 72]],                     # next_n = 3: padded to 4 query rows inside the kernel
])
def test_paged_logits_match_reference(device, context_lens):
    max_context_len = 330  # not a multiple of the page or of a program's chunk: several programs, ragged tail
    q, kv_cache, weights, lens, block_table = _paged_inputs(context_lens, max_context_len, 64, device)
    out = triton_logits.paged_mqa_logits(q, kv_cache, weights, lens, block_table, max_context_len)
    _check_logits(out, ref.paged_mqa_logits(q, kv_cache, weights, lens, block_table, max_context_len))


# ----------------------------------------------------------------------------------------------------------------
# top-k: every test runs both paths (one program per row; rows split over programs, one launch per pass)


@pytest.fixture(params=["rows", "split"])
def topk_path(request):
    with triton_topk.config_override(path=request.param):
        yield request.param


def test_topk_random_rows_with_windows(device, topk_path):
    rows, cols, k = 6, 1500, 16
    logits = torch.randn(rows, cols, device=device)
    starts = torch.tensor([0, 100, 3, 700, 0, 50], dtype=torch.int32, device=device)
    ends = torch.tensor([1500, 1400, 10, 700, 16, 66], dtype=torch.int32, device=device)  # short, empty, exactly k
    out = triton_topk.topk_indices(logits, k, ends, starts)
    _assert_same_sets(out, ref.topk_indices(logits, k, ends, starts))
    out = triton_topk.topk_indices(logits, k, ends)
    _assert_same_sets(out, ref.topk_indices(logits, k, ends))


def test_topk_exact_ties_lowest_index_wins(device, topk_path):
    """Few distinct values and many exact zeros (what the ReLU sum produces), -0.0 beside +0.0, all-equal rows."""
    rows, cols, k = 4, 2000, 48
    logits = (torch.randint(-2, 4, (rows, cols), device=device).float() * 0.5).clamp_min(0)
    logits[0, ::7] = -0.0
    logits[2] = 0.0
    logits[3] = 1.25
    logits[3, 1000:] = 2.0  # 1000 tied at the top: the first 48 of them (columns 1000..1047)
    ends = torch.full((rows,), cols, dtype=torch.int32, device=device)
    starts = torch.tensor([0, 5, 9, 0], dtype=torch.int32, device=device)
    out = triton_topk.topk_indices(logits, k, ends, starts)
    expected = ref.topk_indices(logits, k, ends, starts)
    _assert_same_sets(out, expected)
    assert sorted(out[3].tolist()) == list(range(1000, 1048))


def test_topk_documented_order(device, topk_path):
    """Deterministic order: the columns above the k-th largest value first, then the ties at the k-th value in
    ascending column order (the lowest columns win); in the split path the rows span several programs and the
    ties cross a chunk boundary, and the columns above the k-th value are in ascending column order too."""
    cols, k = 3000, 40
    cfg = triton_topk._topk_config(2, cols, torch.device(device))
    assert cfg["path"] == topk_path and (topk_path == "rows" or cfg["split"] > 1)
    logits = torch.randn(2, cols, device=device)
    logits[1, 2000:2100] = 5.0  # more ties at the top than k, across a chunk boundary
    logits[1, 5] = 6.0
    ends = torch.tensor([cols, cols], dtype=torch.int32, device=device)
    out = triton_topk.topk_indices(logits, k, ends)
    _assert_same_sets(out, ref.topk_indices(logits, k, ends))
    assert torch.equal(out, triton_topk.topk_indices(logits, k, ends))
    for row in range(2):
        values = logits[row, out[row].long()]
        kth = values.min()
        above, tied = out[row][values > kth], out[row][values == kth]
        assert torch.equal(out[row], torch.cat([above, tied]))
        assert bool((tied.diff() > 0).all())
        if topk_path == "split":
            assert bool((above.diff() > 0).all())


def test_topk_physical_slots(device, topk_path):
    rows, cols, k = 3, 700, 24
    logits = torch.randn(rows, cols, device=device)
    ends = torch.tensor([700, 20, 650], dtype=torch.int32, device=device)
    starts = torch.tensor([0, 0, 64], dtype=torch.int32, device=device)
    block_table = torch.randperm(60, device=device)[:2 * 12].reshape(2, 12).int()
    row_request = torch.tensor([1, 0, 1], dtype=torch.int32, device=device)
    out = triton_topk.topk_indices(logits, k, ends, starts, block_table, row_request)
    _assert_same_sets(out, ref.topk_indices(logits, k, ends, starts, block_table, row_request))
    bt2 = block_table[row_request.long()].contiguous()
    out = triton_topk.topk_indices(logits, k, ends, None, bt2)
    _assert_same_sets(out, ref.topk_indices(logits, k, ends, None, bt2))


def test_topk_k2048(device, topk_path):
    logits = torch.randn(2, 4096, device=device)
    logits[1, ::2] = 0.0
    ends = torch.tensor([4096, 3000], dtype=torch.int32, device=device)
    out = triton_topk.topk_indices(logits, 2048, ends)
    _assert_same_sets(out, ref.topk_indices(logits, 2048, ends))


def test_topk_k_larger_than_columns(device, topk_path):
    logits = torch.randn(2, 50, device=device)
    ends = torch.tensor([50, 31], dtype=torch.int32, device=device)
    out = triton_topk.topk_indices(logits, 64, ends)
    _assert_same_sets(out, ref.topk_indices(logits, 64, ends))
    assert out[0, :50].tolist() == list(range(50)) and bool((out[:, 50:] == -1).all())


# ----------------------------------------------------------------------------------------------------------------
# lightning indexer


def test_lightning_indexer_matches_reference(device):
    context_lens = [[200, 201], [30, 31]]
    max_context_len, k = 256, 32
    q, kv_cache, weights, lens, block_table = _paged_inputs(context_lens, max_context_len, 64, device)
    out = triton_topk.lightning_indexer(q, kv_cache, weights, lens, block_table, max_context_len, k)
    # Top-k on the same logits is exact; comparing against the reference logits too would depend on
    # accumulation order at near-ties.
    logits = triton_logits.paged_mqa_logits(q, kv_cache, weights, lens, block_table, max_context_len)
    _assert_same_sets(out, ref.topk_indices(logits, k, lens.reshape(-1)))
    # Rows shorter than k (request 1) take every visible key, whatever the logits.
    expected = ref.lightning_indexer(q, kv_cache, weights, lens, block_table, max_context_len, k)
    _assert_same_sets(out[2:], expected[2:])
