"""Targets: which accelerator a tensor lives on, as plain data.

A `Target` is parsed strictly from the vendors' own names (`sm90`, `gfx950`, `npu`, `cpu`) so that
any target can be simulated on any machine (`DSA_INDEXER_TARGET=gfx950`) and tests can walk the
whole arch matrix without the hardware.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

import torch

TARGET_ENV = "DSA_INDEXER_TARGET"

VENDORS = ("cuda", "rocm", "npu", "cpu")
KNOWN_CUDA_ARCHS = ("sm90", "sm100", "sm120")
KNOWN_ROCM_ARCHS = ("gfx942", "gfx950", "gfx1250")

_CUDA_RE = re.compile(r"^sm_?(\d{2,3})[af]?$")
_ROCM_RE = re.compile(r"^(gfx[0-9a-f]{3,4})(:[A-Za-z0-9_+\-:]*)?$")
_NPU_RE = re.compile(r"^npu(?:[:/](?P<soc>[A-Za-z0-9_.\-]+))?$")


@dataclass(frozen=True)
class Target:
    """An accelerator family and architecture, e.g. ``Target("rocm", "gfx950")``.

    ``soc`` carries the Ascend SoC name when torch_npu reports one; it never changes resolution.
    """

    vendor: str
    arch: str
    soc: str | None = None

    def __post_init__(self) -> None:
        if self.vendor not in VENDORS:
            raise ValueError(f"Target.vendor must be one of {VENDORS}, got {self.vendor!r}")
        # Hashed on every op call (the registry's cache key): compute it once.
        object.__setattr__(self, "_hash", hash((self.vendor, self.arch, self.soc)))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    def __str__(self) -> str:
        return self.arch if self.soc is None else f"{self.arch}:{self.soc}"

    @property
    def is_gpu(self) -> bool:
        """True for accelerators on which the pure-torch reference is a slow fallback."""
        return self.vendor != "cpu"

    @property
    def fp8_dtype(self) -> torch.dtype:
        """The fp8 e4m3 flavour this target's matrix units take (fnuz on MI300 / gfx942)."""
        return torch.float8_e4m3fnuz if self.arch == "gfx942" else torch.float8_e4m3fn


CPU = Target("cpu", "cpu")


def parse_target(name: str) -> Target:
    """Parse a vendor's arch name strictly.

    Accepts ``sm90`` / ``sm_90`` / ``sm90a`` (cuda), ``gfx942`` or torch's ``gcnArchName`` such as
    ``gfx942:sramecc+:xnack-`` (rocm, suffixes stripped), ``npu`` / ``npu:Ascend910B`` and ``cpu``.
    """
    if not isinstance(name, str):
        raise TypeError(f"target must be a str such as 'sm90' or 'gfx950', got {type(name).__name__}")
    text = name.strip()
    lower = text.lower()
    if lower == "cpu":
        return CPU
    match = _CUDA_RE.match(lower)
    if match:
        return Target("cuda", f"sm{match.group(1)}")
    match = _ROCM_RE.match(lower)
    if match:
        return Target("rocm", match.group(1))
    match = _NPU_RE.match(text if text.lower().startswith("npu") else lower)
    if match and lower.startswith("npu"):
        return Target("npu", "npu", match.group("soc"))
    raise ValueError(
        f"unknown target {name!r}: expected a CUDA arch (sm90, sm100, sm120), a ROCm arch "
        f"(gfx942, gfx950, gfx1250), 'npu' (optionally 'npu:<SoC>') or 'cpu'"
    )


def _device_of(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if _npu_available():
            return torch.device("npu")
        return torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


def _npu_available() -> bool:
    npu = getattr(torch, "npu", None)
    try:
        return bool(npu is not None and npu.is_available())
    except Exception:  # torch_npu present but no driver
        return False


@functools.lru_cache(maxsize=64)
def _detect_hardware(device: torch.device) -> Target:
    if device.type == "cpu" or device.type == "meta":
        return CPU
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        if torch.version.hip:
            return parse_target(props.gcnArchName)
        return Target("cuda", f"sm{props.major}{props.minor}")
    if device.type == "npu":
        soc = None
        try:
            soc = torch.npu.get_device_name(device.index or 0)  # type: ignore[attr-defined]
        except Exception:
            soc = None
        return Target("npu", "npu", soc.replace(" ", "") if soc else None)
    raise ValueError(f"device type {device.type!r} is not supported by dsa_indexer (cuda, npu or cpu)")


def detect_target(device: torch.device | str | int | None = None, override: str | Target | None = None) -> Target:
    """The target of ``device`` (default: the current accelerator, else the CPU).

    ``override`` (argument) wins over ``DSA_INDEXER_TARGET`` (environment), which wins over the hardware.
    """
    if override is not None:
        return override if isinstance(override, Target) else parse_target(override)
    env = os.environ.get(TARGET_ENV)
    if env:
        return parse_target(env)
    return _detect_hardware(_device_of(device))


_UNREAD = object()
_env_target: object = _UNREAD  # the parsed DSA_INDEXER_TARGET, read once (os.environ lookups cost ~2 us)


def reload_environment() -> None:
    """Re-read DSA_INDEXER_TARGET on the next op call (`Registry.clear_cache` calls this)."""
    global _env_target
    _env_target = _UNREAD


def target_of_tensor(tensor: torch.Tensor) -> Target:
    """The target an op on ``tensor`` runs for; the hot path, so detection and the override are cached."""
    global _env_target
    override = _env_target
    if override is _UNREAD:
        name = os.environ.get(TARGET_ENV)
        override = _env_target = parse_target(name) if name else None
    if override is not None:
        return override  # type: ignore[return-value]
    return _detect_hardware(tensor.device)
