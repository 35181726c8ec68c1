"""The Triton logits and top-k kernels on a real GPU, at realistic shapes, against the pure-torch reference.

Tolerances: logits within 2e-3 x the row's largest |logit| + 2e-3 relative. Hopper's fp8 MMA accumulates
with fewer mantissa bits than fp32 (about 14 per the DeepSeek-V3 report), and the kernels sum heads in
another order than torch; the reference itself is exact fp32 (TF32 is off for torch matmuls by default).
Top-k: exact index-set equality with the reference applied to the same logits (the kernel's own logits,
so that near-ties cannot flip between the two logits implementations).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu  # skipped without a GPU by tests/conftest.py

pytest.importorskip("triton")

from dsa_indexer.backends.reference import kernels as ref  # noqa: E402
from dsa_indexer.backends.triton import logits as triton_logits  # noqa: E402
from dsa_indexer.backends.triton import topk as triton_topk  # noqa: E402
from dsa_indexer.contract.cache import PAGE_SIZE, page_views  # noqa: E402

FP8 = torch.float8_e4m3fn
DEVICE = "cuda"
TOL = 2e-3


def _check_logits(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert not torch.isnan(out).any()
    visible = torch.isfinite(expected)
    assert torch.equal(torch.isneginf(out), ~visible)
    zero = torch.zeros_like(expected)
    row_max = torch.where(visible, expected.abs(), zero).amax(dim=1, keepdim=True)
    err = torch.where(visible, (out - expected).abs(), zero)
    excess = err - (TOL * row_max + TOL * expected.abs())
    assert float(excess.max()) <= 0, f"max error {float(err.max())}"


def _assert_same_sets(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.shape == expected.shape and out.dtype == torch.int32
    assert torch.equal(out.sort(dim=1).values, expected.sort(dim=1).values)


def _paged_inputs(batch: int, ctx: int, next_n: int, heads: int = 64, seed: int = 0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    # Request lengths in [ctx / 2, ctx]; the rows of a request see one more key each (MTP / verify).
    last = torch.randint(ctx // 2, ctx + 1, (batch,), generator=gen, device=DEVICE)
    lens = (last[:, None] - (next_n - 1) + torch.arange(next_n, device=DEVICE)[None, :]).clamp_min(1).int()
    max_pages = -(-ctx // PAGE_SIZE)
    num_pages = batch * max_pages + 7
    kv_cache = torch.randint(0, 256, (num_pages, PAGE_SIZE, 1, 132), dtype=torch.uint8, device=DEVICE,
                             generator=gen)
    keys, scales = page_views(kv_cache, FP8)
    keys.copy_(torch.randn(keys.shape, generator=gen, device=DEVICE).to(FP8))
    scales.copy_(torch.rand(scales.shape, generator=gen, device=DEVICE) + 0.5)
    block_table = torch.randperm(num_pages, generator=gen, device=DEVICE)[:batch * max_pages]
    block_table = block_table.reshape(batch, max_pages).int()
    q = torch.randn(batch, next_n, heads, 128, generator=gen, device=DEVICE).to(FP8)
    weights = torch.randn(batch * next_n, heads, generator=gen, device=DEVICE) * heads ** -0.5
    return q, kv_cache, weights, lens, block_table


@pytest.mark.parametrize("next_n", [1, 2])
@pytest.mark.parametrize("ctx", [1000, 8192, 40000])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_paged_logits(batch, ctx, next_n):
    q, kv_cache, weights, lens, block_table = _paged_inputs(batch, ctx, next_n)
    out = triton_logits.paged_mqa_logits(q, kv_cache, weights, lens, block_table, ctx)
    _check_logits(out, ref.paged_mqa_logits(q, kv_cache, weights, lens, block_table, ctx))


@pytest.mark.parametrize("prefix", [0, 3000])
@pytest.mark.parametrize("rows", [128, 1024])
def test_ragged_logits_causal(rows, prefix):
    n = prefix + rows
    q = torch.randn(rows, 64, 128, device=DEVICE).to(FP8)
    k = torch.randn(n, 128, device=DEVICE).to(FP8)
    k_scales = torch.rand(n, device=DEVICE) + 0.5
    weights = torch.randn(rows, 64, device=DEVICE) * 0.125
    ks = torch.zeros(rows, dtype=torch.int32, device=DEVICE)
    ke = (prefix + 1 + torch.arange(rows, device=DEVICE)).int()
    out = triton_logits.ragged_mqa_logits(q, k, k_scales, weights, ks, ke)
    _check_logits(out, ref.ragged_mqa_logits(q, k, k_scales, weights, ks, ke))


def _indexer_like_logits(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Weighted ReLU sums: mostly positive, with exact zeros where no head fires."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen, device=DEVICE)
    x = torch.where(torch.rand(rows, cols, generator=gen, device=DEVICE) < 0.2, torch.zeros_like(x), x.exp())
    return x


@pytest.mark.parametrize("path", [None, "rows", "split"])
@pytest.mark.parametrize("cols", [3000, 8192, 65536])
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_topk_2048(rows, cols, path):
    logits = _indexer_like_logits(rows, cols, seed=rows * cols)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    ends = torch.randint(cols // 2, cols + 1, (rows,), generator=gen, device=DEVICE).int()
    ends[0] = cols
    starts = (ends - torch.randint(1, cols + 1, (rows,), generator=gen, device=DEVICE).int()).clamp_min(0).int()
    overrides = {} if path is None else {"path": path}
    with triton_topk.config_override(**overrides):
        out = triton_topk.topk_indices(logits, 2048, ends)
        _assert_same_sets(out, ref.topk_indices(logits, 2048, ends))
        out = triton_topk.topk_indices(logits, 2048, ends, starts)
        _assert_same_sets(out, ref.topk_indices(logits, 2048, ends, starts))


@pytest.mark.parametrize("path", ["rows", "split"])
def test_topk_tie_heavy(path):
    rows, cols = 8, 65536
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    logits = torch.randint(0, 4, (rows, cols), generator=gen, device=DEVICE).float()
    logits[1] = 0.0                    # all tied
    logits[2, ::3] = -0.0              # -0.0 ties with +0.0
    logits[3] = 1.0
    logits[3, 30000:40000] = 2.0       # 10000 tied at the top, k = 2048 of them: the lowest columns
    ends = torch.full((rows,), cols, dtype=torch.int32, device=DEVICE)
    with triton_topk.config_override(path=path):
        out = triton_topk.topk_indices(logits, 2048, ends)
    _assert_same_sets(out, ref.topk_indices(logits, 2048, ends))
    assert out[3].tolist() == list(range(30000, 32048))


def test_topk_slots():
    rows, cols = 16, 20000
    logits = _indexer_like_logits(rows, cols, seed=5)
    ends = torch.randint(1000, cols + 1, (rows,), device=DEVICE).int()
    block_table = torch.randperm(8 * 320, device=DEVICE)[:8 * 320].reshape(8, 320).int()
    row_request = torch.arange(rows, device=DEVICE).int() // 2
    out = triton_topk.topk_indices(logits, 2048, ends, None, block_table, row_request)
    _assert_same_sets(out, ref.topk_indices(logits, 2048, ends, None, block_table, row_request))


@pytest.mark.parametrize("batch,ctx,next_n", [(1, 40000, 1), (8, 8192, 2), (64, 3000, 1)])
def test_lightning_indexer(batch, ctx, next_n):
    q, kv_cache, weights, lens, block_table = _paged_inputs(batch, ctx, next_n, seed=11)
    out = triton_topk.lightning_indexer(q, kv_cache, weights, lens, block_table, ctx, 2048)
    logits = triton_logits.paged_mqa_logits(q, kv_cache, weights, lens, block_table, ctx)
    _assert_same_sets(out, ref.topk_indices(logits, 2048, lens.reshape(-1)))


@pytest.mark.parametrize("path", ["rows", "split"])
def test_cuda_graph_capture(path):
    """Fixed grids and no host sync: logits + top-k capture in a CUDA graph and replay on new inputs."""
    q, kv_cache, weights, lens, block_table = _paged_inputs(4, 20000, 2, seed=13)
    with triton_topk.config_override(path=path):
        for _ in range(2):  # compile outside the capture
            triton_topk.lightning_indexer(q, kv_cache, weights, lens, block_table, 20000, 2048)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = triton_topk.lightning_indexer(q, kv_cache, weights, lens, block_table, 20000, 2048)
    q2, kv2, w2, lens2, bt2 = _paged_inputs(4, 20000, 2, seed=14)
    for dst, src in ((q, q2), (kv_cache, kv2), (weights, w2), (lens, lens2), (block_table, bt2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    logits = triton_logits.paged_mqa_logits(q, kv_cache, weights, lens, block_table, 20000)
    _assert_same_sets(out, ref.topk_indices(logits, 2048, lens.reshape(-1)))
