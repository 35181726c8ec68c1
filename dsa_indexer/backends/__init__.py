"""Backends: one folder per vendor. Each registers its implementations through the plugin hook and touches nothing else.

A backend folder may hold a ``platform.py`` (its `Platform`: arch names, device detection, fp8 flavour per arch,
vendor library probes). The built-in packages are listed here, in registration order, and declared again as
entry points of the ``dsa_indexer.backends`` group in pyproject.toml (the list lets a source tree that is not
pip-installed find them too); dispatch reads this list and names none of them.
"""

BUILTIN_PACKAGES = (
    "dsa_indexer.generic",  # the generic strategies (single-stream pipeline, composed lightning indexer)
    "dsa_indexer.backends.reference",
    "dsa_indexer.backends.triton",
    "dsa_indexer.backends.cuda",
    "dsa_indexer.backends.rocm",
    "dsa_indexer.backends.npu",
)
