"""Platforms: what a vendor knows about its own hardware, kept in that vendor's backend folder.

A `Platform` says how its arch names parse, how a torch device of its kind is recognized, which fp8 flavour each arch
takes, and which environment facts its libraries and devices add (the probes). Dispatch only loops over the
registered platforms: it names no vendor library and no backend module. Every platform, built-in or third-party,
is an entry point of the group ``dsa_indexer.platforms`` (`discovery`; the built-in ones are declared in
pyproject.toml), or is added by `register_platform`, so a new vendor is a folder plus an entry point and a new arch
is a line in its platform. (``Target`` in the annotations below is `dispatch.target.Target`, which imports this
module.)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from . import discovery

Probe = Callable[[], "str | None"]  # an environment fact's probe: None when the fact holds, else the reason

PLATFORM_ENTRY_POINT_GROUP = "dsa_indexer.platforms"


@dataclass(frozen=True)
class Platform:
    """One accelerator family. ``parse(name)`` -> Target or None (not this vendor's name); ``detect(device)`` ->
    Target or None (not this vendor's device); ``device_visible()`` -> whether a device of this kind is present."""

    vendor: str
    archs: tuple[str, ...]  # the archs this library knows (explain all, the arch matrix); others may still parse
    parse: Callable[[str], "Target | None"]
    detect: Callable[[torch.device], "Target | None"]
    device_visible: Callable[[], bool] = lambda: False
    fp8_dtypes: Mapping[str, torch.dtype] = field(default_factory=dict)  # arch -> e4m3 flavour (default e4m3fn)
    probes: Mapping[str, "Probe"] = field(default_factory=dict)  # environment facts of this vendor
    default_device: str | None = None  # the torch device type used when a device must be guessed
    is_accelerator: bool = True  # False for the CPU: the reference is not a slow fallback there
    names: str = ""  # the names parse accepts, for error messages
    # Reuse a q_lora fp8 copy quantized before bf16 rounding (1 fp8 ulp from re-quantizing) by default?
    reuse_unrounded_quant: bool = False
    libraries: Mapping[str, str] = field(default_factory=dict)  # fact -> module: installed but failing warns once
    distributions: tuple[str, ...] = ()  # the vendor's Python packages whose versions `dsa-indexer info` shows
    # compress ratio -> the index-K cache layout `Indexer.allocate_cache` picks (default: the fp8 132-byte pages)
    cache_layouts: Mapping[int, str] = field(default_factory=dict)
    # The on-disk caches this vendor's first-use compiles fill ({"name", "path", "env"} each), and the builds made
    # so far in this process ({"source", "seconds", ...} each): what `dsa-indexer run` reports around its warm-up.
    # Reading them imports no vendor library.
    compile_caches: Callable[[], list] = lambda: []
    compile_builds: Callable[[], list] = lambda: []

    def fp8_dtype(self, arch: str) -> torch.dtype:
        return self.fp8_dtypes.get(arch, torch.float8_e4m3fn)

    def cache_layout(self, compress_ratio: int) -> str:
        return self.cache_layouts.get(compress_ratio, "paged64_fp8_e4m3")


_PLATFORMS: dict[str, Platform] = {}
_lock = threading.RLock()
_loaded = False
load_errors: list[str] = []


_on_change: list[Callable[[], None]] = []  # listeners (the target module's cached detection)


def on_platforms_changed(listener: Callable[[], None]) -> None:
    """Call ``listener`` whenever a platform is registered or removed (so `target` forgets cached detections
    without this module importing it)."""
    _on_change.append(listener)


def register_platform(platform: Platform) -> None:
    """Add (or replace) the platform of ``platform.vendor``; clears the cached hardware detection."""
    with _lock:
        _PLATFORMS[platform.vendor] = platform
    for listener in _on_change:
        listener()


def unregister_platform(vendor: str) -> None:
    with _lock:
        _PLATFORMS.pop(vendor, None)
    for listener in _on_change:
        listener()


def _load() -> None:
    """Import the built-in platform modules and the platform entry points, once. A failure is recorded, not fatal."""
    global _loaded
    if _loaded:  # the hot path (and what torch.compile traces): no lock once loaded
        return
    with _lock:
        if _loaded:
            return
        _loaded = True
        for entry in discovery.entries(PLATFORM_ENTRY_POINT_GROUP):  # built-in ones first, then third-party
            try:
                register_platform(entry.load())
            except Exception as exc:  # noqa: BLE001
                load_errors.append(f"{entry.name} ({entry.value}): {type(exc).__name__}: {exc}")


def platforms() -> tuple[Platform, ...]:
    _load()
    return tuple(_PLATFORMS.values())


def platform_of(vendor: str) -> Platform:
    _load()
    try:
        return _PLATFORMS[vendor]
    except KeyError:
        raise ValueError(f"no platform is registered for vendor {vendor!r} (registered: "
                         f"{', '.join(sorted(_PLATFORMS))})") from None


def vendors() -> tuple[str, ...]:
    return tuple(p.vendor for p in platforms())


def vendor_probes() -> dict[str, "Probe"]:
    """Every platform's environment facts (a vendor library's probe, its device check)."""
    probes: dict[str, "Probe"] = {}
    for platform in platforms():
        probes.update(platform.probes)
    return probes


def vendor_libraries() -> dict[str, str]:
    """fact -> importable module of every platform's vendor libraries."""
    libraries: dict[str, str] = {}
    for platform in platforms():
        libraries.update(platform.libraries)
    return libraries
