"""Fixtures the backend tests share."""

from __future__ import annotations

import pytest

from dsa_indexer.dispatch import Registry, load_plugins


@pytest.fixture(scope="module")
def registry():
    """A registry of the built-in backends only (no installed plugin), fresh for each test module."""
    reg = Registry()
    load_plugins(reg, entry_points=False)
    return reg
