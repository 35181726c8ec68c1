"""Declared capabilities: what an implementation serves, stated as data instead of a hand-written check.

    caps = Capabilities("DeepGEMM logits", heads={"sm90": (32, 64)}, dim=(128,), fp8=("fn",),
                        next_n={"sm90": (1, 2), "sm100": None}, k=Rule(lambda k: k % 128 == 0, "multiples of 128"))

Each keyword is a problem fact; its value says which values the implementation takes:
- a tuple (or set) of values;
- a dict arch -> tuple (``None``: any value on that arch; an arch not listed takes none), for limits that differ
  per arch (the archs themselves live in the platforms: a dict only keys the ones an implementation serves);
- a `Rule`: a predicate with the words for what it wants, which follow the fact's name (``width at most 16384``,
  so they do not repeat it).
A fact the problem does not carry is not checked (a coarse problem, e.g. the CLI's defaults, stays resolvable).
`reasons` reports every failing fact at once; the registry runs it before an implementation's own ``supports``
(kept for what data cannot say, e.g. an environment knob), and `dsa-indexer explain` shows both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .problem import Problem
from .target import Target


@dataclass(frozen=True)
class Rule:
    """A fact's values that pass ``test``, described by ``wanted`` ("multiples of 128")."""

    test: Callable[[Any], bool]
    wanted: str

    def __repr__(self) -> str:
        return self.wanted


# How a fact reads in a reason where "<fact>=<value>" would not (every other fact reads "heads=16").
LABELS = {"dim": "head dim {}"}


def _shown(name: str, value: Any) -> str:
    label = LABELS.get(name)
    return label.format(value) if label else f"{name}={value}"


def _words(values) -> str:
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " or " + values[-1]


class Capabilities:
    """The facts an implementation takes (see the module docstring). ``owner`` names it in the reasons."""

    def __init__(self, owner: str, **facts: Any) -> None:
        self.owner = owner
        self.facts: dict[str, Any] = {}
        for name, allowed in facts.items():
            if isinstance(allowed, (list, set, frozenset)):
                allowed = tuple(allowed)
            if not isinstance(allowed, (tuple, Mapping, Rule)):
                raise TypeError(f"capability {name!r} of {owner}: expected a tuple of values, a per-arch dict or a "
                                f"Rule, got {type(allowed).__name__}")
            self.facts[name] = allowed

    def _reason(self, name: str, value: Any, allowed: Any, target: Target) -> str | None:
        if isinstance(allowed, Rule):
            return None if allowed.test(value) else f"{_shown(name, value)}: {self.owner} takes {allowed.wanted}"
        where = ""
        if isinstance(allowed, Mapping):
            where = f" on {target.arch}"
            if target.arch not in allowed:
                return f"{_shown(name, value)}: {self.owner} is not declared for {target.arch}"
            allowed = allowed[target.arch]
            if allowed is None:
                return None
        return None if value in allowed else f"{_shown(name, value)}: {self.owner}{where} takes {_words(allowed)}"

    def reasons(self, problem: Problem, target: Target) -> list[str]:
        """Every fact of ``problem`` outside what is declared, each as ``"<fact>=<value>: <owner> takes ..."``
        (`LABELS`: "head dim 64: ...")."""
        found = []
        for name, allowed in self.facts.items():
            value = problem.get(name, _MISSING)
            if value is _MISSING or value is None:
                continue
            reason = self._reason(name, value, allowed, target)
            if reason is not None:
                found.append(reason)
        return found

    def describe(self) -> dict[str, str]:
        """Fact -> what is taken, as text (`Implementation.to_dict`, `dsa-indexer explain`)."""
        out = {}
        for name, allowed in self.facts.items():
            if isinstance(allowed, Mapping):
                out[name] = "; ".join(f"{arch}: {'any' if v is None else _words(v)}" for arch, v in allowed.items())
            elif isinstance(allowed, Rule):
                out[name] = allowed.wanted
            else:
                out[name] = _words(allowed)
        return out

    def takes_text(self) -> str:
        """What is taken, as one line (`dsa-indexer explain`'s ``takes:``): each fact then its values, as in
        ``heads 32, 64 or 128, width at most 16384 (...)`` (a `Rule`'s words follow its fact's name)."""
        return ", ".join(f"{k} {v}" for k, v in self.describe().items())

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}: {v}" for k, v in self.describe().items())
        return f"Capabilities({self.owner}: {inner})"


_MISSING = object()
