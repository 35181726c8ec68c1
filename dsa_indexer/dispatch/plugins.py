"""Backends arrive as pluggy plugins with one hook, ``dsa_indexer_register(registry)``.

Every backend, built-in or third-party, is an entry point of the group ``dsa_indexer.backends`` (the built-in ones
are declared in pyproject.toml) and registers through the same hook. The built-ins are those `dsa_indexer.backends`
lists (so a source tree that is not pip-installed still finds them); they load first, in that order. A plugin that fails to import or to register is recorded
(``registry.plugins_failed``, shown by `dsa-indexer info` and in "no implementation" errors) and whatever
it registered before failing is rolled back; the host never crashes because of a plugin.

Environment:
- ``DSA_INDEXER_DISABLE_PLUGIN_AUTOLOAD=1``: load only the built-in backends.
- ``DSA_INDEXER_PLUGINS=name1,name2``: load only these third-party entry points.
"""

from __future__ import annotations

import importlib
import os
import threading
from importlib import metadata
from typing import Any

import pluggy

from ..envflags import env_flag
from .registry import Registry

PROJECT = "dsa_indexer"
ENTRY_POINT_GROUP = "dsa_indexer.backends"
AUTOLOAD_ENV = "DSA_INDEXER_DISABLE_PLUGIN_AUTOLOAD"
ALLOW_ENV = "DSA_INDEXER_PLUGINS"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)



def known_ops() -> tuple[str, ...]:
    """The ops a plugin may implement: those of the contract's specs, and the pipeline strategy."""
    from ..contract.specs import PIPELINE_OP, PROBLEM_KEYS

    return (*PROBLEM_KEYS, PIPELINE_OP)


def builtin_backends() -> tuple[str, ...]:
    from .. import backends

    return tuple(backends.BUILTIN_PACKAGES)


class BackendSpec:
    @hookspec
    def dsa_indexer_register(self, registry: Registry) -> None:
        """Register this backend's implementations with ``registry.register`` / ``registry.implementation``."""


def _contained(exc: BaseException) -> bool:
    """A plugin may raise anything, even SystemExit from an import: contain all but a user's Ctrl-C."""
    return not isinstance(exc, KeyboardInterrupt)


def _register_one(registry: Registry, manager: pluggy.PluginManager, name: str, plugin: Any) -> None:
    before = registry.snapshot_ids()
    try:
        manager.register(plugin, name=name)
        manager.check_pending()  # a @hookimpl whose name has a typo: PluginValidationError names it
        if not manager.get_hookcallers(plugin):
            raise LookupError("it defines no dsa_indexer_register hook (a function of that name decorated with "
                              "dsa_indexer.dispatch.plugins.hookimpl)")
        others = [p for p in manager.get_plugins() if p is not plugin]
        manager.subset_hook_caller("dsa_indexer_register", remove_plugins=others)(registry=registry)
    except BaseException as exc:  # noqa: BLE001
        if not _contained(exc):
            raise
        for impl_id in registry.snapshot_ids() - before:
            registry.unregister(impl_id)
        if manager.is_registered(plugin):
            manager.unregister(plugin)
        registry.plugins_failed.append(f"{name}: register failed: {type(exc).__name__}: {exc}")
        return
    added = registry.snapshot_ids() - before
    unknown = sorted({impl_id.split(".", 1)[0] for impl_id in added} - set(known_ops()))
    if unknown:  # a typo in an op name would otherwise "load" and never be used
        for impl_id in added:
            registry.unregister(impl_id)
        if manager.is_registered(plugin):
            manager.unregister(plugin)
        registry.plugins_failed.append(f"{name}: registers unknown op(s) {', '.join(unknown)}; known ops: "
                                       f"{', '.join(known_ops())}")
        return
    registry.adopt(added, origin=name)
    registry.plugins_loaded.append(name)


def load_plugins(registry: Registry, *, builtins: tuple[str, ...] | None = None,
                 entry_points: bool | None = None) -> pluggy.PluginManager:
    """Register the built-in backends, then the other installed entry points, into ``registry``."""
    builtins = builtin_backends() if builtins is None else builtins
    manager = pluggy.PluginManager(PROJECT)
    manager.add_hookspecs(BackendSpec)
    for module_name in builtins:
        try:
            module = importlib.import_module(module_name)
        except BaseException as exc:  # noqa: BLE001
            if not _contained(exc):
                raise
            registry.plugins_failed.append(f"{module_name}: import failed: {type(exc).__name__}: {exc}")
            continue
        _register_one(registry, manager, module_name.rsplit(".", 1)[-1], module)
    if entry_points is None:
        entry_points = not env_flag(AUTOLOAD_ENV)
    if not entry_points:
        return manager
    allowed = {n.strip() for n in os.environ.get(ALLOW_ENV, "").split(",") if n.strip()}
    seen: set[str] = set()
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        seen.add(entry.name)
        if entry.value in builtin_backends():
            continue  # a built-in, loaded above
        if allowed and entry.name not in allowed:
            continue
        try:
            plugin = entry.load()
        except BaseException as exc:  # noqa: BLE001
            if not _contained(exc):
                raise
            registry.plugins_failed.append(f"{entry.name} ({entry.value}): import failed: {type(exc).__name__}: {exc}")
            continue
        _register_one(registry, manager, entry.name, plugin)
    for name in sorted(allowed - seen):
        registry.plugins_failed.append(f"{name}: named in {ALLOW_ENV} but no such entry point is installed "
                                       f"(group {ENTRY_POINT_GROUP}; installed: {', '.join(sorted(seen)) or '-'})")
    return manager


_default: Registry | None = None
_default_lock = threading.Lock()


def default_registry() -> Registry:
    """The process-wide registry, with every plugin loaded on first use."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                registry = Registry()
                load_plugins(registry)
                _default = registry
    return _default
