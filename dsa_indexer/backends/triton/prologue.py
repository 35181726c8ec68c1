"""Triton q / k prologues of the indexer: (norm) + RoPE + Hadamard + fp8 quant (+ the index-K cache store).

`q_prologue` and `k_prologue_store` are each ONE kernel launch. A program owns BLOCK_M rows of 128 elements
(q: rows are (token, head) pairs of the flattened [T*H, 128] tensor; k: rows are tokens), held in registers as
four column quarters of 32 (separate [BLOCK_M, 32] tiles), and does:

1. (k only) LayerNorm / RMSNorm over the row, in fp32.
2. RoPE on dims ``[rope_offset, rope_offset + R)`` (NeoX: dim i pairs with i + R/2; interleaved: 2i with 2i+1).
   For the model layouts the pairs are whole quarters (V3.2: dims 0-31 with 32-63) or register neighbours
   (V4: interleaved over the last 64 dims, a reshape + split), so RoPE is register math plus contiguous
   cos/sin loads. Any other layout takes a general path that re-reads each element's partner column from
   global memory (same cache lines: L1 hits) and norms it with the same row statistics.
3. The orthonormal Hadamard rotation ``x @ H128 / sqrt(128)``. Sylvester's H128 = H4 (x) H32: two butterfly
   stages across the quarters (elementwise fp32 adds), then each quarter times the +-1 matrix H32 (built in
   registers from the parity of ``popcount(i & j)``) on the tensor cores: 4x fewer dot FLOPs than a 128x128
   dot, which keeps the kernel memory bound. For fp32 accuracy with bf16 tensor-core inputs, each quarter is
   split exactly into three bf16 pieces ``x = hi + mid + lo`` (truncating the fp32 bits; 3 x 8 significant
   bits cover fp32's 24), and ``x @ H = hi @ H + mid @ H + lo @ H``: products with +-1 are exact and the dot
   accumulates in fp32, so the result is as accurate as an fp32 matmul (only the summation order differs from
   the reference). A single fp32 ``input_precision="ieee"`` dot would run on the FMA units instead, and
   "tf32x3" is NVIDIA-only.
4. Per-row fp8 quant (shared helpers from `quant.py`). q: the scale is folded into the head weights.
   k: the fp8 bytes and the fp32 scale go into the paged cache (slot -1 = skip).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...contract.cache import PAGE_BYTES, PAGE_SIZE, page_views
from .pdl import pdl_options, wait_for_predecessor
from .quant import (FP8_CONSTEXPRS, abs_max, fp8_constexprs, fp8_group_scale, interpreted, nan_maximum,
                    quantize_groups, round_to_dtype_grid, round_to_fp8_grid)

HEAD_DIM = 128
_NORMS = {"none": 0, "layernorm": 1, "rmsnorm": 2}


# ----------------------------------------------------------------------------------------------------------------
# Norm + RoPE
@triton.jit
def _norm(x, cols, mean, rstd, w_ptr, b_ptr, NORM: tl.constexpr):
    """Apply the row statistics to columns ``cols`` of a tile: 0 none, 1 LayerNorm (w, b), 2 RMSNorm (w)."""
    out = x
    if NORM == 1:
        w = tl.load(w_ptr + cols).to(tl.float32)
        b = tl.load(b_ptr + cols).to(tl.float32)
        out = (x - mean[:, None]) * rstd[:, None] * w[None, :] + b[None, :]
    elif NORM == 2:
        w = tl.load(w_ptr + cols).to(tl.float32)
        out = x * rstd[:, None] * w[None, :]
    return out


@triton.jit
def _rope_pair(xa, xb, cs_row, rmask, FREQ0: tl.constexpr, QW: tl.constexpr, HALF: tl.constexpr):
    """NeoX RoPE of two whole quarters that pair up (xa: first-half dims, xb: their partners)."""
    f = FREQ0 + tl.arange(0, QW)
    cos = tl.load(cs_row + f[None, :], mask=rmask[:, None], other=1.0)
    sin = tl.load(cs_row + HALF + f[None, :], mask=rmask[:, None], other=0.0)
    return xa * cos - xb * sin, xb * cos + xa * sin


@triton.jit
def _rope_interleaved_quarter(x, cs_row, rmask, Q: tl.constexpr, QW: tl.constexpr, ROPE_OFF: tl.constexpr,
                              ROPE_DIM: tl.constexpr):
    """Interleaved (GPT-J) RoPE of quarter ``Q`` if it lies in the rotated range: the pairs (2i, 2i+1) are
    neighbours in registers, so a reshape + split gives both operands without another load."""
    out = x
    if Q * QW >= ROPE_OFF:
        if Q * QW < ROPE_OFF + ROPE_DIM:
            HALF: tl.constexpr = ROPE_DIM // 2
            f = (Q * QW - ROPE_OFF) // 2 + tl.arange(0, QW // 2)
            cos = tl.load(cs_row + f[None, :], mask=rmask[:, None], other=1.0)
            sin = tl.load(cs_row + HALF + f[None, :], mask=rmask[:, None], other=0.0)
            even, odd = tl.split(tl.reshape(x, [x.shape[0], QW // 2, 2]))
            out = tl.reshape(tl.join(even * cos - odd * sin, odd * cos + even * sin), [x.shape[0], QW])
    return out


@triton.jit
def _rope_plan(cols, ROPE_OFF: tl.constexpr, ROPE_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """General path, per column: (rotated?, partner column, sign of the partner term, cos/sin index).

    out[i] = x[i] * cos[f] + sign * x[partner] * sin[f]: NeoX pairs the first half with the second
    (a*cos - b*sin, b*cos + a*sin), interleaved pairs even i with i+1 the same way.
    """
    HALF: tl.constexpr = ROPE_DIM // 2
    i = cols - ROPE_OFF
    in_rope = (i >= 0) & (i < ROPE_DIM)
    i = tl.where(in_rope, i, 0)
    if INTERLEAVED:
        first = (i & 1) == 0
        partner = ROPE_OFF + (i ^ 1)
        freq = i >> 1
    else:
        first = i < HALF
        partner = ROPE_OFF + tl.where(first, i + HALF, i - HALF)
        freq = tl.where(first, i, i - HALF)
    partner = tl.where(in_rope, partner, cols)
    sign = tl.where(first, -1.0, 1.0)
    return in_rope, partner, sign, freq


@triton.jit
def _norm_rope_quarter_gather(x, row_ptr, cs_row, rmask, mean, rstd, w_ptr, b_ptr, Q: tl.constexpr,
                              QW: tl.constexpr, NORM: tl.constexpr, ROPE_OFF: tl.constexpr, ROPE_DIM: tl.constexpr,
                              INTERLEAVED: tl.constexpr):
    """General path: norm + RoPE of quarter ``Q``, re-reading the partner columns from global memory.

    Quarters outside the rotated range skip the partner and cos/sin loads (decided at compile time).
    """
    cols = Q * QW + tl.arange(0, QW)
    x = _norm(x, cols, mean, rstd, w_ptr, b_ptr, NORM)
    if Q * QW + QW > ROPE_OFF:
        if Q * QW < ROPE_OFF + ROPE_DIM:
            HALF: tl.constexpr = ROPE_DIM // 2
            in_rope, partner, sign, freq = _rope_plan(cols, ROPE_OFF, ROPE_DIM, INTERLEAVED)
            xp = tl.load(row_ptr + partner[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
            xp = _norm(xp, partner, mean, rstd, w_ptr, b_ptr, NORM)
            m = rmask[:, None] & in_rope[None, :]
            cos = tl.load(cs_row + freq[None, :], mask=m, other=1.0)
            sin = tl.load(cs_row + HALF + freq[None, :], mask=m, other=0.0)
            rotated = x * cos + (sign[None, :] * xp) * sin
            x = tl.where(in_rope[None, :], rotated, x)
    return x


@triton.jit
def _norm_rope_row(x0, x1, x2, x3, row_ptr, cs_row, rmask, mean, rstd, w_ptr, b_ptr, QW: tl.constexpr,
                   NORM: tl.constexpr, ROPE_MODE: tl.constexpr, ROPE_OFF: tl.constexpr, ROPE_DIM: tl.constexpr,
                   INTERLEAVED: tl.constexpr):
    """Norm + RoPE of a row held as four quarters; `_rope_mode` says which of three ways RoPE takes."""
    if ROPE_MODE == 0:
        x0 = _norm_rope_quarter_gather(x0, row_ptr, cs_row, rmask, mean, rstd, w_ptr, b_ptr, 0, QW, NORM,
                                       ROPE_OFF, ROPE_DIM, INTERLEAVED)
        x1 = _norm_rope_quarter_gather(x1, row_ptr, cs_row, rmask, mean, rstd, w_ptr, b_ptr, 1, QW, NORM,
                                       ROPE_OFF, ROPE_DIM, INTERLEAVED)
        x2 = _norm_rope_quarter_gather(x2, row_ptr, cs_row, rmask, mean, rstd, w_ptr, b_ptr, 2, QW, NORM,
                                       ROPE_OFF, ROPE_DIM, INTERLEAVED)
        x3 = _norm_rope_quarter_gather(x3, row_ptr, cs_row, rmask, mean, rstd, w_ptr, b_ptr, 3, QW, NORM,
                                       ROPE_OFF, ROPE_DIM, INTERLEAVED)
    else:
        c = tl.arange(0, QW)
        x0 = _norm(x0, c, mean, rstd, w_ptr, b_ptr, NORM)
        x1 = _norm(x1, QW + c, mean, rstd, w_ptr, b_ptr, NORM)
        x2 = _norm(x2, 2 * QW + c, mean, rstd, w_ptr, b_ptr, NORM)
        x3 = _norm(x3, 3 * QW + c, mean, rstd, w_ptr, b_ptr, NORM)
        if ROPE_MODE == 1:  # NeoX over whole quarters: which quarters pair depends on the offset and width
            HALF: tl.constexpr = ROPE_DIM // 2
            if ROPE_DIM == 4 * QW:
                x0, x2 = _rope_pair(x0, x2, cs_row, rmask, 0, QW, HALF)
                x1, x3 = _rope_pair(x1, x3, cs_row, rmask, QW, QW, HALF)
            elif ROPE_OFF == 0:
                x0, x1 = _rope_pair(x0, x1, cs_row, rmask, 0, QW, HALF)
            elif ROPE_OFF == QW:
                x1, x2 = _rope_pair(x1, x2, cs_row, rmask, 0, QW, HALF)
            else:
                x2, x3 = _rope_pair(x2, x3, cs_row, rmask, 0, QW, HALF)
        else:  # ROPE_MODE == 2: interleaved over whole quarters
            x0 = _rope_interleaved_quarter(x0, cs_row, rmask, 0, QW, ROPE_OFF, ROPE_DIM)
            x1 = _rope_interleaved_quarter(x1, cs_row, rmask, 1, QW, ROPE_OFF, ROPE_DIM)
            x2 = _rope_interleaved_quarter(x2, cs_row, rmask, 2, QW, ROPE_OFF, ROPE_DIM)
            x3 = _rope_interleaved_quarter(x3, cs_row, rmask, 3, QW, ROPE_OFF, ROPE_DIM)
    return x0, x1, x2, x3


def _rope_mode(rope_offset: int, rope_dim: int, interleaved: bool, dim: int = HEAD_DIM) -> int:
    """How the kernels apply RoPE (a compile-time choice).

    1: NeoX where whole quarters pair up (rotating 64 dims at offset 0/32/64, as V3.2; or all 128).
    2: interleaved over whole quarters (offset and width multiples of 32, as V4's last 64 dims).
    0: any other layout: the general partner-gather path.
    """
    quarter = dim // 4
    if rope_offset % quarter or rope_dim % quarter:
        return 0
    if interleaved:
        return 2
    if rope_dim in (2 * quarter, dim):
        return 1
    return 0


# ----------------------------------------------------------------------------------------------------------------
# Hadamard + quant
@triton.jit
def _dot_fp32(x, h, INTERPRET: tl.constexpr):
    """fp32-accurate ``x @ h`` for a +-1 matrix ``h`` (bf16), through three exact bf16 pieces of ``x``.

    Under the interpreter the pieces go through an exact fp32 "ieee" dot instead: its tl.dot multiplies the
    raw uint16 bits of bf16 operands (Triton 3.9). The split is the same in both.
    """
    # Exact split by truncation: each piece keeps the next 8 significant bits, so every piece is exactly a
    # bf16 value (the casts do not round) and hi + mid + lo == x.
    hi = (x.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
    rest = x - hi
    mid = (rest.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
    lo = rest - mid
    # Smallest pieces first so the larger partial sums absorb them.
    if INTERPRET:
        hf = h.to(tl.float32)
        acc = tl.dot(lo, hf, input_precision="ieee")
        acc = tl.dot(mid, hf, acc, input_precision="ieee")
        acc = tl.dot(hi, hf, acc, input_precision="ieee")
    else:
        acc = tl.dot(lo.to(tl.bfloat16), h)
        acc = tl.dot(mid.to(tl.bfloat16), h, acc)
        acc = tl.dot(hi.to(tl.bfloat16), h, acc)
    return acc


@triton.jit
def _hadamard_quarters(x0, x1, x2, x3, QW: tl.constexpr, INTERPRET: tl.constexpr):
    """The orthonormal Hadamard rotation of rows given as four column quarters ([BLOCK_M, QW] fp32 each).

    Sylvester's H_{4*QW} = H_4 (x) H_QW: output quarter j is ``(sum_i H_4[i, j] x_i) @ H_QW``. The H_4 part is
    two butterfly stages of elementwise adds; only the QW x QW part runs on the tensor cores.
    """
    tl.static_assert(QW <= 32, "the parity fold below covers 5 index bits")
    idx = tl.arange(0, QW)
    parity = idx[:, None] & idx[None, :]
    parity = parity ^ (parity >> 4)
    parity = parity ^ (parity >> 2)
    parity = parity ^ (parity >> 1)
    h = tl.where((parity & 1) == 0, 1.0, -1.0).to(tl.bfloat16)
    a0 = x0 + x1
    a1 = x0 - x1
    a2 = x2 + x3
    a3 = x2 - x3
    norm: tl.constexpr = 1.0 / (4 * QW) ** 0.5
    y0 = _dot_fp32(a0 + a2, h, INTERPRET) * norm
    y1 = _dot_fp32(a1 + a3, h, INTERPRET) * norm
    y2 = _dot_fp32(a0 - a2, h, INTERPRET) * norm
    y3 = _dot_fp32(a1 - a3, h, INTERPRET) * norm
    return y0, y1, y2, y3


@triton.jit
def _quant_quarters(y0, y1, y2, y3, FMAX: tl.constexpr, MIN_EXP: tl.constexpr, UE8M0: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """Per-row fp8 quant of a row held as four quarters: (q0..q3 ready for the fp8 cast, scale [BLOCK_M])."""
    amax = nan_maximum(nan_maximum(abs_max(y0, 1), abs_max(y1, 1)), nan_maximum(abs_max(y2, 1), abs_max(y3, 1)))
    scale, inv = fp8_group_scale(amax, FMAX, UE8M0)
    s = scale[:, None]
    r = inv[:, None]
    return (quantize_groups(y0, s, r, FMAX, MIN_EXP, INTERPRET), quantize_groups(y1, s, r, FMAX, MIN_EXP, INTERPRET),
            quantize_groups(y2, s, r, FMAX, MIN_EXP, INTERPRET), quantize_groups(y3, s, r, FMAX, MIN_EXP, INTERPRET),
            scale)


@triton.jit
def _load_quarters(row_ptr, rmask, QW: tl.constexpr):
    c = tl.arange(0, QW)
    x0 = tl.load(row_ptr + c[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    x1 = tl.load(row_ptr + (QW + c)[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(row_ptr + (2 * QW + c)[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    x3 = tl.load(row_ptr + (3 * QW + c)[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    return x0, x1, x2, x3


@triton.jit
def _store_quarters(row_ptr, mask, q0, q1, q2, q3, QW: tl.constexpr):
    c = tl.arange(0, QW)
    ty = row_ptr.dtype.element_ty
    tl.store(row_ptr + c[None, :], q0.to(ty), mask=mask[:, None])
    tl.store(row_ptr + (QW + c)[None, :], q1.to(ty), mask=mask[:, None])
    tl.store(row_ptr + (2 * QW + c)[None, :], q2.to(ty), mask=mask[:, None])
    tl.store(row_ptr + (3 * QW + c)[None, :], q3.to(ty), mask=mask[:, None])


# ----------------------------------------------------------------------------------------------------------------
# q_prologue
@triton.jit
def _q_prologue_kernel(q_ptr, pos_ptr, cs_ptr, hw_ptr, q_out_ptr, w_out_ptr, n_rows, heads, cs_stride, hw_stride,
                       weight_scale,
                       ROPE_MODE: tl.constexpr, ROPE_OFF: tl.constexpr, ROPE_DIM: tl.constexpr,
                       INTERLEAVED: tl.constexpr, UE8M0: tl.constexpr, FMAX: tl.constexpr, MIN_EXP: tl.constexpr,
                       D: tl.constexpr, BLOCK_M: tl.constexpr, INTERPRET: tl.constexpr,
                       PDL: tl.constexpr = False):
    wait_for_predecessor(PDL)
    QW: tl.constexpr = D // 4
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < n_rows
    pos = tl.load(pos_ptr + rows // heads, mask=rmask, other=0).to(tl.int64)
    row_ptr = q_ptr + rows[:, None] * D
    cs_row = cs_ptr + pos[:, None] * cs_stride

    x0, x1, x2, x3 = _load_quarters(row_ptr, rmask, QW)
    # q has no norm (NORM=0): the statistics and norm-weight arguments are placeholders that are never read.
    x0, x1, x2, x3 = _norm_rope_row(x0, x1, x2, x3, row_ptr, cs_row, rmask, 0.0, 0.0, q_ptr, q_ptr, QW, 0,
                                    ROPE_MODE, ROPE_OFF, ROPE_DIM, INTERLEAVED)
    y0, y1, y2, y3 = _hadamard_quarters(x0, x1, x2, x3, QW, INTERPRET)
    q0, q1, q2, q3, scale = _quant_quarters(y0, y1, y2, y3, FMAX, MIN_EXP, UE8M0, INTERPRET)
    _store_quarters(q_out_ptr + rows[:, None] * D, rmask, q0, q1, q2, q3, QW)
    # Rows of the flattened [T*H, D] q and entries of the [T, H] weights share the same flat index; the head
    # weights may be a column slice of a wider GEMM output (row stride hw_stride).
    hw = tl.load(hw_ptr + (rows // heads) * hw_stride + rows % heads, mask=rmask, other=0.0).to(tl.float32)
    tl.store(w_out_ptr + rows, (hw * weight_scale) * scale, mask=rmask)


_Q_PROLOGUE_INTERPRETED = interpreted(_q_prologue_kernel)


def _rows_config(n_rows: int) -> tuple[int, int]:
    """(rows per program, num_warps). 64 rows (one token's heads at H=64) make each 64x32x32 dot one Hopper
    warpgroup MMA; smaller batches take fewer rows per program so that more programs run."""
    if n_rows >= 64 * 256:
        return 64, 4
    if n_rows >= 32 * 128:
        return 32, 4
    return 16, 4


def q_prologue(q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, head_weights: torch.Tensor,
               weight_scale: float, rope_offset: int = 0, interleaved: bool = False, ue8m0: bool = False,
               fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE + Hadamard + per-head fp8 quant of q [T, H, D].

    Returns ``(q_fp8 [T, H, D], weights [T, H] f32 = head_weights * weight_scale * q_scale)``.
    """
    t, h, d = q.shape
    if d != HEAD_DIM:
        raise ValueError(f"the Triton q_prologue is written for head dim {HEAD_DIM}, got {d}")
    q_fp8 = torch.empty((t, h, d), dtype=fp8_dtype, device=q.device)
    weights = torch.empty((t, h), dtype=torch.float32, device=q.device)
    n_rows = t * h
    if n_rows == 0:
        return q_fp8, weights
    rope_dim = cos_sin.shape[1]
    cos_sin = cos_sin.contiguous()
    block_m, warps = _rows_config(n_rows)
    grid = (triton.cdiv(n_rows, block_m),)
    if head_weights.stride(1) != 1:
        head_weights = head_weights.contiguous()
    _q_prologue_kernel[grid](q.contiguous(), positions.contiguous(), cos_sin, head_weights, q_fp8,
                             weights, n_rows, h, cos_sin.stride(0), head_weights.stride(0), float(weight_scale),
                             ROPE_MODE=_rope_mode(rope_offset, rope_dim, interleaved), ROPE_OFF=int(rope_offset),
                             ROPE_DIM=rope_dim, INTERLEAVED=bool(interleaved), UE8M0=bool(ue8m0),
                             **(FP8_CONSTEXPRS.get(fp8_dtype) or fp8_constexprs(fp8_dtype)), D=d, BLOCK_M=block_m,
                             INTERPRET=_Q_PROLOGUE_INTERPRETED, num_warps=warps,
                             **pdl_options(q.device))
    return q_fp8, weights


# ----------------------------------------------------------------------------------------------------------------
# k_prologue_store
@triton.jit
def _k_prologue_store_kernel(k_ptr, w_ptr, b_ptr, pos_ptr, cs_ptr, slot_ptr, keys_ptr, scales_ptr,
                             n_rows, k_stride, cs_stride, eps,
                             NORM: tl.constexpr, ROPE_MODE: tl.constexpr, ROPE_OFF: tl.constexpr,
                             ROPE_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, UE8M0: tl.constexpr,
                             FMAX: tl.constexpr, MIN_EXP: tl.constexpr, PAGE: tl.constexpr,
                             PAGE_KEY_STRIDE: tl.constexpr, PAGE_SCALE_STRIDE: tl.constexpr, D: tl.constexpr,
                             BLOCK_M: tl.constexpr, INTERPRET: tl.constexpr,
                             PDL: tl.constexpr = False):
    wait_for_predecessor(PDL)
    QW: tl.constexpr = D // 4
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < n_rows
    slots = tl.load(slot_ptr + rows, mask=rmask, other=-1).to(tl.int64)
    keep = rmask & (slots >= 0)
    pos = tl.load(pos_ptr + rows, mask=rmask, other=0).to(tl.int64)
    row_ptr = k_ptr + rows[:, None] * k_stride
    cs_row = cs_ptr + pos[:, None] * cs_stride

    x0, x1, x2, x3 = _load_quarters(row_ptr, rmask, QW)
    # Row statistics in fp32 (LayerNorm: biased variance around the mean, like torch).
    mean = tl.zeros([BLOCK_M], dtype=tl.float32)
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM == 1:
        mean = (tl.sum(x0, axis=1) + tl.sum(x1, axis=1) + tl.sum(x2, axis=1) + tl.sum(x3, axis=1)) / D
        d0 = x0 - mean[:, None]
        d1 = x1 - mean[:, None]
        d2 = x2 - mean[:, None]
        d3 = x3 - mean[:, None]
        var = (tl.sum(d0 * d0, axis=1) + tl.sum(d1 * d1, axis=1) + tl.sum(d2 * d2, axis=1)
               + tl.sum(d3 * d3, axis=1)) / D
        rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(var + eps))
    elif NORM == 2:
        mean_sq = (tl.sum(x0 * x0, axis=1) + tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
                   + tl.sum(x3 * x3, axis=1)) / D
        rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_sq + eps))
    x0, x1, x2, x3 = _norm_rope_row(x0, x1, x2, x3, row_ptr, cs_row, rmask, mean, rstd, w_ptr, b_ptr, QW, NORM,
                                    ROPE_MODE, ROPE_OFF, ROPE_DIM, INTERLEAVED)
    y0, y1, y2, y3 = _hadamard_quarters(x0, x1, x2, x3, QW, INTERPRET)
    q0, q1, q2, q3, scale = _quant_quarters(y0, y1, y2, y3, FMAX, MIN_EXP, UE8M0, INTERPRET)

    # Slot s -> page s // 64, row s % 64. keys_ptr / scales_ptr are fp8 / fp32 views of the same cache bytes
    # (page_views), so the strides are in elements of each view.
    page = slots // PAGE
    prow = slots % PAGE
    _store_quarters(keys_ptr + (page * PAGE_KEY_STRIDE + prow * D)[:, None], keep, q0, q1, q2, q3, QW)
    tl.store(scales_ptr + page * PAGE_SCALE_STRIDE + prow, scale, mask=keep)


_K_PROLOGUE_STORE_INTERPRETED = interpreted(_k_prologue_store_kernel)


def _k_config(n_rows: int) -> tuple[int, int]:
    """k has one row per token (256 bytes of bf16): small tiles keep enough programs in flight."""
    if n_rows >= 32 * 1024:
        return 32, 4
    return 16, 4


def k_prologue_store(k: torch.Tensor, norm_weight: torch.Tensor | None, norm_bias: torch.Tensor | None, eps: float,
                     positions: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     rope_offset: int = 0, interleaved: bool = False, ue8m0: bool = False,
                     fp8_dtype: torch.dtype = torch.float8_e4m3fn, norm: str = "layernorm") -> None:
    """Norm + RoPE + Hadamard + fp8 quant of k [T, 128], stored into the paged cache in place (slot -1 skips)."""
    t, d = k.shape
    if d != HEAD_DIM:
        raise ValueError(f"the index-K cache holds head dim {HEAD_DIM}, got {d}")
    if norm not in _NORMS:
        raise ValueError(f"norm must be one of {tuple(_NORMS)}, got {norm!r}")
    if t == 0:
        return
    norm_id = _NORMS[norm]
    if k.stride(1) != 1:
        k = k.contiguous()
    rope_dim = cos_sin.shape[1]
    cos_sin = cos_sin.contiguous()
    keys, scales = page_views(kv_cache, fp8_dtype)
    # Unused norm pointers still need a valid tensor argument; the constexpr NORM keeps them unread.
    w = norm_weight.contiguous() if norm_id else k
    b = norm_bias.contiguous() if norm_id == 1 else w
    block_m, warps = _k_config(t)
    grid = (triton.cdiv(t, block_m),)
    _k_prologue_store_kernel[grid](k, w, b, positions.contiguous(), cos_sin, slot_mapping.contiguous(), keys, scales,
                                   t, k.stride(0), cos_sin.stride(0), float(eps), NORM=norm_id,
                                   ROPE_MODE=_rope_mode(rope_offset, rope_dim, interleaved),
                                   ROPE_OFF=int(rope_offset), ROPE_DIM=rope_dim, INTERLEAVED=bool(interleaved),
                                   UE8M0=bool(ue8m0), **(FP8_CONSTEXPRS.get(fp8_dtype) or fp8_constexprs(fp8_dtype)),
                                   PAGE=PAGE_SIZE, PAGE_KEY_STRIDE=PAGE_BYTES, PAGE_SCALE_STRIDE=PAGE_BYTES // 4,
                                   D=d, BLOCK_M=block_m, INTERPRET=_K_PROLOGUE_STORE_INTERPRETED,
                                   num_warps=warps, **pdl_options(k.device))


# ----------------------------------------------------------------------------------------------------------------
# q_prologue_fp4: V4's FP4 q recipe, bit-identical to the reference composition (`dsa_indexer.fp4`)
#
# Every step is a fixed sequence of correctly rounded fp32 operations, so the result does not depend on the
# device: RoPE as separate multiplies and one add per element (the launch disables FMA contraction, which would
# round a*c - b*s once instead of three times), the Hadamard as the radix-2 butterflies of the fast transform in
# the reference's order (`fp4.hadamard_fwht`) and not as a dot (whose summation order is the hardware's), the
# power-of-two scales from the fp32 bits, the e2m1 rounding with the 2^23 trick (round half to even).
FP4_MAX = tl.constexpr(6.0)  # a constexpr global: the kernel reads it
FP4_AMAX_FLOOR = 6.0 * 2.0 ** -126
FP4_INV_MAX = float(torch.tensor(1.0 / 6.0, dtype=torch.float32))  # 1/6 as fp32, what the reference multiplies by
_FOLD_SHIFT = {torch.float8_e4m3fn: 6, torch.float8_e4m3fnuz: 5}  # `fp4_fold_shift`: 6 * 2^shift <= the fp8 max


@triton.jit
def _rope_rows(x, row_ptr, cs_row, rmask, cols, ROPE_OFF: tl.constexpr, ROPE_DIM: tl.constexpr,
               INTERLEAVED: tl.constexpr):
    """RoPE of a [BLOCK_M, D] fp32 tile as the reference computes it: ``a*cos - b*sin`` / ``b*cos + a*sin``, each
    product and the sum rounded separately; the partner of each element is re-read from global memory (an L1
    hit). Dims outside the rotated range keep their value bit for bit (-0.0 included)."""
    HALF: tl.constexpr = ROPE_DIM // 2
    in_rope, partner, sign, freq = _rope_plan(cols, ROPE_OFF, ROPE_DIM, INTERLEAVED)
    m = rmask[:, None] & in_rope[None, :]
    xp = tl.load(row_ptr + partner[None, :], mask=m, other=0.0).to(tl.float32)
    cos = tl.load(cs_row + freq[None, :], mask=m, other=1.0).to(tl.float32)
    sin = tl.load(cs_row + HALF + freq[None, :], mask=m, other=0.0).to(tl.float32)
    # sign * (xp * sin) is exactly -(b*sin) or +(a*sin): x*cos + (-(b*sin)) == x*cos - b*sin in IEEE arithmetic.
    rotated = x * cos + sign[None, :] * (xp * sin)
    return tl.where(in_rope[None, :], rotated, x)


@triton.jit
def _fwht_rows(x, BLOCK_M: tl.constexpr, D: tl.constexpr, LOG_D: tl.constexpr):
    """The unnormalized Walsh-Hadamard transform of each row of ``x`` [BLOCK_M, D] (Sylvester order).

    Constant-geometry form: every stage adds and subtracts neighbours (2i, 2i+1) and writes the sums to the first
    half, the differences to the second. Stage s combines the bit s of the original index, the same pairs and the
    same ``a + b`` / ``a - b`` (a: the bit-0 partial) as the in-place transform with stride 2^s, so every output
    is the same tree of fp32 additions as `fp4.hadamard_fwht`."""
    for _ in tl.static_range(LOG_D):
        a, b = tl.split(tl.reshape(x, [BLOCK_M, D // 2, 2]))
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), [BLOCK_M, D])
    return x


@triton.jit
def _pow2_round_up(s):
    """The smallest power of two >= ``s`` (a positive normal fp32), from the bits; NaN stays NaN."""
    bits = s.to(tl.int32, bitcast=True)
    exp_bits = bits & 0x7F800000
    up = tl.where((bits & 0x7FFFFF) != 0, exp_bits + 0x800000, exp_bits)
    return tl.where(s != s, s, up.to(tl.float32, bitcast=True))


@triton.jit
def _round_to_e2m1(v):
    """``v`` (|v| <= 6 or NaN) to the nearest e2m1 point, ties to the even code (`round_to_e2m1`): |v| in units
    of the grid spacing (0.5 below 2, 1 below 4, 2 up to 6; exact power-of-two scalings) rounded half to even by
    adding and subtracting 2^23, the sign copied from the bits (-0.0 stays -0.0)."""
    mag = tl.abs(v)
    inv_step = tl.where(mag < 2.0, 2.0, tl.where(mag < 4.0, 1.0, 0.5))
    step = tl.where(mag < 2.0, 0.5, tl.where(mag < 4.0, 1.0, 2.0))
    rounded = ((mag * inv_step + 8388608.0) - 8388608.0) * step
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _q_prologue_fp4_kernel(q_ptr, pos_ptr, cs_ptr, hw_ptr, q_out_ptr, w_out_ptr, n_rows, heads, cs_stride,
                           hw_stride, weight_scale, hadamard_scale,
                           ROPE_OFF: tl.constexpr, ROPE_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
                           D: tl.constexpr, LOG_D: tl.constexpr, BLOCK: tl.constexpr, FOLD_SHIFT: tl.constexpr,
                           MIN_EXP: tl.constexpr, AMAX_FLOOR: tl.constexpr, INV_MAX: tl.constexpr,
                           BLOCK_M: tl.constexpr, INTERPRET: tl.constexpr,
                           PDL: tl.constexpr = False):
    wait_for_predecessor(PDL)
    NB: tl.constexpr = D // BLOCK
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # flat (token, head) rows of q [T*H, D]
    rmask = rows < n_rows
    cols = tl.arange(0, D)
    pos = tl.load(pos_ptr + rows // heads, mask=rmask, other=0).to(tl.int64)
    row_ptr = q_ptr + rows[:, None] * D
    x = tl.load(row_ptr + cols[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)

    # 1. RoPE, rounded to q's dtype (DeepSeek rotates q in place).
    x = _rope_rows(x, row_ptr, cs_ptr + pos[:, None] * cs_stride, rmask, cols, ROPE_OFF, ROPE_DIM, INTERLEAVED)
    x = round_to_dtype_grid(x, q_ptr.dtype.element_ty, INTERPRET).to(q_ptr.dtype.element_ty).to(tl.float32)
    # 2. The orthonormal Hadamard: butterflies, then one multiply by fp32(D^-0.5); rounded to bf16.
    y = _fwht_rows(x, BLOCK_M, D, LOG_D) * hadamard_scale
    y = round_to_dtype_grid(y, tl.bfloat16, INTERPRET).to(tl.bfloat16).to(tl.float32)
    # 3. FP4 e2m1 per block: scale = 2^ceil(log2(max(amax, floor) * fp32(1/6))), values = e2m1(clamp(y / scale)).
    yb = tl.reshape(y, [BLOCK_M, NB, BLOCK])
    amax = nan_maximum(abs_max(yb, 2), AMAX_FLOOR)
    scale = _pow2_round_up(amax * INV_MAX)  # [BLOCK_M, NB]
    # y / scale as y times the exact reciprocal of the power of two (2^(127 - e) from the bits: scale <= 2^126 for
    # finite bf16 y): both are the one rounding of the same real, without a division per element.
    inv_scale = ((254 << 23) - scale.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    v = tl.where(scale[:, :, None] != scale[:, :, None], float("nan"), yb * inv_scale[:, :, None])
    v = tl.where(v != v, v, tl.minimum(tl.maximum(v, -FP4_MAX), FP4_MAX))
    values = _round_to_e2m1(v)
    # 4. The fold into fp8: one power-of-two row scale (the largest block scale * 2^-shift), each block's values
    #    times scale / row (a power of two; exact in e4m3 unless a block sits more than 2^14 below the row's top).
    smax = tl.max(scale, axis=1)
    smax = tl.where(tl.max((scale != scale).to(tl.int32), axis=1) > 0, float("nan"), smax)
    row_scale = smax * (2.0 ** -FOLD_SHIFT)
    ratio = tl.math.div_rn(scale, row_scale[:, None])
    folded = tl.reshape(values * ratio[:, :, None], [BLOCK_M, D])
    if INTERPRET:
        folded = round_to_fp8_grid(folded, MIN_EXP)  # the interpreter's fp8 cast does not round to nearest even
    tl.store(q_out_ptr + rows[:, None] * D + cols[None, :], folded.to(q_out_ptr.dtype.element_ty),
             mask=rmask[:, None])
    # 5. weights = head_weights * weight_scale * row_scale, in that order (the reference's).
    hw = tl.load(hw_ptr + (rows // heads) * hw_stride + rows % heads, mask=rmask, other=0.0).to(tl.float32)
    tl.store(w_out_ptr + rows, (hw * weight_scale) * row_scale, mask=rmask)


_Q_PROLOGUE_FP4_INTERPRETED = interpreted(_q_prologue_fp4_kernel)


@functools.lru_cache(maxsize=8)
def _fp32_inverse_sqrt(d: int) -> float:
    """fp32(d^-0.5) as a Python float (exactly representable, so the kernel's fp32 argument is that value)."""
    return float(torch.tensor(d ** -0.5, dtype=torch.float32))


def _fp4_rows_config(n_rows: int) -> tuple[int, int]:
    """(rows per program, num_warps) of the FP4 q prologue. H200, 64 heads (per call, CUDA events over a Python
    loop): 16 rows / 4 warps 146 us at 4096 tokens vs 152 (8 rows), 188 (32), 210 (64 rows, 8 warps); at 4 and 64
    tokens every tile takes 68-96 us, the launch's host cost (a CUDA graph removes it)."""
    return 16, 4


def q_prologue_fp4_into(q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, head_weights: torch.Tensor,
                        weight_scale: float, rope_offset: int, interleaved: bool, block: int,
                        q_fp8: torch.Tensor, weights: torch.Tensor) -> None:
    """`q_prologue_fp4` into caller-given outputs (``q_fp8`` [T, H, D] fp8, ``weights`` [T, H] fp32, contiguous):
    the tests hand in poisoned buffers to see that every element is written."""
    t, h, d = q.shape
    if d & (d - 1) or d > 256:
        raise ValueError(f"the Triton q_prologue_fp4 takes a power-of-two head dim up to 256, got {d}")
    if block & (block - 1) or d % block:
        raise ValueError(f"the FP4 block must be a power of two dividing the head dim {d}, got {block}")
    if q_fp8.dtype not in _FOLD_SHIFT:
        raise TypeError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e4m3fnuz, got {q_fp8.dtype}")
    n_rows = t * h
    if n_rows == 0:
        return
    if head_weights.stride(1) != 1:
        head_weights = head_weights.contiguous()
    cos_sin = cos_sin.contiguous()
    block_m, warps = _fp4_rows_config(n_rows)
    grid = (triton.cdiv(n_rows, block_m),)
    hadamard_scale = _fp32_inverse_sqrt(d)
    _q_prologue_fp4_kernel[grid](q.contiguous(), positions.contiguous(), cos_sin, head_weights, q_fp8, weights,
                                 n_rows, h, cos_sin.stride(0), head_weights.stride(0), float(weight_scale),
                                 hadamard_scale, ROPE_OFF=int(rope_offset), ROPE_DIM=cos_sin.shape[1],
                                 INTERLEAVED=bool(interleaved), D=d, LOG_D=d.bit_length() - 1, BLOCK=int(block),
                                 FOLD_SHIFT=_FOLD_SHIFT[q_fp8.dtype], MIN_EXP=FP8_CONSTEXPRS[q_fp8.dtype]["MIN_EXP"],
                                 AMAX_FLOOR=FP4_AMAX_FLOOR, INV_MAX=FP4_INV_MAX, BLOCK_M=block_m,
                                 INTERPRET=_Q_PROLOGUE_FP4_INTERPRETED, num_warps=warps,
                                 enable_fp_fusion=False, **pdl_options(q.device))


def q_prologue_fp4(q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, head_weights: torch.Tensor,
                   weight_scale: float, rope_offset: int = 0, interleaved: bool = False, block: int = 32,
                   fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """V4's FP4 q prologue of q [T, H, D] in one launch: RoPE (rounded to q's dtype), the Hadamard (rounded to
    bf16), e2m1 per ``block`` with power-of-two scales, folded into fp8 with one power-of-two row scale.

    Returns ``(q_fp8 [T, H, D], weights [T, H] f32 = head_weights * weight_scale * row_scale)``, bit-identical to
    the reference (`backends/reference/kernels.py`) when its Hadamard is the butterfly transform."""
    t, h, d = q.shape
    q_fp8 = torch.empty((t, h, d), dtype=fp8_dtype, device=q.device)
    weights = torch.empty((t, h), dtype=torch.float32, device=q.device)
    q_prologue_fp4_into(q, positions, cos_sin, head_weights, weight_scale, rope_offset, interleaved, block, q_fp8,
                        weights)
    return q_fp8, weights
