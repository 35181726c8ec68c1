"""Generic strategies: compositions that run on every target by calling the ops through the registry.

They are not kernels, so they live beside the pipeline rather than in a backend: the single-stream pipeline
strategy (`pipeline.single_stream`) and the composed lightning indexers (paged or ragged logits, then top-k, each
resolved on its own, so the best logits kernel and the best top-k of a target combine where no backend fuses them). They
register through the same plugin hook as the backends (an entry point of `dsa_indexer.backends` in pyproject.toml).
"""

from __future__ import annotations

import torch

from . import ops
from .contract.cache import decode_row_requests
from .dispatch.plugins import hookimpl
from .dispatch.registry import Registry
from .dispatch.target import Target
from .pipeline import register_single_stream

COMPOSED_PRIORITY = 1  # above the pure-torch oracle (0), below any fused kernel
# The prefill composition outranks the Triton fused ragged top-k (1): it measured faster on the H200 at every size
# (backends/triton/__init__.py says by how much); a vendor's fused kernel would rank above both.
RAGGED_COMPOSED_PRIORITY = 2


def lightning_indexer_composed(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                               context_lens: torch.Tensor, block_table: torch.Tensor, max_context_len: int,
                               k: int, return_slots: bool = False, *, target: Target) -> torch.Tensor:
    """``topk_indices(paged_mqa_logits(...))`` through the public ops (the registry picks each for ``target``, the
    one the outer call was resolved for)."""
    logits = ops.paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len, target=target)
    ends = context_lens.reshape(-1)
    if not return_slots:
        return ops.topk_indices(logits, k, ends, target=target)
    return ops.topk_indices(logits, k, ends, block_table=block_table,
                            row_request=decode_row_requests(q.shape[0], q.shape[1], q.device), target=target)


def ragged_mqa_topk_composed(q, k, k_scales, weights, ks, ke, topk: int, *, target: Target) -> torch.Tensor:
    """``topk_indices(ragged_mqa_logits(...))`` through the public ops (the [S, N] logits in memory)."""
    logits = ops.ragged_mqa_logits(q, k, k_scales, weights, ks, ke, target=target)
    return ops.topk_indices(logits, topk, ke, ks, target=target)


@hookimpl
def dsa_indexer_register(registry: Registry) -> None:
    registry.implementation("ragged_mqa_topk", impl_id="ragged_mqa_topk.generic.composed", targets=("*",),
                            priority=RAGGED_COMPOSED_PRIORITY,
                            description="ragged_mqa_logits then topk_indices, each resolved on its own",
                            takes_target=True)(lambda: ragged_mqa_topk_composed)
    registry.implementation("lightning_indexer", impl_id="lightning_indexer.generic.composed", targets=("*",),
                            priority=COMPOSED_PRIORITY,
                            description="paged_mqa_logits then topk_indices, each resolved on its own",
                            takes_target=True)(lambda: lightning_indexer_composed)
    register_single_stream(registry)
