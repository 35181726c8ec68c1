"""Bind once, call many times: `bind(op, target, problem)` is the one way library code reaches a kernel.

A `Bound` (made by `Registry.bound`) is what dispatch decided for one (op, target, problem): the callable that runs it (``fn``), the
`Resolution` that chose it (every candidate with its verdict, for explain) and the chosen implementation's facts
(``info``: a GEMM's input layout, a producer tag, a scorer's bytes per row ...). Calling it calls ``fn``: no
resolution, no problem, no lookup.

It stays valid while the registry is unchanged. What invalidates it is what changes the registry's `generation`:
a registration or unregistration, `Registry.force`, `Registry.set_strict`, `Registry.set_environment`,
`Registry.add_probe`, `Registry.clear_cache` (which also re-reads ``DSA_INDEXER_TARGET`` / ``_FORCE`` /
``_STRICT``), `Registry.start_recording_usage`, and a factory found broken at its first build. A holder of
Bounds checks `Bound.current` (or compares `Bound.generation` with `Registry.generation`) and binds again when
it is stale; `bind` itself always answers for the registry as it is now (its cache is emptied on each change).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .plugins import default_registry
from .problem import Problem
from .registry import Bound, Registry

if TYPE_CHECKING:  # names for annotations only
    from .target import Target

__all__ = ["Bound", "bind"]


def bind(op: str, target: Target, problem: Problem | None = None, registry: Registry | None = None) -> Bound:
    """The implementation of ``op`` for ``target`` and ``problem`` (default: no facts), bound: what
    `Registry.function` would call, with the resolution that chose it and its ``info``. Cached per registry until
    it changes. Strict mode, the one-time fallback warning and a broken factory's fallback apply as for any call;
    nothing that can run raises `NoImplementationError` with the whole trace."""
    registry = default_registry() if registry is None else registry
    bound = registry.bindings.get((op, target, problem))
    return bound if bound is not None else registry.bound(op, target, problem)
