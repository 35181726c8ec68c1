"""The Ascend backend: the probe of the environment fact ``torch_npu``, and no op implementations (yet).

torch_npu's indexer kernel, ``npu_lightning_indexer``, takes bf16 queries and a bf16 paged key cache
``[blocks, block_size, 1, 128]``; every op of this library takes fp8 operands and the fp8 132-byte cache (and
torch_npu has no fp8 path for them), so no op signature here can be met by a torch_npu kernel and none is
registered: resolution on target ``npu`` picks the pure-torch reference (which runs on NPU tensors) and says why
(the Triton kernels do not serve ``npu``). `lightning.npu_lightning_indexer_bf16` wraps the NPU kernel for callers
with a bf16 key cache; docs/backends-amd-npu.md says what registering it would take.

The probe replaces the default "is it installed" check: torch_npu must import (inside a try: it needs the CANN
toolkit) and ``torch.npu.is_available()`` must hold. On other machines it returns the reason.
"""

from __future__ import annotations

import torch

from ...dispatch.plugins import hookimpl
from ...dispatch.registry import Registry
from ...dispatch.vendor import VendorLibrary
from .lightning import npu_lightning_indexer_bf16

__all__ = ["UNREGISTERED", "npu_lightning_indexer_bf16", "torch_npu_probe"]

INSTALL_HINT = "pip install 'dsa-indexer[npu]' (torch-npu) with the CANN toolkit"

UNREGISTERED = {
    "lightning_indexer": "torch_npu.npu_lightning_indexer takes bf16 q and a bf16 [blocks, block_size, 1, 128] key "
                         "cache; this op takes fp8 q and the fp8 132-byte cache (npu_lightning_indexer_bf16 wraps "
                         "the kernel for bf16 callers)",
    "paged_mqa_logits": "no torch_npu kernel returns the logits themselves for an fp8 cache",
    "ragged_mqa_logits": "no torch_npu kernel for fp8 ragged logits",
    "topk_indices": "torch.topk runs on NPU tensors already: the reference implementation is the NPU path",
    "quant_fp8_groups": "torch_npu has no e4m3 fp8 quant matching this recipe (its dynamic quant is int8)",
    "rmsnorm_quant_fp8": "as quant_fp8_groups",
    "q_prologue": "fp8 output; see quant_fp8_groups",
    "k_prologue_store": "writes the fp8 cache; see quant_fp8_groups",
    "gemm_fp8_blockscale": "no e4m3 block-scaled GEMM in torch_npu for these operands",
}


def _npu_visible(module) -> str | None:
    npu = getattr(torch, "npu", None)
    try:
        available = bool(npu is not None and npu.is_available())
    except Exception as exc:  # noqa: BLE001
        return f"torch_npu imported but torch.npu.is_available() failed ({type(exc).__name__}: {exc})"
    return None if available else "torch_npu imported but torch.npu.is_available() is False (no NPU visible)"


# The shared vendor-library probe (dispatch/vendor.py): no API detection or self-test yet (nothing is registered).
LIBRARY = VendorLibrary(module="torch_npu", install_hint=INSTALL_HINT, after_import=_npu_visible,
                        catch_base_exceptions=True)  # a missing CANN toolkit must not take the host down


def torch_npu_probe() -> str | None:
    """None when torch_npu imports and an NPU is visible; else the reason. Never raises."""
    return LIBRARY.probe()


@hookimpl
def dsa_indexer_register(registry: Registry) -> None:
    registry.add_probe("torch_npu", torch_npu_probe)  # a simulated environment keeps its fixed facts
