"""Bind once, call many times: `bind(op, target, problem)` is the one way library code reaches a kernel.

A `Bound` is what dispatch decided for one (op, target, problem): the callable that runs it (``fn``), the
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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from .plugins import default_registry
from .problem import Problem

if TYPE_CHECKING:  # names for annotations only: at run time bind reads the registry through its methods
    from .registry import Implementation, Registry, Resolution
    from .target import Target


@dataclass(frozen=True, eq=False)
class Bound:
    """One op bound for one target and problem: call it like the implementation (the schema's arguments)."""

    fn: Callable[..., Any]
    resolution: Resolution
    info: Mapping[str, Any]
    generation: int  # the registry's `generation` when bound
    registry: Registry = field(repr=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    @property
    def op(self) -> str:
        return self.resolution.op

    @property
    def target(self) -> Target:
        return self.resolution.target

    @property
    def problem(self) -> Problem:
        return self.resolution.problem

    @property
    def implementation(self) -> Implementation:
        return self.resolution.chosen  # type: ignore[return-value] - a Bound exists only where one was chosen

    @property
    def impl_id(self) -> str:
        return self.implementation.impl_id

    @property
    def current(self) -> bool:
        """Whether the registry is unchanged since binding (else `bind` again: the choice may differ now)."""
        return self.registry.generation == self.generation


def bind(op: str, target: Target, problem: Problem | None = None, registry: Registry | None = None) -> Bound:
    """The implementation of ``op`` for ``target`` and ``problem`` (default: no facts), bound: what
    `Registry.function` would call, with the resolution that chose it and its ``info``. Cached per registry until
    it changes. Strict mode, the one-time fallback warning and a broken factory's fallback apply as for any call;
    nothing that can run raises `NoImplementationError` with the whole trace."""
    registry = default_registry() if registry is None else registry
    key = (op, target, problem)
    bound = registry.bindings.get(key)
    if bound is not None:
        return bound
    while True:
        # The dict first, then the generation: a change in between empties a dict this bind then writes to in vain,
        # never the fresh one with a stale Bound.
        bindings, generation = registry.bindings, registry.generation
        fn, resolution = registry.chosen(op, target, problem)
        if registry.generation == generation:
            break  # else a factory was found broken on the way (or another thread changed the registry): again
    bound = Bound(fn, resolution, resolution.chosen.info, generation, registry)
    bindings[key] = bound
    return bound
