"""TEST DOUBLES of aiter's fused RMSNorm + fp8 quant and its CK block-scale GEMM (not aiter): each written from
aiter's documented behaviour, to drive the AMD q_lora reuse adapters without aiter or an AMD GPU."""

import torch


def fused_rms_fp8_group_quant_double(x, w, eps, group_size=128, dtype_quant=torch.float8_e4m3fn,
                                     output_unquantized_inp1=True, transpose_scale=False):
    """A DOUBLE of aiter's ``fused_rms_fp8_group_quant``, written from its documented behaviour (aiter 0.1.7's kernel
    source): RMSNorm in fp32, quantize the fp32 normed value (before rounding) per group of 128 with
    ``scale = amax / fp8_max`` (amax clamped at 1e-10), multiply by 1/scale; return ((fp8, scales), bf16 normed)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * w.float()
    groups = normed.view(x.shape[0], -1, group_size)
    fmax = torch.finfo(dtype_quant).max
    scale = groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10) / fmax
    q = (groups * (1.0 / scale)).clamp(-fmax, fmax).to(dtype_quant).view_as(x)
    return (q, scale.squeeze(-1)), normed.to(x.dtype), None, None


def gemm_a8w8_blockscale_double(XQ, WQ, x_scale, w_scale, dtype=torch.bfloat16):
    """A DOUBLE of aiter's CK ``gemm_a8w8_blockscale``, written from its documented contract (aiter's op test
    reference): XQ [M, K] and WQ [N, K] fp8 of one flavour, x_scale [M, K/128] and w_scale [N/128, K/128] fp32
    row-major; dequantize per (row, 128-group) and per 128 x 128 block, multiply in fp32, return [M, N] in dtype."""
    m, k = XQ.shape
    n = WQ.shape[0]
    assert XQ.dtype == WQ.dtype and x_scale.dtype == w_scale.dtype == torch.float32 and dtype in (torch.bfloat16,
                                                                                               torch.float16)
    assert x_scale.shape == (m, -(-k // 128)) and x_scale.is_contiguous(), "x_scale must be [M, K/128] row-major"
    assert w_scale.shape == (-(-n // 128), -(-k // 128)) and w_scale.is_contiguous()
    a = XQ.float() * x_scale.repeat_interleave(128, 1)[:, :k]
    b = WQ.float() * w_scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return (a @ b.T).to(dtype)
