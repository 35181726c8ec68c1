"""A test vendor, "acme", added in one folder without touching dsa_indexer: its platform and its backend.

A real vendor ships this as a package with two entry points (``dsa_indexer.platforms`` -> ``platform:PLATFORM``,
``dsa_indexer.backends`` -> this module); `tests/dispatch/test_plugins.py` registers both by hand so that CI needs no
extra install. The backend serves the vendor's own arch with a top-k (the example plugin's algorithm).
"""

from dsa_indexer import hookimpl

from .platform import ARCH


@hookimpl
def dsa_indexer_register(registry):
    from dsa_indexer_example_backend import topk_via_torch_topk

    registry.implementation("topk_indices", impl_id="topk_indices.acme.torch_topk", targets=("acme",),
                            priority=120, description="acme: torch.topk-based top-k"
                            )(lambda: topk_via_torch_topk)


__all__ = ["ARCH"]
