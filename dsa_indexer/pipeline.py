"""Pipeline strategies: how the steps of one indexer call are scheduled before the logits.

The steps themselves (project q, fold head weights, project + store k) are shared; a strategy only decides
their order and streams. Strategies are resolved through the registry as the op ``indexer_pipeline`` per
target and problem class, so adding one (dual-stream on CUDA, say) is one registration and the model module
never changes. Every strategy must give bit-identical results to `single_stream`.

A strategy is ``strategy(plan, x, q_lora, positions, key_store, kv_cache, q_lora_quant)``: the step's
`dsa_indexer.plan.StepPlan` (target, weights, layouts, resolved kernels, ``plan.steps`` = these steps) and its
tensors. It runs the q and k paths, stores k in ``kv_cache`` and returns ``(q_fp8 [T, H, D], weights [T, H] f32)``;
``key_store`` is passed to `k_path` untouched: each row's cache slot (V3.2) or the compressor's step (C4). The
problem's ``cache`` fact says which layout a strategy serves: for the fp8 pages ``kv_cache`` is the uint8 page
tensor; for a plain layout it is the `IndexKCache` and the result is ``(q, q_scales, weights)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .compressor import CompressionStep
from .contract.cache import LAYOUT_PAGED64, LAYOUT_PAGED64_FP4, PLAIN_LAYOUT_FORMATS, IndexKCache
from .contract.quant import QuantizedActivation, reuse_rejection
from .contract.specs import PIPELINE_OP
from .dispatch.capabilities import Capabilities
from .dispatch.plugins import hookimpl
from .dispatch.verification import CPU_SUITE, Level, Verified, ran_on
from .plan import StepPlan


def project_q(plan: StepPlan, q_lora: torch.Tensor, q_lora_quant: QuantizedActivation | None) -> torch.Tensor:
    """``wq_b(q_lora)`` -> [T, H * D]; reuses ``q_lora_quant`` when its layout fits the GEMM, else re-quantizes."""
    w = plan.weights
    wanted = plan.wq_b_layout
    if wanted is None:  # a bf16 wq_b
        if q_lora_quant is not None:
            plan.note_reuse(False, reuse_rejection(q_lora_quant, q_lora, False))
        return F.linear(q_lora, w.wq_b)
    quant = None
    if q_lora_quant is not None:
        reason = reuse_rejection(q_lora_quant, q_lora, True, wanted, plan.reuse_unrounded)
        plan.note_reuse(reason is None, reason)
        if reason is None:
            quant = (q_lora_quant.data, q_lora_quant.scales)
    if quant is None:
        quant = plan.run("q_lora_quant", "quant_fp8_groups", q_lora, wanted.group_size, wanted.ue8m0,
                         wanted.fp8_dtype)
    return plan.run("wq_b_gemm", "gemm_fp8_blockscale", quant[0], quant[1], w.wq_b, w.wq_b_scale, q_lora.dtype,
                    plan.wq_b_scale_fmt)


def project_x(plan: StepPlan, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weights_proj(x) [T, H], wk(x) [T, D] or None)``: one GEMM over the concatenated weight
    (`LayerWeights.x_projection`) when the two are fusable (both in the activation dtype), so a decode step
    launches one skinny GEMM (and its split-K reduce) instead of two; both results are then column views of that
    GEMM's output. An fp32 weights_proj with a wk in the activation dtype (V3.2's recipe) runs the `x_projections`
    op: both from one read of x (on a GPU two Triton launches instead of a cast of x, two cuBLAS GEMMs and their two
    split-K reduces). A block-fp8 wk runs its own GEMM (`project_head_weights`, `project_k`)."""
    w = plan.weights
    if w.x_projection is not None:
        out = F.linear(x, w.x_projection)
        heads = plan.config.n_heads
        return out[:, :heads], out[:, heads:]
    if w.wk is not None and plan.wk_layout is None and w.weights_proj.dtype == torch.float32:
        return plan.run("x_projections", "x_projections", x, w.weights_proj, w.wk)
    return project_head_weights(plan, x), project_k(plan, x) if w.wk is not None else None


def project_head_weights(plan: StepPlan, x: torch.Tensor) -> torch.Tensor:
    """``weights_proj(x)`` [T, H] in the recipe's precision: fp32 (``weights_proj_dtype="fp32"``, as V3.2's code
    runs it: no bf16 rounding of the head weights) or the activation dtype."""
    weight = plan.weights.weights_proj
    return F.linear(x.float() if weight.dtype == torch.float32 else x, weight)


def project_k(plan: StepPlan, x: torch.Tensor) -> torch.Tensor:
    """``wk(x)`` [T, D]: a bf16 GEMM, or for a block-fp8 wk (``wk_gemm="fp8"``) the fp8 GEMM DeepSeek runs, with x
    quantized per 128 in the recipe's scale format (``scale_fmt``)."""
    w = plan.weights
    wanted = plan.wk_layout
    if wanted is None:
        return F.linear(x, w.wk)
    x_fp8, x_scales = plan.run("x_quant", "quant_fp8_groups", x, wanted.group_size, wanted.ue8m0, wanted.fp8_dtype)
    return plan.run("wk_gemm", "gemm_fp8_blockscale", x_fp8, x_scales, w.wk, w.wk_scale, x.dtype, plan.wk_scale_fmt)


def q_path(plan: StepPlan, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor,
           q_lora_quant: QuantizedActivation | None, head_weights: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """wq_b + RoPE + Hadamard + fp8 quant of q; ``head_weights`` is ``weights_proj(x)`` when the caller already
    has it (`project_x`)."""
    if head_weights is None:
        head_weights = project_head_weights(plan, x)
    return quantize_q(plan, project_q(plan, q_lora, q_lora_quant), positions, head_weights)


def quantize_q(plan: StepPlan, q: torch.Tensor, positions: torch.Tensor, head_weights: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE + Hadamard + fp8 quant of ``q = wq_b(q_lora)`` [T, H * D], the head weights folded with its scales:
    the q path after its GEMM (a strategy may run the GEMM before ``head_weights`` exist)."""
    cfg = plan.config
    q = q.view(-1, cfg.n_heads, cfg.head_dim)
    if cfg.key_quant == "fp4_e2m1":  # V4's FP4 recipe (dsa_indexer.fp4)
        return plan.run("q_prologue", "q_prologue_fp4", q, positions, plan.weights.cos_sin, head_weights,
                        plan.weight_scale, plan.rope_offset, cfg.rope_interleaved, cfg.fp4_block, plan.fp8_dtype)
    return plan.run("q_prologue", "q_prologue", q, positions, plan.weights.cos_sin, head_weights, plan.weight_scale,
                    plan.rope_offset, cfg.rope_interleaved, cfg.ue8m0, plan.fp8_dtype)


def k_path(plan: StepPlan, x: torch.Tensor, positions: torch.Tensor,
           key_store: torch.Tensor | CompressionStep | None, kv_cache: torch.Tensor, k: torch.Tensor | None = None
           ) -> None:
    """Store this step's keys. V3.2 (``key_store`` = each row's cache slot, -1: none): project, normalize, rotate,
    quantize and store; ``k`` is ``wk(x)`` when the caller already has it (`project_x`). V4 C4 (``key_store`` a
    `CompressionStep`): the indexer's compressor pools the entries this step completes and stores them."""
    if key_store is None:
        return
    cfg, w = plan.config, plan.weights
    if isinstance(key_store, CompressionStep):
        w.compressor.step(plan, x, key_store, kv_cache)
        return
    if k is None:
        k = project_k(plan, x)
    plan.run("k_store", "k_prologue_store", k, w.k_norm_weight, w.k_norm_bias, cfg.norm_eps, positions, w.cos_sin,
             kv_cache, key_store, plan.rope_offset, cfg.rope_interleaved, cfg.ue8m0, plan.fp8_dtype, cfg.k_norm)


def single_stream(plan: StepPlan, x, q_lora, positions, key_store, kv_cache, q_lora_quant):
    """Everything in order on the current stream: the x projections, k (a decode token must see itself), q."""
    if not plan.fuse_x_projections:
        k_path(plan, x, positions, key_store, kv_cache)
        return q_path(plan, x, q_lora, positions, q_lora_quant)
    head_weights, k = project_x(plan, x)
    k_path(plan, x, positions, key_store, kv_cache, k)
    return q_path(plan, x, q_lora, positions, q_lora_quant, head_weights)


# --- the plain paged layouts (paged64_bf16 / paged64_int8): no fp8 anywhere ---------------------------------------
PLAIN_QUANT_DROPPED = ("the cache has a plain layout (bf16 / int8 keys): wq_b runs in the activation dtype, so an fp8 "
                       "q_lora_quant has nothing to feed")


def q_path_plain(plan: StepPlan, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor,
                 q_lora_quant: QuantizedActivation | None, key_format: str, head_weights: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """wq_b (on its weight in the activation dtype: `LayerWeights.wq_b_activation`) + RoPE (+ Hadamard and int8 for
    int8 keys) of q: ``(q [T, H, D], q_scales, weights [T, H] f32)`` for `ops.lightning_indexer_ragged`."""
    cfg = plan.config
    if q_lora_quant is not None:
        plan.note_reuse(False, PLAIN_QUANT_DROPPED)
    if head_weights is None:
        head_weights = project_head_weights(plan, x)
    q = F.linear(q_lora, plan.weights.wq_b_activation).view(-1, cfg.n_heads, cfg.head_dim)
    return plan.run("q_prologue", "q_prologue_plain", q, positions, plan.weights.cos_sin, head_weights,
                    plan.weight_scale, plan.rope_offset, cfg.rope_interleaved, key_format)


def k_path_plain(plan: StepPlan, x: torch.Tensor, positions: torch.Tensor,
                 key_store: torch.Tensor | CompressionStep | None, cache: IndexKCache, k: torch.Tensor | None = None
                 ) -> None:
    """`k_path` for a plain-layout cache: V3.2 keys (LayerNorm, RoPE) or the compressor's C4 entries (RMSNorm, RoPE
    at 4j), stored as bf16, or Hadamard-rotated int8 with a scale, as the cache's layout says."""
    if key_store is None:
        return
    cfg, w = plan.config, plan.weights
    if isinstance(key_store, CompressionStep):
        w.compressor.step(plan, x, key_store, cache)
        return
    if k is None:
        k = project_k(plan, x)
    plan.run("k_store", "k_prologue_store_plain", k, w.k_norm_weight, w.k_norm_bias, cfg.norm_eps, positions,
             w.cos_sin, cache.data, cache.scales_or_empty(), key_store, plan.rope_offset, cfg.rope_interleaved,
             cfg.k_norm, cache.key_format)


def plain_single_stream(plan: StepPlan, x, q_lora, positions, key_store, cache: IndexKCache, q_lora_quant):
    """Every step in order for a plain-layout cache: x projections, k (stored first: a token sees itself), q.
    Returns ``(q, q_scales, weights)``."""
    head_weights = k = None
    if plan.fuse_x_projections:
        head_weights, k = project_x(plan, x)
    k_path_plain(plan, x, positions, key_store, cache, k)
    return q_path_plain(plan, x, q_lora, positions, q_lora_quant, cache.key_format, head_weights)


class PipelineSteps:
    """The shared steps, handed to strategies as ``plan.steps`` so a backend's strategy (dual stream) can reorder
    them without importing the model layer."""

    project_x = staticmethod(project_x)
    project_head_weights = staticmethod(project_head_weights)
    project_k = staticmethod(project_k)
    project_q = staticmethod(project_q)
    quantize_q = staticmethod(quantize_q)
    q_path = staticmethod(q_path)
    k_path = staticmethod(k_path)
    single_stream = staticmethod(single_stream)
    q_path_plain = staticmethod(q_path_plain)
    k_path_plain = staticmethod(k_path_plain)
    plain_single_stream = staticmethod(plain_single_stream)


STEPS = PipelineSteps()


# The cache layouts a strategy's k path writes (the problem's ``cache`` fact): the uint8 pages ``k_path`` stores into
# (the fp8 132-byte ones, or V4's FP4 68-byte ones: the compressor writes either), or the plain bf16 / int8 layouts.
FP8_PAGES_CAPS = Capabilities("the single-stream strategy", cache=(LAYOUT_PAGED64, LAYOUT_PAGED64_FP4))
PLAIN_CAPS = Capabilities("the plain-layout strategy", cache=tuple(PLAIN_LAYOUT_FORMATS))


def plain_cache_said(problem, target) -> str | None:
    """What the declared ``cache`` cannot say: a fact the problem does not carry is not checked, but a problem that
    does not name its layout means the fp8 pages (the default cache), which this strategy does not write."""
    if problem.get("cache") is None:
        return f"the problem does not name its cache layout (the default, {LAYOUT_PAGED64}, is not a plain one)"
    return None


def x_projections_torch(x: torch.Tensor, weights_proj: torch.Tensor, wk: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.x_projections` as torch's own two GEMMs (F.linear; x widened for an fp32 weights_proj): what the step ran
    before the op existed, on every target's native GEMM (cuBLAS, hipBLAS, the NPU's), so no target falls back."""
    return F.linear(x.float() if weights_proj.dtype == torch.float32 else x, weights_proj), F.linear(x, wk)


def register_x_projections_torch(registry) -> None:
    registry.implementation("x_projections", impl_id="x_projections.generic.torch", targets=("*",), priority=1,
                            description="two F.linear calls (torch's GEMMs, any target)",
                            verified=(CPU_SUITE,))(lambda: x_projections_torch)


def register_single_stream(registry) -> None:
    registry.implementation(PIPELINE_OP, impl_id=f"{PIPELINE_OP}.generic.single_stream", targets=("*",),
                            priority=0, capabilities=FP8_PAGES_CAPS,
                            description="all steps in order on the current stream",
                            verified=(CPU_SUITE, ran_on("sm90", "90cca2e", "2026-12-02",
                                                        "benchmarks/results/decode_s6_h200.json; tests/gpu"),
                                      Verified(Level.DOUBLE, ("gfx942", "gfx950", "gfx1250"),
                                               "tests/backends/test_amd_q_lora_reuse.py (the V3.2 decode step, "
                                               "aiter's quant and GEMM doubled)"))
                            )(lambda: single_stream)
    registry.implementation(PIPELINE_OP, impl_id=f"{PIPELINE_OP}.generic.plain_single_stream", targets=("*",),
                            priority=1, capabilities=PLAIN_CAPS, supports=plain_cache_said,  # 1: no tie with
                            # single_stream (their layouts are disjoint anyway)
                            description="all steps in order, for a bf16 / int8 plain-layout cache",
                            # On npu its steps call operators bound by torch_npu's published schemas (CPU CI).
                            verified=(CPU_SUITE, Verified(Level.VENDOR_SCHEMA, ("npu",),
                                                          "tests/backends/test_npu_backend.py, test_npu_schemas.py"))
                            )(lambda: plain_single_stream)


@hookimpl
def dsa_indexer_register(registry) -> None:
    """The generic strategies and the x projections on torch's GEMMs: registered like a backend (an entry point of
    ``dsa_indexer.backends``), so no other module imports this one to register them."""
    register_single_stream(registry)
    register_x_projections_torch(registry)
