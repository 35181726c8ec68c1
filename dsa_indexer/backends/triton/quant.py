"""Triton fp8 group quantization: `quant_fp8_groups` and the fused `rmsnorm_quant_fp8`.

Same contract as the reference (`backends/reference/kernels.py`): per group of ``group_size`` elements,
``s = max(amax, 1e-4) / fp8_max`` (rounded up to a power of two when ``ue8m0``), ``q = clamp(x / s)`` cast to
fp8 (e4m3fn, max 448, or e4m3fnuz, max 224). Both kernels are bandwidth bound: one pass over the input, and
few instructions per element (at ~4.3 TB/s, bf16 in and fp8 out, an H200 issues only ~20 instructions per
element in the same time).

The ``@triton.jit`` helpers here are shared with `prologue.py` and `gemm.py`. Numerical details that make the
kernels match the reference bit for bit:

* ``x / s`` must be the IEEE quotient (Triton lowers a plain fp32 ``/`` to the approximate ``div.full.f32`` on
  NVIDIA, and ``div_rn`` per element costs ~10 instructions). `div_by_scale` takes the correctly rounded
  reciprocal once per group and corrects ``x * (1/s)`` with one FMA residual step, which gives the correctly
  rounded quotient (Markstein's theorem; checked bit-exact against IEEE division on 16M random cases,
  signed zeros included): 3 instructions per element.
* The ue8m0 power of two is taken from the fp32 bits (exact ``2**ceil(log2(s))``), not from ``log2``.
* fp32 -> fp8 / bf16 casts round to nearest even on the GPU (``cvt.rn``). The Triton 3.9 interpreter does
  not (fp8 casts lose the carry when the mantissa rounds up into the next binade; bf16 casts truncate), so
  under ``TRITON_INTERPRET=1`` the kernels round in software first (``INTERPRET`` constexpr, see
  `interpreted`) and the cast only reinterprets an exactly representable value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_options, wait_for_predecessor

# Smallest normal exponent of the fp8 formats: e4m3fn has bias 7, e4m3fnuz bias 8. Below it the fp8 grid is
# uniform (subnormals), spacing 2**(MIN_EXP - 3).
_FP8_MIN_EXP = {torch.float8_e4m3fn: -6, torch.float8_e4m3fnuz: -7}


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """448 for e4m3fn; 224 for e4m3fnuz (the range the AMD integrations use on gfx942)."""
    return 224.0 if fp8_dtype == torch.float8_e4m3fnuz else 448.0


def interpreted(kernel) -> bool:
    """True when ``kernel`` runs in the Triton CPU interpreter (TRITON_INTERPRET=1 when it was defined)."""
    return type(kernel).__name__ == "InterpretedFunction"


def fp8_min_exp(fp8_dtype: torch.dtype) -> int:
    if fp8_dtype not in _FP8_MIN_EXP:
        raise TypeError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e4m3fnuz, got {fp8_dtype}")
    return _FP8_MIN_EXP[fp8_dtype]


# Each fp8 format's launch constants, made once: a launcher reads them with one dict lookup and calls
# `fp8_constexprs` only for a dtype that is not there (to raise its error), so a warm decode step makes no Python
# call into this module for them.
FP8_CONSTEXPRS = {dtype: {"FMAX": fp8_max(dtype), "MIN_EXP": exp} for dtype, exp in _FP8_MIN_EXP.items()}


def fp8_constexprs(fp8_dtype: torch.dtype) -> dict:
    """``FMAX`` and ``MIN_EXP`` of ``fp8_dtype`` (a TypeError naming it for any other dtype); hot launchers inline
    the lookup as ``FP8_CONSTEXPRS.get(dtype) or fp8_constexprs(dtype)``."""
    return {"FMAX": fp8_max(fp8_dtype), "MIN_EXP": fp8_min_exp(fp8_dtype)}


# ----------------------------------------------------------------------------------------------------------------
# Shared device helpers
@triton.jit
def round_to_fp8_grid(x, MIN_EXP: tl.constexpr):
    """Round fp32 ``x`` (already clamped to the fp8 range) to the nearest e4m3 value, ties to even, in fp32.

    The quantum is 2**(e - 3) for a value in binade e (3 mantissa bits), and 2**(MIN_EXP - 3) below the
    smallest normal. ``(y + 2**23) - 2**23`` rounds ``y = |x| / quantum`` (< 16) to an integer with the
    hardware's round-to-nearest-even; the power-of-two scalings are exact. The sign is copied bitwise so
    that -0.0 stays -0.0 (torch keeps the sign of tiny negatives that round to zero).
    """
    bits = x.to(tl.int32, bitcast=True)
    mag = tl.abs(x)
    exp = ((mag.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    q_exp = tl.maximum(exp, MIN_EXP) - 3
    quantum = ((q_exp + 127) << 23).to(tl.float32, bitcast=True)
    inv_quantum = ((127 - q_exp) << 23).to(tl.float32, bitcast=True)
    rounded = ((mag * inv_quantum + 8388608.0) - 8388608.0) * quantum
    return (rounded.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def round_to_bf16_grid(x):
    """Round fp32 ``x`` to the nearest bf16 value (ties to even), returned as fp32 (exact in bf16)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_to_dtype_grid(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 ``x`` made ready for an exact cast to ``DTYPE`` under the interpreter (RNE in software); on the GPU
    the cast itself rounds to nearest even, so ``x`` is returned as is."""
    out = x
    if INTERPRET:
        if DTYPE == tl.bfloat16:
            out = round_to_bf16_grid(x)
    return out


@triton.jit
def abs_max(x, axis: tl.constexpr):
    """``max(|x|)`` along ``axis``, NaN when any element is NaN (``tl.max`` alone skips NaN, which would give a NaN
    group a finite scale and clamp its NaN to +-FMAX: a plausible wrong value instead of the reference's NaN)."""
    has_nan = tl.max((x != x).to(tl.int32), axis=axis) > 0
    return tl.where(has_nan, float("nan"), tl.max(tl.abs(x), axis=axis))


@triton.jit
def nan_maximum(a, b):
    """Elementwise max that keeps NaN (like torch.maximum)."""
    return tl.where(a != a, a, tl.where(b != b, b, tl.maximum(a, b)))


@triton.jit
def fp8_group_scale(amax, FMAX: tl.constexpr, UE8M0: tl.constexpr):
    """``(s, 1/s)`` with ``s = max(amax, 1e-4) / FMAX``, rounded up to a power of two when ``UE8M0``; a NaN amax
    (see `abs_max`) gives a NaN scale, as in the reference, so every score that uses the group is NaN.

    Both are correctly rounded (``div_rn``); they are per group, so their cost does not matter.
    """
    scale = tl.math.div_rn(nan_maximum(amax, 1e-4), FMAX)
    if UE8M0:
        # s is a positive normal fp32: 2**ceil(log2(s)) keeps s when its mantissa is zero, otherwise it is the
        # next power of two (exponent + 1, mantissa cleared).
        bits = scale.to(tl.int32, bitcast=True)
        exp_bits = bits & 0x7F800000
        bits = tl.where((bits & 0x7FFFFF) != 0, exp_bits + 0x800000, exp_bits)
        scale = tl.where(amax != amax, amax, bits.to(tl.float32, bitcast=True))
    return scale, tl.math.div_rn(1.0, scale)


@triton.jit
def div_by_scale(x, scale, inv_scale):
    """The correctly rounded ``x / scale`` (== IEEE division) given ``inv_scale = RN(1 / scale)``.

    ``q = RN(x * inv)`` is within 1 ulp of the quotient, the residual ``q * s - x`` is exact in one FMA, and
    ``RN(q - residual * inv)`` is the correctly rounded quotient (Markstein). The residual is negated (rather
    than ``x - q * s``) so that -0.0 / s stays -0.0 like IEEE division.
    """
    q = x * inv_scale
    residual = tl.fma(q, scale, -x)
    return tl.fma(-residual, inv_scale, q)


@triton.jit
def quantize_groups(x, scale, inv_scale, FMAX: tl.constexpr, MIN_EXP: tl.constexpr, INTERPRET: tl.constexpr):
    """``clamp(x / scale, -FMAX, FMAX)`` in fp32, ready for the cast to fp8 (``scale`` broadcasts)."""
    y = div_by_scale(x, scale, inv_scale)
    clamped = tl.minimum(tl.maximum(y, -FMAX), FMAX)
    if INTERPRET:
        clamped = round_to_fp8_grid(clamped, MIN_EXP)
    return tl.where(y != y, y, clamped)  # NaN stays NaN (min / max would turn it into a bound)


# ----------------------------------------------------------------------------------------------------------------
# quant_fp8_groups
@triton.jit
def _quant_groups_kernel(x_ptr, q_ptr, s_ptr, n_groups,
                         GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_G: tl.constexpr,
                         FMAX: tl.constexpr, MIN_EXP: tl.constexpr, UE8M0: tl.constexpr, INTERPRET: tl.constexpr,
                         PDL: tl.constexpr = False):
    wait_for_predecessor(PDL)
    # The input is viewed as [n_groups, GROUP] (groups never straddle rows since the row width is a multiple
    # of GROUP), so one flat tile of BLOCK_G groups covers several rows at once and stays contiguous in memory.
    pid = tl.program_id(0)
    groups = pid.to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    cols = tl.arange(0, GROUP_P2)
    gmask = groups < n_groups
    mask = gmask[:, None] & (cols[None, :] < GROUP)
    offs = groups[:, None] * GROUP + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scale, inv = fp8_group_scale(abs_max(x, 1), FMAX, UE8M0)
    q = quantize_groups(x, scale[:, None], inv[:, None], FMAX, MIN_EXP, INTERPRET)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + groups, scale, mask=gmask)


_QUANT_GROUPS_INTERPRETED = interpreted(_quant_groups_kernel)


def _quant_config(group_p2: int) -> tuple[int, int]:
    """(groups per program, num_warps): ~4K elements per program, 16-byte vector loads per thread."""
    block_g = max(1, 4096 // group_p2)
    return block_g, 4


def quant_fp8_groups(x: torch.Tensor, group_size: int = 128, ue8m0: bool = False,
                     fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group fp8 quantization along the last dim: ``(x_fp8 like x, scales [..., N // group_size] f32)``."""
    shape = x.shape
    xc = x.contiguous()
    n_groups = xc.numel() // group_size
    q = torch.empty(shape, dtype=fp8_dtype, device=x.device)
    scales = torch.empty((*shape[:-1], shape[-1] // group_size), dtype=torch.float32, device=x.device)
    if n_groups == 0:
        return q, scales
    group_p2 = triton.next_power_of_2(group_size)
    block_g, warps = _quant_config(group_p2)
    grid = (triton.cdiv(n_groups, block_g),)
    _quant_groups_kernel[grid](xc, q, scales, n_groups, GROUP=group_size, GROUP_P2=group_p2, BLOCK_G=block_g,
                               **(FP8_CONSTEXPRS.get(fp8_dtype) or fp8_constexprs(fp8_dtype)), UE8M0=bool(ue8m0),
                               INTERPRET=_QUANT_GROUPS_INTERPRETED, num_warps=warps,
                               **pdl_options(x.device))
    return q, scales


# ----------------------------------------------------------------------------------------------------------------
# rmsnorm_quant_fp8
@triton.jit
def _rmsnorm_quant_kernel(x_ptr, w_ptr, normed_ptr, q_ptr, s_ptr, n_rows, width, n_groups, eps,
                          GROUP: tl.constexpr, GROUP_P2: tl.constexpr, GROUPS_P2: tl.constexpr,
                          BLOCK_R: tl.constexpr, FMAX: tl.constexpr, MIN_EXP: tl.constexpr, UE8M0: tl.constexpr,
                          INTERPRET: tl.constexpr,
                          PDL: tl.constexpr = False):
    wait_for_predecessor(PDL)
    # A [BLOCK_R, groups, group] tile holds BLOCK_R whole rows: the RMS reduces over the last two axes, the
    # fp8 amax over the last one, with no reshape in between.
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.arange(0, GROUPS_P2)
    j = tl.arange(0, GROUP_P2)
    col_mask = (g[:, None] < n_groups) & (j[None, :] < GROUP)            # [G, J]
    cols = g[:, None] * GROUP + j[None, :]                               # [G, J]
    rmask = rows < n_rows
    mask = rmask[:, None, None] & col_mask[None, :, :]
    offs = rows[:, None, None] * width + cols[None, :, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)

    mean_sq = tl.math.div_rn(tl.sum(tl.sum(x * x, axis=2), axis=1), width.to(tl.float32))
    # Correctly rounded 1/sqrt (torch's CPU rsqrt is; the GPU approximations are a few ulp off).
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_sq + eps))
    normed = (x * rstd[:, None, None]) * w[None, :, :]
    # Round to the output dtype first: the fp8 copy must quantize exactly the tensor that is returned.
    normed = round_to_dtype_grid(normed, normed_ptr.dtype.element_ty, INTERPRET)
    normed = normed.to(normed_ptr.dtype.element_ty)
    tl.store(normed_ptr + offs, normed, mask=mask)

    normed = normed.to(tl.float32)
    scale, inv = fp8_group_scale(abs_max(normed, 2), FMAX, UE8M0)  # [R, G]
    q = quantize_groups(normed, scale[:, :, None], inv[:, :, None], FMAX, MIN_EXP, INTERPRET)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    s_offs = rows[:, None] * n_groups + g[None, :]
    tl.store(s_ptr + s_offs, scale, mask=rmask[:, None] & (g[None, :] < n_groups))


_RMSNORM_QUANT_INTERPRETED = interpreted(_rmsnorm_quant_kernel)


def _rmsnorm_config(tile: int) -> tuple[int, int]:
    """(rows per program, num_warps) for a padded row of ``tile`` elements: >= 4K elements per program and
    <= 32 fp32 elements per thread (the row, the weight and the normed copy stay in registers)."""
    rows = max(1, 4096 // tile)
    warps = max(4, min(16, rows * tile // 1024))
    return rows, warps


def rmsnorm_quant_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int = 128, ue8m0: bool = False,
                      fp8_dtype: torch.dtype = torch.float8_e4m3fn
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused RMSNorm + fp8 group quant: ``(normed in x.dtype, fp8 of normed, scales [..., N // group_size])``.

    The fp8 copy is bit-identical to ``quant_fp8_groups(normed)``.
    """
    shape = x.shape
    width = shape[-1]
    xc = x.contiguous()
    n_rows = xc.numel() // width if width else 0
    n_groups = width // group_size
    normed = torch.empty(shape, dtype=x.dtype, device=x.device)
    q = torch.empty(shape, dtype=fp8_dtype, device=x.device)
    scales = torch.empty((*shape[:-1], n_groups), dtype=torch.float32, device=x.device)
    if n_rows == 0 or width == 0:
        return normed, q, scales
    group_p2 = triton.next_power_of_2(group_size)
    groups_p2 = triton.next_power_of_2(n_groups)
    block_r, warps = _rmsnorm_config(group_p2 * groups_p2)
    grid = (triton.cdiv(n_rows, block_r),)
    _rmsnorm_quant_kernel[grid](xc, weight.contiguous(), normed, q, scales, n_rows, width, n_groups, float(eps),
                                GROUP=group_size, GROUP_P2=group_p2, GROUPS_P2=groups_p2, BLOCK_R=block_r,
                                **(FP8_CONSTEXPRS.get(fp8_dtype) or fp8_constexprs(fp8_dtype)), UE8M0=bool(ue8m0),
                                INTERPRET=_RMSNORM_QUANT_INTERPRETED, num_warps=warps,
                                **pdl_options(x.device))
    return normed, q, scales
