"""aiter's Triton kernels on the H200, through THIS library's ROCm adapters, against the reference kernels.

``import aiter`` needs ROCm, but the kernels the ROCm backend uses for ragged logits and the fused RMSNorm + quant
are plain Triton files. A test-only shim replaces the top-level ``aiter`` package in ``sys.modules`` by an empty
module whose ``__path__`` is the unpacked package (``$DSA_AITER_PKG/aiter``, default ``<repo>/.deps/aiter_pkg/aiter``;
git-ignored, so the run must carry it: ``carry=[".deps/aiter_pkg"]``) and whose ``aiter.dtypes.fp8`` is
``torch.float8_e4m3fn``. The backend itself imports the real aiter; only these tests use the shim.

What this checks on real hardware (NVIDIA, not AMD):
* the ragged-logits adapter (starts rounded down to 128, head re-masked) over aiter's real
  ``_fp8_mqa_logits_kernel``, launched by `kernel_launcher` without the AMD-only launch options that aiter's
  public wrapper passes (NVIDIA Triton rejects ``waves_per_eu`` / ``matrix_instr_nonkdim``), on fresh random
  inputs whose starts are mostly NOT multiples of 128, so that the kernel's alignment bug would show;
* that the raw kernel still has that bug for such starts (so the inputs really exercise the workaround); its
  stray stores land in padding allocated for the purpose;
* the probe's self-test routine `check_ragged_adapter` on this GPU;
* ``aiter_fused_rms_fp8_group_quant`` (aiter's public Triton wrapper, which runs unchanged on NVIDIA) against the
  reference ``rmsnorm_quant_fp8`` and its layout tag ``PRODUCER_UNROUNDED``;
* ``paged_mqa_logits.rocm.aiter`` as resolution builds it (the registered factory) over aiter MAIN's plain Triton
  ``_deepgemm_fp8_paged_mqa_logits`` (ROCm/aiter e4048607; the 0.1.7 wheel has only a page-size-1 kernel), from
  ``$DSA_AITER_HEAD_PKG`` (default ``<repo>/.deps/aiter_head_pkg``, a few files of that commit; carry it too), on
  64-token pages: several requests, lengths that are not multiples of 64, shuffled block tables over a larger
  pool, against the reference; and the probe's paged self-test `check_paged_adapter` on this GPU.
NOT checked: anything HIP/CK/asm (the top-k, the GEMM), AMD launch options, e4m3fnuz on gfx942, aiter's Gluon
paged kernels (AMD only; the adapter does not call them).

Tolerances and why:
* logits: -inf pattern exact; finite values within 2e-3 x the row's largest |logit| (+2e-3 relative): Hopper's fp8
  MMA accumulates with fewer than fp32's mantissa bits, and the sums run in another order than torch's.
* fused quant: ``normed`` within 1 bf16 ulp of the reference (rsqrt and summation order); fp8 payload within
  1 fp8 ulp, because aiter quantizes the fp32 normed value before rounding to bf16 and multiplies by 1/scale
  where the reference quantizes the rounded value by division (the documented PRODUCER_UNROUNDED difference);
  scales within 2**-7 relative (the bf16 rounding of the group's amax).
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from pathlib import Path

import pytest
import torch

AITER_PKG = Path(os.environ.get("DSA_AITER_PKG", Path(__file__).parents[2] / ".deps" / "aiter_pkg"))
AITER_HEAD_PKG = Path(os.environ.get("DSA_AITER_HEAD_PKG", Path(__file__).parents[2] / ".deps" / "aiter_head_pkg"))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (AITER_PKG / "aiter" / "ops" / "triton").is_dir(),
                       reason=f"aiter's Python package not found at {AITER_PKG}/aiter (set DSA_AITER_PKG, or carry "
                              ".deps/aiter_pkg to the GPU machine)"),
]

triton = pytest.importorskip("triton", reason="triton is not importable")

from dsa_indexer.backends.reference import kernels as ref  # noqa: E402
from dsa_indexer.backends.rocm import logits as rocm_logits  # noqa: E402
from dsa_indexer.backends.rocm import quant as rocm_quant  # noqa: E402
from dsa_indexer.contract.quant import PRODUCER_UNROUNDED  # noqa: E402

FP8 = torch.float8_e4m3fn


@contextlib.contextmanager
def _aiter_shim(pkg: Path):
    """Test-only stand-in for ``import aiter`` (see the module docstring); removes every ``aiter`` module after."""
    before = {name: mod for name, mod in sys.modules.items() if name == "aiter" or name.startswith("aiter.")}
    for name in before:
        del sys.modules[name]
    shim = types.ModuleType("aiter")
    shim.__path__ = [str(pkg / "aiter")]
    dtypes = types.ModuleType("aiter.dtypes")
    dtypes.fp8 = FP8
    shim.dtypes = dtypes
    sys.modules["aiter"], sys.modules["aiter.dtypes"] = shim, dtypes
    try:
        yield shim
    finally:
        for name in [n for n in sys.modules if n == "aiter" or n.startswith("aiter.")]:
            del sys.modules[name]
        sys.modules.update(before)


@pytest.fixture(scope="module")
def shim():
    with _aiter_shim(AITER_PKG) as module:
        yield module


@pytest.fixture
def head_shim():
    """aiter main's Triton files (the block-level paged kernel) instead of the 0.1.7 wheel's."""
    kernel = AITER_HEAD_PKG / "aiter" / "ops" / "triton" / "_triton_kernels" / "attention" / "pa_mqa_logits.py"
    if not kernel.is_file():
        pytest.skip(f"aiter main's paged kernel not found at {kernel} (set DSA_AITER_HEAD_PKG, or carry "
                    ".deps/aiter_head_pkg)")
    with _aiter_shim(AITER_HEAD_PKG) as module:
        yield module


def _check_logits(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert not torch.isnan(out).any()
    visible = torch.isfinite(expected)
    assert torch.equal(torch.isneginf(out), ~visible), "the -inf pattern differs from the rows' windows"
    row_max = torch.where(visible, expected.abs(), torch.zeros_like(expected)).amax(dim=1, keepdim=True)
    bound = 2e-3 * row_max + 2e-3 * torch.where(visible, expected.abs(), torch.zeros_like(expected))
    err = torch.where(visible, (out - expected).abs(), torch.zeros_like(out))
    assert bool((err <= bound).all()), f"max error {float(err.max()):.3g}"


def _inputs(rows: int, keys: int, heads: int, gen: torch.Generator):
    q = (torch.randn(rows, heads, 128, generator=gen) * 40).to(FP8)
    k = (torch.randn(keys, 128, generator=gen) * 40).to(FP8)
    scales = torch.rand(keys, generator=gen) * 1e-3 + 1e-4
    weights = torch.randn(rows, heads, generator=gen)
    return q, k, scales, weights


def _random_windows(rows: int, keys: int, gen: torch.Generator):
    ks = torch.randint(0, keys + 1, (rows,), generator=gen, dtype=torch.int32)
    edge = torch.tensor([0, 1, 127, 128, 129, 255, 256, 257], dtype=torch.int32).clamp_max(keys)
    ks[: min(rows, 8)] = edge[: min(rows, 8)]
    ke = torch.minimum(ks + torch.randint(0, max(2, keys // 2), (rows,), generator=gen, dtype=torch.int32),
                       torch.tensor(keys, dtype=torch.int32))
    return ks, ke


def _packed_prefill_windows(prefixes: list[int], news: list[int]):
    """Several requests' keys packed into one K (request b's keys start where b-1's end, NOT at multiples of 128);
    query i of request b sees ``[start_b, start_b + prefix_b + i + 1)``."""
    ks, ke, start = [], [], 0
    for prefix, new in zip(prefixes, news):
        for i in range(new):
            ks.append(start)
            ke.append(start + prefix + i + 1)
        start += prefix + new
    return torch.tensor(ks, dtype=torch.int32), torch.tensor(ke, dtype=torch.int32), start


@pytest.mark.parametrize("rows, keys, heads", [(1, 1, 64), (7, 300, 64), (100, 1000, 64), (333, 4097, 64),
                                               (64, 2000, 16), (64, 700, 128)])
def test_ragged_adapter_over_aiters_kernel_random_windows(shim, rows, keys, heads):
    gen = torch.Generator().manual_seed(1000 + rows + keys + heads)
    q, k, s, w = _inputs(rows, keys, heads, gen)
    ks, ke = _random_windows(rows, keys, gen)
    args = [t.cuda() for t in (q, k, s, w, ks, ke)]
    fn = rocm_logits.make_ragged_mqa_logits(launch="kernel")
    _check_logits(fn(*args), ref.ragged_mqa_logits(*args))


def test_ragged_adapter_over_aiters_kernel_packed_prefill(shim):
    ks, ke, keys = _packed_prefill_windows([0, 77, 1000, 5], [130, 64, 200, 300])
    gen = torch.Generator().manual_seed(7)
    q, k, s, w = _inputs(ks.numel(), keys, 64, gen)
    args = [t.cuda() for t in (q, k, s, w, ks, ke)]
    assert bool((ks % 128 != 0).any())
    _check_logits(rocm_logits.make_ragged_mqa_logits(launch="kernel")(*args), ref.ragged_mqa_logits(*args))


def test_raw_kernel_still_has_the_alignment_bug(shim):
    """Without the workaround, rows whose start is not a multiple of 128 come out wrong: the inputs above do
    exercise the bug. (If this fails, the installed aiter fixed it: the workaround is then merely redundant and
    docs/backends-amd-npu.md should say so.) The stray stores and reads land in padding allocated here."""
    found = rocm_logits.find_kernel()
    assert found is not None
    kernel = found[1]
    gen = torch.Generator().manual_seed(3)
    rows, keys, heads, pad = 32, 1000, 64, 256
    q, k, s, w = _inputs(rows, keys, heads, gen)
    ks, ke = _random_windows(rows, keys, gen)
    k_pad = torch.cat([k.view(torch.uint8), torch.zeros(pad, 128, dtype=torch.uint8)]).view(FP8).cuda()
    s_pad = torch.cat([s, torch.zeros(pad)]).cuda()
    buf = torch.full((rows + 1, keys + 2 * pad), float("-inf"), device="cuda")
    q, w, ks_d, ke_d = q.cuda(), w.cuda(), ks.cuda(), ke.cuda()
    kernel[(rows,)](Q_ptr=q, KV_ptr=k_pad, kv_scales_ptr=s_pad, weights_ptr=w, cu_start_ptr=ks_d, cu_end_ptr=ke_d,
                    logits_ptr=buf, seq_len=rows, seq_len_kv=keys, NUM_HEADS=heads, HEAD_SIZE=128,
                    stride_q_s=q.stride(0), stride_q_h=q.stride(1), stride_q_d=q.stride(2),
                    stride_kv_s=k_pad.stride(0), stride_kv_d=k_pad.stride(1), stride_w_s=w.stride(0),
                    stride_w_h=w.stride(1), stride_logits_s=buf.stride(0), stride_logits_k=buf.stride(1),
                    BLOCK_KV=128, num_warps=4, num_stages=2)
    raw = buf[:rows, :keys].cpu()
    want = ref.ragged_mqa_logits(q.cpu(), k, s, w.cpu(), ks, ke)
    wrong = (torch.isneginf(raw) != torch.isneginf(want)).any(dim=1)
    unaligned = (ks % 128 != 0) & (ke > ks)
    assert not bool(wrong[~unaligned].any()), "rows with aligned starts must be right even without the workaround"
    assert bool(wrong[unaligned].any()), "the raw kernel handled unaligned starts: aiter fixed the bug?"


def test_probe_self_test_passes_on_this_gpu(shim):
    rocm_logits.check_ragged_adapter(rocm_logits.make_ragged_mqa_logits(launch="kernel"), "cuda", FP8)


def _ordinal(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Monotone integer code of a float's bit pattern (sign-magnitude -> two's complement order)."""
    if bits == 8:
        code = x.view(torch.uint8).to(torch.int32)
        mag = code & 0x7F
        return torch.where(code >= 0x80, -mag, mag)
    code = x.view(torch.int16).to(torch.int32)
    return torch.where(code < 0, -(code & 0x7FFF), code)


@pytest.mark.parametrize("tokens, width", [(1, 1536), (33, 1536), (256, 7168)])
def test_fused_rms_quant_adapter_against_the_reference(shim, tokens, width):
    gen = torch.Generator().manual_seed(tokens + width)
    x = (torch.randn(tokens, width, generator=gen) * 3).to(torch.bfloat16).cuda()
    weight = (torch.rand(width, generator=gen) + 0.5).to(torch.bfloat16).cuda()
    normed, quant = rocm_quant.aiter_fused_rms_fp8_group_quant(x, weight, 1e-6)
    r_normed, r_fp8, r_scale = ref.rmsnorm_quant_fp8(x, weight, 1e-6)
    assert quant.layout.producer == PRODUCER_UNROUNDED
    assert (quant.layout.group_size, quant.layout.rows, quant.layout.fp8_dtype) == (128, tokens, FP8)
    assert normed.dtype == torch.bfloat16 and quant.data.dtype == FP8 and quant.scales.shape == (tokens, width // 128)
    assert int((_ordinal(normed, 16) - _ordinal(r_normed, 16)).abs().max()) <= 1, "normed: > 1 bf16 ulp"
    assert int((_ordinal(quant.data, 8) - _ordinal(r_fp8, 8)).abs().max()) <= 1, "fp8 payload: > 1 fp8 ulp"
    torch.testing.assert_close(quant.scales, r_scale, rtol=2 ** -7, atol=0)


# --- paged logits: aiter main's plain Triton kernel through the registered adapter ---------------------------------
def _paged_inputs(lens: list[int], heads: int, gen: torch.Generator, spare_pages: int = 5):
    """Random 64-token pages (a pool larger than the tables, so unused pages hold other keys), a shuffled block table
    one page wider than the longest request, q and weights; lengths as given (1 x next_n)."""
    from dsa_indexer.contract.cache import IndexKCache, page_views

    width = max(-(-n // 64) for n in lens) + 1
    pool = len(lens) * width + spare_pages
    cache = IndexKCache.allocate(pool, "cpu", FP8).data
    keys, scales = page_views(cache, FP8)
    keys.copy_((torch.randn(keys.shape, generator=gen) * 40).to(FP8))
    scales.copy_(torch.rand(scales.shape, generator=gen) * 1e-3 + 1e-4)
    table = torch.randperm(pool, generator=gen)[: len(lens) * width].to(torch.int32).view(len(lens), width)
    q = (torch.randn(len(lens), 1, heads, 128, generator=gen) * 40).to(FP8)
    w = torch.randn(len(lens), heads, generator=gen)
    context = torch.tensor(lens, dtype=torch.int32).view(-1, 1)
    return [t.cuda() for t in (q, cache, w, context, table)] + [width * 64]


@pytest.mark.parametrize("lens, heads", [
    ([1, 63, 65, 130, 1000, 4097, 2049, 333], 64),
    ([7, 200, 5000], 32),
    ([129] * 16, 64),
    ([8191, 3], 16),
    ([300] * 3 + [70], 128),
])
def test_registered_paged_adapter_over_aiters_plain_kernel(head_shim, lens, heads):
    """Tolerance as for the ragged logits: -inf exactly outside each request's window (so every visible column was
    written: the adapter pre-fills -inf), no NaN, finite values within 2e-3 x the row's largest |logit| + 2e-3
    relative (fp8 MMA accumulation)."""
    from dsa_indexer.dispatch import Environment, Problem, Registry, Target, load_plugins

    reg = Registry(environment=Environment.simulated(gpu=True, triton=True, aiter=True))
    load_plugins(reg, entry_points=False)
    gfx950 = Target("rocm", "gfx950")
    problem = Problem(heads=heads, dim=128, next_n=1, fp8="fn")
    fn = reg.function("paged_mqa_logits", gfx950, problem)
    assert reg.used[("paged_mqa_logits", gfx950, problem)].chosen.impl_id == "paged_mqa_logits.rocm.aiter"
    gen = torch.Generator().manual_seed(sum(lens) + heads)
    args = _paged_inputs(lens, heads, gen)
    got = fn(*args)
    want = ref.paged_mqa_logits(*args)
    _check_logits(got, want)
    visible = torch.isfinite(want.cpu())
    assert visible.sum(dim=1).tolist() == lens  # the windows the reference masks are the requests' lengths


def test_paged_probe_self_test_passes_on_this_gpu(head_shim):
    from dsa_indexer.backends.rocm import paged

    paged.check_paged_adapter(paged.make_paged_mqa_logits(launch="kernel"), "cuda", FP8)
