"""Generic compositions that run on every target: each declares the ops it calls and receives them bound.

They are not kernels, so they live beside the pipeline rather than in a backend (the single-stream pipeline
strategies register from `pipeline.py` itself): the composed lightning indexers (paged or ragged logits, then
top-k, each resolved on its own, so the best logits kernel and the best top-k of a target combine where no backend
fuses them). Each declares the ops it uses and the problem it calls each with (`Implementation.uses`); the registry
binds those for the target and problem the composition was chosen for and hands them to its factory, so a call
reaches the inner kernels directly, and forcing an inner op (which changes the registry) rebinds the composition.
They register through the same plugin hook as the backends (an entry point of `dsa_indexer.backends`
in pyproject.toml).
"""

from __future__ import annotations

from typing import Mapping

import torch

from .contract.cache import decode_row_requests
from .contract.specs import WRITES_OUT_INFO, call_into
from .contract.step import STEP_CONTEXT_INFO, StepContext, takes_step_context
from .dispatch.plugins import hookimpl
from .dispatch.problem import Problem
from .dispatch.registry import Bound, Registry
from .dispatch.verification import CPU_SUITE, Level, Verified, ran_on

COMPOSED_PRIORITY = 1  # above the pure-torch oracle (0), below any fused kernel
# The prefill composition outranks the Triton fused ragged top-k (1): it measured faster on the H200 at every size
# (backends/triton/__init__.py says by how much); a vendor's fused kernel would rank above both.
RAGGED_COMPOSED_PRIORITY = 2


def inner_problem(outer: Problem, facts: Mapping[str, str], **fixed) -> Problem:
    """The problem of an inner op: its fact ``inner`` is the outer problem's fact ``facts[inner]``, each ``fixed``
    one is set. A fact the outer problem does not carry (a coarse problem, e.g. the CLI's) stays out, as it would
    of a problem made for the inner op directly."""
    return Problem(**{inner: outer[name] for inner, name in facts.items() if name in outer}, **fixed)


def into_out(inner: Bound):
    """``inner``'s function writing a caller's buffer, ``fn(*args, out)`` -> the buffer (`contract.specs.call_into`)."""
    fn, info = inner.fn, inner.info
    return lambda *args, out: call_into(fn, info, args, out)


# What each composition calls, and with which problem (`Implementation.uses`). Every fact of an inner op's problem
# comes from the outer op's: the paged cache's facts (including its page count) are the lightning indexer's own;
# its top-k reads logits from column 0 (no starts), its ragged top-k from each row's start.
_PAGED_FACTS = {fact: fact for fact in ("heads", "dim", "next_n", "fp8", "keys", "pages")}
_RAGGED_FACTS = {fact: fact for fact in ("heads", "dim", "fp8", "keys")}
LIGHTNING_INDEXER_USES = {
    "paged_mqa_logits": lambda outer: inner_problem(outer, _PAGED_FACTS),
    "topk_indices": lambda outer: inner_problem(outer, {"k": "k", "slots": "slots"}, starts=False),
}
RAGGED_MQA_TOPK_USES = {
    "ragged_mqa_logits": lambda outer: inner_problem(outer, _RAGGED_FACTS),
    "topk_indices": lambda outer: inner_problem(outer, {"k": "k"}, slots=False, starts=True),
}


def make_lightning_indexer_composed(paged_mqa_logits: Bound, topk_indices: Bound):
    """The composed lightning indexer over its inner ops, bound for its target and problem (`LIGHTNING_INDEXER_USES`):
    each call reaches the two kernels directly."""
    logits_of, topk, topk_into = paged_mqa_logits.fn, topk_indices.fn, into_out(topk_indices)
    logits_take_context = takes_step_context(paged_mqa_logits.info)

    def lightning_indexer_composed(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                                   context_lens: torch.Tensor, block_table: torch.Tensor, max_context_len: int,
                                   k: int, return_slots: bool = False, *,
                                   context: StepContext | None = None, out: torch.Tensor | None = None
                                   ) -> torch.Tensor:
        """``topk_indices(paged_mqa_logits(...))``, each bound for the outer call's target (the arguments were
        checked by the outer op or the Indexer). ``context``: the step's, handed to the logits (DeepGEMM's schedule,
        once per step) and giving the row map. ``out``: the top-k's buffer."""
        if context is not None and logits_take_context:
            logits = logits_of(q, kv_cache, weights, context_lens, block_table, max_context_len, context=context)
        else:
            logits = logits_of(q, kv_cache, weights, context_lens, block_table, max_context_len)
        ends = context_lens.reshape(-1)
        if return_slots:
            rows = (decode_row_requests(q.shape[0], q.shape[1], q.device) if context is None
                    else context.row_requests(q.shape[0], q.shape[1], q.device))
            args = (logits, k, ends, None, block_table, rows)
        else:
            args = (logits, k, ends, None, None, None)
        return topk(*args) if out is None else topk_into(*args, out=out)

    return lightning_indexer_composed


def make_ragged_mqa_topk_composed(ragged_mqa_logits: Bound, topk_indices: Bound):
    """The composed prefill scoring over its inner ops, bound for its target and problem (`RAGGED_MQA_TOPK_USES`)."""
    logits_of, select, select_into = ragged_mqa_logits.fn, topk_indices.fn, into_out(topk_indices)

    def ragged_mqa_topk_composed(q, k, k_scales, weights, ks, ke, topk: int, *,
                                 out: torch.Tensor | None = None) -> torch.Tensor:
        """``topk_indices(ragged_mqa_logits(...))``, each bound for the outer call's target (the [S, N] logits in
        memory); ``out``: the top-k's buffer."""
        args = (logits_of(q, k, k_scales, weights, ks, ke), topk, ke, ks, None, None)
        return select(*args) if out is None else select_into(*args, out=out)

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
    registry.implementation("ragged_mqa_topk", impl_id="ragged_mqa_topk.generic.composed", targets=("*",),
                            priority=RAGGED_COMPOSED_PRIORITY,
                            description="ragged_mqa_logits then topk_indices, each resolved on its own",
                            uses=RAGGED_MQA_TOPK_USES, info={WRITES_OUT_INFO: True},
                            verified=RAGGED_COMPOSED_VERIFIED)(make_ragged_mqa_topk_composed)
    registry.implementation("lightning_indexer", impl_id="lightning_indexer.generic.composed", targets=("*",),
                            priority=COMPOSED_PRIORITY,
                            description="paged_mqa_logits then topk_indices, each resolved on its own",
                            uses=LIGHTNING_INDEXER_USES, info={STEP_CONTEXT_INFO: True, WRITES_OUT_INFO: True},
                            verified=COMPOSED_VERIFIED)(make_lightning_indexer_composed)
