"""The reference numerics checked against independent float64 formulas written from the contract.

Every expected value here is computed by this file in float64 (its own Hadamard, RoPE, YaRN, norms,
quantization bounds, logits and top-k oracle), never by calling the code under test a second time.
Inputs are fresh random tensors (``torch.randn``) from a per-test seeded generator.

fp8 e4m3 error model used throughout (derived once, here):
  e4m3fn has 3 explicit mantissa bits, so inside a binade [2**e, 2**(e+1)) the spacing is 2**(e-3) and
  round-to-nearest errs by at most 2**(e-4) <= 2**-4 * |y|. Below the smallest normal (2**-6 for fn,
  2**-7 for fnuz) the spacing is 2**-9 (fn) / 2**-10 (fnuz), so the error is at most 2**-10. Clamped values
  (|y| > fp8 max) only lose the fp32 rounding of x / s. With y = x / s (fp32, relative error 2**-24):
      |x - fp8(x / s) * s| <= 2**-4 * |x| + 2**-10 * s   (+ 2**-20 * |x| slack for the fp32 division)
"""

from __future__ import annotations

import math

import pytest
import torch

from dsa_indexer import IndexKCache, ops
from dsa_indexer.backends.reference.kernels import hadamard_matrix
from dsa_indexer.rope import YarnScaling, cos_sin_table, rope_frequencies

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
FP8_MAX = {FN: 448.0, FNUZ: 224.0}
PAGE = 64
PAGE_BYTES = 64 * 128 + 64 * 4  # 8448: 64 token-major fp8 rows of 128 bytes, then 64 fp32 scales
SCALE_BASE = 64 * 128  # 8192: byte offset of the scale block inside a page


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------------------------
# Independent float64 building blocks.
def sylvester64(n: int) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix by the recursion H_2m = [[H, H], [H, -H]], float64."""
    assert n & (n - 1) == 0
    h = torch.tensor([[1.0]], dtype=torch.float64)
    size = 1
    while size < n:
        top = torch.cat([h, h], dim=1)
        bottom = torch.cat([h, -h], dim=1)
        h = torch.cat([top, bottom], dim=0)
        size *= 2
    return h / math.sqrt(n)


def inv_freqs64(rope_dim: int = 64, theta: float = 10000.0) -> torch.Tensor:
    return torch.tensor([theta ** (-(2.0 * i) / rope_dim) for i in range(rope_dim // 2)], dtype=torch.float64)


def cos_sin64(positions: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ang = positions.double()[:, None] * freqs[None, :]
    return torch.cos(ang), torch.sin(ang)


def rope_neox64(x: torch.Tensor, positions: torch.Tensor, offset: int = 0, rope_dim: int = 64,
                freqs: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, ..., D] float64: dims offset+i and offset+i+rope_dim/2 rotate together by angle pos * f_i."""
    half = rope_dim // 2
    cos, sin = cos_sin64(positions, inv_freqs64(rope_dim) if freqs is None else freqs)
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    out = x.clone()
    a = x[..., offset:offset + half]
    b = x[..., offset + half:offset + rope_dim]
    out[..., offset:offset + half] = a * cos - b * sin
    out[..., offset + half:offset + rope_dim] = b * cos + a * sin
    return out


def rope_interleaved64(x: torch.Tensor, positions: torch.Tensor, offset: int = 64, rope_dim: int = 64) -> torch.Tensor:
    """x [T, ..., D] float64: dims offset+2i and offset+2i+1 rotate together by angle pos * f_i."""
    cos, sin = cos_sin64(positions, inv_freqs64(rope_dim))
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    out = x.clone()
    for i in range(rope_dim // 2):
        a = x[..., offset + 2 * i]
        b = x[..., offset + 2 * i + 1]
        out[..., offset + 2 * i] = a * cos[..., i] - b * sin[..., i]
        out[..., offset + 2 * i + 1] = b * cos[..., i] + a * sin[..., i]
    return out


def fp8_bound(x_ref: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-element dequantization error bound (see the module docstring); scale broadcasts against x_ref."""
    return 2.0 ** -4 * x_ref.abs() + 2.0 ** -10 * scale + 2.0 ** -20 * x_ref.abs()


def is_power_of_two(t: torch.Tensor) -> torch.Tensor:
    mant, _ = torch.frexp(t.double())
    return (mant == 0.5) & (t > 0)


def random_fp8(shape, g: torch.Generator, std: float = 8.0, fp8=FN) -> torch.Tensor:
    """randn -> fp8 (clamped to the fp8 range so the cast never makes NaN)."""
    x = torch.randn(*shape, generator=g) * std
    return x.clamp(-FP8_MAX[fp8], FP8_MAX[fp8]).to(fp8)


def layernorm64(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)  # biased variance, as LayerNorm
    return (x - mean) / torch.sqrt(var + eps) * w.double() + b.double()


def rmsnorm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w.double()


def bf16_ulp(ref: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers (8 significant bits) at the magnitude of ref (float64)."""
    _, exp = torch.frexp(ref.abs().clamp_min(2.0 ** -126))
    return torch.ldexp(torch.ones_like(ref), exp - 8)


# ------------------------------------------------------------------------------------------------------------
# Hadamard
def test_hadamard_matrix_orthonormal_and_sylvester():
    h = hadamard_matrix(128, torch.device("cpu"))
    assert h.shape == (128, 128) and h.dtype == torch.float32
    hd = h.double()
    # fp32 entries of magnitude 128**-0.5: each product rounds at 2**-24 relative, 128 terms -> << 1e-6.
    assert torch.allclose(hd @ hd.T, torch.eye(128, dtype=torch.float64), atol=1e-6, rtol=0)
    # 128**-0.5 is irrational in binary: the fp32 entry is within half an fp32 ulp (~2.2e-9 here) of it.
    assert torch.all((hd.abs() - 128 ** -0.5).abs() < 1e-8)
    assert torch.equal(hd.abs() > 0, torch.ones_like(hd, dtype=torch.bool))
    mine = sylvester64(128)
    assert torch.allclose(mine @ mine.T, torch.eye(128, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.equal(torch.sign(hd), torch.sign(mine))
    assert (hd - mine).abs().max().item() < 1e-8


# ------------------------------------------------------------------------------------------------------------
# RoPE tables and YaRN
def test_cos_sin_table_matches_float64_formula():
    max_pos = 1000
    table = cos_sin_table(64, max_pos, 10000.0, None)
    assert table.shape == (max_pos, 64) and table.dtype == torch.float32
    cos, sin = cos_sin64(torch.arange(max_pos), inv_freqs64(64))
    ref = torch.cat([cos, sin], dim=1)
    # Values in [-1, 1] rounded once to fp32: error <= 2**-25 (half an ulp at 1); 1e-7 leaves room for the
    # last bit of a float64 angle computed in another order.
    assert (table.double() - ref).abs().max().item() < 1e-7


YARN_DS_V3 = YarnScaling(factor=40.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0)


def _correction_dim(rotations: float, dim: int = 64, orig: int = 4096, theta: float = 10000.0) -> float:
    """The pair index whose wavelength completes `rotations` turns within the original context."""
    return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def test_yarn_frequencies_deepseek_v3():
    dim, theta = 64, 10000.0
    freqs = rope_frequencies(dim, theta, YARN_DS_V3)
    assert freqs.shape == (32,) and freqs.dtype == torch.float64
    base = inv_freqs64(dim, theta)
    low = max(math.floor(_correction_dim(32.0)), 0)
    high = min(math.ceil(_correction_dim(1.0)), dim - 1)
    assert (low, high) == (10, 23)  # 10.47 -> 10, 22.51 -> 23 for the V3 numbers
    ratio = freqs / base
    # float64 throughout: 1e-12 relative is many ulps of slack, far from any real formula difference.
    assert torch.allclose(ratio[:low + 1], torch.ones(low + 1, dtype=torch.float64), rtol=1e-12, atol=0)
    assert torch.allclose(ratio[high:], torch.full((32 - high,), 1 / 40, dtype=torch.float64), rtol=1e-12, atol=0)
    mid = ratio[low:high + 1]
    assert torch.all(mid[1:] < mid[:-1]), "the ramp between low and high must strictly decrease"
    # Exactly the linear ramp: keep = 1 - (i - low) / (high - low) clamped to [0, 1].
    i = torch.arange(32, dtype=torch.float64)
    ramp = ((i - low) / (high - low)).clamp(0, 1)
    expect = base / 40 * ramp + base * (1 - ramp)
    assert torch.allclose(freqs, expect, rtol=1e-12, atol=0)
    # The frequencies are the model's, not the table's: a table shorter than the original window is scaled too
    # (DeepSeek-V4's rule, original_seq_len > 0; V3.2's max_seq_len 163840 > 4096 gives the same).
    for rows in (3000, 5000):
        table = cos_sin_table(dim, rows, theta, YARN_DS_V3)
        ref = torch.cat(cos_sin64(torch.arange(rows), expect), 1)
        assert (table.double() - ref).abs().max().item() < 1e-7  # fp32 rounding of values in [-1, 1]
    assert torch.allclose(rope_frequencies(dim, theta, None), base, rtol=1e-12, atol=0)


# ------------------------------------------------------------------------------------------------------------
# q_prologue: RoPE layout, Hadamard, fp8 quant and the folded q scale
LAYOUTS = [pytest.param(0, False, id="neox_first64_v32"), pytest.param(64, True, id="interleaved_last64_v4")]


def _rope_oracle(x: torch.Tensor, positions: torch.Tensor, offset: int, interleaved: bool) -> torch.Tensor:
    return rope_interleaved64(x, positions, offset) if interleaved else rope_neox64(x, positions, offset)


@pytest.mark.parametrize("ue8m0", [False, True], ids=["plain_scale", "ue8m0"])
@pytest.mark.parametrize("offset,interleaved", LAYOUTS)
def test_q_prologue_rope_hadamard_quant(offset, interleaved, ue8m0):
    g = gen(11 + offset + ue8m0)
    t, h, d, max_pos = 7, 4, 128, 512
    q = (torch.randn(t, h, d, generator=g) * 2.0).to(torch.bfloat16)
    positions = torch.randint(1, max_pos, (t,), generator=g)
    hw = torch.randn(t, h, generator=g)
    hw = (torch.sign(hw) * (0.1 + hw.abs())).to(torch.bfloat16)  # never near 0: q_scale is recovered by division
    weight_scale = h ** -0.5 * d ** -0.5
    table = cos_sin_table(64, max_pos, 10000.0, None)
    q_fp8, weights = ops.q_prologue(q, positions, table, hw, weight_scale, rope_offset=offset,
                                    interleaved=interleaved, ue8m0=ue8m0, fp8_dtype=FN)
    assert q_fp8.shape == (t, h, d) and q_fp8.dtype == FN
    assert weights.shape == (t, h) and weights.dtype == torch.float32

    # The q scale, recovered from the folded weights (two fp32 roundings: ~2.4e-7 relative).
    q_scale = weights.double() / (hw.double() * weight_scale)
    rot = _rope_oracle(q.double(), positions, offset, interleaved)
    x_ref = rot @ sylvester64(d)  # row vector times H, H symmetric
    amax = x_ref.abs().amax(dim=-1)
    plain = amax.clamp_min(1e-4) / 448.0
    # The library's x is fp32 (rope + 128-term matmul): amax differs by ~1e-6 relative; 1e-5 is safe.
    if ue8m0:
        snapped = torch.exp2(torch.round(torch.log2(q_scale)))
        assert torch.allclose(q_scale, snapped, rtol=1e-6, atol=0)
        assert torch.all(snapped >= plain * (1 - 1e-5)) and torch.all(snapped < 2 * plain * (1 + 1e-5))
    else:
        assert torch.allclose(q_scale, plain, rtol=1e-5, atol=0)

    deq = q_fp8.double() * q_scale[..., None]
    # Rotated domain, per element: the fp8 bound plus the fp32 path error (<= 1e-5 * amax, generous).
    slack = 1e-5 * amax[..., None]
    err = (deq - x_ref).abs()
    assert torch.all(err <= fp8_bound(x_ref, q_scale[..., None]) + slack), float((err - fp8_bound(
        x_ref, q_scale[..., None])).max())

    # Undo the Hadamard with our own matrix: H orthonormal keeps the error's 2-norm, so per head
    # ||back - rope(q)||_2 <= 2**-4 * ||rope(q)||_2 + sqrt(128) * 2**-10 * s (+ slack).
    back = deq @ sylvester64(d).T
    head_err = (back - rot).norm(dim=-1)
    bound = 2.0 ** -4 * rot.norm(dim=-1) + math.sqrt(d) * 2.0 ** -10 * q_scale + math.sqrt(d) * 1e-5 * amax
    assert torch.all(head_err <= bound)
    untouched = slice(64, 128) if offset == 0 else slice(0, 64)
    assert torch.all((back[..., untouched] - q.double()[..., untouched]).norm(dim=-1) <= bound)
    # The test has teeth: the other RoPE layout, or no RoPE, is far outside the bound.
    wrong = _rope_oracle(q.double(), positions, offset, not interleaved)
    assert (back - wrong).norm() > 4 * bound.norm()
    assert (back - q.double()).norm() > 4 * bound.norm()


# ------------------------------------------------------------------------------------------------------------
# quant_fp8_groups
def _grouped_input(shape, g: torch.Generator) -> torch.Tensor:
    """bf16 randn with per-row magnitudes over 6 decades, plus one tiny group (all |x| < 1e-4)."""
    x = torch.randn(*shape, generator=g)
    mags = 10.0 ** (torch.rand(shape[0], generator=g) * 6 - 3)
    x = x * mags.reshape(-1, *([1] * (len(shape) - 1)))
    flat = x.reshape(shape[0], -1)
    flat[1, :128] = torch.randn(128, generator=g) * 1e-6  # first group of row 1: amax << 1e-4
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("fp8", [FN, FNUZ], ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("ue8m0", [False, True], ids=["plain_scale", "ue8m0"])
@pytest.mark.parametrize("shape", [(6, 1536), (5, 4, 128)], ids=["T_1536", "T_H_128"])
def test_quant_fp8_groups_round_trip(shape, ue8m0, fp8):
    g = gen(100 * len(shape) + 10 * ue8m0 + (fp8 == FNUZ))
    x = _grouped_input(shape, g)
    x_fp8, scales = ops.quant_fp8_groups(x, 128, ue8m0=ue8m0, fp8_dtype=fp8)
    fmax = FP8_MAX[fp8]
    assert x_fp8.dtype == fp8 and x_fp8.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (*shape[:-1], shape[-1] // 128)

    groups = x.double().reshape(*shape[:-1], shape[-1] // 128, 128)
    plain = groups.abs().amax(dim=-1).clamp_min(1e-4) / fmax
    if ue8m0:
        assert torch.all(is_power_of_two(scales))
        assert torch.all(scales.double() >= plain) and torch.all(scales.double() < 2 * plain)
    else:
        # amax of bf16 values is exact; one fp32 division: relative error <= 2**-24.
        assert torch.allclose(scales.double(), plain, rtol=1e-6, atol=0)
    # The tiny group used the 1e-4 clamp (fp32(1e-4) / fmax, within fp32 rounding).
    tiny = scales.reshape(shape[0], -1)[1, 0].double()
    want = 1e-4 / fmax
    if ue8m0:
        assert tiny.item() == 2.0 ** math.ceil(math.log2(want))
    else:
        assert abs(tiny.item() / want - 1) < 1e-6

    q = x_fp8.double().reshape(groups.shape)
    assert torch.isfinite(q).all() and q.abs().max().item() <= fmax
    s = scales.double()[..., None]
    err = (q * s - groups).abs()
    assert torch.all(err <= fp8_bound(groups, s))


def test_quant_ue8m0_scale_never_below_plain_scale_fp32_input():
    # amax / 448 = 2**-7 * (1 + ~1.2e-7): exactly representable just above 2**-7 in fp32. ceil(log2(.)) = -6, so
    # the contract's s = 2**ceil(log2(amax / 448)) is 2**-6; fp32 log2 returns exactly -7.0 and gives 2**-7.
    amax = float(torch.nextafter(torch.tensor(3.5), torch.tensor(4.0)))
    x = torch.randn(2, 128, generator=gen(5)).clamp(-3, 3)
    x[:, 7] = amax
    _, s_ue8m0 = ops.quant_fp8_groups(x, 128, ue8m0=True, fp8_dtype=FN)
    plain = amax / 448.0
    assert plain > 2.0 ** -7
    assert s_ue8m0[0, 0].item() == 2.0 ** math.ceil(math.log2(plain))  # 2**-6


# ------------------------------------------------------------------------------------------------------------
# rmsnorm_quant_fp8
@pytest.mark.parametrize("fp8", [FN, FNUZ], ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("ue8m0", [False, True], ids=["plain_scale", "ue8m0"])
def test_rmsnorm_quant_fp8(ue8m0, fp8):
    g = gen(21 + ue8m0)
    t, n, eps = 5, 1536, 1e-6
    x = (torch.randn(t, n, generator=g) * 3.0).to(torch.bfloat16)
    w = (1.0 + 0.2 * torch.randn(n, generator=g)).to(torch.bfloat16)
    normed, qa = ops.rmsnorm_quant_fp8(x, w, eps, 128, ue8m0=ue8m0, fp8_dtype=fp8)
    assert normed.dtype == torch.bfloat16 and normed.shape == (t, n)
    ref = rmsnorm64(x, w, eps)
    # fp32 compute then one rounding to bf16: within one bf16 ulp of the float64 value.
    assert torch.all((normed.double() - ref).abs() <= bf16_ulp(ref))
    # The fp8 copy is exactly the group quant of the returned bf16 tensor.
    data, scales = ops.quant_fp8_groups(normed, 128, ue8m0=ue8m0, fp8_dtype=fp8)
    assert qa.data.dtype == fp8 and torch.equal(qa.data.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(qa.scales, scales)
    lay = qa.layout
    assert (lay.rows, lay.group_size, lay.ue8m0, lay.fp8_dtype) == (t, 128, ue8m0, fp8)
    fp8_data, fp8_scales, fp8_layout = qa  # the documented unpacking
    assert fp8_layout is lay and fp8_data is qa.data and fp8_scales is qa.scales


# ------------------------------------------------------------------------------------------------------------
# gemm_fp8_blockscale
def _expand_scales64(a_scales, b_scales, m, n, kdim):
    a_full = torch.empty(m, kdim, dtype=torch.float64)
    for j in range(kdim):
        a_full[:, j] = a_scales[:, j // 128].double()
    b_full = torch.empty(n, kdim, dtype=torch.float64)
    for i in range(n):
        for j0 in range(0, kdim, 128):
            b_full[i, j0:j0 + 128] = b_scales[i // 128, j0 // 128].double()
    return a_full, b_full


@pytest.mark.parametrize("m,n,kdim", [(5, 256, 384), (3, 200, 320), (4, 130, 130)],
                         ids=["M5_N256_K384", "ragged_N200_K320", "ragged_N130_K130"])
def test_gemm_fp8_blockscale(m, n, kdim):
    g = gen(m * 1000 + n + kdim)
    ga, gb = -(-kdim // 128), -(-n // 128)
    a = random_fp8((m, kdim), g, std=32.0)
    b = random_fp8((n, kdim), g, std=32.0)
    a_scales = torch.rand(m, ga, generator=g) * 0.02 + 1e-3
    b_scales = torch.rand(gb, ga, generator=g) * 0.02 + 1e-3
    a_full, b_full = _expand_scales64(a_scales, b_scales, m, n, kdim)
    ref = (a.double() * a_full) @ (b.double() * b_full).T
    out = ops.gemm_fp8_blockscale(a, a_scales, b, b_scales, torch.bfloat16)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    # bf16 output: one rounding at 2**-9 relative per element -> relative Frobenius error <= ~2e-3 < 1e-2.
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    out32 = ops.gemm_fp8_blockscale(a, a_scales, b, b_scales, torch.float32)
    # fp32 accumulation over K terms: error <= K * 2**-24 * sum|terms|; 1e-5 of sum|terms| covers K <= 384.
    abs_terms = (a.double().abs() * a_full) @ (b.double().abs() * b_full).T
    assert torch.all((out32.double() - ref).abs() <= 1e-5 * abs_terms + 1e-30)


# ------------------------------------------------------------------------------------------------------------
# Logits
def logits_oracle64(q, k, k_scale, w):
    """L[t, s] = k_scale[s] * sum_h w[t, h] * relu(q[t, h] . k[s]) and the same sum of |terms|, float64."""
    dots = torch.einsum("thd,sd->ths", q.double(), k.double()).clamp_min(0)
    val = torch.einsum("ths,th->ts", dots, w.double()) * k_scale.double()[None, :]
    mag = torch.einsum("ths,th->ts", dots, w.double().abs()) * k_scale.double()[None, :]
    return val, mag


def _check_logits(out, ref, mag, visible):
    assert out.dtype == torch.float32
    assert torch.equal(torch.isneginf(out), ~visible), "-inf exactly outside the visible range"
    assert torch.isfinite(out[visible]).all()
    # fp32 accumulation over D=128 products and H heads: relative error ~1e-7 per op, well under 1e-5 of the
    # row's largest sum of |terms| (the sum of |terms| rather than |L| because weights have both signs).
    row_max = torch.where(visible, mag, torch.zeros_like(mag)).amax(dim=1, keepdim=True)
    diff = torch.where(visible, (out.double() - ref).abs(), torch.zeros_like(ref))
    assert torch.all(diff <= 1e-5 * row_max)


def test_ragged_mqa_logits():
    g = gen(31)
    s_rows, h, d, n = 9, 8, 128, 150
    q = random_fp8((s_rows, h, d), g)
    k = random_fp8((n, d), g)
    k_scale = torch.rand(n, generator=g) * 0.5 + 0.01
    w = torch.randn(s_rows, h, generator=g)
    ks = torch.randint(0, n + 1, (s_rows,), generator=g)
    ke = ks + (torch.rand(s_rows, generator=g) * (n + 1 - ks)).long()
    ks[0], ke[0] = 0, n  # a full row
    ks[1], ke[1] = 40, 40  # an empty row
    ks[2], ke[2] = 149, 150  # one key
    ks, ke = ks.to(torch.int32), ke.to(torch.int32)
    out = ops.ragged_mqa_logits(q, k, k_scale, w, ks, ke)
    assert out.shape == (s_rows, n)
    ref, mag = logits_oracle64(q, k, k_scale, w)
    cols = torch.arange(n)
    visible = (cols[None, :] >= ks[:, None].long()) & (cols[None, :] < ke[:, None].long())
    _check_logits(out, ref, mag, visible)


def _build_paged(g, seq_lens, next_n, h=8, num_pages=9, max_pages=4):
    """Random keys written byte by byte into a cache full of random bytes, random non-contiguous block table."""
    b = len(seq_lens)
    cache = IndexKCache.allocate(num_pages)
    flat = cache.data.view(num_pages, PAGE_BYTES)
    flat.copy_(torch.randint(0, 256, flat.shape, generator=g, dtype=torch.uint8))
    perm = torch.randperm(num_pages, generator=g).tolist()
    table = torch.full((b, max_pages), -1, dtype=torch.int32)
    keys, scales = [], []
    for r, length in enumerate(seq_lens):
        pages = -(-length // PAGE)
        table[r, :pages] = torch.tensor([perm.pop() for _ in range(pages)], dtype=torch.int32)
        kr = random_fp8((length, 128), g)
        sr = torch.rand(length, generator=g) * 0.5 + 0.01
        for pos in range(length):
            slot = int(table[r, pos // PAGE]) * PAGE + pos % PAGE
            page, row = slot // PAGE, slot % PAGE
            flat[page, row * 128:(row + 1) * 128] = kr[pos].view(torch.uint8)
            flat[page, SCALE_BASE + row * 4:SCALE_BASE + row * 4 + 4] = sr[pos:pos + 1].view(torch.uint8)
        keys.append(kr)
        scales.append(sr)
    seq = torch.tensor(seq_lens)
    ctx = (seq[:, None] - next_n + torch.arange(next_n)[None, :] + 1).to(torch.int32)  # [B, next_n]
    q = random_fp8((b, next_n, h, 128), g)
    w = torch.randn(b * next_n, h, generator=g)
    return cache, table, keys, scales, ctx, q, w


@pytest.mark.parametrize("next_n", [1, 2], ids=["next_n1", "next_n2"])
def test_paged_mqa_logits(next_n):
    g = gen(41 + next_n)
    seq_lens = [70, 131, 5]
    max_ctx = 200
    cache, table, keys, scales, ctx, q, w = _build_paged(g, seq_lens, next_n)
    out = ops.paged_mqa_logits(q, cache.data, w, ctx, table, max_ctx)
    b, h = len(seq_lens), q.shape[2]
    assert out.shape == (b * next_n, max_ctx)
    ref = torch.zeros(b * next_n, max_ctx, dtype=torch.float64)
    mag = torch.zeros_like(ref)
    visible = torch.zeros(b * next_n, max_ctx, dtype=torch.bool)
    for r in range(b):
        length = seq_lens[r]
        val, m = logits_oracle64(q[r], keys[r], scales[r], w[r * next_n:(r + 1) * next_n])
        ref[r * next_n:(r + 1) * next_n, :length] = val
        mag[r * next_n:(r + 1) * next_n, :length] = m
        for nn in range(next_n):
            visible[r * next_n + nn, :int(ctx[r, nn])] = True
    _check_logits(out, ref, mag, visible)


# ------------------------------------------------------------------------------------------------------------
# Top-k
def topk_oracle(row: list[float], start: int, end: int, k: int) -> list[int]:
    """Request-local indices of the k best visible columns, key (value desc, index asc)."""
    cols = sorted(range(start, end), key=lambda c: (-row[c], c))[:k]
    return [c - start for c in cols]


def _check_topk_rows(out, logits, k, starts, ends):
    assert out.dtype == torch.int32 and out.shape == (logits.shape[0], k)
    for r in range(logits.shape[0]):
        st, en = int(starts[r]), int(ends[r])
        want = topk_oracle(logits[r].double().tolist(), st, en, k)
        got = out[r].tolist()
        count = len(want)
        assert sorted(got[:count]) == sorted(want), f"row {r}"
        assert got[count:] == [-1] * (k - count), f"row {r}: padding"


def test_topk_short_rows_and_full_rows():
    g = gen(51)
    k = 16
    logits = torch.randn(5, 40, generator=g)
    ends = torch.tensor([5, 0, 16, 40, 17], dtype=torch.int32)
    out = ops.topk_indices(logits, k, ends)
    _check_topk_rows(out, logits, k, torch.zeros(5, dtype=torch.int32), ends)
    assert sorted(out[0, :5].tolist()) == [0, 1, 2, 3, 4] and out[0, 5:].eq(-1).all()
    assert out[1].eq(-1).all()
    assert sorted(out[2].tolist()) == list(range(16))


def test_topk_k_larger_than_columns():
    g = gen(52)
    logits = torch.randn(3, 10, generator=g)
    ends = torch.tensor([10, 3, 7], dtype=torch.int32)
    out = ops.topk_indices(logits, 32, ends)
    _check_topk_rows(out, logits, 32, torch.zeros(3, dtype=torch.int32), ends)


def test_topk_ties_lower_index_wins_with_starts():
    g = gen(53)
    r, c, k = 6, 100, 20
    # ReLU-like rows: most values exactly 0, the rest on a 4-level grid: ties everywhere, k cuts through them.
    levels = torch.randint(0, 4, (r, c), generator=g).float() * 0.5
    logits = torch.where(torch.rand(r, c, generator=g) < 0.6, torch.zeros(r, c), levels)
    logits[0] = 0.0  # an all-zero row
    starts = torch.tensor([0, 3, 17, 50, 64, 99], dtype=torch.int32)
    ends = torch.tensor([100, 90, 40, 100, 80, 100], dtype=torch.int32)
    out = ops.topk_indices(logits, k, ends, starts)
    _check_topk_rows(out, logits, k, starts, ends)
    assert sorted(out[0].tolist()) == list(range(20))  # all zeros: the 20 lowest columns


def test_topk_starts_values_are_column_minus_start():
    logits = torch.full((2, 30), -5.0)
    logits[0, 12] = 3.0
    logits[0, 20] = 2.0
    logits[1, 29] = 1.0
    starts = torch.tensor([10, 25], dtype=torch.int32)
    ends = torch.tensor([30, 30], dtype=torch.int32)
    out = ops.topk_indices(logits, 2, ends, starts)
    assert out[0].tolist() in ([2, 10], [10, 2])
    assert out[1].tolist()[0] == 4 or out[1].tolist()[1] == 4


def test_topk_visible_minus_inf_with_starts():
    inf = float("-inf")
    logits = torch.tensor([[0.0, 0.0, inf, 1.0, inf]])
    out = ops.topk_indices(logits, 3, torch.tensor([5], dtype=torch.int32), torch.tensor([2], dtype=torch.int32))
    # Three visible columns (2, 3, 4) and k = 3: all of them, request-local 0, 1, 2.
    assert sorted(out[0].tolist()) == [0, 1, 2]


def _slots64(table, req, pos):
    return -1 if pos < 0 else int(table[req, pos // PAGE]) * PAGE + pos % PAGE


@pytest.mark.parametrize("with_row_request", [True, False], ids=["row_request", "row_is_request"])
def test_topk_slot_transform(with_row_request):
    g = gen(54 + with_row_request)
    b, max_pages, k = 3, 4, 24
    table = torch.randperm(64, generator=g)[:b * max_pages].reshape(b, max_pages).to(torch.int32)
    if with_row_request:
        r = 6
        row_request = torch.tensor([2, 0, 1, 1, 2, 0], dtype=torch.int32)
    else:
        r, row_request = b, None
    c = 300
    logits = torch.relu(torch.randn(r, c, generator=g))
    starts = torch.randint(0, 40, (r,), generator=g).to(torch.int32)
    widths = torch.tensor([256, 10, 130, 0, 200, 65][:r], dtype=torch.int32)
    ends = (starts + widths).clamp(max=c).to(torch.int32)
    kwargs = dict(block_table=table)
    if row_request is not None:
        kwargs["row_request"] = row_request
    out = ops.topk_indices(logits, k, ends, starts, **kwargs)
    assert out.dtype == torch.int32 and out.shape == (r, k)
    for i in range(r):
        req = int(row_request[i]) if row_request is not None else i
        local = topk_oracle(logits[i].double().tolist(), int(starts[i]), int(ends[i]), k)
        want = sorted(_slots64(table, req, p) for p in local)
        got = out[i].tolist()
        assert sorted(got[:len(local)]) == want, f"row {i}"
        assert got[len(local):] == [-1] * (k - len(local)), f"row {i}: -1 stays -1"


@pytest.mark.parametrize("next_n", [1, 2], ids=["next_n1", "next_n2"])
def test_lightning_indexer_equals_topk_of_paged_logits(next_n):
    g = gen(61 + next_n)
    seq_lens = [70, 131, 5]
    max_ctx, k = 192, 32
    cache, table, _, _, ctx, q, w = _build_paged(g, seq_lens, next_n)
    out = ops.lightning_indexer(q, cache.data, w, ctx, table, max_ctx, k)
    logits = ops.paged_mqa_logits(q, cache.data, w, ctx, table, max_ctx)
    ends = ctx.reshape(-1)
    via_topk = ops.topk_indices(logits, k, ends)
    assert out.shape == (len(seq_lens) * next_n, k) and out.dtype == torch.int32
    for r in range(out.shape[0]):
        assert sorted(out[r].tolist()) == sorted(via_topk[r].tolist()), f"row {r}"
    # And both equal our own oracle on the (fp32) logits.
    _check_topk_rows(out, logits, k, torch.zeros_like(ends), ends)


# ------------------------------------------------------------------------------------------------------------
# k_prologue_store: cache byte layout and the stored values
K_CASES = [
    pytest.param("layernorm", 0, False, False, id="layernorm_neox_first64"),
    pytest.param("layernorm", 0, False, True, id="layernorm_neox_first64_ue8m0"),
    pytest.param("rmsnorm", 0, False, False, id="rmsnorm_neox_first64"),
    pytest.param("none", 64, True, False, id="none_interleaved_last64"),
]


@pytest.mark.parametrize("norm,offset,interleaved,ue8m0", K_CASES)
def test_k_prologue_store_bytes_and_values(norm, offset, interleaved, ue8m0):
    g = gen(71 + offset + ue8m0 + len(norm))
    num_pages, t, max_pos, eps = 5, 12, 512, 1e-6
    cache = IndexKCache.allocate(num_pages)
    flat = cache.data.view(num_pages, PAGE_BYTES)
    flat.copy_(torch.randint(0, 256, flat.shape, generator=g, dtype=torch.uint8))
    before = flat.clone()
    k = (torch.randn(t, 128, generator=g) * 3.0 + 0.5).to(torch.bfloat16)
    w = (1.0 + 0.2 * torch.randn(128, generator=g)).to(torch.bfloat16)
    bias = (0.1 * torch.randn(128, generator=g)).to(torch.bfloat16)
    positions = torch.randint(1, max_pos, (t,), generator=g)
    slots = torch.randperm(num_pages * PAGE, generator=g)[:t]
    slots[3] = -1
    slots[8] = -1
    slots[0] = num_pages * PAGE - 1  # the very last slot of the cache
    table = cos_sin_table(64, max_pos, 10000.0, None)
    ops.k_prologue_store(k, w if norm != "none" else None, bias if norm == "layernorm" else None, eps, positions,
                         table, cache.data, slots, rope_offset=offset, interleaved=interleaved, ue8m0=ue8m0,
                         fp8_dtype=FN, norm=norm)

    # float64 oracle: norm -> RoPE -> Hadamard -> amax scale.
    if norm == "layernorm":
        x = layernorm64(k, w, bias, eps)
    elif norm == "rmsnorm":
        x = rmsnorm64(k, w, eps)
    else:
        x = k.double()
    x = _rope_oracle(x, positions, offset, interleaved) @ sylvester64(128)
    amax = x.abs().amax(dim=-1)
    plain = amax.clamp_min(1e-4) / 448.0

    touched = torch.zeros_like(flat, dtype=torch.bool)
    for i in range(t):
        slot = int(slots[i])
        if slot < 0:
            continue
        page, row = slot // PAGE, slot % PAGE
        key_bytes = flat[page, row * 128:(row + 1) * 128]
        scale_bytes = flat[page, SCALE_BASE + row * 4:SCALE_BASE + row * 4 + 4]
        touched[page, row * 128:(row + 1) * 128] = True
        touched[page, SCALE_BASE + row * 4:SCALE_BASE + row * 4 + 4] = True
        scale = scale_bytes.clone().view(torch.float32).double()[0]
        key = key_bytes.clone().view(FN).double()
        if ue8m0:
            assert bool(is_power_of_two(scale.reshape(1)))
            assert plain[i] * (1 - 1e-5) <= scale < 2 * plain[i] * (1 + 1e-5)
        else:
            # fp32 LayerNorm / rope / matmul against float64: amax agrees to ~1e-6; 1e-5 is safe.
            assert abs(scale / plain[i] - 1) < 1e-5, f"token {i}"
        assert key.abs().max() <= 448.0
        err = (key * scale - x[i]).abs()
        assert torch.all(err <= fp8_bound(x[i], scale) + 1e-5 * amax[i]), f"token {i}"
    assert torch.equal(flat[~touched], before[~touched]), "bytes outside the written rows changed"
    assert int(touched.sum()) == 132 * int((slots >= 0).sum())
