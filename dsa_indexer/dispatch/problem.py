"""A problem class: the few facts of an op call that can change which implementation runs.

Facts are coarse on purpose (head count, next_n, dtype names, a token-count bucket), so the
resolution cache stays small and the hot path hashes a short tuple.
"""

from __future__ import annotations

from typing import Any


class Problem:
    """An immutable, hashable set of named facts: ``Problem(heads=64, next_n=1)``."""

    __slots__ = ("_items", "_hash")

    def __init__(self, **facts: Any) -> None:
        items = tuple(sorted(facts.items()))
        object.__setattr__(self, "_items", items)
        object.__setattr__(self, "_hash", hash(items))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Problem is immutable")

    def get(self, name: str, default: Any = None) -> Any:
        for key, value in self._items:
            if key == name:
                return value
        return default

    def __getitem__(self, name: str) -> Any:
        for key, value in self._items:
            if key == name:
                return value
        raise KeyError(name)

    def __contains__(self, name: str) -> bool:
        return any(key == name for key, _ in self._items)

    def items(self) -> tuple[tuple[str, Any], ...]:
        return self._items

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Problem) and other._items == self._items

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in self._items)
        return f"Problem({inner})"


def token_bucket(tokens: int) -> int:
    """Round a token count up to a power of two (at least 1) so problems with similar sizes share a class."""
    bucket = 1
    while bucket < tokens:
        bucket <<= 1
    return bucket
