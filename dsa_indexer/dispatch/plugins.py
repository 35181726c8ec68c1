"""Backends arrive as pluggy plugins with one hook, ``dsa_indexer_register(registry)``.

Every backend, built-in or third-party, is an entry point of the group ``dsa_indexer.backends`` (the built-in ones
are declared in pyproject.toml, read from the source tree when it is there: `discovery`) and registers through the
same hook; the built-ins load first, in pyproject order. A plugin that fails to import or to register is recorded
(``registry.plugins_failed``, shown by `dsa-indexer info` and in "no implementation" errors) and whatever
it registered before failing is rolled back; the host never crashes because of a plugin.

Environment:
- ``DSA_INDEXER_DISABLE_PLUGIN_AUTOLOAD=1``: load only the built-in backends.
- ``DSA_INDEXER_PLUGINS=name1,name2``: load only these third-party entry points.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any

import pluggy

from ..envflags import check_environment, env_flag
from . import discovery
from .platform import platforms, vendors
from .registry import Registry

PROJECT = "dsa_indexer"
ENTRY_POINT_GROUP = "dsa_indexer.backends"
AUTOLOAD_ENV = "DSA_INDEXER_DISABLE_PLUGIN_AUTOLOAD"
ALLOW_ENV = "DSA_INDEXER_PLUGINS"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)



def known_ops() -> tuple[str, ...]:
    """The ops a plugin may implement: those of the contract's specs, and the pipeline strategy."""
    from ..contract.declarations import OPS
    from ..contract.specs import PIPELINE_OP

    return (*OPS, PIPELINE_OP)


def builtin_backends() -> tuple[str, ...]:
    """The built-in backend packages (this distribution's ``dsa_indexer.backends`` entry points), in order."""
    return tuple(entry.value for entry in discovery.builtin_entries(ENTRY_POINT_GROUP))


class BackendSpec:
    @hookspec
    def dsa_indexer_register(self, registry: Registry) -> None:
        """Register this backend's implementations with ``registry.register`` / ``registry.implementation``."""


def _contained(exc: BaseException) -> bool:
    """A plugin may raise anything, even SystemExit from an import: contain all but a user's Ctrl-C."""
    return not isinstance(exc, KeyboardInterrupt)


def _arch_problem(name: str) -> str | None:
    """Why a registration's target ``name`` can never match a target, as the end of "which ..." (None: it can): no
    platform parses it, or a platform reads it as another arch (the registry compares the arch exactly)."""
    if name == "*" or name in vendors():
        return None
    for platform in platforms():
        try:
            target = platform.parse(name)
        except Exception:  # noqa: BLE001 - a third-party platform's parser must not fail the plugin's load
            continue
        if target is not None:
            return None if target.arch == name else f"the {platform.vendor} platform reads as {target.arch}"
    return "no platform parses"


def _warn_unserved_archs(registry: Registry, name: str, impl_ids: set[str]) -> None:
    """One warning per (plugin, arch) whose implementations can never be chosen: a typo (``sm9O``) would otherwise
    load without a word and never run. Also kept in ``registry.plugins_warned`` (`dsa-indexer info`)."""
    unserved: dict[str, list[str]] = {}
    for op in registry.ops():
        for impl in registry.implementations(op):
            if impl.impl_id in impl_ids:
                for arch in impl.targets:
                    if _arch_problem(arch) is not None:
                        unserved.setdefault(arch, []).append(impl.impl_id)
    for arch, ids in sorted(unserved.items()):
        examples = ", ".join(p.archs[0] for p in platforms() if p.archs)
        note = (f"{name}: registers {', '.join(sorted(ids))} for target {arch!r}, which {_arch_problem(arch)}, so "
                f"{'it never serves' if len(ids) == 1 else 'they never serve'} (a target is an arch such as "
                f"{examples}, a vendor: {', '.join(vendors())}, or '*')")
        registry.plugins_warned.append(note)
        warnings.warn(f"dsa_indexer: plugin {note}", RuntimeWarning, stacklevel=2)


def _register_one(registry: Registry, manager: pluggy.PluginManager, name: str, plugin: Any,
                  builtin: bool = False) -> None:
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
    if builtin:
        registry.builtin_origins.add(name)
    _warn_unserved_archs(registry, name, added)


def load_plugins(registry: Registry, *, builtins: tuple[str, ...] | None = None,
                 entry_points: bool | None = None) -> pluggy.PluginManager:
    """Register the built-in backends, then the other installed entry points, into ``registry``: one discovery
    path (`discovery.entries`) for both. ``builtins`` (module names) replaces the built-in entries (tests)."""
    manager = pluggy.PluginManager(PROJECT)
    manager.add_hookspecs(BackendSpec)
    if builtins is None:
        builtin = discovery.builtin_entries(ENTRY_POINT_GROUP)
    else:
        builtin = [discovery.Entry(name.rsplit(".", 1)[-1], name, builtin=True) for name in builtins]
    if entry_points is None:
        entry_points = not env_flag(AUTOLOAD_ENV)
    allowed = {n.strip() for n in os.environ.get(ALLOW_ENV, "").split(",") if n.strip()}
    third_party = discovery.third_party_entries(ENTRY_POINT_GROUP) if entry_points else []
    builtin_values = {entry.value for entry in builtin}
    seen = {entry.name for entry in third_party}
    for entry in builtin + third_party:
        if not entry.builtin and (entry.value in builtin_values or (allowed and entry.name not in allowed)):
            continue
        try:
            plugin = entry.load()
        except BaseException as exc:  # noqa: BLE001
            if not _contained(exc):
                raise
            where = entry.value if entry.builtin else f"{entry.name} ({entry.value})"
            registry.plugins_failed.append(f"{where}: import failed: {type(exc).__name__}: {exc}")
            continue
        _register_one(registry, manager, entry.name, plugin, builtin=entry.builtin)
    if entry_points:
        for name in sorted(allowed - seen):
            registry.plugins_failed.append(f"{name}: named in {ALLOW_ENV} but no such entry point is installed "
                                           f"(group {ENTRY_POINT_GROUP}; installed: {', '.join(sorted(seen)) or '-'})")
    return manager


_default: Registry | None = None
_default_lock = threading.Lock()


def default_registry() -> Registry:
    """The process-wide registry, with every plugin loaded on first use (after the environment variables are
    checked: a bad value raises here, naming the variable)."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                # The library's first read of its environment: every DSA_INDEXER_* value is checked now, also those
                # that this device's code paths never read (envflags.check_environment).
                check_environment()
                registry = Registry()
                load_plugins(registry)
                _default = registry
    return _default
