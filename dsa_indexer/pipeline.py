"""Pipeline strategies: how the steps of one indexer call are scheduled before the logits.

The steps themselves (project q, fold head weights, project + store k) are shared; a strategy only decides
their order and streams. Strategies are resolved through the registry as the op ``indexer_pipeline`` per
target and problem class, so adding one (dual-stream on CUDA, say) is one registration and `Indexer` never
changes. Every strategy must give bit-identical results to `single_stream`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Protocol

import torch
import torch.nn.functional as F

from . import ops
from .compressor import CompressionStep
from .contract.cache import LAYOUT_PAGED64, IndexKCache
from .contract.quant import QuantizedActivation, reuse_rejection

if TYPE_CHECKING:
    from .indexer import Indexer

log = logging.getLogger("dsa_indexer")

PIPELINE_OP = ops.PIPELINE_OP


class PipelineStrategy(Protocol):
    def __call__(self, indexer: "Indexer", x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor,
                 key_store: torch.Tensor | CompressionStep | None, kv_cache: torch.Tensor | IndexKCache,
                 q_lora_quant: QuantizedActivation | None) -> tuple[torch.Tensor, ...]:
        """Run the q and k paths; store k in ``kv_cache``; return (q_fp8 [T, H, D], weights [T, H] f32).
        ``key_store`` is passed to `k_path` untouched: each row's cache slot (V3.2) or the compressor's step (C4).
        The problem's ``cache`` fact says which layout a strategy serves: for the fp8 pages ``kv_cache`` is the
        uint8 page tensor; for a plain layout it is the `IndexKCache` and the result is (q, q_scales, weights)."""


def project_q(indexer: "Indexer", q_lora: torch.Tensor, q_lora_quant: QuantizedActivation | None) -> torch.Tensor:
    """``wq_b(q_lora)`` -> [T, H * D]; reuses ``q_lora_quant`` when its layout fits the GEMM, else re-quantizes."""
    wq_b = indexer.wq_b
    if not indexer.wq_b_is_block_fp8:
        if q_lora_quant is not None:
            indexer.note_reuse(False, reuse_rejection(q_lora_quant, q_lora, False))
        return F.linear(q_lora, wq_b.weight)
    wanted = indexer.gemm_input_layout(q_lora)
    quant = None
    if q_lora_quant is not None:
        reason = reuse_rejection(q_lora_quant, q_lora, True, wanted, indexer.reuses_unrounded_quant())
        indexer.note_reuse(reason is None, reason)
        if reason is None:
            quant = (q_lora_quant.data, q_lora_quant.scales)
    if quant is None:
        quant = ops.quant_fp8_groups(q_lora, wanted.group_size, ue8m0=wanted.ue8m0, fp8_dtype=wanted.fp8_dtype,
                                     target=indexer.target)
    return ops.gemm_fp8_blockscale(quant[0], quant[1], wq_b.weight, wq_b.weight_scale_inv, q_lora.dtype,
                                   target=indexer.target)


def project_x(indexer: "Indexer", x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weights_proj(x) [T, H], wk(x) [T, D] or None)``: one GEMM over the concatenated weight
    (`Indexer.x_projection_weight`) when the two are fusable (both in the activation dtype), so a decode step
    launches one skinny GEMM (and its split-K reduce) instead of two; both results are then column views of that
    GEMM's output. A block-fp8 wk or an fp32 weights_proj runs its own GEMM (`project_head_weights`, `project_k`)."""
    if indexer.x_projections_fusable:
        out = F.linear(x, indexer.x_projection_weight())
        heads = indexer.config.n_heads
        return out[:, :heads], out[:, heads:]
    return project_head_weights(indexer, x), project_k(indexer, x) if indexer.wk is not None else None


def project_head_weights(indexer: "Indexer", x: torch.Tensor) -> torch.Tensor:
    """``weights_proj(x)`` [T, H] in the recipe's precision: fp32 (``weights_proj_dtype="fp32"``, as V3.2's code
    runs it: no bf16 rounding of the head weights) or the activation dtype."""
    if indexer.config.weights_proj_dtype == "fp32":
        return F.linear(x.float(), indexer.fp32_weights_proj())
    return F.linear(x, indexer.weights_proj.weight)


def project_k(indexer: "Indexer", x: torch.Tensor) -> torch.Tensor:
    """``wk(x)`` [T, D]: a bf16 GEMM, or for a block-fp8 wk (``wk_gemm="fp8"``) the fp8 GEMM DeepSeek runs, with x
    quantized per 128 in the recipe's scale format (``scale_fmt``)."""
    wk = indexer.wk
    if not indexer.wk_is_block_fp8:
        return F.linear(x, wk.weight)
    wanted = indexer.gemm_input_layout(x, wk.weight)
    x_fp8, x_scales = ops.quant_fp8_groups(x, wanted.group_size, ue8m0=wanted.ue8m0, fp8_dtype=wanted.fp8_dtype,
                                           target=indexer.target)
    return ops.gemm_fp8_blockscale(x_fp8, x_scales, wk.weight, wk.weight_scale_inv, x.dtype, target=indexer.target)


def q_path(indexer: "Indexer", x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor,
           q_lora_quant: QuantizedActivation | None, head_weights: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """wq_b + RoPE + Hadamard + fp8 quant of q; ``head_weights`` is ``weights_proj(x)`` when the caller already
    has it (`project_x`)."""
    cfg = indexer.config
    if head_weights is None:
        head_weights = project_head_weights(indexer, x)
    q = project_q(indexer, q_lora, q_lora_quant).view(-1, cfg.n_heads, cfg.head_dim)
    if cfg.key_quant == "fp4_e2m1":  # V4's FP4 recipe (dsa_indexer.fp4)
        return ops.q_prologue_fp4(q, positions, indexer.cos_sin, head_weights, cfg.weight_scale,
                                  rope_offset=cfg.rope_offset, interleaved=cfg.rope_interleaved, block=cfg.fp4_block,
                                  fp8_dtype=indexer.fp8_dtype, target=indexer.target)
    return ops.q_prologue(q, positions, indexer.cos_sin, head_weights, cfg.weight_scale, rope_offset=cfg.rope_offset,
                          interleaved=cfg.rope_interleaved, ue8m0=cfg.ue8m0, fp8_dtype=indexer.fp8_dtype,
                          target=indexer.target)


def k_path(indexer: "Indexer", x: torch.Tensor, positions: torch.Tensor,
           key_store: torch.Tensor | CompressionStep | None, kv_cache: torch.Tensor, k: torch.Tensor | None = None
           ) -> None:
    """Store this step's keys. V3.2 (``key_store`` = each row's cache slot, -1: none): project, normalize, rotate,
    quantize and store; ``k`` is ``wk(x)`` when the caller already has it (`project_x`). V4 C4 (``key_store`` a
    `CompressionStep`): the indexer's compressor pools the entries this step completes and stores them."""
    if key_store is None:
        return
    cfg = indexer.config
    if isinstance(key_store, CompressionStep):
        indexer.compressor.step(x, key_store, kv_cache, indexer.cos_sin, indexer.fp8_dtype, indexer.target)
        return
    slot_mapping = key_store
    if k is None:
        k = project_k(indexer, x)
    norm_w = indexer.k_norm.weight if indexer.k_norm is not None else None
    norm_b = indexer.k_norm.bias if indexer.k_norm is not None else None
    ops.k_prologue_store(k, norm_w, norm_b, cfg.norm_eps, positions, indexer.cos_sin, kv_cache, slot_mapping,
                         rope_offset=cfg.rope_offset, interleaved=cfg.rope_interleaved, ue8m0=cfg.ue8m0,
                         fp8_dtype=indexer.fp8_dtype, norm=cfg.k_norm, target=indexer.target)


def single_stream(indexer, x, q_lora, positions, key_store, kv_cache, q_lora_quant):
    """Everything in order on the current stream: the x projections, k (a decode token must see itself), q."""
    if not indexer.fuse_x_projections:
        k_path(indexer, x, positions, key_store, kv_cache)
        return q_path(indexer, x, q_lora, positions, q_lora_quant)
    head_weights, k = project_x(indexer, x)
    k_path(indexer, x, positions, key_store, kv_cache, k)
    return q_path(indexer, x, q_lora, positions, q_lora_quant, head_weights)


# --- the plain paged layouts (paged64_bf16 / paged64_int8): no fp8 anywhere ---------------------------------------
PLAIN_QUANT_DROPPED = ("the cache has a plain layout (bf16 / int8 keys): wq_b runs in the activation dtype, so an fp8 "
                       "q_lora_quant has nothing to feed")


def q_path_plain(indexer: "Indexer", x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor,
                 q_lora_quant: QuantizedActivation | None, key_format: str, head_weights: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """wq_b (on its weight in the activation dtype: `Indexer.activation_wq_b`) + RoPE (+ Hadamard and int8 for int8
    keys) of q: ``(q [T, H, D], q_scales, weights [T, H] f32)`` for `ops.lightning_indexer_ragged`."""
    cfg = indexer.config
    if q_lora_quant is not None:
        indexer.note_reuse(False, PLAIN_QUANT_DROPPED)
    if head_weights is None:
        head_weights = project_head_weights(indexer, x)
    q = F.linear(q_lora, indexer.activation_wq_b()).view(-1, cfg.n_heads, cfg.head_dim)
    return ops.q_prologue_plain(q, positions, indexer.cos_sin, head_weights, cfg.weight_scale, key_format=key_format,
                                rope_offset=cfg.rope_offset, interleaved=cfg.rope_interleaved, target=indexer.target)


def k_path_plain(indexer: "Indexer", x: torch.Tensor, positions: torch.Tensor,
                 key_store: torch.Tensor | CompressionStep | None, cache: IndexKCache, k: torch.Tensor | None = None
                 ) -> None:
    """`k_path` for a plain-layout cache: V3.2 keys (LayerNorm, RoPE) or the compressor's C4 entries (RMSNorm, RoPE
    at 4j), stored as bf16, or Hadamard-rotated int8 with a scale, as the cache's layout says."""
    if key_store is None:
        return
    if isinstance(key_store, CompressionStep):
        indexer.compressor.step(x, key_store, cache, indexer.cos_sin, indexer.fp8_dtype, indexer.target)
        return
    cfg = indexer.config
    if k is None:
        k = project_k(indexer, x)
    ops.k_prologue_store_plain(k, indexer.k_norm.weight, indexer.k_norm.bias, cfg.norm_eps, positions, indexer.cos_sin,
                               cache.data, cache.scales_or_empty(), key_store, key_format=cache.key_format,
                               rope_offset=cfg.rope_offset, interleaved=cfg.rope_interleaved, norm=cfg.k_norm,
                               target=indexer.target)


def plain_single_stream(indexer, x, q_lora, positions, key_store, cache: IndexKCache, q_lora_quant):
    """Every step in order for a plain-layout cache: x projections, k (stored first: a token sees itself), q.
    Returns ``(q, q_scales, weights)``."""
    head_weights = k = None
    if indexer.fuse_x_projections:
        head_weights, k = project_x(indexer, x)
    k_path_plain(indexer, x, positions, key_store, cache, k)
    return q_path_plain(indexer, x, q_lora, positions, q_lora_quant, cache.key_format, head_weights)


class PipelineSteps:
    """The shared steps, handed to strategies through ``indexer.steps`` so a backend's strategy (dual stream) can
    reorder them without importing the model layer."""

    project_x = staticmethod(project_x)
    project_head_weights = staticmethod(project_head_weights)
    project_k = staticmethod(project_k)
    q_path = staticmethod(q_path)
    k_path = staticmethod(k_path)
    single_stream = staticmethod(single_stream)
    q_path_plain = staticmethod(q_path_plain)
    k_path_plain = staticmethod(k_path_plain)
    plain_single_stream = staticmethod(plain_single_stream)


STEPS = PipelineSteps()


def fp8_cache_only(problem, target) -> str | None:
    """The `supports` check of strategies that write the fp8 132-byte pages (``problem.cache`` is the layout)."""
    layout = problem.get("cache", LAYOUT_PAGED64)
    return None if layout == LAYOUT_PAGED64 else f"writes the {LAYOUT_PAGED64} cache, not {layout}"


def plain_cache_only(problem, target) -> str | None:
    layout = problem.get("cache", LAYOUT_PAGED64)
    return None if layout != LAYOUT_PAGED64 else f"serves the plain layouts (bf16 / int8 keys), not {layout}"


def register_single_stream(registry) -> None:
    registry.implementation(PIPELINE_OP, impl_id=f"{PIPELINE_OP}.generic.single_stream", targets=("*",),
                            priority=0, supports=fp8_cache_only,
                            description="all steps in order on the current stream")(lambda: single_stream)
    registry.implementation(PIPELINE_OP, impl_id=f"{PIPELINE_OP}.generic.plain_single_stream", targets=("*",),
                            priority=1, supports=plain_cache_only,  # 1: no tie with single_stream (disjoint anyway)
                            description="all steps in order, for a bf16 / int8 plain-layout cache"
                            )(lambda: plain_single_stream)
