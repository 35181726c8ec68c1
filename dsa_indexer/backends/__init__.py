"""Backends: one folder per vendor. Each registers its implementations through the plugin hook and touches nothing else.

A backend folder may hold a ``platform.py`` (its `Platform`: arch names, device detection, fp8 flavour per arch,
vendor library probes). The built-in backends and platforms are declared once, as entry points of the groups
``dsa_indexer.backends`` and ``dsa_indexer.platforms`` in pyproject.toml, and found the way third-party ones are
(`dsa_indexer.dispatch.discovery`); dispatch names none of them.
"""
