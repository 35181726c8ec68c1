"""aiter's fused RMSNorm + fp8 group quant: the AMD producer of q_lora_quant (registered as ``rmsnorm_quant_fp8``).

``aiter.ops.triton.fused_fp8_quant.fused_rms_fp8_group_quant(x, w, eps, group_size=128, dtype_quant=fp8,
output_unquantized_inp1=True)`` returns ``((x_fp8, scales [T, K/128]), normed, None, None)``. Its recipe differs
from the library's ``rmsnorm_quant_fp8`` contract in three ways (read from aiter 0.1.7's kernel source):

* it quantizes the fp32 normed value BEFORE rounding it to the returned bf16 tensor (the library quantizes the
  rounded tensor, so that reusing the fp8 copy is bit-identical to re-quantizing ``normed``), and it multiplies
  by ``1 / scale`` where the library divides: payloads may differ by 1 fp8 ulp and scales by the bf16 rounding
  of the group's amax;
* it clamps ``amax`` at 1e-10 (the library: 1e-4), which matters only for groups that are almost all zero;
* its fp8 range is ``torch.finfo(dtype).max``: 448 for e4m3fn, but 240 for e4m3fnuz, where the AMD
  integrations and the library use 224. The adapter therefore refuses e4m3fnuz (gfx942).

It serves the op ``rmsnorm_quant_fp8`` on AMD targets as the seed integration uses it (SGLang on MI355X: attention's
q_lora comes out of this kernel), declaring its output ``PRODUCER_UNROUNDED`` (registry info ``producer``), so that
the op's `QuantizedActivation` says so and a consumer decides: on AMD the indexer reuses it by default (the ROCm
platform's rule), on NVIDIA it keeps the bit-identical rule. gfx942 is refused (the 240 vs 224 fnuz range above).
`aiter_fused_rms_fp8_group_quant` is the same call for callers who want aiter's kernel directly.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch

from ...contract import validate as v
from ...contract.quant import PRODUCER_UNROUNDED, Fp8GroupLayout, QuantizedActivation
from .lookup import find_function

GROUP_SIZE = 128
FUSED_QUANT_MODULES = ("aiter.ops.triton.fused_fp8_quant", "aiter.ops.triton.quant.fused_fp8_quant")
FUSED_QUANT_NAME = "fused_rms_fp8_group_quant"


def find_fused_rms_quant() -> tuple[str, Callable] | None:
    """aiter's ``fused_rms_fp8_group_quant`` (imports aiter)."""
    return find_function(FUSED_QUANT_MODULES, FUSED_QUANT_NAME, callable_only=True)


def aiter_fused_rms_fp8_group_quant(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                                    fp8_dtype: torch.dtype | None = None,
                                    fused_rms_fp8_group_quant: Callable | None = None
                                    ) -> tuple[torch.Tensor, QuantizedActivation]:
    """RMSNorm + per-128-group fp8 quant by aiter's fused Triton kernel: ``(normed [T, K] in x's dtype,
    QuantizedActivation(x_fp8 [T, K], scales [T, K/128] f32 row-major, layout))`` with
    ``layout.producer == PRODUCER_UNROUNDED`` (see the module docstring for how it differs from
    ``dsa_indexer.rmsnorm_quant_fp8``).

    ``fp8_dtype`` defaults to ``aiter.dtypes.fp8`` (e4m3fn on gfx950); e4m3fnuz is refused.
    ``fused_rms_fp8_group_quant`` defaults to the installed aiter's function (tests pass a fake)."""
    v.tensor("x", x, dtype=(torch.bfloat16, torch.float16), ndim=2)
    v.tensor("weight", weight, shape=(x.shape[1],), device=x.device)
    if x.shape[1] % GROUP_SIZE:
        raise v.IndexerInputError(f"x's width {x.shape[1]} must be a multiple of {GROUP_SIZE}")
    if not v.finite_number("eps", eps) > 0:
        raise v.IndexerInputError(f"eps must be > 0, got {eps}")
    if fp8_dtype is None:
        fp8_dtype = importlib.import_module("aiter").dtypes.fp8
    v.fp8_dtype("fp8_dtype", fp8_dtype)
    if fp8_dtype == torch.float8_e4m3fnuz:
        raise v.IndexerInputError(
            "aiter's fused_rms_fp8_group_quant scales e4m3fnuz to +-240 (torch.finfo max); the library's fnuz recipe "
            "(and the AMD integrations') uses +-224. Use dsa_indexer.rmsnorm_quant_fp8 on gfx942")
    if fused_rms_fp8_group_quant is None:
        found = find_fused_rms_quant()
        if found is None:
            raise RuntimeError(f"aiter has no {FUSED_QUANT_NAME} in {' / '.join(FUSED_QUANT_MODULES)}")
        fused_rms_fp8_group_quant = found[1]
    (x_fp8, scales), normed, _, _ = fused_rms_fp8_group_quant(
        x, weight, float(eps), group_size=GROUP_SIZE, dtype_quant=fp8_dtype, output_unquantized_inp1=True,
        transpose_scale=False)
    layout = Fp8GroupLayout(group_size=GROUP_SIZE, ue8m0=False, scale_major="row", packed_scales=False,
                            rows=x.shape[0], fp8_dtype=fp8_dtype, producer=PRODUCER_UNROUNDED)
    return normed, QuantizedActivation(x_fp8, scales, layout)


def make_rmsnorm_quant_fp8(fused_rms_fp8_group_quant: Callable | None = None) -> Callable:
    """The ``rmsnorm_quant_fp8`` implementation over aiter's kernel, with the reference signature
    ``(x, weight, eps, group_size, ue8m0, fp8_dtype) -> (normed, x_fp8, scales)``."""
    if fused_rms_fp8_group_quant is None:
        found = find_fused_rms_quant()
        if found is None:
            raise RuntimeError(f"aiter has no {FUSED_QUANT_NAME} in {' / '.join(FUSED_QUANT_MODULES)}")
        fused_rms_fp8_group_quant = found[1]

    def rmsnorm_quant_fp8(x, weight, eps, group_size, ue8m0, fp8_dtype):
        (x_fp8, scales), normed, _, _ = fused_rms_fp8_group_quant(
            x, weight, float(eps), group_size=group_size, dtype_quant=fp8_dtype, output_unquantized_inp1=True,
            transpose_scale=False)
        return normed, x_fp8, scales

    return rmsnorm_quant_fp8
