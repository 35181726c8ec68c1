"""The Triton logits over V4's FP4 keys (`backends/triton/logits_fp4.py`) against the reference, on fresh random keys
and queries: paged over the ``paged64_fp4_e2m1`` pages (decode) and ragged over rows gathered from them in their
stored bytes (prefill, `IndexKCache.gather_packed`).

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

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from dsa_indexer.backends.reference import kernels as ref  # noqa: E402
from dsa_indexer.backends.triton import logits_fp4  # noqa: E402
from dsa_indexer.backends.triton.fp4_codes import e2m1_value  # noqa: E402
from dsa_indexer.contract.cache import E2M1_GRID, IndexKCache, store_fp4_rows  # noqa: E402

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


def _ragged_case(gen: torch.Generator, rows: int, heads: int, keys: int):
    """Fresh FP4 keys gathered in their stored bytes in a shuffled order, q through the recipe's FP4 quant (folded
    into fp8, its row scale in the weights), windows including an empty row, a one-key row and the last key."""
    cache = _fp4_cache((keys + 63) // 64, "cpu", gen)
    packed, scale_bytes = cache.gather_packed(torch.randperm(keys, generator=gen))
    q, row_scale = ref.rotate_quant_fp4(torch.randn(rows, heads, 128, generator=gen), 32)
    weights = torch.randn(rows, heads, generator=gen) * row_scale
    ks = torch.randint(0, keys // 2, (rows,), generator=gen).to(torch.int32)
    ke = torch.minimum(ks + torch.randint(0, keys, (rows,), generator=gen).to(torch.int32), torch.tensor(keys))
    ke[0], ks[1], ke[1], ke[-1] = ks[0], 5, 6, keys
    return q, packed, scale_bytes, weights, ks, ke.to(torch.int32)


@pytest.mark.parametrize("rows,heads,keys", [(7, 32, 150), (12, 64, 333), (3, 128, 64)])
def test_fp4_ragged_logits_match_the_reference(device, rows, heads, keys):
    gen = torch.Generator().manual_seed(rows * heads + keys)
    args = _ragged_case(gen, rows, heads, keys)
    want = ref.ragged_mqa_logits(*args)
    got = logits_fp4.ragged_mqa_logits_fp4(*[t.to(device) for t in args]).cpu()
    check_against_reference(got, want, 2e-3 if device == "cuda" else 1e-5)
    assert bool(torch.isneginf(got[0]).all())  # the empty window
    assert int((~torch.isneginf(got[1])).sum()) == 1  # one key: column 5


def test_fp4_ragged_logits_keep_a_block_the_fold_loses(device):
    """A key whose block 0 lies 2^20 below its largest block: the fold into one fp8 row scale flushes it, the FP4 rows
    keep each block's own scale. The kernel matches a float64 sum over the stored values, not the fold."""
    gen = torch.Generator().manual_seed(3)
    values, scales = ref.quant_fp4_e2m1(torch.randn(64, 128, generator=gen), 32)
    scales[:, 0] *= 2.0 ** -20
    cache = IndexKCache.allocate(1, layout=FP4)
    store_fp4_rows(cache.data, torch.arange(64), values, scales)
    packed, scale_bytes = cache.gather_packed(torch.arange(64))
    q = torch.zeros(2, 32, 128)
    q[:, :, :32] = torch.randn(2, 32, 32, generator=gen)  # only block 0 counts
    q = q.to(torch.float8_e4m3fn)
    weights = torch.rand(2, 32, generator=gen) + 0.5
    ks, ke = torch.zeros(2, dtype=torch.int32), torch.full((2,), 64, dtype=torch.int32)
    exact = torch.einsum("shd,nd->shn", q.double(), (values.reshape(64, 4, 32) * scales[..., None]).reshape(64, 128)
                         .double()).clamp_min(0)
    exact = (exact * weights.double()[..., None]).sum(1)
    got = logits_fp4.ragged_mqa_logits_fp4(*[t.to(device) for t in (q, packed, scale_bytes, weights, ks, ke)]).cpu()
    assert bool((exact.abs() > 0).any())
    torch.testing.assert_close(got.double(), exact, rtol=2e-3 if device == "cuda" else 1e-5, atol=0)
    folded, row = cache.gather(torch.arange(64))
    assert bool((folded.float()[:, :32] == 0).all())  # what the fold keeps of block 0: nothing


def test_fp4_ragged_kernel_refuses_fp8_keys_and_the_fp8_kernel_fp4_keys(device):
    from dsa_indexer.backends.triton import logits

    gen = torch.Generator().manual_seed(4)
    q, packed, scale_bytes, weights, ks, ke = _ragged_case(gen, 2, 32, 64)
    keys = torch.randn(64, 128, generator=gen).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="reads packed FP4 keys"):
        logits_fp4.ragged_mqa_logits_fp4(q, keys, torch.ones(64), weights, ks, ke)
    with pytest.raises(ValueError, match="FP4 keys .* are read by logits_fp4.ragged_mqa_logits_fp4"):
        logits.ragged_mqa_logits(q, packed, scale_bytes, weights, ks, ke)


@triton.jit
def _decode_nibbles(nibbles_ptr, out_ptr):
    offs = tl.arange(0, 16)
    tl.store(out_ptr + offs, e2m1_value(tl.load(nibbles_ptr + offs)).to(out_ptr.dtype.element_ty))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_every_nibble_becomes_its_e2m1_value_in_fp8(device, fp8):
    """All 16 nibbles through the kernels' decode (`fp4_codes.e2m1_value`, then the conversion to q's fp8 flavour)
    against the e2m1 grid: exact, and negative zero (nibble 8) is a zero, never e4m3fnuz's NaN (0x80)."""
    if device == "cuda" and fp8 == torch.float8_e4m3fnuz:
        pytest.skip("e4m3fnuz is gfx942's flavour: the interpreter only")
    out = torch.empty(16, dtype=fp8, device=device)
    _decode_nibbles[(1,)](torch.arange(16, dtype=torch.uint8, device=device), out)
    got = out.cpu().float()
    want = torch.tensor(list(E2M1_GRID) + [-v for v in E2M1_GRID])
    assert torch.equal(got, want) and not bool(torch.isnan(got).any())
