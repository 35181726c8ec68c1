"""Facts about the software on this machine that decide which implementations can run.

Resolution reads these facts only through an `Environment`, so tests can simulate any machine:
``Environment.simulated(gpu=True, triton=True)`` describes a GPU machine with Triton and no vendor library.
A fact is a name mapped to ``None`` (present and working) or a reason string (absent or broken).
Real facts are probed lazily, once. The portable facts (``gpu``, ``triton``) are here; each platform brings its
vendor's (dispatch/platform.py), and a backend replaces a probe with a deeper one (a self-test) through
`Registry.add_probe`.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import warnings
from typing import Callable, Mapping

import torch

from .platform import Probe, platforms, vendor_libraries, vendor_probes



def module_probe(module: str, hint: str) -> Probe:
    """A probe that says whether ``module`` can be found, without importing it."""

    def probe() -> str | None:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        return None if found else f"'{module}' is not installed ({hint})"

    return probe


def _gpu_probe() -> str | None:
    for platform in platforms():
        if platform.is_accelerator and platform.device_visible():
            return None
    return "no accelerator device is visible to torch"


def _triton_probe() -> str | None:
    found = module_probe("triton", "pip install triton")()
    if found is not None:
        return found
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return _gpu_probe() and "triton needs a GPU (or TRITON_INTERPRET=1 for the CPU interpreter)"


BUILTIN_PROBES: dict[str, Probe] = {
    "gpu": _gpu_probe,
    "triton": _triton_probe,
}


def default_probes() -> dict[str, Probe]:
    """The portable facts plus every registered platform's (its vendor libraries, its devices)."""
    return {**BUILTIN_PROBES, **vendor_probes()}


_warned: set[str] = set()


def _warn_if_installed(fact: str, module: str, reason: str) -> None:
    """A vendor library that is installed but fails its probe or self-test is a surprise: say so once, with the
    reason (its implementations then fall back to the next candidate)."""
    if fact in _warned:
        return
    try:
        installed = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        installed = False
    if installed:
        _warned.add(fact)
        warnings.warn(f"dsa_indexer: {module} is installed but not usable, so its implementations are skipped: "
                      f"{reason}", RuntimeWarning, stacklevel=3)


class Environment:
    """A mapping fact -> None (usable) or the reason it is not; probed lazily and cached."""

    def __init__(self, probes: Mapping[str, Probe] | None = None, facts: Mapping[str, str | None] | None = None,
                 name: str = "detected", libraries: Mapping[str, str] | None = None) -> None:
        if libraries is None and probes is None:
            libraries = vendor_libraries()
        self._libraries = dict(libraries or {})
        self._probes = dict(default_probes() if probes is None else probes)
        self._facts: dict[str, str | None] = dict(facts or {})
        self._lock = threading.Lock()
        self.name = name
        self.simulated = False

    @classmethod
    def simulated(cls, **present: bool | str) -> "Environment":
        """An environment with fixed facts: ``True`` = present, ``False`` or a reason string = absent.

        Facts not named are absent ("not in the simulated environment").
        """
        facts: dict[str, str | None] = {}
        for fact, value in present.items():
            if value is True:
                facts[fact] = None
            elif value is False:
                facts[fact] = f"'{fact}' is absent in the simulated environment"
            else:
                facts[fact] = str(value)
        label = ",".join(f"{k}={'yes' if v is None else 'no'}" for k, v in sorted(facts.items()))
        env = cls(probes={}, facts=facts, name=f"simulated({label})")
        env.simulated = True
        return env

    def add_probe(self, fact: str, probe: Probe) -> None:
        """Probe ``fact`` with ``probe`` (a backend's self-test). A simulated environment keeps its fixed facts."""
        if self.simulated:
            return
        with self._lock:
            self._probes[fact] = probe
            self._facts.pop(fact, None)

    def missing(self, fact: str) -> str | None:
        """None when ``fact`` holds, else the reason it does not."""
        try:
            return self._facts[fact]
        except KeyError:
            pass
        with self._lock:
            if fact in self._facts:
                return self._facts[fact]
            probe = self._probes.get(fact)
            if probe is None:
                reason: str | None = f"'{fact}' is absent in the {self.name} environment"
            else:
                try:
                    reason = probe()
                except Exception as exc:  # a probe must never take the host down
                    reason = f"probe for '{fact}' failed: {type(exc).__name__}: {exc}"
            self._facts[fact] = reason
        if reason is not None and fact in self._libraries:
            _warn_if_installed(fact, self._libraries[fact], reason)
        return reason

    def __repr__(self) -> str:
        return f"Environment({self.name})"
