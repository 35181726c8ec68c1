"""DeepGEMM's FP4 logits (sm100 only; DeepGEMM's csrc/apis/attention.hpp at commit 54e2261, docs/v4.md): the
packing of the FP4 operands and the adapters of ``fp8_fp4_mqa_logits`` and ``fp8_fp4_paged_mqa_logits``, each with
the matching reference kernel's signature and result. Nothing here imports ``deep_gemm``: the factories in
`backends/cuda/__init__.py` pass the module in. The vendor-free FP4 packing (e2m1 nibbles, ue8m0 bytes, the 68-byte
cache layout) lives in `contract/cache.py`."""

from __future__ import annotations

from types import ModuleType
from typing import Callable

import torch

from ...contract.validate import IndexerInputError, ranges_checked
from .deepgemm_api import FP4_LOGITS_BLOCK, RAGGED_NEW, DeepGemmApi
from .deepgemm_kernels import require_powers_of_two, ue8m0_bytes

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitude of e2m1 code c (bits 0-2); bit 3 is the sign


def pack_ue8m0_rows(scales: torch.Tensor) -> torch.Tensor:
    """fp32 power-of-two block scales [..., B] (B <= 4) as one int32 per row (contiguous), the ``q_sf`` / ``kv_sf``
    of DeepGEMM's FP4 logits: block b's ue8m0 byte in byte b (little-endian); missing blocks hold 127 (2^0), as
    DeepGEMM's own quantizer pads them (they cover no elements)."""
    blocks = scales.shape[-1]
    if blocks > 4:
        raise ValueError(f"one int32 packs at most 4 block scales, got {blocks} per row")
    padded = torch.full((*scales.shape[:-1], 4), 127, dtype=torch.uint8, device=scales.device)
    padded[..., :blocks] = ue8m0_bytes(scales)
    return padded.view(torch.int32).squeeze(-1)


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """fp32 values on the e2m1 grid [..., D] as DeepGEMM's packed FP4 (int8 [..., D / 2]): element 2i in the low
    nibble, 2i + 1 in the high one; a nibble is sign << 3 | code, zero always code 0 (no negative zero)."""
    grid = torch.tensor(E2M1_GRID, device=values.device)
    mag = values.float().abs()
    code = torch.searchsorted(grid, mag.contiguous()).clamp_max(7).to(torch.uint8)
    code = code | (((values < 0) & (code != 0)).to(torch.uint8) << 3)
    return (code[..., 0::2] | (code[..., 1::2] << 4)).view(torch.int8)


def unfold_fp4_rows(x_fp8: torch.Tensor, row_scale: torch.Tensor | None, block: int = FP4_LOGITS_BLOCK
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of the fold (`fp4.fold_fp4_to_fp8`): fp8 rows [..., D] that hold FP4 values times one
    power-of-two row scale, back to ``(e2m1 values [..., D] fp32, block scales [..., D / block] fp32)``.

    Each block's scale is ``2^(floor(log2(max |x|)) - 2)`` (the smallest power of two that brings the block's
    largest value to at most 6; 1 for an all-zero block) times the row scale (``None``: 1, for q, whose row scale
    lives in the head weights). Exact for every block the fold kept exact; a block more than 2^14 below its row's
    largest (e4m3 subnormals after the fold) takes the nearest e2m1 values (a change below 2^-14 of the row)."""
    from ..reference.kernels import round_to_e2m1

    shape = x_fp8.shape
    xf = x_fp8.float().reshape(*shape[:-1], shape[-1] // block, block)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    _, exponent = torch.frexp(amax)  # amax = m * 2^exponent, m in [0.5, 1): floor(log2(amax)) = exponent - 1
    scale = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), exponent - 3), torch.ones_like(amax))
    values = round_to_e2m1((xf / scale).clamp(-6.0, 6.0))
    if ranges_checked(xf) and not torch.equal(values * scale, xf):
        raise IndexerInputError("the fp8 rows do not hold FP4 values (key_quant='fp4_e2m1' folds them so): the FP4 "
                                "logits would change them; use the fp8 logits")
    scale = scale.squeeze(-1)
    if row_scale is not None:
        require_powers_of_two("k_scales", row_scale)
        scale = scale * row_scale.float()[..., None]
    return values.reshape(shape), scale


def make_fp4_ragged_mqa_logits(module: ModuleType, api: DeepGemmApi) -> Callable[..., torch.Tensor]:
    """Ragged logits of V4's FP4 recipe through DeepGEMM's FP4 kernel (``fp8_fp4_mqa_logits`` with ``q_sf`` given;
    DeepGEMM runs it on sm100 only). Same signature and result as the fp8 `ragged_mqa_logits` op, on the fp8 rows
    the FP4 recipe folds (`fp4.fold_fp4_to_fp8`): q [S, H, 128] (row scale in ``weights``) and k [N, 128] with
    power-of-two ``k_scales`` [N] are unfolded exactly (`unfold_fp4_rows`) into packed e2m1 [.., 64] int8 and one
    int32 of four ue8m0 block scales per row. Not registered: the op's problem does not say that its rows are FP4
    values (docs/v4.md); on other fp8 rows the values would change (an error where ranges are checked)."""
    if api.ragged_fn != RAGGED_NEW:
        raise RuntimeError(f"{api.describe()} has no FP4 ragged logits ({RAGGED_NEW}, DeepGEMM 2.x)")
    kernel = getattr(module, api.ragged_fn)

    def ragged_mqa_logits_fp4(q: torch.Tensor, k: torch.Tensor, k_scales: torch.Tensor, weights: torch.Tensor,
                              ks: torch.Tensor, ke: torch.Tensor) -> torch.Tensor:
        if q.shape[-1] != 128:
            raise IndexerInputError(f"the FP4 logits adapter takes head dim 128 (4 blocks of 32), got {q.shape[-1]}")
        q_values, q_blocks = unfold_fp4_rows(q, None)
        k_values, k_blocks = unfold_fp4_rows(k, k_scales.reshape(-1))
        q_arg = (pack_e2m1(q_values).contiguous(), pack_ue8m0_rows(q_blocks).contiguous())
        kv_arg = (pack_e2m1(k_values).contiguous(), pack_ue8m0_rows(k_blocks).contiguous())
        logits = kernel(q_arg, kv_arg, weights.float().contiguous(), ks.contiguous(), ke.contiguous(),
                        clean_logits=True, logits_dtype=torch.float32)
        return logits.contiguous()

    ragged_mqa_logits_fp4.api = api  # type: ignore[attr-defined]
    return ragged_mqa_logits_fp4
