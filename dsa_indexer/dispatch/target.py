"""Targets: which accelerator a tensor lives on, as plain data.

A `Target` is parsed strictly from the vendors' own names (`sm90`, `gfx950`, `npu`, `cpu`; each vendor's
`Platform` parses its own) so that any target can be simulated on any machine (`DSA_INDEXER_TARGET=gfx950`) and
tests can walk the whole arch matrix without the hardware. Resolve a target once and pass it down
(`Indexer(target=...)`, ``ops.*(..., target=...)``); ``DSA_INDEXER_TARGET`` is read in one place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..contract.validate import IndexerInputError
from .platform import on_platforms_changed, platform_of, platforms, vendors

TARGET_ENV = "DSA_INDEXER_TARGET"


@dataclass(frozen=True)
class Target:
    """An accelerator family and architecture, e.g. ``Target("rocm", "gfx950")``.

    ``vendor`` names a registered `Platform` (dispatch/platform.py); ``soc`` carries a SoC name when the vendor
    reports one (Ascend); it never changes resolution.
    """

    vendor: str
    arch: str
    soc: str | None = None

    def __post_init__(self) -> None:
        if self.vendor not in vendors():
            raise ValueError(f"Target.vendor must be one of {vendors()}, got {self.vendor!r}")
        # Hashed on every op call (the registry's cache key): compute it once.
        object.__setattr__(self, "_hash", hash((self.vendor, self.arch, self.soc)))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    def __str__(self) -> str:
        return self.arch if self.soc is None else f"{self.arch}:{self.soc}"

    @property
    def is_accelerator(self) -> bool:
        """True for accelerators on which the pure-torch reference is a slow fallback."""
        return platform_of(self.vendor).is_accelerator

    @property
    def fp8_dtype(self) -> torch.dtype:
        """The fp8 e4m3 flavour this target's matrix units take (its platform says, per arch)."""
        return platform_of(self.vendor).fp8_dtype(self.arch)


def parse_target(name: str, source: str | None = None) -> Target:
    """Parse a vendor's arch name strictly: each registered platform tries it (``sm90``, ``gfx942:sramecc+``,
    ``npu:Ascend910B``, ``cpu`` with the built-in ones). ``source`` (where the name came from: ``--target``,
    ``target=``, the environment variable) is named in the error, and an arch that parses but that nothing lists
    warns once naming it (`warn_if_unknown_arch`)."""
    where = f"{source}: " if source else ""
    if not isinstance(name, str):
        raise IndexerInputError(f"{where}target must be a str such as 'sm90' or 'gfx950', got {type(name).__name__}")
    text = name.strip()
    for platform in platforms():
        target = platform.parse(text)
        if target is not None:
            if source is not None:
                warn_if_unknown_arch(target, source)
            return target
    accepted = "; ".join(p.names for p in platforms() if p.names)
    raise IndexerInputError(f"{where}unknown target {name!r}: expected {accepted}")


def device_of(device: torch.device | str | int | None) -> torch.device:
    """``device`` as a torch device; None: the first visible accelerator a platform names, else the CPU."""
    if device is None:
        for platform in platforms():
            if platform.default_device and platform.device_visible():
                return torch.device(platform.default_device)
        return torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


_detected: dict[torch.device, Target] = {}  # a plain dict, not functools.lru_cache: torch.compile traces this path


def _detect_hardware(device: torch.device) -> Target:
    target = _detected.get(device)
    if target is not None:
        return target
    probe = torch.device("cpu") if device.type == "meta" else device
    for platform in platforms():
        target = platform.detect(probe)
        if target is not None:
            _detected[device] = target
            return target
    raise ValueError(f"device type {device.type!r} is not served by any registered platform "
                     f"({', '.join(vendors())})")


def warm_detection() -> None:
    """Detect the host (and nothing that needs a driver) ahead of any traced call."""
    _detect_hardware(torch.device("cpu"))


def forget_detection() -> None:
    """Drop cached detections (a platform was registered or removed)."""
    _detected.clear()


on_platforms_changed(forget_detection)


def detect_target(device: torch.device | str | int | None = None, override: str | Target | None = None) -> Target:
    """The target of ``device`` (default: the current accelerator, else the CPU).

    ``override`` (argument) wins over ``DSA_INDEXER_TARGET`` (environment), which wins over the hardware.
    """
    if override is not None:
        return override if isinstance(override, Target) else parse_target(override, "target=")
    env = _environment_override()
    if env is not None:
        return env
    return _detect_hardware(device_of(device))


_UNREAD = object()
_env_target: object = _UNREAD  # the parsed DSA_INDEXER_TARGET, read once (os.environ lookups cost ~2 us)


def _environment_override() -> Target | None:
    """``DSA_INDEXER_TARGET``, the user's override: the one place it is read (parsed once, cached)."""
    global _env_target
    if _env_target is _UNREAD:
        name = os.environ.get(TARGET_ENV)
        _env_target = parse_target(name, TARGET_ENV) if name else None
    return _env_target  # type: ignore[return-value]


_registered_archs: set[str] = set()  # archs that registered implementations name (a plugin's sm103, say)
_arch_warned: set[tuple[str, str]] = set()


def note_registered_archs(names) -> None:
    """The registry reports the archs its implementations serve: a plugin that adds one makes it known."""
    _registered_archs.update(names)


def warn_if_unknown_arch(target: Target, source: str) -> None:
    """A simulated arch that parses but that neither its platform nor any registered implementation lists
    (``sm91``, ``gfx9500``) is most likely a typo: one warning per arch and source, from every entry point
    (``--target``, ``Indexer(target=)``, ``ops.*(target=)``, ``DSA_INDEXER_TARGET``)."""
    known = platform_of(target.vendor).archs
    if target.arch in known or target.arch in _registered_archs or (target.arch, source) in _arch_warned:
        return
    _arch_warned.add((target.arch, source))
    import warnings

    warnings.warn(f"dsa_indexer: {source} names {target.arch}, which the {target.vendor} platform does not list "
                  f"({', '.join(known)}) and no registered implementation serves; resolving for it anyway",
                  RuntimeWarning, stacklevel=3)


def reload_environment() -> None:
    """Re-read DSA_INDEXER_TARGET on the next call (`Registry.clear_cache` calls this)."""
    global _env_target
    _env_target = _UNREAD


def target_of_tensor(tensor: torch.Tensor, target: Target | None = None) -> Target:
    """The target an op on ``tensor`` runs for: ``target`` when the caller has resolved it (an `Indexer` holds
    its target), else the user's override, else the tensor's hardware. The hot path: all three are cached."""
    if target is not None:
        return target
    # Both caches read here, not through their functions: this runs on every public call (two calls less).
    override = _env_target if _env_target is not _UNREAD else _environment_override()
    if override is not None:
        return override  # type: ignore[return-value]
    device = tensor.device
    detected = _detected.get(device)
    return detected if detected is not None else _detect_hardware(device)


def known_targets() -> tuple[Target, ...]:
    """One target per arch every registered platform knows (`dsa-indexer explain all`, the arch matrix)."""
    return tuple(parse_target(arch) for platform in platforms() for arch in platform.archs)
