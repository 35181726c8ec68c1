"""DeepGEMM's FP4 logits (sm100 only; DeepGEMM's csrc/apis/attention.hpp at commit 54e2261, docs/v4.md): the
packing of the FP4 operands and the adapters of ``fp8_fp4_mqa_logits`` and ``fp8_fp4_paged_mqa_logits``, each with
the matching reference kernel's signature and result. Nothing here imports ``deep_gemm``: the factories in
`backends/cuda/__init__.py` pass the module in. The vendor-free FP4 packing (e2m1 nibbles, ue8m0 bytes, the 68-byte
cache layout) lives in `contract/cache.py`."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

import torch

from ...contract.cache import E2M1_GRID, FP4_BYTES_PER_TOKEN, PAGE_SIZE  # noqa: F401 (E2M1_GRID re-exported)
from ...contract.cache import pack_e2m1 as pack_fp4_bytes
from ...contract.validate import IndexerInputError, ranges_checked
from .deepgemm_api import FP4_LOGITS_BLOCK, METADATA, PAGED_NEW, RAGGED_NEW, DeepGemmApi
from .deepgemm_kernels import _num_sms, mask_tail_, require_powers_of_two, step_memo, ue8m0_bytes

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
    """fp32 values on the e2m1 grid [..., D] as DeepGEMM's packed FP4 (int8 [..., D / 2]): the bytes of
    `contract.cache.pack_e2m1` (element 2i in the low nibble, ``sign << 3 | code``), as the int8 DeepGEMM takes."""
    return pack_fp4_bytes(values).view(torch.int8)


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


def make_fp4_paged_mqa_logits(module: ModuleType, api: DeepGemmApi) -> Callable[..., torch.Tensor]:
    """Decode logits over V4's FP4 pages (``paged64_fp4_e2m1``, 68 bytes per token: DeepGEMM's own paged FP4 layout,
    passed as is) through ``fp8_fp4_paged_mqa_logits`` with q's scales given (FP4 q; DeepGEMM runs it on sm100 only).
    Same signature and result as the `paged_mqa_logits` op: q [B, N, H, 128] is the library's folded fp8 q (its row
    scale in ``weights``), unfolded exactly (`unfold_fp4_rows`) into packed e2m1 int8 [B, N, H, 64] and one int32 of
    four ue8m0 block scales per (row, head). 2-D context lengths, schedule metadata once per step (shared with the
    layers through `step_memo`), the tail past each row's length masked here (``clean_logits=False``, as the fp8
    adapter: DeepGEMM leaves garbage there)."""
    if api.paged_fn != PAGED_NEW:
        raise RuntimeError(f"{api.describe()} has no FP4 paged logits ({PAGED_NEW} with {METADATA}, DeepGEMM 2.x)")
    kernel = getattr(module, PAGED_NEW)
    metadata = getattr(module, METADATA)
    extra: dict[str, Any] = {}
    if "clean_logits" in api.paged_params:
        extra["clean_logits"] = False
    if "logits_dtype" in api.paged_params:
        extra["logits_dtype"] = torch.float32

    def schedule(context_lens: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        num_sms = _num_sms(module, device)

        def compute() -> tuple[torch.Tensor, torch.Tensor]:
            # Rows with no visible key would make DeepGEMM fault: one key to read; the mask below uses the true ones.
            lens = context_lens.contiguous().clamp_min(1)
            return lens, metadata(lens, PAGE_SIZE, num_sms)

        return step_memo(context_lens, ("deepgemm_fp4_paged_schedule", num_sms), compute)

    def paged_mqa_logits_fp4(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                             context_lens: torch.Tensor, block_table: torch.Tensor, max_context_len: int
                             ) -> torch.Tensor:
        if q.shape[-1] != 4 * FP4_LOGITS_BLOCK:
            raise IndexerInputError(f"the FP4 paged logits adapter takes head dim 128 (4 blocks of 32), got "
                                    f"{q.shape[-1]}")
        if kv_cache.shape[-1] != FP4_BYTES_PER_TOKEN:
            raise IndexerInputError(f"the FP4 paged logits adapter reads the paged64_fp4_e2m1 pages "
                                    f"({FP4_BYTES_PER_TOKEN} bytes per token), got {kv_cache.shape[-1]} per token")
        if ranges_checked(context_lens) and not bool((context_lens[:, -1:] >= context_lens).all()):
            raise IndexerInputError(f"{api.describe()} computes keys up to context_lens[b, -1] for every row of "
                                    "request b: context_lens[b, j] must be <= context_lens[b, -1]")
        q_values, q_blocks = unfold_fp4_rows(q, None)
        q_arg = (pack_e2m1(q_values).contiguous(), pack_ue8m0_rows(q_blocks).contiguous())
        lens, meta = schedule(context_lens, q.device)
        logits = kernel(q_arg, kv_cache, weights.float().contiguous(), lens, block_table, meta, max_context_len,
                        **extra)
        mask_tail_(logits, context_lens.reshape(-1))
        return logits if logits.is_contiguous() else logits.contiguous()

    paged_mqa_logits_fp4.api = api  # type: ignore[attr-defined]
    return paged_mqa_logits_fp4


def check_fp4_paged_adapter(adapter: Callable[..., torch.Tensor], device: torch.device | str) -> None:
    """Run ``adapter`` once on fresh random FP4 keys and folded FP4 q against the reference (the factory's self-test
    on the GPU: the adapter has never run on a real sm100; a failure rejects it and resolution moves on)."""
    from ...contract.cache import IndexKCache, store_fp4_rows
    from ..reference import kernels as ref

    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    pages, batch, next_n, heads = 6, 2, 2, 64
    values, scales = ref.quant_fp4_e2m1(torch.randn(pages * 64, 128, generator=gen), FP4_LOGITS_BLOCK)
    cache = IndexKCache.allocate(pages, layout="paged64_fp4_e2m1")
    store_fp4_rows(cache.data, torch.arange(pages * 64), values, scales)
    q, row_scale = ref.rotate_quant_fp4(torch.randn(batch, next_n, heads, 128, generator=gen), FP4_LOGITS_BLOCK)
    weights = torch.randn(batch * next_n, heads, generator=gen) * row_scale.reshape(batch * next_n, heads)
    table = torch.randperm(pages, generator=gen).to(torch.int32).view(batch, 3)
    lens = torch.tensor([[99, 100], [190, 191]], dtype=torch.int32)
    args = [t.to(device) for t in (q, cache.data, weights, lens, table)]
    got = adapter(*args, 192).cpu()
    want = ref.paged_mqa_logits(q, cache.data, weights, lens, table, 192)
    if got.shape != want.shape or not torch.equal(torch.isneginf(got), torch.isneginf(want)):
        raise RuntimeError("the DeepGEMM FP4 paged logits differ from the reference in shape or -inf pattern")
    visible = ~torch.isneginf(want)
    diff = float((got[visible] - want[visible]).abs().max())
    bound = 2e-3 * float(want[visible].abs().max())
    if not diff <= bound:
        raise RuntimeError(f"the DeepGEMM FP4 paged logits differ from the reference: max |diff| {diff:.3g} > "
                           f"{bound:.3g}")
