"""The Ascend platform: ``npu`` (optionally ``npu:<SoC>``), devices of torch_npu's ``npu`` type."""

from __future__ import annotations

import re

import torch

from ...dispatch.environment import module_probe
from ...dispatch.platform import Platform
from ...dispatch.target import Target

# The SoC as torch_npu.npu.get_device_name() names it (Ascend910B3, Ascend910_9392, Ascend310P3): "Ascend" and a
# three-digit model, then the variant. It never changes resolution, so a misspelled one would pass unnoticed.
_NAME = re.compile(r"^npu(?:[:/](?P<soc>Ascend[0-9]{3}[A-Za-z0-9_]*))?$", re.IGNORECASE)


def _parse(name: str) -> Target | None:
    match = _NAME.match(name)
    return Target("npu", "npu", match.group("soc")) if match else None


def _visible() -> bool:
    npu = getattr(torch, "npu", None)
    try:
        return bool(npu is not None and npu.is_available())
    except Exception:  # noqa: BLE001 - torch_npu present but no driver
        return False


def _detect(device: torch.device) -> Target | None:
    if device.type != "npu":
        return None
    try:
        soc = torch.npu.get_device_name(device.index or 0)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001
        soc = None
    return Target("npu", "npu", soc.replace(" ", "") if soc else None)


PLATFORM = Platform(
    vendor="npu", archs=("npu",), parse=_parse, detect=_detect, device_visible=_visible, default_device="npu",
    probes={"torch_npu": module_probe("torch_npu", "pip install 'dsa-indexer[npu]' with the CANN toolkit")},
    libraries={"torch_npu": "torch_npu"},
    distributions=("torch_npu",),
    # torch_npu's indexers read plain paged keys: bf16 for V3.2 (npu_lightning_indexer), int8 + fp16 scales for V4's
    # C4 indexer (npu_quant_lightning_indexer takes no compression ratio, so that scoring runs on the reference; the
    # int8 store and prologues run on torch_npu)
    cache_layouts={1: "paged64_bf16", 4: "paged64_int8"},
    names="'npu' (optionally 'npu:<SoC>', the SoC as torch_npu names it: Ascend910B3, Ascend910_9392 ...)")
