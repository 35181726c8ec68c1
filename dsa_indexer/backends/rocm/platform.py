"""The AMD platform: gfx archs (torch's gcnArchName with its feature suffixes), HIP devices, e4m3fnuz on gfx942."""

from __future__ import annotations

import re

import torch

from ...dispatch.environment import module_probe
from ...dispatch.platform import Platform
from ...dispatch.target import Target

ARCHS = ("gfx942", "gfx950", "gfx1250")
FP8_DTYPES = {"gfx942": torch.float8_e4m3fnuz}  # MI300's matrix units take fnuz; the others e4m3fn
_NAME = re.compile(r"^(gfx[0-9a-f]{3,4})(:[A-Za-z0-9_+\-:]*)?$")
# What a user may write: an arch, then LLVM's target-ID features (each on or off), e.g. gfx942:sramecc+:xnack-.
_USER_NAME = re.compile(r"^(gfx[0-9a-f]{3,4})(?::(?:sramecc|xnack)[+-])*$")


def _parse_reported(name: str) -> Target | None:
    """The arch torch reports (gcnArchName): lenient about its suffix, so detection never fails on a new feature."""
    match = _NAME.match(name.lower())
    return Target("rocm", match.group(1)) if match else None


def _parse(name: str) -> Target | None:
    match = _USER_NAME.match(name.lower())
    return Target("rocm", match.group(1)) if match else None


def _visible() -> bool:
    return torch.cuda.is_available() and bool(torch.version.hip)


def _detect(device: torch.device) -> Target | None:
    if device.type != "cuda" or not torch.version.hip:
        return None
    return _parse_reported(torch.cuda.get_device_properties(device).gcnArchName)


PLATFORM = Platform(
    vendor="rocm", archs=ARCHS, parse=_parse, detect=_detect, device_visible=_visible, default_device="cuda",
    fp8_dtypes=FP8_DTYPES,
    reuse_unrounded_quant=True,  # as SGLang's gfx950 / gfx1250 integration does with aiter's fused RMSNorm + quant
    probes={"aiter": module_probe("aiter", "pip install 'dsa-indexer[rocm]' on a ROCm machine")},
    libraries={"aiter": "aiter"},
    distributions=("amd-aiter",),
    names="a ROCm arch (gfx942, gfx950, gfx1250; optionally with target-ID features, e.g. gfx942:sramecc+:xnack-)")
