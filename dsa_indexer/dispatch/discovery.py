"""Discovery: the one way backends and platforms are found, built-in or third-party: entry points.

The built-in ones are the entry points pyproject.toml declares for this distribution (``dsa_indexer.backends``,
``dsa_indexer.platforms``): read from the source tree's pyproject.toml when the package runs from one (a checkout, an
editable install: always current, also when the tree is only on ``sys.path``), else from the installed
distribution's metadata (a wheel). Third-party ones are the other installed distributions' entry points of the same
groups. Dispatch names no backend: it only walks these lists.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

DISTRIBUTION = "dsa-indexer"
PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # .../dsa_indexer
SOURCE_PYPROJECT = PACKAGE_ROOT.parent / "pyproject.toml"


@dataclass(frozen=True)
class Entry:
    """One entry point: ``name = "module[:attribute]"``; ``builtin``: declared by this distribution."""

    name: str
    value: str
    builtin: bool

    def load(self) -> Any:
        module_name, _, attribute = self.value.partition(":")
        obj = importlib.import_module(module_name.strip())
        for part in filter(None, attribute.strip().split(".")):
            obj = getattr(obj, part)
        return obj


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pyproject_entry_points(text: str, group: str) -> list[tuple[str, str]]:
    """The ``[project.entry-points."<group>"]`` table of a pyproject.toml, in file order (a table of plain
    ``name = "value"`` lines is all this project writes there; no TOML library needed on Python 3.10)."""
    header = re.compile(r'^\[project\.entry-points\.(?:"([^"]+)"|([A-Za-z0-9_.-]+))\]\s*$')
    entries, inside = [], False
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith("["):
            match = header.match(line)
            inside = bool(match) and (match.group(1) or match.group(2)) == group
            continue
        if inside and "=" in line:
            name, _, value = line.partition("=")
            entries.append((name.strip().strip('"'), value.strip().strip('"').strip("'")))
    return entries


def _running_from_source() -> bool:
    """The package is imported from a tree whose pyproject.toml declares this distribution."""
    if not SOURCE_PYPROJECT.is_file():
        return False
    return re.search(rf'(?m)^name\s*=\s*"{DISTRIBUTION}"', SOURCE_PYPROJECT.read_text()) is not None


def builtin_entries(group: str) -> list[Entry]:
    """This distribution's entry points of ``group``, in the order pyproject.toml declares them."""
    if _running_from_source():
        pairs = _pyproject_entry_points(SOURCE_PYPROJECT.read_text(), group)
    else:
        try:
            dist = metadata.distribution(DISTRIBUTION)
        except metadata.PackageNotFoundError:
            pairs = []
        else:
            pairs = [(ep.name, ep.value) for ep in dist.entry_points if ep.group == group]
    return [Entry(name, value, builtin=True) for name, value in pairs]


def third_party_entries(group: str) -> list[Entry]:
    """The installed entry points of ``group`` from every other distribution."""
    found = []
    for ep in metadata.entry_points(group=group):
        dist = getattr(ep, "dist", None)
        if dist is not None and _normalized(dist.metadata["Name"] or "") == DISTRIBUTION:
            continue
        found.append(Entry(ep.name, ep.value, builtin=False))
    return found


def entries(group: str, *, third_party: bool = True) -> list[Entry]:
    """Built-in entries first (pyproject order), then third-party ones; a third-party entry with a built-in's value
    (a stale install of this package under another name) is dropped."""
    builtin = builtin_entries(group)
    if not third_party:
        return builtin
    values = {entry.value for entry in builtin}
    return builtin + [entry for entry in third_party_entries(group) if entry.value not in values]
