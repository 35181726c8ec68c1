"""Generic compositions that run on every target by calling the ops through the registry.

They are not kernels, so they live beside the pipeline rather than in a backend (the single-stream pipeline
strategies register from `pipeline.py` itself): the composed lightning indexers (paged or ragged logits, then
top-k, each resolved on its own, so the best logits kernel and the best top-k of a target combine where no backend
fuses them). They register through the same plugin hook as the backends (an entry point of `dsa_indexer.backends`
in pyproject.toml).
"""

from __future__ import annotations

import torch

from . import ops
from .contract.cache import decode_row_requests
from .contract.specs import WRITES_OUT_INFO, writes_out
from .contract.step import STEP_CONTEXT_INFO, StepContext, takes_step_context
from .dispatch.bind import bind
from .dispatch.plugins import hookimpl
from .dispatch.registry import Registry
from .dispatch.target import Target
from .dispatch.verification import CPU_SUITE, Level, Verified, ran_on

COMPOSED_PRIORITY = 1  # above the pure-torch oracle (0), below any fused kernel
# The prefill composition outranks the Triton fused ragged top-k (1): it measured faster on the H200 at every size
# (backends/triton/__init__.py says by how much); a vendor's fused kernel would rank above both.
RAGGED_COMPOSED_PRIORITY = 2


class InnerOps:
    """A composition's inner op calls, each bound once per (registry state, target, problem facts) (`dispatch.bind`)
    and then called directly: the warm path computes the facts (one generated function), makes one dict lookup, and
    hashes no `Target` or `Problem`. The entry keeps its target alive, so the key's ``id(target)`` stays that
    object's. ``context``: the step's (`contract.step.StepContext`), handed to an inner kernel that takes it.
    ``out``: a caller's buffer for the inner op's result, written by an inner kernel that declares ``writes_out``,
    else filled with its result by one copy."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._memo: dict[tuple, tuple] = {}

    def call(self, op: str, target: Target, *args, context: StepContext | None = None,
             out: torch.Tensor | None = None):
        declared = ops.OPERATORS[op]
        key = (self.registry.generation, id(target), op, declared.facts(*args))
        entry = self._memo.get(key)
        if entry is None:
            if len(self._memo) >= 256:  # stale generations are never asked for again
                self._memo.clear()
            bound = bind(op, target, declared.problem(*args), self.registry)
            entry = self._memo[key] = (target, bound.fn, takes_step_context(bound.info), writes_out(bound.info))
        kwargs = {"context": context} if context is not None and entry[2] else {}
        if out is None:
            return entry[1](*args, **kwargs)
        if not entry[3]:
            return out.copy_(entry[1](*args, **kwargs))
        result = entry[1](*args, out=out, **kwargs)
        return result if result is out else out.copy_(result)


def make_lightning_indexer_composed(inner: InnerOps):
    def lightning_indexer_composed(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                                   context_lens: torch.Tensor, block_table: torch.Tensor, max_context_len: int,
                                   k: int, return_slots: bool = False, *, target: Target,
                                   context: StepContext | None = None, out: torch.Tensor | None = None
                                   ) -> torch.Tensor:
        """``topk_indices(paged_mqa_logits(...))``, each resolved for ``target`` (the one the outer call was
        resolved for); the arguments were checked by the outer op or the Indexer. ``context``: the step's, handed
        to the logits (DeepGEMM's schedule, once per step) and giving the row map. ``out``: the top-k's buffer."""
        logits = inner.call("paged_mqa_logits", target, q, kv_cache, weights, context_lens, block_table,
                            max_context_len, context=context)
        ends = context_lens.reshape(-1)
        if not return_slots:
            return inner.call("topk_indices", target, logits, k, ends, None, None, None, out=out)
        rows = (decode_row_requests(q.shape[0], q.shape[1], q.device) if context is None
                else context.row_requests(q.shape[0], q.shape[1], q.device))
        return inner.call("topk_indices", target, logits, k, ends, None, block_table, rows, out=out)

    return lightning_indexer_composed


def make_ragged_mqa_topk_composed(inner: InnerOps):
    def ragged_mqa_topk_composed(q, k, k_scales, weights, ks, ke, topk: int, *, target: Target,
                                 out: torch.Tensor | None = None) -> torch.Tensor:
        """``topk_indices(ragged_mqa_logits(...))``, each resolved for ``target`` (the [S, N] logits in memory);
        ``out``: the top-k's buffer."""
        logits = inner.call("ragged_mqa_logits", target, q, k, k_scales, weights, ks, ke)
        return inner.call("topk_indices", target, logits, topk, ke, ks, None, None, out=out)

    return ragged_mqa_topk_composed


# On the H200 with the Triton / DeepGEMM kernels inside; elsewhere on CPU tensors only.
RAGGED_COMPOSED_VERIFIED = (CPU_SUITE, ran_on("sm90", "dd525a6", "2026-12-01",
                                              "tests/gpu/test_prefill_scoring_gpu.py; benchmarks/results/"
                                              "prefill_scoring_h200.json"))
# The V3.2 decode step on simulated AMD targets, with aiter's fused quant and CK GEMM as doubles.
AMD_STEP = Verified(Level.DOUBLE, ("gfx942", "gfx950", "gfx1250"), "tests/backends/test_amd_q_lora_reuse.py (the "
                                                                   "V3.2 decode step, aiter's quant and GEMM doubled)")
COMPOSED_VERIFIED = (CPU_SUITE, ran_on("sm90", "90cca2e", "2026-12-02", "benchmarks/results/decode_s6_h200.json"),
                     AMD_STEP)


@hookimpl
def dsa_indexer_register(registry: Registry) -> None:
    inner = InnerOps(registry)
    registry.implementation("ragged_mqa_topk", impl_id="ragged_mqa_topk.generic.composed", targets=("*",),
                            priority=RAGGED_COMPOSED_PRIORITY,
                            description="ragged_mqa_logits then topk_indices, each resolved on its own",
                            takes_target=True, info={WRITES_OUT_INFO: True},
                            verified=RAGGED_COMPOSED_VERIFIED)(lambda: make_ragged_mqa_topk_composed(inner))
    registry.implementation("lightning_indexer", impl_id="lightning_indexer.generic.composed", targets=("*",),
                            priority=COMPOSED_PRIORITY,
                            description="paged_mqa_logits then topk_indices, each resolved on its own",
                            takes_target=True, info={STEP_CONTEXT_INFO: True, WRITES_OUT_INFO: True},
                            verified=COMPOSED_VERIFIED)(lambda: make_lightning_indexer_composed(inner))
