"""The numerics every implementation and the model share, in pure torch: fp8 ranges and power-of-two scales, RMSNorm,
RoPE, and DeepSeek-V4's FP4 e2m1 recipe (quant, dequant, the exact fold into fp8, the butterfly Hadamard).

Contract, not a backend: the reference kernels (`backends/reference/kernels.py`, which re-exports these names)
compose them into the ops' oracles, and `dsa_indexer.fp4` into the model's FP4 helpers, so the model imports no
backend to reach them.
"""

from __future__ import annotations

import torch


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """448 for e4m3fn; 224 for e4m3fnuz, the range the AMD integrations use on gfx942."""
    return 224.0 if fp8_dtype == torch.float8_e4m3fnuz else 448.0


def ue8m0_round_up(scale: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= ``scale``, exactly (fp32 ``exp2(ceil(log2(s)))`` can round down)."""
    mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2**exponent, mantissa in [0.5, 1)
    rounded = torch.ldexp(torch.ones_like(scale), exponent - (mantissa == 0.5).to(exponent.dtype))
    return torch.where(torch.isnan(scale), scale, rounded)  # frexp(NaN) has exponent 0: keep NaN a NaN


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, rope_offset: int,
               interleaved: bool) -> torch.Tensor:
    """Rotate dims ``[rope_offset, rope_offset + R)`` of ``x`` ([T, ..., D] fp32), R = cos_sin.shape[1].

    NeoX (rotate-half): dim i pairs with i + R/2. Interleaved (GPT-J): dim 2i pairs with 2i + 1.
    ``cos_sin[p] = [cos(p * f_0..f_{R/2-1}), sin(...)]``.
    """
    rope_dim = cos_sin.shape[1]
    half = rope_dim // 2
    cs = cos_sin.float()[positions.long()]
    cos, sin = cs[:, :half], cs[:, half:]
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    out = x.clone()
    part = x[..., rope_offset:rope_offset + rope_dim]
    if interleaved:
        a, b = part[..., 0::2], part[..., 1::2]
        rotated = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    else:
        a, b = part[..., :half], part[..., half:]
        rotated = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    out[..., rope_offset:rope_offset + rope_dim] = rotated
    return out


# --- FP4 e2m1 (DeepSeek-V4's indexer recipe; `dsa_indexer.fp4` and the reference compose these) ------------------------------------
FP4_MAX = 6.0  # the largest e2m1 magnitude
FP4_AMAX_FLOOR = 6.0 * 2.0 ** -126  # DeepSeek's floor: the smallest scale is then 2^-126 (a normal fp32)
FP4_INV_MAX = float(torch.tensor(1.0 / 6.0, dtype=torch.float32))  # 1/6 rounded to fp32, as DeepSeek multiplies


def round_to_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``y`` (|y| <= 6) to the nearest e2m1 value {0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to the even code.

    The grid's spacing is 0.5 below 2, 1 below 4 and 2 up to 6; rounding ``|y| / spacing`` half-to-even lands a tie
    on the even code in every interval (0.25 -> 0, 0.75 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4). NaN stays NaN."""
    mag = y.abs()
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0)).to(y.dtype)
    return torch.copysign(torch.round(mag / step) * step, y)


def quant_fp4_e2m1(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 e2m1 quant of ``x`` [..., D] per block of ``block`` along D: ``(values, scales)`` with ``values`` the
    e2m1 grid points (fp32, like x) and ``scales`` [..., D / block] fp32 powers of two, ``x ~ values * scale``.

    DeepSeek's recipe: ``amax = max |x|`` over the block, floored at 6 * 2^-126; ``scale = 2^ceil(log2(amax * (1/6)))``
    (1/6 as fp32, the product rounded to fp32, then rounded UP to a power of two exactly); ``values = e2m1(x / scale)``
    clamped to +-6, rounded to nearest even. The NaN rule: a block holding NaN gets a NaN scale."""
    shape = x.shape
    groups = x.float().reshape(*shape[:-1], shape[-1] // block, block)
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp_min(FP4_AMAX_FLOOR)
    scale = ue8m0_round_up(amax * torch.full_like(amax, FP4_INV_MAX))
    values = round_to_e2m1((groups / scale).clamp(-FP4_MAX, FP4_MAX))
    return values.reshape(shape), scale.reshape(*shape[:-1], shape[-1] // block)


def dequant_fp4_e2m1(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``values * scale`` per block, fp32 (exact: an e2m1 value times a power of two; also exact in bf16)."""
    block = values.shape[-1] // scales.shape[-1]
    return (values.float().reshape(*scales.shape, block) * scales.float()[..., None]).reshape(values.shape)


def fp4_fold_shift(fp8_dtype: torch.dtype) -> int:
    """Exponent headroom of the fold: the row's largest e2m1 value (6) times 2^shift stays within the fp8 max
    (6 * 64 = 384 <= 448 for e4m3fn; 6 * 32 = 192 <= 224 for e4m3fnuz)."""
    return 5 if fp8_dtype == torch.float8_e4m3fnuz else 6


def fold_fp4_to_fp8(values: torch.Tensor, scales: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 blocks of a row ([..., D] e2m1 values, [..., D / block] power-of-two scales) as fp8 e4m3 with ONE
    power-of-two scale per row: ``(fp8 [..., D], row_scale [...] fp32)``, ``fp8 * row_scale`` = the FP4 values.

    ``row_scale = max block scale * 2^-shift`` (`fp4_fold_shift`); each block's values times ``scale / row_scale``
    (a power of two) are exact in e4m3 (one mantissa bit into three) unless a block's scale is more than 2^14
    (e4m3fnuz: 2^13) below the row's largest, where e4m3's subnormals keep 2^-9 of the row scale. So the index-K
    cache's fp8 layout and every fp8 logits kernel serve the FP4 recipe unchanged."""
    block = values.shape[-1] // scales.shape[-1]
    shift = fp4_fold_shift(fp8_dtype)
    row = scales.amax(dim=-1, keepdim=True) * 2.0 ** -shift
    ratio = scales / row  # powers of two in [2^-..., 2^shift]
    folded = values.float().reshape(*scales.shape, block) * ratio[..., None]
    return folded.reshape(values.shape).to(fp8_dtype), row.squeeze(-1)


def hadamard_butterfly(x: torch.Tensor) -> torch.Tensor:
    """The orthonormal Hadamard along the last dim (a power of two) as the radix-2 butterfly transform, fp32: pairs
    ``(a + b, a - b)`` at stride 1, 2, ..., D/2 in that order, then one multiply by fp32(D^-0.5). Unlike a matmul
    (summed in the BLAS's order) every step is one correctly rounded fp32 operation, so every device and kernel that
    follows this order gets the same bits (the FP4 recipe's Hadamard; the Triton FP4 prologue computes exactly this)."""
    d = x.shape[-1]
    x = x.float()
    stride = 1
    while stride < d:
        pairs = x.reshape(*x.shape[:-1], d // (2 * stride), 2, stride)
        first, second = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((first + second, first - second), dim=-2).reshape(*x.shape[:-1], d)
        stride *= 2
    return x * torch.tensor(d ** -0.5, dtype=torch.float32, device=x.device)


def rotate_quant_fp4(x: torch.Tensor, block: int = 32, fp8_dtype: torch.dtype = torch.float8_e4m3fn
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Hadamard (orthonormal, along the last dim, `hadamard_butterfly`; output rounded to bf16 as DeepSeek's
    ``rotate_activation``), FP4 e2m1 quant per ``block``, folded into fp8: ``(fp8 like x, row scale [...] fp32)``."""
    if x.shape[-1] % block:
        raise ValueError(f"the last dim {x.shape[-1]} must be a multiple of the FP4 block {block}")
    rotated = hadamard_butterfly(x).to(torch.bfloat16)
    return fold_fp4_to_fp8(*quant_fp4_e2m1(rotated, block), fp8_dtype)
