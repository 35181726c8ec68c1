"""The CPU platform: the host, where the pure-torch reference is the implementation, not a slow fallback."""

from __future__ import annotations

import torch

from ...dispatch.platform import Platform
from ...dispatch.target import Target


def _parse(name: str) -> Target | None:
    return Target("cpu", "cpu") if name.lower() == "cpu" else None


def _detect(device: torch.device) -> Target | None:
    return Target("cpu", "cpu") if device.type == "cpu" else None


PLATFORM = Platform(vendor="cpu", archs=("cpu",), parse=_parse, detect=_detect, device_visible=lambda: True,
                    is_accelerator=False, names="'cpu'")
