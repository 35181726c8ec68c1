"""The per-step plan: a table role -> bound kernel, built once per problem class, run with the step's tensors.

`Indexer.step_plan` builds a `StepPlan` per layer and problem class (decode or prefill, token bucket, next_n,
whether a q_lora quant is handed in, the cache layout, the activation dtype) and keeps it while the weights, the
target and the registry stay as they were. Building it binds every kernel the step runs (`dispatch.bind`), each
for a problem made from facts the plan is given (config, cache layout, dtype, next_n, the weights' shapes): a
missing fact is an error at build (`role_problem`), not a resolution at the first call. The table is keyed by
role, a name for one call site of the step ("wq_b_gemm", "score", ...), and each entry is the `Bound` of its op for
that problem: the facts the plan reads (the GEMMs' input layouts, a scorer's bytes per row) come from the same
``Bound.info``. A warm step makes no resolution, builds no `Problem` and converts no target; the strategies and
steps receive the plan, never the module.

The first call of each role on CPU tensors (or with ``DSA_INDEXER_CHECK_RANGES=1``) checks that the facts of its
arguments are the problem the role was bound for (a plan that would run a kernel outside its problem is a bug
here, caught where checking is free). Kernels that declare ``step_context`` in their registry info receive the
step's `contract.step.StepContext` (``context=``). While `torch.compile` traces, `StepPlan.run` calls the op's
custom op instead (the implementation then runs inside it at run time, as for any traced op call).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from . import ops
from .compressor import WINDOW
from .config import IndexerConfig
from .contract.cache import LAYOUT_PAGED64_FP4
from .contract.quant import Fp8GroupLayout
from .contract.specs import DECLARED, fp8_name
from .contract.step import StepContext, takes_step_context
from .contract.validate import ranges_checked
from .dispatch.bind import Bound
from .dispatch.problem import Problem
from .dispatch.registry import Registry, Resolution
from .dispatch.target import Target

log = logging.getLogger("dsa_indexer")


def role_problem(op: str, **facts: Any) -> Problem:
    """The `Problem` a plan binds ``op`` for: every one of the op's declared facts, given (a missing or an unknown
    one is an error naming it, at plan build)."""
    declared = DECLARED[op].problem_keys
    missing = [key for key in declared if key not in facts]
    unknown = sorted(set(facts) - set(declared))
    if missing or unknown:
        raise ValueError(f"the plan binds {op} without fact(s) {missing} / with unknown {unknown}; {op} declares "
                         f"{list(declared)}")
    return Problem(**facts)


@dataclass(frozen=True, eq=False)
class LayerWeights:
    """One layer's indexer weights as a step reads them (derived forms made once per plan)."""

    wq_b: torch.Tensor                    # [H * D, q_lora_rank]: block-fp8 (with ``wq_b_scale``) or activation dtype
    wq_b_scale: torch.Tensor | None
    weights_proj: torch.Tensor            # [H, hidden] in the recipe's precision (fp32 or the activation dtype)
    x_projection: torch.Tensor | None     # [weights_proj; wk] as one GEMM's weight, when the two fuse
    wk: torch.Tensor | None               # [D, hidden] (V3.2): block-fp8 (with ``wk_scale``) or activation dtype
    wk_scale: torch.Tensor | None
    k_norm_weight: torch.Tensor | None
    k_norm_bias: torch.Tensor | None
    cos_sin: torch.Tensor                 # the shared RoPE table [max_position, rope_dim] fp32
    wq_b_activation: torch.Tensor | None  # wq_b in the activation dtype, for the plain (bf16 / int8) layouts
    compressor: Any = None                # V4 C4: the layer's key compressor (`dsa_indexer.compressor.Compressor`)


@dataclass(eq=False)
class StepPlan:
    """What a step of one layer runs, bound once (see the module docstring)."""

    config: IndexerConfig
    target: Target
    fp8_dtype: torch.dtype
    weights: LayerWeights
    problem: Problem                      # the pipeline strategy's problem class
    pipeline: Resolution
    strategy: Callable[..., tuple]
    steps: Any                            # the shared steps a strategy orders (`pipeline.PipelineSteps`)
    registry: Registry
    fuse_x_projections: bool
    kernels: Mapping[str, Bound]          # role -> its op bound for the role's problem (`explain`)
    wq_b_layout: Fp8GroupLayout | None    # the activation layout wq_b's fp8 GEMM takes (None: a bf16 wq_b)
    wk_layout: Fp8GroupLayout | None      # the same for a block-fp8 wk
    reuse_unrounded: bool                 # reuse a q_lora quant made before bf16 rounding (the platform's policy)
    # The `gemm_fp8_blockscale` ``scale_fmt`` fact of each fp8 GEMM, a host fact taken at plan build: "ue8m0" when
    # the recipe's activation scales (config.scale_fmt) and the weight's block scales (read once at weight load,
    # `Indexer.record_weight_scale_formats`) are both powers of two, else "fp32".
    wq_b_scale_fmt: str = "fp32"
    wk_scale_fmt: str = "fp32"
    weight_scale: float = 1.0             # the config's derived constants, read once (softmax scale x head scale)
    rope_offset: int = 0
    # prefill: the gathered keys' format, the ragged ops' ``keys`` fact ("fp4": the FP4 pages' bytes as stored)
    prefill_keys: str = "fp8"
    scoring_bytes: tuple[int, int] | None = None  # prefill: (bytes per row, per (row, key)) a scored chunk holds
    reasons: Mapping[str, str] = field(default_factory=dict)  # role -> why the plan runs it (`explain`)
    reuse_stats: Counter = field(default_factory=Counter)
    _checked: set = field(default_factory=set)  # roles whose first call was checked against their problem
    _with_context: frozenset = frozenset()  # roles whose kernel takes the step's context

    def __post_init__(self) -> None:
        self._with_context = frozenset(role for role, bound in self.kernels.items() if takes_step_context(bound.info))

    def run(self, role: str, op: str, *args: Any, context: StepContext | None = None) -> Any:
        """Run ``role``'s bound kernel, an ``op`` (named at the call site, checked at the first call), on ``args``
        (the op's schema order); ``context``: the step's, for a kernel that takes it."""
        bound = self.kernels.get(role)
        if bound is None:
            raise KeyError(f"this step plan binds no kernel for role {role!r} (it binds {sorted(self.kernels)}): "
                           "the plan and the step disagree on what runs")
        if torch.compiler.is_compiling():  # traced: the op's custom op holds the call (resolved at run time)
            return getattr(torch.ops.dsa_indexer, op)(*args, target=str(self.target))
        if role not in self._checked:
            self._check_first_call(role, op, bound, args)
        if context is not None and role in self._with_context:
            return bound.fn(*args, context=context)
        return bound.fn(*args)

    def schedule(self, context: StepContext, *args: Any) -> tuple:
        """Run the plan's pipeline strategy on the step's tensors (``x, q_lora, positions, key_store, kv_cache,
        q_lora_quant``); a strategy that declares ``step_context`` also receives the step's context."""
        if "pipeline" in self._with_context:
            return self.strategy(self, *args, context=context)
        return self.strategy(self, *args)

    def _check_first_call(self, role: str, op: str, bound: Bound, args: tuple) -> None:
        if op != bound.op:
            raise RuntimeError(f"step plan role {role!r} is bound to {bound.op}, but the step calls it as {op}")
        anchor = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if anchor is not None and ranges_checked(anchor):
            actual = ops.OPERATORS[bound.op].problem(*args)
            if actual != bound.problem:
                raise RuntimeError(f"step plan role {role!r} was bound for {bound.op} {bound.problem}, but its first "
                                   f"call has {actual}: the plan's facts disagree with the step's tensors")
        self._checked.add(role)

    def explain(self) -> list[tuple[str, str, str, str]]:
        """One row per role: ``(role, op, implementation id, why)``; why: the plan's reason for the role, then the
        resolution's for the implementation (forced, chosen over the others, a fallback and its reasons)."""
        rows = []
        for role, bound in self.kernels.items():
            res = bound.resolution
            if res.forced:
                choice = f"forced ({res.forced})"
            elif res.is_fallback:
                choice = f"fallback: {res.fallback_reasons()}"
            else:
                others = [c.impl.impl_id for c in res.candidates if c.impl is not res.chosen and not c.accepted]
                choice = (f"priority {res.chosen.priority}" if res.chosen is not None else "-") + \
                    (f"; rejected {len(others)} other(s)" if others else "")
            rows.append((role, bound.op, bound.impl_id, f"{self.reasons.get(role, '')}; {choice}".lstrip("; ")))
        return rows

    def note_reuse(self, used: bool, reason: str | None) -> None:
        """Count each q_lora_quant decision; a drop is logged at debug level with its reason."""
        if used:
            self.reuse_stats["reused"] += 1
        else:
            self.reuse_stats["dropped"] += 1
            self.reuse_stats[f"dropped: {reason}"] += 1
            log.debug("q_lora_quant dropped, re-quantizing from bf16: %s", reason)


@dataclass(frozen=True)
class Role:
    """One call site of a step, before binding: its op, the problem it is bound for, and why the step runs it."""

    op: str
    problem: Problem
    why: str


def q_and_k_roles(config: IndexerConfig, fp8: str, cache_layout: str, plain_format: str | None,
                  weights: LayerWeights, fuse_x_projections: bool, wk_fp8: bool) -> dict[str, Role]:
    """The roles of the q and k paths (`pipeline`) that need no other role's facts: the x projections, the q
    prologue, the key store (V3.2) or the compressor's kernels (C4). The fp8 GEMMs and the quants that feed them are
    bound by the caller (a quant's layout is its GEMM's ``info``)."""
    cfg = config
    rope = dict(rope_dim=weights.cos_sin.shape[1], interleaved=cfg.rope_interleaved)
    roles: dict[str, Role] = {}
    if fuse_x_projections and weights.x_projection is None and weights.wk is not None and not wk_fp8 \
            and weights.weights_proj.dtype == torch.float32:
        roles["x_projections"] = Role("x_projections", role_problem(
            "x_projections", hidden=cfg.hidden_size, heads=weights.weights_proj.shape[0], dim=weights.wk.shape[0],
            head_proj=str(weights.weights_proj.dtype)), "weights_proj (fp32) and wk (bf16) from one read of x")
    if plain_format is not None:
        roles["q_prologue"] = Role("q_prologue_plain", role_problem(
            "q_prologue_plain", heads=cfg.n_heads, dim=cfg.head_dim, format=plain_format, **rope),
            f"q for the {cache_layout} cache ({plain_format} keys)")
    elif cfg.key_quant == "fp4_e2m1":
        roles["q_prologue"] = Role("q_prologue_fp4", role_problem(
            "q_prologue_fp4", heads=cfg.n_heads, dim=cfg.head_dim, block=cfg.fp4_block, fp8=fp8, **rope),
            "key_quant fp4_e2m1: V4's FP4 q recipe, folded into fp8")
    else:
        roles["q_prologue"] = Role("q_prologue", role_problem(
            "q_prologue", heads=cfg.n_heads, dim=cfg.head_dim, ue8m0=cfg.ue8m0, fp8=fp8, **rope),
            "RoPE, Hadamard and fp8 quant of q")
    if cfg.compress_ratio == 1:
        if plain_format is not None:
            roles["k_store"] = Role("k_prologue_store_plain", role_problem(
                "k_prologue_store_plain", dim=cfg.head_dim, norm=cfg.k_norm, format=plain_format, **rope),
                f"this step's keys into the {cache_layout} cache")
        else:
            roles["k_store"] = Role("k_prologue_store", role_problem(
                "k_prologue_store", dim=cfg.head_dim, norm=cfg.k_norm, ue8m0=cfg.ue8m0, fp8=fp8, **rope),
                "this step's keys into the fp8 pages")
        return roles
    roles["c4_pool"] = Role("c4_compress_pool", role_problem("c4_compress_pool", dim=cfg.head_dim, window=WINDOW),
                            "C4: pool the entries this step completes, roll the state forward")
    if cfg.key_quant == "fp4_e2m1":
        if cache_layout != LAYOUT_PAGED64_FP4:  # the FP4 pages take the codes as made (torch ops, no kernel)
            roles["c4_fp4_keys"] = Role("q_prologue_fp4", role_problem(
                "q_prologue_fp4", heads=1, dim=cfg.head_dim, block=cfg.fp4_block, fp8=fp8, **rope),
                "C4 FP4 keys folded into the fp8 pages (the FP4 q recipe, one head)")
    elif plain_format is not None:
        roles["c4_store"] = Role("k_prologue_store_plain", role_problem(
            "k_prologue_store_plain", dim=cfg.head_dim, norm="rmsnorm", format=plain_format, **rope),
            f"C4 entries into the {cache_layout} cache")
    else:
        roles["c4_store"] = Role("k_prologue_store", role_problem(
            "k_prologue_store", dim=cfg.head_dim, norm="rmsnorm", ue8m0=cfg.ue8m0, fp8=fp8, **rope),
            "C4 entries into the fp8 pages")
    return roles


def scoring_role(config: IndexerConfig, fp8: str, decode: bool, next_n: int, cache_layout: str,
                 plain_format: str | None, prefill_keys: str, logits_pages: int | None,
                 cache_pages: int | None = None) -> tuple[str, Role]:
    """The step's scoring role: "score" (decode: `lightning_indexer`; prefill: `ragged_mqa_topk` per chunk; a plain
    layout: `lightning_indexer_ragged`), or for a plan of the decode-logits seam (``logits_pages``: the cache's page
    count, a fact of the paged logits) "logits", `paged_mqa_logits`. ``cache_pages``: the decode cache's page count,
    a fact of `lightning_indexer` (None: a plan made without a cache, `Indexer.explain_step`)."""
    cfg = config
    keys = "fp4" if cache_layout == LAYOUT_PAGED64_FP4 else "fp8"
    if logits_pages is not None:
        return "logits", Role("paged_mqa_logits", role_problem(
            "paged_mqa_logits", heads=cfg.n_heads, dim=cfg.head_dim, next_n=next_n, fp8=fp8, keys=keys,
            pages=logits_pages), "the decode logits seam (context-parallel decode merges its shards' scores)")
    if plain_format is not None:
        return "score", Role("lightning_indexer_ragged", role_problem(
            "lightning_indexer_ragged", heads=cfg.n_heads, dim=cfg.head_dim, k=cfg.topk, format=plain_format,
            ratio=cfg.compress_ratio), f"one fused ragged indexer over the rows ({cache_layout} cache)")
    if decode:
        return "score", Role("lightning_indexer", role_problem(
            "lightning_indexer", heads=cfg.n_heads, dim=cfg.head_dim, next_n=next_n, k=cfg.topk, fp8=fp8,
            slots=False, keys=keys, pages=cache_pages), "decode: paged logits and top-k")
    return "score", Role("ragged_mqa_topk", role_problem(
        "ragged_mqa_topk", heads=cfg.n_heads, dim=cfg.head_dim, fp8=fp8, k=cfg.topk, keys=prefill_keys),
        f"prefill: logits and top-k per chunk over the gathered {prefill_keys} keys")


def gemm_role(weight: torch.Tensor, dtype: torch.dtype, scale_fmt: str, why: str) -> Role:
    """A block-fp8 GEMM role: the weight's shape and flavour, the output dtype, the scales' format."""
    return Role("gemm_fp8_blockscale", role_problem(
        "gemm_fp8_blockscale", n=weight.shape[0], k=weight.shape[1], out=str(dtype), fp8=fp8_name(weight.dtype),
        scale_fmt=scale_fmt), why)


def quant_role(layout: Fp8GroupLayout, width: int, why: str) -> Role:
    """The fp8 group quant that feeds a GEMM, in the GEMM's input layout (its ``info``)."""
    return Role("quant_fp8_groups", role_problem("quant_fp8_groups", group_size=layout.group_size, ue8m0=layout.ue8m0,
                                                 fp8=fp8_name(layout.fp8_dtype), width=width), why)
