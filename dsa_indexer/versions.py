"""The versions a report records (`dsa-indexer info`, `run --json`, `bench --json`): one definition for all three."""

from __future__ import annotations

import sys

import torch

from . import __version__


def package_versions() -> dict:
    """dsa_indexer, torch, python, triton, pluggy and every platform's vendor distributions: their installed versions
    (distribution metadata; None when not installed). What `dsa-indexer info`, `run` and `bench` reports show."""
    import importlib.metadata as md

    out = {"dsa_indexer": __version__, "torch": torch.__version__, "python": sys.version.split()[0]}
    from .dispatch.platform import platforms

    vendor_dists = [d for p in platforms() for d in p.distributions]
    for dist in ("triton", "pluggy", *vendor_dists):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out
