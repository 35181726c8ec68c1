"""Finding a function in the installed aiter by where it may live (a leaf module: the adapters and the probe
both use it, and it imports neither)."""

from __future__ import annotations

import importlib
from typing import Any


def find_function(modules: tuple[str, ...], name: str, *, callable_only: bool = False) -> tuple[str, Any] | None:
    """The first ``module.name`` that imports, as (dotted path, object); None when none does. aiter's module paths
    moved between releases (``aiter.ops.triton.X`` -> ``aiter.ops.triton.<family>.X``), so every adapter lists the
    places it knows and takes the first that exists."""
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        obj = getattr(module, name, None)
        if obj is not None and (callable(obj) or not callable_only):
            return f"{module_name}.{name}", obj
    return None
