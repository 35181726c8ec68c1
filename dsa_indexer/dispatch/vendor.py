"""One probe for every vendor library: installed -> device check -> import -> feature detection -> one-time
self-test -> a cached verdict with its reason.

A backend describes its library (`VendorLibrary`: the module, how to check the device, how to detect the API it
adapts, whether that API is usable, how to self-test it) and registers ``library.probe`` as the environment fact's
probe. The environment caches the answer, and an installed library that fails is reported once (environment.py).
Nothing here names a library: the backends pass their own.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import torch

log = logging.getLogger("dsa_indexer")

LIBRARIES: dict[str, "VendorLibrary"] = {}  # module name -> its probe description, filled as backends define them


def importable_from(module: str) -> str | None:
    """Where ``module`` would be imported from (its file or folder), None when it is not importable. Distribution
    metadata can disagree (a source build of DeepGEMM has none), so `info` reports this too."""
    if module in sys.modules:
        return getattr(sys.modules[module], "__file__", None) or "(loaded)"
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    return spec.origin or ", ".join(spec.submodule_search_locations or []) or "(namespace)"


@dataclass
class VendorLibrary:
    """How to probe one vendor library. Each callable may be a lambda that looks its target up at call time (so
    tests can patch the backend module's functions).

    - ``device_check()`` -> reason or None: the hardware and torch build this library needs (before importing it).
    - ``detect(module)`` -> api: feature detection on the imported module (names and signatures, never versions).
    - ``usable(api)`` -> reason or None: the detected API offers something the adapters use.
    - ``self_test(module, api, device)`` -> api: run the adapters once against the reference; raise on a mismatch.
    - ``after_import(module)`` -> reason or None: checks that need the module (a device query through it).
    - ``catch_base_exceptions``: the import may call ``exit()`` (a library whose import needs its vendor toolkit).
    """

    module: str
    install_hint: str
    device_check: Callable[[], str | None] = lambda: None
    detect: Callable[[ModuleType], Any] = lambda module: module
    usable: Callable[[Any], str | None] = lambda api: None
    self_test: Callable[[ModuleType, Any, torch.device], Any] | None = None
    after_import: Callable[[ModuleType], str | None] = lambda module: None
    describe: Callable[[Any], str] = lambda api: str(api)
    catch_base_exceptions: bool = False
    # A library this package builds from its own sources (the CUDA backend's nvcc-built kernels): ``load()`` builds
    # or loads it in place of importing ``module`` (then only the library's name); there is nothing to install.
    load: Callable[[], Any] | None = None
    needs_eager: bool = True  # the self-test syncs with the host: refuse to run it inside graph capture

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self.detected: tuple[ModuleType | None, Any] | None = None
        LIBRARIES[self.module] = self  # `dsa-indexer info` describes what each probed library provides

    def description(self) -> str | None:
        """What the probe found (the backend's ``describe`` of the detected API), None before a passing probe."""
        api = self.detected_api()
        return None if api is None else self.describe(api)

    def installed(self) -> bool:
        if self.load is not None or self.module in sys.modules:
            return True
        try:
            return importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):
            return False

    def detected_api(self) -> Any:
        """The API the probe found and self-tested in this process (None before the probe ran or when it failed)."""
        return self.detected[1] if self.detected is not None else None

    def reset(self) -> None:
        with self._lock:
            self.detected = None

    def probe(self) -> str | None:
        """None when the library is usable here; else the reason. Never raises; caches the detected API."""
        name = self.module
        if not self.installed():
            return f"{name} is not installed ({self.install_hint})"
        reason = self.device_check()
        if reason is not None:
            return reason
        if self.needs_eager and self.self_test is not None and torch.cuda.is_available() \
                and torch.cuda.is_current_stream_capturing():
            reason = (f"{name} was first resolved inside graph capture, where its self-test cannot run; run the step "
                      "once eagerly before capturing")
            log.warning("dsa_indexer: %s", reason)
            return reason
        try:
            module = self.load() if self.load is not None else importlib.import_module(name)
            api = self.detect(module)
        except BaseException as exc:  # noqa: BLE001 - a broken build must not take the host down
            if isinstance(exc, KeyboardInterrupt) or not (self.catch_base_exceptions or isinstance(exc, Exception)):
                raise
            if self.load is not None:
                return f"{name} failed to build or load ({type(exc).__name__}: {exc})"
            return f"{name} is installed but failed to import ({type(exc).__name__}: {exc})"
        reason = self.after_import(module) or self.usable(api)
        if reason is not None:
            return reason
        if self.self_test is not None:
            try:
                api = self.self_test(module, api, torch.device("cuda", torch.cuda.current_device()))
            except Exception as exc:  # noqa: BLE001
                return f"{self.describe(api)} self-test failed: {exc}"
        with self._lock:
            self.detected = (module, api)
        log.info("dsa_indexer: %s is usable", self.describe(api))
        return None
