"""V4's FP4 q recipe written for the tests from its description (not the library's code path): RoPE rounded to q's
dtype, the orthonormal Hadamard as the radix-2 butterfly transform (stride 1, 2, ..., D/2, fp32 adds) times
fp32(D^-0.5), rounded to bf16, then the reference's e2m1 quant (`quant_fp4_e2m1`) and fold (`fold_fp4_to_fp8`);
weights = head_weights * weight_scale * row_scale. Used by the Triton FP4 prologue tests (CPU and H200).

The butterfly order is what makes the recipe device-independent (every operation is one correctly rounded fp32 add,
subtract or multiply). The library's torch reference (`backends/reference/kernels.hadamard_butterfly`) follows the
same order; before it did, its fp32 matmul (summed in the BLAS's order) differed in 1-4 codes per million on the H200.
This file is written separately from it, so that the tests do not check the library against itself."""

import torch

from dsa_indexer.backends.reference import kernels as ref


def butterfly_hadamard(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform along the last dim, in-place radix-2 order (fp32 adds only)."""
    d = x.shape[-1]
    stride = 1
    while stride < d:
        pairs = x.reshape(*x.shape[:-1], d // (2 * stride), 2, stride)
        first, second = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((first + second, first - second), dim=-2).reshape(*x.shape[:-1], d)
        stride *= 2
    return x


def rotate_bf16(x: torch.Tensor) -> torch.Tensor:
    """The orthonormal Hadamard of ``x`` (butterflies, then one multiply by fp32(D^-0.5)), rounded to bf16."""
    scale = torch.tensor(x.shape[-1] ** -0.5, dtype=torch.float32, device=x.device)
    return (butterfly_hadamard(x.float()) * scale).to(torch.bfloat16)


def fp4_q_recipe(q, positions, cos_sin, head_weights, weight_scale, rope_offset, interleaved, block, fp8_dtype):
    """``(q_fp8 [T, H, D], weights [T, H] fp32)`` of V4's FP4 q recipe, on q's device."""
    roped = ref.apply_rope(q.float(), positions, cos_sin, rope_offset, interleaved).to(q.dtype)
    q_fp8, row_scale = ref.fold_fp4_to_fp8(*ref.quant_fp4_e2m1(rotate_bf16(roped), block), fp8_dtype)
    return q_fp8, head_weights.float() * weight_scale * row_scale
