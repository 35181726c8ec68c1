"""DeepSeek-V4's FP4 indexer recipe (``IndexerConfig.key_quant="fp4_e2m1"``): q and the compressed keys are rotated
by the Hadamard, quantized to e2m1 in blocks of 32 with power-of-two scales, and scored as the dequantized values.

Two ways to keep the keys. The ``paged64_fp4_e2m1`` cache (68 bytes per token, DeepGEMM's paged FP4 layout; the
packing helpers live in `contract.cache` and are re-exported here) stores the e2m1 codes and block scales as the
recipe makes them (`key_fp4`); the paged FP4 logits kernels dequantize in the kernel. Or the fp8 cache, as follows.

How it runs here: an FP4 row of 128 (four blocks, four power-of-two scales) is folded exactly into fp8 e4m3 with one
power-of-two scale (`fold_fp4_to_fp8`), so the keys live in the ``paged64_fp8_e4m3`` cache and every fp8 logits and
top-k implementation (DeepGEMM, Triton, aiter, the reference) scores FP4 values unchanged; the q row scale folds
into the head weights as the fp8 one does. Scores are then fp32 sums of exact products (DeepSeek's code rounds the
einsum to bf16, which only moves near-ties). Numerics follow DeepSeek's code point by point: RoPE'd q rounded to
bf16, the Hadamard's output rounded to bf16, then the FP4 quant (see `quant_fp4_e2m1` for the rounding).

The Hadamard is the radix-2 butterfly transform in a fixed order (`hadamard_butterfly`), so every device and kernel
gets the same bits. q and the compressor's keys (after their RMSNorm, `normed_key`) go through the registry op
`ops.q_prologue_fp4` (RoPE, Hadamard, quant, fold in one call: a Triton kernel on GPUs, bit-identical to its
reference in `backends/reference/kernels.py`); the helpers here are the shared recipe's torch tensor ops
(`contract/recipe.py`, which the reference composes too), for tests and callers that quantize rows themselves, on
any device.
"""

from __future__ import annotations

import torch

from .contract.recipe import (apply_rope, dequant_fp4_e2m1, fold_fp4_to_fp8, hadamard_butterfly, quant_fp4_e2m1,
                              rmsnorm, rotate_quant_fp4)
from .contract.cache import pack_e2m1, ue8m0_bytes, unpack_e2m1, ue8m0_values

__all__ = ["rotate_quant_fp4", "hadamard_butterfly", "fp4_values", "quant_fp4_e2m1", "dequant_fp4_e2m1",
           "fold_fp4_to_fp8", "normed_key", "key_fp4", "pack_e2m1", "unpack_e2m1", "ue8m0_bytes", "ue8m0_values"]


def fp4_values(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """``x`` [..., D] after DeepSeek's FP4 simulation (quantize, dequantize): fp32, exact in bf16."""
    return dequant_fp4_e2m1(*quant_fp4_e2m1(x, block))


def normed_key(pooled: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The compressor's RMSNorm of pooled entries [E, D], fp32 math, bf16 out (DeepSeek's ``RMSNorm``)."""
    return rmsnorm(pooled, norm_weight, eps).to(torch.bfloat16)


def key_fp4(normed: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, rope_offset: int,
            interleaved: bool, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressor's FP4 keys as the recipe makes them, unfolded: ``normed`` bf16 [E, 128] (after `normed_key`)
    -> RoPE at ``positions`` (rounded to bf16), Hadamard (`hadamard_butterfly`, rounded to bf16), e2m1 per ``block``:
    (values [E, 128] on the e2m1 grid, power-of-two scales [E, 128 / block]), what the ``paged64_fp4_e2m1`` cache
    stores. The same steps, in the same order, as `q_prologue_fp4` with one head (which then folds into fp8)."""
    roped = apply_rope(normed.float(), positions, cos_sin, rope_offset, interleaved).to(normed.dtype)
    return quant_fp4_e2m1(hadamard_butterfly(roped).to(torch.bfloat16), block)
