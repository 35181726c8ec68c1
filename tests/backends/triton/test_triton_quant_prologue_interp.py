"""The Triton quant / prologue / GEMM kernels against the pure-torch reference, on tiny shapes.

Without CUDA they run in the Triton CPU interpreter (TRITON_INTERPRET=1, set before triton is imported);
with CUDA the same tests run compiled on the GPU.

Tolerances and why:
- quant_fp8_groups: bit-identical (amax is exact, the division is IEEE in both, no summation).
- rmsnorm_quant_fp8: fp8 + scales bit-identical to quant_fp8_groups(its own normed output) (the contract);
  normed within 1 bf16 ulp of the reference (the mean of squares is summed in another order).
- q_prologue / k_prologue_store: the Hadamard sums 128 products in another order than the reference matmul,
  so a pre-quant value can land on the other side of an fp8 rounding boundary: fp8 payloads may differ by at
  most 1 fp8 ulp, in at most 1% of the elements (0 is typical); scales (and q weights) rtol 1e-5; with ue8m0
  scales are exactly equal (a power of two does not move with ulp-level amax changes).
- gemm_fp8_blockscale: fp32 accumulation in another order, one final rounding: relative Frobenius error
  < 1e-2 for bf16 output (< 1e-5 for fp32 output).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not importable")

from dsa_indexer.backends.reference import kernels as ref  # noqa: E402
from dsa_indexer.backends.triton import gemm as tgemm  # noqa: E402
from dsa_indexer.backends.triton import prologue as tprologue  # noqa: E402
from dsa_indexer.backends.triton import quant as tquant  # noqa: E402
from dsa_indexer.contract.cache import PAGE_SIZE, page_views  # noqa: E402

FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
FN, FNUZ = FP8
ROPES = {"neox_first64": (0, 64, False), "interleaved_last64": (64, 64, True), "neox_mid32": (32, 32, False)}


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _fp8_ok(fp8_dtype: torch.dtype, device: str) -> bool:
    """e4m3fnuz kernels only compile for AMD; the interpreter takes both."""
    return device == "cpu" or fp8_dtype == torch.float8_e4m3fn or torch.version.hip is not None


# ----------------------------------------------------------------------------------------------------------------
# helpers
def _poison(*outputs: tuple[tuple[int, ...], torch.dtype], device: str) -> None:
    """Best effort: allocate and free 0xFF-filled blocks of the sizes the op will allocate, so that its
    ``torch.empty`` outputs likely start as NaN / out-of-range garbage (the CUDA caching allocator and glibc
    reuse freed blocks of the same size). Every output is then compared in full, so an unwritten element fails."""
    bait = [torch.full((torch.Size(shape).numel() * dtype.itemsize,), 255, dtype=torch.uint8, device=device)
            for shape, dtype in outputs]
    del bait


def _fp8_ordinal(x: torch.Tensor) -> torch.Tensor:
    """Position of each fp8 code on the number line (sign-magnitude -> integer); adjacent values differ by 1."""
    bits = x.view(torch.uint8).to(torch.int32)
    mag = bits & 0x7F
    return torch.where(bits >= 0x80, -mag, mag)


def assert_fp8_close(got: torch.Tensor, want: torch.Tensor, max_frac: float = 0.01) -> None:
    """fp8 payloads equal except for 1-ulp flips in at most ``max_frac`` of the elements."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not torch.isnan(got.float()).any(), "NaN in the fp8 output (unwritten or overflowed elements)"
    step = (_fp8_ordinal(got) - _fp8_ordinal(want)).abs()
    assert int(step.max()) <= 1, f"fp8 payload off by {int(step.max())} ulp"
    frac = step.count_nonzero().item() / max(1, step.numel())
    assert frac <= max_frac, f"{frac:.2%} of the fp8 payloads differ by 1 ulp (limit {max_frac:.0%})"


def assert_scales(got: torch.Tensor, want: torch.Tensor, ue8m0: bool) -> None:
    if ue8m0:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def assert_dequant_close(q, s, rq, rs, group: int) -> None:
    """Dequantized values agree within one fp8 ulp (12.5% relative, or the subnormal quantum near zero)."""
    deq = (q.float().reshape(*s.shape, group) * s[..., None]).reshape(q.shape)
    rdeq = (rq.float().reshape(*rs.shape, group) * rs[..., None]).reshape(rq.shape)
    quantum = (rs[..., None] * 2.0 ** -9).expand(*rs.shape, group).reshape(rq.shape)
    assert bool(((deq - rdeq).abs() <= 0.125 * rdeq.abs() + quantum * 1.001).all())


def _cos_sin(max_pos: int, rope_dim: int, device: str) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim))
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=1).float().to(device)


def _randn(*shape, dtype=torch.bfloat16, device="cpu", scale=1.0, shift=0.0):
    return (torch.randn(*shape, device=device) * scale + shift).to(dtype)


# ----------------------------------------------------------------------------------------------------------------
# quant_fp8_groups
@pytest.mark.parametrize("fp8_dtype", FP8, ids=["fn", "fnuz"])
@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32scale", "ue8m0"])
@pytest.mark.parametrize("group_size,shape,x_dtype", [
    (128, (3, 5, 256), torch.bfloat16),
    (64, (7, 192), torch.float16),
    (32, (2, 96), torch.float32),
    (96, (4, 192), torch.bfloat16),  # not a power of two: padded, masked lanes
], ids=["g128-bf16-3d", "g64-fp16", "g32-fp32", "g96-bf16"])
def test_quant_fp8_groups_matches_reference_bitwise(device, fp8_dtype, ue8m0, group_size, shape, x_dtype):
    if not _fp8_ok(fp8_dtype, device):
        pytest.skip(f"{fp8_dtype} needs an AMD GPU")
    x = _randn(*shape, dtype=x_dtype, device=device, scale=3.0)
    groups = x.view(-1, group_size)
    groups[0] *= 1e-7  # below the 1e-4 amax clamp
    groups[1] = groups[1].clamp(-1.5, 1.5)
    groups[1, 3] = -1.75  # amax / 448 is exactly 2**-8: ue8m0 must keep it, not round up
    # Magnitudes over 8 decades: subnormal fp8 payloads and payloads that round to (signed) zero.
    groups[2] *= torch.logspace(-8, 0, group_size, device=device).to(x_dtype)
    n_groups = shape[-1] // group_size
    _poison((shape, fp8_dtype), ((*shape[:-1], n_groups), torch.float32), device=device)
    q, s = tquant.quant_fp8_groups(x, group_size, ue8m0, fp8_dtype)
    rq, rs = ref.quant_fp8_groups(x, group_size, ue8m0, fp8_dtype)
    assert q.shape == x.shape and q.dtype == fp8_dtype and s.shape == (*shape[:-1], n_groups)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s, rs)


# ----------------------------------------------------------------------------------------------------------------
# rmsnorm_quant_fp8
@pytest.mark.parametrize("fp8_dtype", FP8, ids=["fn", "fnuz"])
@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32scale", "ue8m0"])
@pytest.mark.parametrize("rows,width,group_size,x_dtype", [
    (5, 384, 128, torch.bfloat16),
    (3, 1536, 128, torch.bfloat16),
    (4, 256, 64, torch.float16),
], ids=["5x384", "3x1536", "4x256-g64-fp16"])
def test_rmsnorm_quant_fp8(device, fp8_dtype, ue8m0, rows, width, group_size, x_dtype):
    if not _fp8_ok(fp8_dtype, device):
        pytest.skip(f"{fp8_dtype} needs an AMD GPU")
    x = _randn(rows, width, dtype=x_dtype, device=device, scale=2.0, shift=0.3)
    weight = _randn(width, dtype=x_dtype, device=device, scale=0.5, shift=1.0)
    groups = width // group_size
    _poison(((rows, width), x_dtype), ((rows, width), fp8_dtype), ((rows, groups), torch.float32), device=device)
    normed, q, s = tquant.rmsnorm_quant_fp8(x, weight, 1e-6, group_size, ue8m0, fp8_dtype)
    rnormed, _, _ = ref.rmsnorm_quant_fp8(x, weight, 1e-6, group_size, ue8m0, fp8_dtype)
    assert normed.dtype == x_dtype and q.dtype == fp8_dtype and s.shape == (rows, groups)
    # The contract: the fp8 copy is exactly quant_fp8_groups of the normed tensor that is returned.
    q2, s2 = ref.quant_fp8_groups(normed, group_size, ue8m0, fp8_dtype)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8))
    assert torch.equal(s, s2)
    # normed vs the reference: at most one ulp of x's dtype (summation order of the mean square).
    ulp = torch.finfo(x_dtype).eps * rnormed.float().abs().clamp_min(torch.finfo(x_dtype).tiny)
    assert bool(((normed.float() - rnormed.float()).abs() <= ulp * 1.001).all())


# ----------------------------------------------------------------------------------------------------------------
# q_prologue
def _q_case(fp8_dtype, ue8m0, rope, tokens, heads):
    name = f"{'fnuz' if fp8_dtype == FNUZ else 'fn'}-{'ue8m0' if ue8m0 else 'fp32scale'}-{rope}-T{tokens}H{heads}"
    return pytest.param(fp8_dtype, ue8m0, rope, tokens, heads, id=name)


# Interpreter time grows with programs x ops: a chosen slice of the (fp8, ue8m0, rope, shape) matrix.
@pytest.mark.parametrize("fp8_dtype,ue8m0,rope,tokens,heads", [
    _q_case(FN, False, "neox_first64", 5, 8),
    _q_case(FN, True, "neox_first64", 5, 8),
    _q_case(FN, False, "interleaved_last64", 5, 8),
    _q_case(FN, True, "interleaved_last64", 5, 8),
    _q_case(FN, False, "neox_mid32", 5, 8),
    _q_case(FNUZ, False, "neox_first64", 5, 8),
    _q_case(FNUZ, True, "interleaved_last64", 5, 8),
    _q_case(FN, False, "neox_first64", 2, 64),
    _q_case(FN, True, "interleaved_last64", 2, 64),
])
def test_q_prologue(device, fp8_dtype, ue8m0, rope, tokens, heads):
    if not _fp8_ok(fp8_dtype, device):
        pytest.skip(f"{fp8_dtype} needs an AMD GPU")
    rope_offset, rope_dim, interleaved = ROPES[rope]
    q = _randn(tokens, heads, 128, device=device)
    positions = torch.randint(0, 200, (tokens,), device=device)
    cos_sin = _cos_sin(200, rope_dim, device)
    head_weights = _randn(tokens, heads, device=device)
    weight_scale = heads ** -0.5 * 128 ** -0.5
    _poison(((tokens, heads, 128), fp8_dtype), ((tokens, heads), torch.float32), device=device)
    q_fp8, w = tprologue.q_prologue(q, positions, cos_sin, head_weights, weight_scale, rope_offset, interleaved,
                                    ue8m0, fp8_dtype)
    rq_fp8, rw = ref.q_prologue(q, positions, cos_sin, head_weights, weight_scale, rope_offset, interleaved, ue8m0,
                                fp8_dtype)
    assert q_fp8.shape == q.shape and q_fp8.dtype == fp8_dtype
    assert w.shape == (tokens, heads) and w.dtype == torch.float32
    assert_fp8_close(q_fp8, rq_fp8)
    # weights = head_weights * weight_scale * q_scale: the q scale's tolerance carries over.
    torch.testing.assert_close(w, rw, rtol=0 if ue8m0 else 1e-5, atol=0)
    # Dequantized: recover the q scales from the weights.
    scale = (w / (head_weights.float() * weight_scale))
    rscale = (rw / (head_weights.float() * weight_scale))
    assert_dequant_close(q_fp8, scale, rq_fp8, rscale, 128)


# Every RoPE code path of the prologue kernels: (offset, width, interleaved) -> the path `_rope_mode` picks.
RARE_ROPES = {
    "neox_all128": ((0, 128, False), 1),
    "neox_off32": ((32, 64, False), 1),
    "neox_off64": ((64, 64, False), 1),
    "interleaved_all128": ((0, 128, True), 2),
    "interleaved_off16_r32": ((16, 32, True), 0),
    "neox_off8_r16": ((8, 16, False), 0),
}


@pytest.mark.parametrize("rope", list(RARE_ROPES))
def test_prologue_rope_layouts(device, rope):
    """Layouts beyond the models' (each RoPE path once): q and k against the reference."""
    (rope_offset, rope_dim, interleaved), mode = RARE_ROPES[rope]
    assert tprologue._rope_mode(rope_offset, rope_dim, interleaved) == mode
    tokens, heads = 3, 8
    cos_sin = _cos_sin(64, rope_dim, device)
    positions = torch.randint(0, 64, (tokens,), device=device)
    q = _randn(tokens, heads, 128, device=device)
    hw = _randn(tokens, heads, device=device)
    q_fp8, w = tprologue.q_prologue(q, positions, cos_sin, hw, 0.1, rope_offset, interleaved)
    rq_fp8, rw = ref.q_prologue(q, positions, cos_sin, hw, 0.1, rope_offset, interleaved)
    assert_fp8_close(q_fp8, rq_fp8)
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=0)

    k = _randn(tokens, 128, device=device)
    norm_weight, norm_bias = _randn(128, device=device), _randn(128, device=device)
    cache = torch.randint(0, 256, (1, PAGE_SIZE, 1, 132), dtype=torch.uint8, device=device)
    rcache = cache.clone()
    slots = torch.tensor([7, 0, 63], device=device)
    tprologue.k_prologue_store(k, norm_weight, norm_bias, 1e-6, positions, cos_sin, cache, slots, rope_offset,
                               interleaved)
    ref.k_prologue_store(k, norm_weight, norm_bias, 1e-6, positions, cos_sin, rcache, slots, rope_offset, interleaved)
    keys, scales = page_views(cache)
    rkeys, rscales = page_views(rcache)
    assert_fp8_close(keys[0, slots], rkeys[0, slots])
    assert_scales(scales[0, slots], rscales[0, slots], ue8m0=False)


def test_q_prologue_hadamard_is_fp32_accurate(device):
    """The three-piece Hadamard is as accurate as an fp32 matmul: at most 0.1% of the fp8 payloads flip by one
    ulp (rounding the rotated input to bf16 before a plain bf16 dot flips about 4% of them)."""
    q = _randn(4, 64, 128, device=device)
    positions = torch.arange(4, device=device)
    cos_sin = _cos_sin(4, 64, device)
    hw = torch.ones(4, 64, device=device)
    q_fp8, _ = tprologue.q_prologue(q, positions, cos_sin, hw, 1.0)
    rq_fp8, _ = ref.q_prologue(q, positions, cos_sin, hw, 1.0)
    assert_fp8_close(q_fp8, rq_fp8, max_frac=1e-3)


# ----------------------------------------------------------------------------------------------------------------
# k_prologue_store
@pytest.mark.parametrize("fp8_dtype", FP8, ids=["fn", "fnuz"])
@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32scale", "ue8m0"])
@pytest.mark.parametrize("norm,rope", [("layernorm", "neox_first64"), ("rmsnorm", "interleaved_last64"),
                                       ("none", "interleaved_last64"), ("layernorm", "neox_mid32")])
def test_k_prologue_store(device, fp8_dtype, ue8m0, norm, rope):
    if not _fp8_ok(fp8_dtype, device):
        pytest.skip(f"{fp8_dtype} needs an AMD GPU")
    rope_offset, rope_dim, interleaved = ROPES[rope]
    tokens, pages = 21, 3
    k = _randn(tokens, 128, device=device, scale=2.0, shift=0.5)
    if norm == "none":
        # A row-strided view (k sliced out of a wider fused projection output).
        k = torch.cat([k, _randn(tokens, 64, device=device)], dim=1)[:, :128]
    norm_weight = _randn(128, device=device, scale=0.3, shift=1.0)
    norm_bias = _randn(128, device=device, scale=0.3)
    positions = torch.randint(0, 500, (tokens,), device=device)
    cos_sin = _cos_sin(500, rope_dim, device)
    # Distinct slots spread over all pages (first and last rows of a page included), some tokens skipped (-1).
    slots = torch.randperm(pages * PAGE_SIZE, device=device)[:tokens]
    slots[:3] = torch.tensor([0, PAGE_SIZE - 1, pages * PAGE_SIZE - 1], device=device)
    slots[[4, 9, 17]] = -1
    slots = slots.to(torch.int32 if norm == "rmsnorm" else torch.int64)
    cache = torch.randint(0, 256, (pages, PAGE_SIZE, 1, 132), dtype=torch.uint8, device=device)
    before = cache.clone()
    rcache = cache.clone()

    tprologue.k_prologue_store(k, norm_weight, norm_bias, 1e-6, positions, cos_sin, cache, slots, rope_offset,
                               interleaved, ue8m0, fp8_dtype, norm)
    ref.k_prologue_store(k, norm_weight, norm_bias, 1e-6, positions, cos_sin, rcache, slots, rope_offset,
                         interleaved, ue8m0, fp8_dtype, norm)

    # Bytes of untouched slots (key bytes and scale bytes) are unchanged.
    keys, scales = page_views(cache, fp8_dtype)
    rkeys, rscales = page_views(rcache, fp8_dtype)
    bkeys, bscales = page_views(before, fp8_dtype)
    touched = torch.zeros(pages * PAGE_SIZE, dtype=torch.bool, device=device)
    kept = slots[slots >= 0].long()
    touched[kept] = True
    untouched = ~touched
    assert torch.equal(keys.reshape(-1, 128)[untouched].view(torch.uint8),
                       bkeys.reshape(-1, 128)[untouched].view(torch.uint8))
    assert torch.equal(scales.reshape(-1)[untouched].view(torch.int32),
                       bscales.reshape(-1)[untouched].view(torch.int32))
    # Touched slots match the reference.
    got_k, want_k = keys.reshape(-1, 128)[kept], rkeys.reshape(-1, 128)[kept]
    got_s, want_s = scales.reshape(-1)[kept], rscales.reshape(-1)[kept]
    assert_fp8_close(got_k, want_k)
    assert_scales(got_s, want_s, ue8m0)
    assert_dequant_close(got_k, got_s[:, None], want_k, want_s[:, None], 128)


# ----------------------------------------------------------------------------------------------------------------
# gemm_fp8_blockscale
@pytest.mark.parametrize("fp8_dtype,m,n,k,mn_major", [
    (FN, 1, 256, 256, False),
    (FN, 33, 320, 384, True),  # a_scales given M-major (a transposed view), as DeepGEMM lays them out
    (FN, 70, 130, 200, False),  # K and N not multiples of 128: masked K tail, partial scale blocks
    (FN, 130, 256, 128, False),
    (FNUZ, 70, 130, 200, False),
], ids=["fn-1x256x256", "fn-33x320x384-mn_major", "fn-70x130x200", "fn-130x256x128", "fnuz-70x130x200"])
def test_gemm_fp8_blockscale(device, fp8_dtype, m, n, k, mn_major):
    if not _fp8_ok(fp8_dtype, device):
        pytest.skip(f"{fp8_dtype} needs an AMD GPU")
    fmax = tquant.fp8_max(fp8_dtype)
    a = (torch.randn(m, k, device=device) * 64).clamp(-fmax, fmax).to(fp8_dtype)
    b = (torch.randn(n, k, device=device) * 64).clamp(-fmax, fmax).to(fp8_dtype)
    a_scales = torch.rand(m, -(-k // 128), device=device) * 1e-2 + 1e-3
    if mn_major:
        a_scales = a_scales.t().contiguous().t()
    b_scales = torch.rand(-(-n // 128), -(-k // 128), device=device) * 1e-2 + 1e-3
    want = ref.gemm_fp8_blockscale(a, a_scales, b, b_scales, torch.float32)
    _poison(((m, n), torch.bfloat16), device=device)
    out = tgemm.gemm_fp8_blockscale(a, a_scales, b, b_scales)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert torch.isfinite(out.float()).all()
    rel = ((out.float() - want).norm() / want.norm()).item()
    assert rel < 1e-2, rel
    out32 = tgemm.gemm_fp8_blockscale(a, a_scales, b, b_scales, torch.float32)
    rel32 = ((out32 - want).norm() / want.norm()).item()
    assert rel32 < 1e-5, rel32
