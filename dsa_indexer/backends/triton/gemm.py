"""Triton block-scaled fp8 GEMM for the indexer's ``wq_b``: ``out = (a * a_scales) @ (b * b_scales).T``.

a [M, K] fp8 with per-token-group scales [M, ceil(K/128)] (one scale per row per 128 columns),
b [N, K] fp8 (the weight, K-major) with per-block scales [ceil(N/128), ceil(K/128)].

BLOCK_K is fixed at 128, aligned to the scale groups, so each K step is one tensor-core fp8 dot whose fp32
result is scaled by ``sa[m] * sb[n // 128]`` and added into an fp32 accumulator. Scaling every 128-wide
partial sum (instead of feeding the dot's own accumulator) also limits how much is summed inside the tensor
core's reduced-precision fp8 accumulation on Hopper (what DeepGEMM's "promotion" does).

Configs are fixed per M range (no autotuning: decode batches must not pay a tuning run, and CUDA-graph capture
must not see one). Small M is weight-bandwidth bound: narrow N tiles give enough programs to stream b from
every SM. Large M is compute bound: 128x128 tiles, grouped launch order so that a band of a stays in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_options, wait_for_predecessor
from .quant import interpreted, round_to_dtype_grid

SCALE_BLOCK = 128



@triton.jit
def _gemm_fp8_blockscale_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K,
                                stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr,
                                PDL: tl.constexpr = False):
    wait_for_predecessor(PDL)
    # Grouped ordering: GROUP_M consecutive programs walk down M for the same band of N columns, so that the
    # b tile they share is read from L2 rather than HBM.
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * grid_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    # Clamp out-of-range rows to row 0 instead of masking them: loads stay unmasked along M/N (the results of
    # those rows are never stored), which keeps the tile loads simple and vectorized.
    safe_m = tl.where(mmask, offs_m, 0).to(tl.int64)
    safe_n = tl.where(nmask, offs_n, 0).to(tl.int64)
    a_ptrs = a_ptr + safe_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + safe_n[:, None] * stride_bn + offs_k[None, :]
    as_ptrs = as_ptr + safe_m * stride_asm
    # BLOCK_N divides the 128-row scale block of b, so the whole tile shares one b scale per K step.
    tl.static_assert(BLOCK_K % BLOCK_N == 0)
    bs_ptrs = bs_ptr + ((pid_n * BLOCK_N) // BLOCK_K) * stride_bsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            kmask = offs_k < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[None, :], other=0.0)
        scale = tl.load(as_ptrs + kb) * tl.load(bs_ptrs + kb)
        acc += tl.dot(a, tl.trans(b)) * scale[:, None]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    # Under the interpreter, round to nearest even in software first (its bf16 cast truncates).
    out = round_to_dtype_grid(acc, c_ptr.dtype.element_ty, INTERPRET)
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


# (max M, BLOCK_M, BLOCK_N, num_warps, num_stages), first match wins. BLOCK_N must divide 128 (one b scale
# per tile and K step).
_CONFIGS = (
    (16, 16, 64, 4, 5),
    (32, 32, 64, 4, 5),
    (64, 64, 64, 4, 4),
    (256, 64, 128, 4, 4),
    (None, 128, 128, 8, 3),
)


_GEMM_INTERPRETED = interpreted(_gemm_fp8_blockscale_kernel)


def _config(m: int) -> tuple[int, int, int, int]:
    for max_m, bm, bn, warps, stages in _CONFIGS:
        if max_m is None or m <= max_m:
            return bm, bn, warps, stages
    raise AssertionError("unreachable")


def gemm_fp8_blockscale(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                        out_dtype: torch.dtype = torch.bfloat16, scale_fmt: str = "fp32") -> torch.Tensor:
    """``(a * a_scales) @ (b * b_scales).T`` -> [M, N] ``out_dtype`` (fp32 accumulation). The kernel reads fp32
    scales, so both ``scale_fmt`` values ("ue8m0" scales are fp32 powers of two) take the same path."""
    m, kdim = a.shape
    n = b.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if kdim == 0:
        return out.zero_()
    # The kernel walks K contiguously; the scale tensors only need unit stride along K.
    a = a if a.stride(1) == 1 else a.contiguous()
    b = b if b.stride(1) == 1 else b.contiguous()
    a_scales = a_scales if a_scales.stride(1) == 1 else a_scales.contiguous()
    b_scales = b_scales if b_scales.stride(1) == 1 else b_scales.contiguous()
    bm, bn, warps, stages = _config(m)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _gemm_fp8_blockscale_kernel[grid](a, a_scales, b, b_scales, out, m, n, kdim,
                                      a.stride(0), a_scales.stride(0), b.stride(0), b_scales.stride(0), out.stride(0),
                                      BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=SCALE_BLOCK, GROUP_M=8,
                                      EVEN_K=kdim % SCALE_BLOCK == 0,
                                      INTERPRET=_GEMM_INTERPRETED, num_warps=warps,
                                      num_stages=stages, **pdl_options(a.device))
    return out
