"""The op registry: which implementation of an op runs for a target and a problem, and why.

An implementation is a record (`Implementation`): op name, id ``<op>.<vendor>.<variant>``, the targets it
serves (an exact arch such as ``sm90``, a family such as ``rocm``, or ``*``), an explicit priority,
the environment facts it needs (``gpu``, ``triton``, a vendor library's fact ...), its declared ``capabilities``
(`dispatch.capabilities.Capabilities`: heads, dims, fp8 flavours, next_n ... as data), and two checks that return a
reason when they say no: ``available(target, env)`` and ``supports(problem, target)`` (for what data cannot say).
Its ``verified`` records (`dispatch.verification`) say how far it was checked on which archs (`dsa-indexer matrix`).

`Registry.resolve` is a pure function of (op, target, problem, environment, overrides) and returns a
`Resolution` that lists every candidate with its verdict. `Registry.call` caches the chosen function per
(op, target, problem) so the hot path is one dict lookup after the first call.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from ..envflags import env_flag, parse_assignments
from . import results
from .capabilities import Capabilities
from .environment import Environment
from .problem import Problem
from .target import Target, note_registered_archs, reload_environment
from .verification import Verified, verification_for

FORCE_ENV = "DSA_INDEXER_FORCE"
STRICT_ENV = "DSA_INDEXER_STRICT"

REFERENCE_VENDOR = "reference"

Check = Callable[..., "str | list[str] | None"]  # None: yes; else the reason (a list: every failing fact)
# A composition's inner problem: the problem its inner op is bound for, made from the problem it was chosen for.
InnerProblem = Callable[[Problem], Problem]


@dataclass(frozen=True, eq=False)
class Implementation:
    """One way to compute one op. ``factory()`` returns the callable; vendor imports belong inside it. A composition
    (``uses``) has ``factory(**inner)``: each op it uses, bound (`Bound`) for the target and problem it was chosen
    for (`Registry.composition`)."""

    op: str
    impl_id: str
    targets: tuple[str, ...]
    priority: int
    factory: Callable[[], Callable[..., Any]]
    requires: tuple[str, ...] = ()
    available: Check | None = None
    supports: Check | None = None
    description: str = ""
    origin: str = "?"
    info: Mapping[str, Any] = field(default_factory=dict)  # op-specific facts, e.g. a GEMM's input layout
    # A composition: op it calls -> the problem it calls that op with, from its own problem. Its factory receives
    # those ops bound for the same target (strict mode, forcing and the fallback warning apply to them as to any
    # op), so its calls reach the inner kernels directly, with no lookup, and never re-detect a target.
    uses: Mapping[str, InnerProblem] = field(default_factory=dict)
    # The facts it takes, as data; checked before ``supports``, every failing fact reported at once.
    capabilities: Capabilities | None = None
    # How far it has been checked on which archs (`dispatch.verification`); an arch none covers reads as "read".
    verified: tuple[Verified, ...] = ()

    def __post_init__(self) -> None:
        parts = self.impl_id.split(".")
        if len(parts) != 3 or parts[0] != self.op or not all(parts):
            raise ValueError(f"implementation id {self.impl_id!r} must read '<op>.<vendor>.<variant>' with op {self.op!r}")
        if not self.targets:
            raise ValueError(f"{self.impl_id}: targets must name at least one arch, family or '*'")
        object.__setattr__(self, "targets", tuple(self.targets))
        object.__setattr__(self, "requires", tuple(self.requires))
        object.__setattr__(self, "verified", tuple(self.verified))
        object.__setattr__(self, "uses", dict(self.uses))
        wrong = [v for v in self.verified if not isinstance(v, Verified)]
        if wrong:
            raise TypeError(f"{self.impl_id}: verified= takes dispatch.verification.Verified records, got {wrong!r}")

    @property
    def vendor(self) -> str:
        return self.impl_id.split(".")[1]

    def serves(self, target: Target) -> bool:
        return any(t == "*" or t == target.arch or t == target.vendor for t in self.targets)

    def verification(self, target: Target) -> Verified:
        """The strongest evidence recorded for ``target``'s arch (level ``read`` where none is)."""
        return verification_for(self.verified, target.arch, target.vendor)


@dataclass(frozen=True)
class Candidate:
    impl: Implementation
    accepted: bool
    reason: str


@dataclass(frozen=True)
class Resolution:
    """The answer of `Registry.resolve`: the chosen implementation and every candidate's verdict."""

    op: str
    target: Target
    problem: Problem
    chosen: Implementation | None
    candidates: tuple[Candidate, ...]
    forced: str | None = None
    environment: str = ""
    failed_plugins: tuple[str, ...] = ()

    @property
    def is_fallback(self) -> bool:
        """The pure-torch reference runs on an accelerator target: whether faster implementations serve the target
        but cannot run here, or none serves it at all (both are the slow path a user should hear about)."""
        return self.chosen is not None and self.chosen.vendor == REFERENCE_VENDOR and self.target.is_accelerator

    def fallback_reasons(self) -> str:
        """Why no accelerated implementation runs: each rejected candidate's reason, or that none serves."""
        rejected = "; ".join(f"{c.impl.impl_id}: {c.reason}" for c in self.candidates
                             if c.impl.serves(self.target) and not c.accepted)
        return rejected or f"no accelerated implementation serves target {self.target}"

    def to_dict(self) -> dict:
        """The resolution as plain data (`dsa-indexer explain --json`, `info --json`)."""
        return {"op": self.op, "target": str(self.target), "problem": dict(self.problem.items()),
                "environment": self.environment, "forced": self.forced,
                "chosen": self.chosen.impl_id if self.chosen else None, "fallback": self.is_fallback,
                "candidates": [{"impl": c.impl.impl_id, "priority": c.impl.priority, "accepted": c.accepted,
                                "reason": c.reason} for c in self.candidates],
                "info": {k: str(v) for k, v in (self.chosen.info.items() if self.chosen else ())},
                "uses": list(self.chosen.uses) if self.chosen else [],
                "capabilities": (self.chosen.capabilities.describe()
                                 if self.chosen is not None and self.chosen.capabilities is not None else None),
                "failed_plugins": list(self.failed_plugins)}

    def explain(self) -> str:
        facts = ", ".join(f"{k}={v}" for k, v in self.problem.items()) or "no facts"  # not "problem Problem(...)"
        lines = [f"op {self.op} on target {self.target} ({self.target.vendor}), problem ({facts})",
                 f"environment: {self.environment}"]
        if self.forced:
            lines.append(f"forced: {self.forced}")
        for cand in self.candidates:
            mark = "*" if self.chosen is cand.impl else ("+" if cand.accepted else "-")
            lines.append(f"  {mark} {cand.impl.impl_id:<44} prio {cand.impl.priority:>4}  {cand.reason}")
        if self.chosen is None:
            lines.append("  => no implementation")
        else:
            lines.append(f"  => {self.chosen.impl_id}")
            for key, value in self.chosen.info.items():
                lines.append(f"     {key}: {value}")
            if self.chosen.uses:
                lines.append(f"     uses: {', '.join(self.chosen.uses)} (each resolved for this target)")
            if self.chosen.capabilities is not None:
                lines.append(f"     takes: {self.chosen.capabilities.takes_text()}")
        for failure in self.failed_plugins:
            lines.append(f"  failed plugin: {failure}")
        return "\n".join(lines)


@dataclass(frozen=True, eq=False)
class Bound:
    """One op bound for one target and problem (`Registry.bound`, `dispatch.bind.bind`): call it like the
    implementation (the schema's arguments)."""

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


class FactoryResultError(RuntimeError):
    """An implementation's factory returned something that cannot be called (None, say): it is rejected."""


class NoImplementationError(RuntimeError):
    """No registered implementation can run this op here; the message holds the whole trace."""

    def __init__(self, resolution: Resolution, why: str) -> None:
        self.resolution = resolution
        hints = [f"Override with {FORCE_ENV}='{resolution.op}=<impl_id>' or Registry.force()",
                 "simulate another target with DSA_INDEXER_TARGET=<arch>"]
        if why.startswith("strict mode"):  # the strict hint only where strict mode refused
            hints.append(f"allow the reference fallback by unsetting {STRICT_ENV}")
        super().__init__(f"{why}\n{resolution.explain()}\n" + "; ".join(hints) + ".")


def _from(impl: Implementation) -> str:
    return "" if impl.origin == "?" else f" (plugin {impl.origin})"


def parse_force(text: str | None) -> dict[str, str]:
    """``"op=impl,op2=impl2"`` -> ``{op: impl}``; a malformed entry, or an op named twice, is an error naming it."""
    return parse_assignments(FORCE_ENV, text)


@dataclass
class _Overrides:
    forced: dict[str, str] = field(default_factory=dict)
    strict: bool | None = None


class Registry:
    """Holds implementations; resolves and calls them. Thread-safe."""

    def __init__(self, environment: Environment | None = None) -> None:
        self._impls: dict[str, dict[str, Implementation]] = {}
        self._lock = threading.RLock()
        self._fn_cache: dict[tuple, tuple[Callable[..., Any], Resolution]] = {}
        # (op, target, problem) -> its `Bound` (`bound`): derived from the state above, so emptied with it.
        self.bindings: dict[tuple, Any] = {}
        self._resolution_cache: dict[tuple, Resolution] = {}
        self._factories: dict[str, Callable[..., Any]] = {}
        self._broken: dict[str, str] = {}  # impl_id -> why its factory failed (it is then rejected)
        self._check_failures: dict[str, str] = {}  # impl_id -> how its available / supports check broke
        self._warned: set[tuple] = set()
        self._overrides = _Overrides()
        self.environment = environment or Environment()
        self.plugins_loaded: list[str] = []
        self.used: dict[tuple, Resolution] = {}  # every (op, target, problem) resolved for a call so far
        self.plugins_failed: list[str] = []
        self.plugins_warned: list[str] = []  # loaded, but with a registration that can never serve (an unparsed arch)
        self.builtin_origins: set[str] = set()  # the built-in backends' plugin names: their results are not wrapped
        # Bumped whenever cached functions are dropped: a holder of resolved functions (the Indexer's step plans)
        # compares it to know its functions are still what resolution would choose.
        self.generation = 0

    # --- registration -------------------------------------------------------------------------
    def register(self, impl: Implementation) -> Implementation:
        with self._lock:
            per_op = self._impls.setdefault(impl.op, {})
            if impl.impl_id in per_op:
                raise ValueError(f"{impl.impl_id} is already registered (by {per_op[impl.impl_id].origin})")
            for other in per_op.values():
                shared = set(other.targets) & set(impl.targets)
                if other.priority == impl.priority and shared:
                    raise ValueError(
                        f"priority tie: {impl.impl_id} and {other.impl_id} both serve {sorted(shared)} at priority "
                        f"{impl.priority}; give one an explicit different priority"
                    )
            per_op[impl.impl_id] = impl
            note_registered_archs(t for t in impl.targets if t != "*")
            self._invalidate()
            return impl

    def implementation(self, op: str, *, impl_id: str, targets: Iterable[str], priority: int,
                       requires: Iterable[str] = (), available: Check | None = None, supports: Check | None = None,
                       description: str = "", origin: str = "?", info: Mapping[str, Any] | None = None,
                       uses: Mapping[str, InnerProblem] | None = None, capabilities: Capabilities | None = None,
                       verified: Iterable[Verified] = ()) -> Callable[[Callable], Callable]:
        """Decorator form: the decorated function is the factory returning the kernel callable (a composition's,
        with ``uses``, takes the ops it uses bound: see `Implementation`)."""

        def wrap(factory: Callable[[], Callable]) -> Callable[[], Callable]:
            self.register(Implementation(op, impl_id, tuple(targets), priority, factory, tuple(requires), available,
                                         supports, description or (factory.__doc__ or "").strip().split("\n")[0],
                                         origin, dict(info or {}), dict(uses or {}), capabilities,
                                         tuple(verified)))
            return factory

        return wrap

    def unregister(self, impl_id: str) -> None:
        with self._lock:
            for per_op in self._impls.values():
                per_op.pop(impl_id, None)
            # The callable its factory built and a failure recorded for it go too: an implementation registered
            # later under the same id is built from its own factory, not served by the old one's function.
            self._factories.pop(impl_id, None)
            self._broken.pop(impl_id, None)
            self._invalidate()

    def ops(self) -> list[str]:
        return sorted(self._impls)

    def implementations(self, op: str) -> list[Implementation]:
        if op not in self._impls:
            raise KeyError(f"unknown op {op!r}; known ops: {', '.join(self.ops())}")
        return sorted(self._impls[op].values(), key=lambda i: (-i.priority, i.impl_id))

    def add_probe(self, fact: str, probe: Callable[[], "str | None"]) -> None:
        self.environment.add_probe(fact, probe)
        self._invalidate()

    # --- overrides ----------------------------------------------------------------------------
    def force(self, op: str, impl_id: str | None) -> str | None:
        """Always use ``impl_id`` for ``op`` (``None`` removes the override); returns the override it replaces
        (None: there was none), so a caller that forces for a while can restore it. Both names are checked now: a
        typo raises here, naming what is registered, instead of failing at the op's first call."""
        with self._lock:
            if op not in self._impls:
                raise ValueError(f"Registry.force: unknown op {op!r}; ops: {', '.join(self.ops())}")
            if impl_id is not None and impl_id not in self._impls[op]:
                raise ValueError(f"Registry.force: {impl_id!r} is not registered for {op!r}; registered: "
                                 f"{', '.join(sorted(self._impls[op]))}")
            previous = self._overrides.forced.pop(op, None)
            if impl_id is not None:
                self._overrides.forced[op] = impl_id
            self._invalidate()
            return previous

    def set_strict(self, strict: bool | None) -> None:
        """Refuse the reference fallback on GPU targets (``None``: follow ``DSA_INDEXER_STRICT``)."""
        with self._lock:
            self._overrides.strict = strict
            self._invalidate()

    def set_environment(self, environment: Environment) -> None:
        with self._lock:
            self.environment = environment
            self._invalidate()

    def _forced_for(self, op: str) -> str | None:
        if op in self._overrides.forced:
            return self._overrides.forced[op]
        forced = parse_force(os.environ.get(FORCE_ENV))
        problems = tuple(why for other, why in self.forced_problems(forced).items() if other != op)
        if problems and ("force", problems) not in self._warned:
            # The op being resolved raises below when its entry names nothing registered; every other entry that
            # cannot be honoured is said once, whether or not its op is ever reached.
            self._warned.add(("force", problems))
            warnings.warn(f"dsa_indexer: {FORCE_ENV} names {'; and '.join(problems)}", RuntimeWarning, stacklevel=3)
        return forced.get(op)

    def forced_problems(self, forced: Mapping[str, str] | None = None) -> dict[str, str]:
        """op -> what is wrong with its entry in ``forced`` (default: ``DSA_INDEXER_FORCE``), for each entry that
        names an unknown op or an implementation not registered for its op, with what is registered."""
        forced = parse_force(os.environ.get(FORCE_ENV)) if forced is None else forced
        problems = {}
        for op, impl_id in forced.items():
            if op not in self._impls:
                problems[op] = f"unknown op {op!r} (in {op}={impl_id}); ops: {', '.join(self.ops())}"
            elif impl_id not in self._impls[op]:
                problems[op] = (f"{impl_id!r} for {op!r}, which is not registered; registered: "
                                f"{', '.join(sorted(self._impls[op]))}")
        return problems

    def check_forced(self) -> None:
        """Raise naming every ``DSA_INDEXER_FORCE`` entry that cannot be honoured (`dsa-indexer run` and `bench`
        check before any work: an entry for an op the run never reaches would otherwise go unnoticed)."""
        problems = self.forced_problems()
        if problems:
            raise ValueError(f"{FORCE_ENV} names {'; and '.join(problems.values())}")

    def forced(self) -> dict[str, str]:
        """Every forced op -> implementation: Registry.force, then DSA_INDEXER_FORCE (what `dsa-indexer info` shows)."""
        return {**parse_force(os.environ.get(FORCE_ENV)), **self._overrides.forced}

    def is_strict(self) -> bool:
        """Whether strict mode is on (`Registry.set_strict`, else ``DSA_INDEXER_STRICT``)."""
        return self._strict()

    def required_facts(self) -> set[str]:
        """Every environment fact some registered implementation requires (what `--assume` may name)."""
        return {fact for per_op in self._impls.values() for impl in per_op.values() for fact in impl.requires}

    def _strict(self) -> bool:
        if self._overrides.strict is not None:
            return self._overrides.strict
        return env_flag(STRICT_ENV)

    def _invalidate(self) -> None:
        self._fn_cache = {}
        self._resolution_cache = {}
        self.bindings = {}
        self.generation += 1

    def start_recording_usage(self) -> None:
        """Forget which implementations calls used so far (``used``) and the cached functions, so that from now on
        ``used`` holds exactly what the next calls run (`dsa-indexer run` reports its own run, not the process's)."""
        with self._lock:
            self.used = {}
            self._fn_cache = {}
            self.bindings = {}
            self.generation += 1

    def clear_cache(self) -> None:
        """Forget cached resolutions and re-read DSA_INDEXER_TARGET / _FORCE / _STRICT from the environment; the
        once-per-(op, target) warnings (a fallback to the reference, an unusable force) are given again."""
        reload_environment()
        with self._lock:
            self._broken.clear()
            self._check_failures.clear()
            self._warned.clear()
            self._invalidate()

    # --- resolution ---------------------------------------------------------------------------
    def resolve(self, op: str, target: Target, problem: Problem | None = None, *,
                environment: Environment | None = None, force: str | None = None) -> Resolution:
        problem = problem if problem is not None else Problem()
        env = environment or self.environment
        forced = force if force is not None else self._forced_for(op)
        key = (op, target, problem, env, forced)
        cached = self._resolution_cache.get(key)
        if cached is not None:
            return cached
        with self._lock:
            impls = self.implementations(op)
            candidates: list[Candidate] = []
            chosen: Implementation | None = None
            if forced is not None and forced not in {i.impl_id for i in impls}:
                res = Resolution(op, target, problem, None, (), forced, env.name, tuple(self.plugins_failed))
                raise NoImplementationError(res, f"forced implementation {forced!r} is not registered for op {op!r}; "
                                                 f"registered: {', '.join(i.impl_id for i in impls)}")
            for impl in impls:
                reason = self._verdict(impl, target, problem, env, forced)
                if reason is None and impl.impl_id in self._broken:
                    reason = self._broken[impl.impl_id]
                accepted = reason is None
                if accepted and chosen is None:
                    chosen = impl
                    reason = "chosen" + (" (forced)" if forced == impl.impl_id else "")
                elif accepted:
                    reason = f"usable, lower priority than {chosen.impl_id}" if chosen else "usable"
                candidates.append(Candidate(impl, accepted, reason))
            res = Resolution(op, target, problem, chosen, tuple(candidates), forced, env.name,
                             tuple(self.plugins_failed))
            self._resolution_cache[key] = res
            return res

    def resolve_runnable(self, op: str, target: Target, problem: Problem | None = None, *,
                         environment: Environment | None = None) -> Resolution:
        """`resolve`, with the chosen implementation's factory built (as the first call would build it): a factory
        that fails marks that implementation rejected with the reason and resolution moves on, so what
        `dsa-indexer info` / `explain` report is what a call runs. A simulated environment builds nothing (its
        facts are assumptions; the vendor code behind them is not there to build). A composition builds nothing of
        its own: each op it uses is resolved on its own when it is bound (`composition`)."""
        env = environment or self.environment
        while True:
            res = self.resolve(op, target, problem, environment=env)
            if res.chosen is None or env.simulated or res.chosen.uses:
                return res
            try:
                self._factory_result(res.chosen)
            except BaseException as exc:  # noqa: BLE001 - recorded as the implementation's reason, as in function()
                if isinstance(exc, KeyboardInterrupt):
                    raise
                self._mark_broken(res.chosen, exc)
                continue
            return res

    def _verdict(self, impl: Implementation, target: Target, problem: Problem, env: Environment,
                 forced: str | None) -> str | None:
        if forced is not None and impl.impl_id != forced:
            return f"not the forced implementation ({forced})"
        if not impl.serves(target) and impl.impl_id != forced:
            return f"serves {', '.join(impl.targets)}, not {target}"
        for fact in impl.requires:
            missing = env.missing(fact)
            if missing is not None:
                return missing
        if impl.available is not None:
            reasons = self._ask(impl, "available", impl.available, target, env)
            if reasons:
                return "; ".join(reasons)
        reasons = (self._ask(impl, "capabilities", impl.capabilities.reasons, problem, target)
                   if impl.capabilities is not None else [])
        if impl.supports is not None:
            reasons += [r for r in self._ask(impl, "supports", impl.supports, problem, target) if r not in reasons]
        return "; ".join(reasons) or None

    def _ask(self, impl: Implementation, name: str, check: Callable[..., Any], *args: Any) -> list[str]:
        """One of an implementation's checks, as reasons (empty: yes). A check that raises, or answers something
        that is neither None nor reason text, rejects the implementation with that as its reason and warns once:
        a plugin's broken check must not take every call of the op (or `dsa-indexer info`) down with it."""
        try:
            answer = check(*args)
        except BaseException as exc:  # noqa: BLE001 - as a plugin's import: contained, but never a user's Ctrl-C
            if isinstance(exc, KeyboardInterrupt):
                raise
            return [self._check_failed(impl, f"{name} check raised {type(exc).__name__}: {exc}")]
        if answer is None:
            return []
        if isinstance(answer, str):
            return [answer]
        if isinstance(answer, (list, tuple)) and all(isinstance(r, str) for r in answer):
            return list(answer)
        return [self._check_failed(impl, f"{name} check returned {answer!r}; a check returns None (yes) or the "
                                         f"reason it says no (a str, or a list of them)")]

    def _check_failed(self, impl: Implementation, reason: str) -> str:
        with self._lock:
            first = impl.impl_id not in self._check_failures
            self._check_failures[impl.impl_id] = reason
        if first:
            warnings.warn(f"dsa_indexer: {impl.impl_id}{_from(impl)} is rejected: its {reason}",
                          RuntimeWarning, stacklevel=4)
        return reason

    def failed_implementations(self) -> dict[str, str]:
        """impl_id -> why it can never be chosen as registered: its factory failed or returned no callable, or one
        of its checks raised (`dsa-indexer info` lists them; explain shows each as that candidate's reason)."""
        return {**self._check_failures, **self._broken}

    def choose(self, op: str, target: Target, problem: Problem | None = None) -> Resolution:
        """`resolve`, then apply strict mode and the fallback warning; raise when nothing can run."""
        res = self.resolve(op, target, problem)
        if res.chosen is None:
            why = (f"forced implementation {res.forced} cannot run here" if res.forced
                   else f"no implementation of {op!r} can run on target {target}")
            raise NoImplementationError(res, why)
        if res.is_fallback and not res.forced:
            if self._strict():
                raise NoImplementationError(res, f"strict mode ({STRICT_ENV}=1): refusing the reference fallback "
                                                 f"for {op!r} on accelerator target {target} "
                                                 f"({res.fallback_reasons()})")
            warn_key = (op, target)
            if warn_key not in self._warned:
                self._warned.add(warn_key)
                warnings.warn(f"dsa_indexer: {op} on {target} falls back to the slow reference "
                              f"({res.fallback_reasons()})", RuntimeWarning, stacklevel=3)
        return res

    def function(self, op: str, target: Target, problem: Problem | None = None) -> Callable[..., Any]:
        """The callable that runs ``op`` for (target, problem); cached (`chosen` says how it is found)."""
        entry = self._fn_cache.get((op, target, problem))
        return entry[0] if entry is not None else self.chosen(op, target, problem)[0]

    def chosen(self, op: str, target: Target, problem: Problem | None = None
               ) -> tuple[Callable[..., Any], Resolution]:
        """The callable that runs ``op`` for (target, problem) and the resolution that chose it; cached until the
        registry changes (`generation`). A factory that fails (its vendor import is missing, say) or returns no
        callable marks that implementation rejected with the reason, warns once, and resolution moves on. An
        implementation that is not built in has its results' metadata checked (`dispatch.results`); a
        composition (``uses``) is built with its inner ops bound for this target and problem (`composition`)."""
        key = (op, target, problem)
        entry = self._fn_cache.get(key)
        if entry is not None:
            return entry
        while True:  # every pass returns or marks one more implementation broken, so it ends
            res = self.choose(op, target, problem)
            # Outside the try: an inner op that cannot run here (strict mode, say) raises its own
            # NoImplementationError, as its call would, instead of marking the composition broken.
            inner = self._bind_used(res.chosen, target, problem) if res.chosen.uses else None
            try:
                fn = (self._factory_result(res.chosen) if inner is None
                      else self._checked_callable(res.chosen.factory(**inner)))
            except BaseException as exc:  # noqa: BLE001 - a broken implementation must not take the caller down
                if isinstance(exc, KeyboardInterrupt):
                    raise
                reason = self._mark_broken(res.chosen, exc)
                warnings.warn(f"dsa_indexer: {res.chosen.impl_id} could not be built, falling back ({reason})",
                              RuntimeWarning, stacklevel=2)
                continue
            if res.chosen.origin not in self.builtin_origins:
                fn = results.checked(fn, res.chosen)  # metadata only: a plugin's wrong dtype or shape raises here
            self.used[key] = res
            entry = self._fn_cache[key] = (fn, res)
            return entry

    def _mark_broken(self, impl: Implementation, exc: BaseException) -> str:
        """Reject ``impl`` from now on (until `clear_cache`) with why building it failed; -> that reason."""
        reason = str(exc) if isinstance(exc, FactoryResultError) else f"factory failed: {type(exc).__name__}: {exc}"
        with self._lock:
            self._broken[impl.impl_id] = reason
            self._invalidate()
        return reason

    def _factory_result(self, impl: Implementation) -> Callable[..., Any]:
        fn = self._factories.get(impl.impl_id)
        if fn is None:
            with self._lock:
                fn = self._factories.get(impl.impl_id)
                if fn is None:
                    fn = self._factories[impl.impl_id] = self._checked_callable(impl.factory())
        return fn

    @staticmethod
    def _checked_callable(fn: Any) -> Callable[..., Any]:
        if fn is None:
            raise FactoryResultError("factory returned None")
        if not callable(fn):
            raise FactoryResultError(f"factory returned a {type(fn).__name__}, not a callable")
        return fn

    def _bind_used(self, impl: Implementation, target: Target, problem: Problem | None) -> dict[str, Bound]:
        """The ops ``impl`` uses, each bound for ``target`` and the problem ``impl`` derives from ``problem``."""
        outer = problem if problem is not None else Problem()
        return {op: self.bound(op, target, inner_problem(outer)) for op, inner_problem in impl.uses.items()}

    def composition(self, impl: Implementation, target: Target, problem: Problem | None = None) -> Callable[..., Any]:
        """The callable of composition ``impl`` (``uses``) for ``target`` and ``problem``: its factory given the
        ops it uses, bound (what a call that chooses it runs, less the results check of a plugin's; a conformance
        check builds one per problem with this)."""
        if not impl.uses:
            raise ValueError(f"{impl.impl_id} is not a composition (it declares no ops it uses)")
        return self._checked_callable(impl.factory(**self._bind_used(impl, target, problem)))

    def bound(self, op: str, target: Target, problem: Problem | None = None) -> Bound:
        """``op`` bound for ``target`` and ``problem`` (`dispatch.bind.bind`, which reads the default registry, is
        the way library code asks): cached in ``bindings`` until the registry changes."""
        key = (op, target, problem)
        bound = self.bindings.get(key)
        if bound is not None:
            return bound
        while True:
            # The dict first, then the generation: a change in between empties a dict this bind then writes to in
            # vain, never the fresh one with a stale Bound.
            bindings, generation = self.bindings, self.generation
            fn, resolution = self.chosen(op, target, problem)
            if self.generation == generation:
                break  # else a factory was found broken on the way (or another thread changed the registry): again
        bound = Bound(fn, resolution, resolution.chosen.info, generation, self)
        bindings[key] = bound
        return bound

    def call(self, op: str, target: Target, problem: Problem | None, *args: Any, **kwargs: Any) -> Any:
        entry = self._fn_cache.get((op, target, problem))
        return (entry[0] if entry is not None else self.chosen(op, target, problem)[0])(*args, **kwargs)

    # --- plugin transactions ------------------------------------------------------------------
    def adopt(self, impl_ids: Iterable[str], origin: str) -> None:
        """Record which plugin registered ``impl_ids`` (for `dsa-indexer info` and explain traces)."""
        with self._lock:
            for per_op in self._impls.values():
                for impl_id in impl_ids:
                    impl = per_op.get(impl_id)
                    if impl is not None and impl.origin == "?":
                        per_op[impl_id] = dataclasses.replace(impl, origin=origin)
            self._invalidate()

    def snapshot_ids(self) -> set[str]:
        return {impl_id for per_op in self._impls.values() for impl_id in per_op}

    def table(self, target: Target, problems: Mapping[str, Problem] | None = None) -> list[Resolution]:
        """The resolution of every op on ``target`` (for `dsa-indexer info` and the arch-matrix tests)."""
        problems = problems or {}
        return [self.resolve(op, target, problems.get(op, Problem())) for op in self.ops()]
