"""aiter's block-scale fp8 GEMM as ``gemm_fp8_blockscale`` on AMD (the indexer's wq_b, the q_lora reuse consumer).

Read from ROCm/aiter's source (HEAD e4048607, 2026-08; `aiter/ops/gemm_op_a8w8.py`, the CK kernel's common header and
`op_tests/test_gemm_a8w8_blockscale.py`): ``aiter.gemm_a8w8_blockscale(XQ, WQ, x_scale, w_scale, dtype=bf16)``
allocates and returns Y [M, N]; XQ [M, K] and WQ [N, K] are fp8 of one flavour (``aiter.dtypes.fp8``: e4m3fnuz on
gfx942, e4m3fn on gfx950 / gfx1250), ``x_scale`` [M, K/128] fp32 row-major (per-token groups of 128: exactly the
library's `GEMM_INPUT_LAYOUT`), ``w_scale`` [N/128, K/128] fp32 row-major (the checkpoint's ``weight_scale_inv``),
out dtype bf16 or fp16. aiter takes its CK path on gfx942 / gfx950 / gfx1250 (its prebuilt archs) and its own Triton
GEMM elsewhere; the registration here refuses gfx1250 (no tuned entries there, never run: ``GEMM_GFX1250`` in this
package's ``__init__``), so the library's Triton GEMM serves it. The preshuffled variant (``gemm_a8w8_blockscale_bpreshuffle``, transposed x_scale,
16x16-shuffled weights) is not used: it needs the weight re-laid out at load time.

Its CK modules (``module_gemm_a8w8_blockscale``, and on main ``module_gemm_a8w8_blockscale_cktile``) are built by
hipcc at the first call when not prebuilt; the probe turns this implementation off until they are
(aiter_api.module_prebuilt), so no call hides a minutes-long build.

HIP/CK only: never run here. The adapter's argument marshalling is tested against a double written from that
signature (tests/backends/test_rocm_npu_backends_cpu.py).
"""

from __future__ import annotations

from typing import Callable

import torch

from .lookup import find_function

GEMM_NAME = "gemm_a8w8_blockscale"
CKTILE_NAME = "gemm_a8w8_blockscale_cktile"  # ROCm/aiter main: shapes tuned for CK-tile call this module


def find_gemm() -> tuple[str, Callable] | None:
    """aiter's ``gemm_a8w8_blockscale`` (imports aiter)."""
    return find_function(("aiter",), GEMM_NAME, callable_only=True)


def find_cktile() -> tuple[str, Callable] | None:
    """aiter's CK-tile block-scale GEMM (main only): ``gemm_a8w8_blockscale`` may call it for tuned shapes, so its
    compiled module must be built too (aiter_api.module_prebuilt)."""
    return find_function(("aiter", "aiter.ops.gemm_op_a8w8"), CKTILE_NAME, callable_only=True)


def make_gemm_fp8_blockscale(gemm_a8w8_blockscale: Callable | None = None) -> Callable[..., torch.Tensor]:
    """``gemm_fp8_blockscale(a, a_scales, b, b_scales, out_dtype, scale_fmt)`` (the reference's signature) over aiter's
    CK GEMM, which reads fp32 scales: both ``scale_fmt`` values pass them as they are."""
    if gemm_a8w8_blockscale is None:
        found = find_gemm()
        if found is None:
            raise RuntimeError("aiter has no gemm_a8w8_blockscale")
        gemm_a8w8_blockscale = found[1]

    def gemm_fp8_blockscale(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                            out_dtype: torch.dtype, scale_fmt: str = "fp32") -> torch.Tensor:
        if out_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"aiter's gemm_a8w8_blockscale writes bf16 or fp16, not {out_dtype}")
        # CK reads row-major scales with unit column stride: make the views it gets contiguous.
        return gemm_a8w8_blockscale(a.contiguous(), b.contiguous(), a_scales.float().contiguous(),
                                    b_scales.float().contiguous(), dtype=out_dtype)

    return gemm_fp8_blockscale
