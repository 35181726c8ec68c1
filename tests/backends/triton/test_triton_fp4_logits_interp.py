"""The Triton paged logits over V4's FP4 pages (``paged64_fp4_e2m1``, `backends/triton/logits_fp4.py`) against the
reference, on fresh random keys and queries.

Without CUDA the kernel runs in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set before the kernel module is
imported); with CUDA the same tests run on the GPU. Tolerance: rtol 1e-5 and atol 1e-5 x the row's largest |logit|
in the interpreter (exact products, fp32 sums in another order); 2e-3 on a GPU (Hopper's fp8 MMA accumulates each
K = 32 dot with fewer than fp32's mantissa bits). The -inf pattern is compared exactly, and the output is handed in
NaN-free only by the kernel: every element is checked to be written (finite or -inf).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from dsa_indexer.backends.reference import kernels as ref  # noqa: E402
from dsa_indexer.backends.triton import logits_fp4  # noqa: E402
from dsa_indexer.contract.cache import IndexKCache, store_fp4_rows  # noqa: E402

FP4 = "paged64_fp4_e2m1"


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _fp4_cache(pages: int, device: str, gen: torch.Generator) -> IndexKCache:
    x = torch.randn(pages * 64, 128, generator=gen)
    x = x * torch.exp2(torch.randint(-6, 4, (pages * 64, 4, 1), generator=gen).float()).repeat_interleave(32, 1)[..., 0]
    values, scales = ref.quant_fp4_e2m1(x, 32)
    cache = IndexKCache.allocate(pages, layout=FP4)
    store_fp4_rows(cache.data, torch.arange(pages * 64), values, scales)
    return IndexKCache(cache.data.to(device), layout=FP4)


def check_against_reference(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert got.shape == want.shape and got.dtype == torch.float32
    assert not torch.isnan(got).any() and not torch.isposinf(got).any()  # every element written
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    visible = ~torch.isneginf(want)
    scale = want.masked_fill(~visible, 0).abs().amax(dim=1, keepdim=True).clamp_min(1e-30).expand_as(want)
    err = (got - want).abs()[visible] / scale[visible]
    assert err.numel() == 0 or float(err.max()) <= tol, float(err.max())


@pytest.mark.parametrize("next_n", [1, 2])
@pytest.mark.parametrize("heads", [32, 64])
def test_fp4_paged_logits_match_the_reference(device, next_n, heads):
    gen = torch.Generator().manual_seed(100 * next_n + heads)
    pages, batch = 10, 4
    cache = _fp4_cache(pages, "cpu", gen)
    q = (torch.randn(batch, next_n, heads, 128, generator=gen) * 2).to(torch.float8_e4m3fn)
    weights = torch.randn(batch * next_n, heads, generator=gen)
    table = torch.randperm(pages, generator=gen).to(torch.int32)[:8].view(batch, 2)
    last = torch.tensor([0, 1, 65, 128], dtype=torch.int32)  # empty, one key, past one page, two full pages
    lens = (last[:, None] - (next_n - 1 - torch.arange(next_n))).clamp_min(0).to(torch.int32)
    max_len = 130  # not a multiple of 64: the last tile is partly past the output
    want = ref.paged_mqa_logits(q, cache.data, weights, lens, table, max_len)
    args = [t.to(device) for t in (q, cache.data, weights, lens, table)]
    got = logits_fp4.paged_mqa_logits_fp4(*args, max_len).cpu()
    check_against_reference(got, want, 2e-3 if device == "cuda" else 1e-5)
    assert bool(torch.isneginf(got[0:next_n]).all())  # the empty request: every column -inf


def test_fp4_kernel_takes_the_fnuz_flavour_and_refuses_the_fp8_pages(device):
    gen = torch.Generator().manual_seed(7)
    cache = _fp4_cache(2, "cpu", gen)
    # e4m3fnuz is gfx942's flavour (no NVIDIA GPU computes with it): in the interpreter only.
    fp8 = torch.float8_e4m3fnuz if device == "cpu" else torch.float8_e4m3fn
    q = (torch.randn(1, 1, 32, 128, generator=gen) * 2).to(fp8)
    weights = torch.randn(1, 32, generator=gen)
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    lens = torch.tensor([[100]], dtype=torch.int32)
    want = ref.paged_mqa_logits(q, cache.data, weights, lens, table, 100)
    got = logits_fp4.paged_mqa_logits_fp4(*[t.to(device) for t in (q, cache.data, weights, lens, table)], 100)
    check_against_reference(got.cpu(), want, 2e-3 if device == "cuda" else 1e-5)
    with pytest.raises(ValueError, match="reads the paged64_fp4_e2m1 pages"):
        logits_fp4.paged_mqa_logits_fp4(q, IndexKCache.allocate(2).data, weights, lens, table, 100)
