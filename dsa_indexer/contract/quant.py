"""A pre-quantized activation (fp8 data + fp32 scales + the layout it was made with).

Attention usually quantizes the normed ``q_lora`` for its own ``wq_b`` already; the indexer's ``wq_b`` takes the
same input with the same block-fp8 recipe, so it can reuse that tensor and skip one quant launch. Reuse is
only safe when the layout matches what the resolved GEMM implementation accepts and the scales are in the
recipe's format (``IndexerConfig.scale_fmt``: "ue8m0" power-of-two or plain "fp32"), so the result is
bit-identical to quantizing again under that recipe; `Fp8GroupLayout` is the tag that lets the indexer decide,
and `reuse_rejection` says why not when it cannot.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

PRODUCER_ROUNDED = "bf16_rounded"  # quantized the bf16 tensor that was returned (the library's producers)
PRODUCER_UNROUNDED = "fp32_unrounded"  # quantized before rounding to bf16 (aiter's fused kernel); may differ by 1 ulp
SCALE_FMTS = ("fp32", "ue8m0")  # block scales as plain fp32, or powers of two (what a ue8m0 byte holds exactly)


def scale_format(scales: torch.Tensor) -> str:
    """The ``scale_fmt`` fact these fp32 scales satisfy: "ue8m0" when every one is a positive normal power of two
    (what a ue8m0 byte holds exactly), else "fp32". It reads the values: a host sync on a GPU, so it runs once where
    scales are loaded or made (`Indexer` at weight load), never inside a step, a plan build or a graph capture."""
    if scales.numel() == 0:
        return "ue8m0"
    bits = scales.detach().float().contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    powers = ((bits & ~0x7F800000) == 0) & (exponent > 0) & (exponent < 255)
    return "ue8m0" if bool(powers.all()) else "fp32"


@dataclass(frozen=True)
class Fp8GroupLayout:
    """How an fp8 activation was quantized.

    group_size: elements per scale along the last dim. ue8m0: scales are powers of two.
    scale_major: "row" (scales [rows, groups] row-major) or "mn" (column-major, TMA-aligned for DeepGEMM).
    packed_scales: scales packed 4 x ue8m0 per int32 (Blackwell DeepGEMM). rows: the number of valid rows.
    producer: PRODUCER_ROUNDED or PRODUCER_UNROUNDED.
    """

    group_size: int = 128
    ue8m0: bool = False
    scale_major: str = "row"
    packed_scales: bool = False
    rows: int = 0
    fp8_dtype: torch.dtype | None = torch.float8_e4m3fn  # None in a declared input layout: the target's flavour
    producer: str = PRODUCER_ROUNDED


@dataclass(frozen=True)
class QuantizedActivation:
    """fp8 ``data`` [rows, K], fp32 ``scales`` [rows, K // group_size], and their ``layout``."""

    data: torch.Tensor
    scales: torch.Tensor
    layout: Fp8GroupLayout

    def __iter__(self):  # allows ``x_fp8, scales, layout = q_lora_quant``
        return iter((self.data, self.scales, self.layout))

    def select_rows(self, rows: slice | torch.Tensor) -> "QuantizedActivation":
        """The same activation for a subset of its rows (a slice or an index tensor), its layout's row count to
        match: what a chunked or split prefill hands the GEMM for its rows."""
        data = self.data[rows]
        return QuantizedActivation(data, self.scales[rows], dataclasses.replace(self.layout, rows=data.shape[0]))


# What the library's block-fp8 GEMMs take: per-token groups of 128, plain fp32 row-major scales, in the target's fp8
# flavour (the reference and Triton GEMMs take e4m3fn or e4m3fnuz, as long as both operands match).
GEMM_INPUT_LAYOUT = Fp8GroupLayout(fp8_dtype=None)


def reuse_rejection(quant: QuantizedActivation, q_lora: torch.Tensor, wq_b_is_block_fp8: bool,
                    wanted: Fp8GroupLayout = GEMM_INPUT_LAYOUT, allow_unrounded: bool = False) -> str | None:
    """None when ``quant`` can feed ``wq_b`` in place of quantizing ``q_lora``; else the drop reason.

    A tensor quantized before bf16 rounding (PRODUCER_UNROUNDED, aiter's fused kernel) may differ from
    re-quantizing ``q_lora`` in the last fp8 bit, so it is reused only when ``allow_unrounded`` says so (the
    default on targets whose platform reuses it, AMD, as the seed integration does)."""
    if not wq_b_is_block_fp8:
        return "wq_b is not block-fp8 128x128 (bf16 weights take the bf16 q_lora)"
    lay = quant.layout
    rows = q_lora.shape[0]
    if quant.data.shape[0] != rows or lay.rows != rows:
        kind = "trimmed" if min(quant.data.shape[0], lay.rows) < rows else "padded"
        return f"rows {kind}: q_lora_quant has {quant.data.shape[0]} rows (layout says {lay.rows}), q_lora has {rows}"
    if quant.data.shape[1] != q_lora.shape[1]:
        return f"width mismatch: q_lora_quant has {quant.data.shape[1]} columns, q_lora has {q_lora.shape[1]}"
    if lay.packed_scales:
        return "scales are packed ue8m0 (Blackwell layout); this GEMM takes fp32 scales"
    if lay.ue8m0 != wanted.ue8m0:
        # Both are fp32 tensors, but only the recipe's format is bit-identical to what the indexer would quantize.
        return (f"scales are {'ue8m0' if lay.ue8m0 else 'plain fp32'}, the recipe wants "
                f"{'ue8m0' if wanted.ue8m0 else 'plain fp32'} (IndexerConfig.scale_fmt="
                f"{'ue8m0' if wanted.ue8m0 else 'fp32'}; quantize with ue8m0={wanted.ue8m0})")
    if lay.group_size != wanted.group_size:
        return f"group size {lay.group_size}, the GEMM wants {wanted.group_size}"
    if lay.scale_major != wanted.scale_major:
        return f"scales are {lay.scale_major}-major, the GEMM wants {wanted.scale_major}-major"
    if wanted.fp8_dtype is not None and lay.fp8_dtype != wanted.fp8_dtype:
        return f"fp8 type {lay.fp8_dtype}, this target's GEMM takes {wanted.fp8_dtype}"
    if lay.producer != PRODUCER_ROUNDED and not allow_unrounded:
        return (f"producer {lay.producer!r} quantized before bf16 rounding (may differ in the last fp8 bit); "
                f"this target keeps the bit-identical rule; set Indexer.allow_unrounded_q_lora_quant = True to accept "
                f"it")
    if quant.data.device != q_lora.device:
        return f"q_lora_quant is on {quant.data.device}, q_lora on {q_lora.device}"
    return None
