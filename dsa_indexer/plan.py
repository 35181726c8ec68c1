"""The per-step plan: what one indexer step resolves once, handed to the pipeline strategy with the step's tensors.

`Indexer.step_plan` builds a `StepPlan` per layer and problem class (decode or prefill, token bucket, next_n,
whether a q_lora quant is handed in, the cache layout) and keeps it while the weights, the target and the registry
stay as they were. The plan holds the target, the weights in the forms the step reads (`LayerWeights`), the GEMM
input layouts, the pipeline strategy, and each op's implementation, resolved on its first call in the plan
(`StepPlan.run`): a warm step makes no resolution, builds no `Problem` and converts no target; the strategies and
steps receive the plan, never the module.

While `torch.compile` traces, `StepPlan.run` calls the op's custom op instead (the implementation then runs
inside it at run time, as for any traced op call).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import ops
from .config import IndexerConfig
from .contract.quant import Fp8GroupLayout
from .dispatch.problem import Problem
from .dispatch.registry import Registry, Resolution
from .dispatch.target import Target

log = logging.getLogger("dsa_indexer")


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
    """What a step of one layer runs, resolved once (see the module docstring)."""

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
    reuse_stats: Counter = field(default_factory=Counter)
    _kernels: dict[str, Callable[..., Any]] = field(default_factory=dict)

    def run(self, role: str, op: str, *args: Any) -> Any:
        """Run ``op`` (schema-ordered ``args``) as this plan's ``role`` (a name for one call site of the step, e.g.
        "wq_b_gemm"): resolved on the role's first call, a direct call of the implementation after."""
        if torch.compiler.is_compiling():  # traced: the op's custom op holds the call (resolved at run time)
            return getattr(torch.ops.dsa_indexer, op)(*args, target=str(self.target))
        fn = self._kernels.get(role)
        if fn is None:
            fn = self._kernels[role] = self.registry.function(op, self.target, ops.OPERATORS[op].problem(*args))
        return fn(*args)

    def note_reuse(self, used: bool, reason: str | None) -> None:
        """Count each q_lora_quant decision; a drop is logged at debug level with its reason."""
        if used:
            self.reuse_stats["reused"] += 1
        else:
            self.reuse_stats["dropped"] += 1
            self.reuse_stats[f"dropped: {reason}"] += 1
            log.debug("q_lora_quant dropped, re-quantizing from bf16: %s", reason)
