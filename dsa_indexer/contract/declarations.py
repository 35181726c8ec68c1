"""Every op, declared once: its public signature (annotated), its checks, the facts of its `Problem`, its fake.

Each declared function is an op's public signature without the target, and its body the op's checks: it raises
`IndexerInputError` naming a bad argument and returns the arguments, normalized, in its signature's order (what
every implementation takes, positionally). `specs.declare` infers the custom-op schema from the annotations and
compiles the facts; `dsa_indexer.ops` makes each declaration its public function (checks, `dispatch.bind`, call)
and its ``dsa_indexer::<op>`` custom op. Nothing here knows the target: an ``fp8_dtype`` left None (`target_fp8`)
is the target's flavour, filled in by `dsa_indexer.ops`.

Adding an op: one declared function here, its reference implementation in `backends/reference/kernels.py`
(docs/architecture.md, "How to add an op").

Shapes: T tokens, H index heads, D = 128 head dim, B requests, N = next_n, K = q_lora_rank.
"""

from __future__ import annotations

import torch

from . import validate as v
from .cache import (FP4_BLOCK, FP4_VALUE_BYTES, HEAD_DIM, LAYOUT_PAGED64_BF16, LAYOUT_PAGED64_INT8, MAX_PAGES,
                    PAGE_SIZE, check_kv_cache, check_paged_cache, check_plain_cache)
from .quant import SCALE_FMTS, QuantizedActivation, scale_format
from .specs import DECLARED, declare

NORMS = ("layernorm", "rmsnorm", "none")
KEY_FORMATS = ("bf16", "int8")  # the plain paged layouts (contract/cache.py: paged64_bf16, paged64_int8)


def _fp8_or_target(fp8_dtype: torch.dtype | None) -> torch.dtype | None:
    """``fp8_dtype`` checked, or None: the target's flavour (e4m3fnuz on gfx942), which `dsa_indexer.ops` fills."""
    return None if fp8_dtype is None else v.fp8_dtype("fp8_dtype", fp8_dtype)


# --- shared checks --------------------------------------------------------------------------------------------------
def _check_rope(cos_sin: torch.Tensor, dim: int, rope_offset: int, device: torch.device) -> None:
    v.tensor("cos_sin", cos_sin, dtype=torch.float32, ndim=2, device=device)
    v.integer("rope_offset", rope_offset)
    rope_dim = cos_sin.shape[1]
    if rope_dim % 2 or rope_dim <= 0 or rope_offset < 0 or rope_offset + rope_dim > dim:
        raise v.IndexerInputError(f"cos_sin width {rope_dim} at rope_offset {rope_offset} must be even and fit in "
                                  f"head dim {dim}")

def _check_q_inputs(q, positions, cos_sin, head_weights, weight_scale, rope_offset: int, hadamard: bool) -> None:
    """The checks every q prologue makes (q [T, H, D], positions, the RoPE table, the head weights)."""
    v.tensor("q", q, dtype=v.ACT_DTYPES, ndim=3)
    t, h, d = q.shape
    if hadamard and d & (d - 1):
        raise v.IndexerInputError(f"q's head dim must be a power of two for the Hadamard rotation, got {d}")
    v.tensor("positions", positions, dtype=(torch.int32, torch.int64), shape=(t,), device=q.device)
    _check_rope(cos_sin, d, rope_offset, q.device)
    v.tensor("head_weights", head_weights, dtype=v.ACT_DTYPES, shape=(t, h), device=q.device)
    v.finite_number("weight_scale", weight_scale)
    v.in_range("positions", positions, 0, cos_sin.shape[0], "rows of cos_sin")

def _check_k_inputs(k, norm_weight, norm_bias, eps, positions, cos_sin, rope_offset: int, norm: str) -> int:
    """The checks every key prologue makes (k [T, 128], its norm's parameters, positions, the RoPE table); -> T."""
    v.tensor("k", k, dtype=v.ACT_DTYPES, ndim=2)
    t, d = k.shape
    if d != 128:
        raise v.IndexerInputError(f"k must have head dim 128 (the cache layout's), got {d}")
    if norm not in NORMS:
        raise v.IndexerInputError(f"norm must be one of {NORMS}, got {norm!r}")
    if norm != "none" and not (v.finite_number("eps", eps) > 0):
        raise v.IndexerInputError(f"eps must be > 0, got {eps}")
    if norm != "none":
        v.tensor("norm_weight", norm_weight, shape=(d,), device=k.device)
    if norm == "layernorm":
        v.tensor("norm_bias", norm_bias, shape=(d,), device=k.device)
    v.tensor("positions", positions, dtype=(torch.int32, torch.int64), shape=(t,), device=k.device)
    _check_rope(cos_sin, d, rope_offset, k.device)
    return t

def _check_ragged(q, k, k_scales, weights, ks, ke) -> None:
    v.tensor("q", q, dtype=v.FP8_DTYPES, ndim=3)
    s, h, d = q.shape
    if isinstance(k, torch.Tensor) and k.dtype == torch.uint8:  # FP4 keys, as the 68-byte pages store them
        if d != HEAD_DIM:
            raise v.IndexerInputError(f"FP4 keys (uint8 k) take head dim {HEAD_DIM} (four blocks of {FP4_BLOCK}), "
                                      f"got q's {d}")
        v.tensor("k", k, shape=(None, FP4_VALUE_BYTES), device=q.device)
        n = k.shape[0]
        v.tensor("k_scales", k_scales, dtype=torch.uint8, shape=(n, HEAD_DIM // FP4_BLOCK), device=q.device)
    else:
        v.tensor("k", k, dtype=q.dtype, shape=(None, d), device=q.device)
        n = k.shape[0]
        v.tensor("k_scales", k_scales, dtype=torch.float32, shape=(n,), device=q.device)
    v.tensor("weights", weights, dtype=torch.float32, shape=(s, h), device=q.device)
    v.tensor("ks", ks, dtype=torch.int32, shape=(s,), device=q.device)
    v.tensor("ke", ke, dtype=torch.int32, shape=(s,), device=q.device)
    v.in_range("ks", ks, 0, n + 1, "key rows")
    v.in_range("ke", ke, 0, n + 1, "key rows")
    if v.ranges_checked(ks) and s and bool((ke < ks).any()):
        raise v.IndexerInputError("ke must be >= ks on every row")

def _check_paged(q, kv_cache, weights, context_lens, block_table, max_context_len) -> None:
    v.tensor("q", q, dtype=v.FP8_DTYPES, ndim=4)
    b, n, h, d = q.shape
    if d != 128:
        raise v.IndexerInputError(f"q's head dim must be 128 (the cache layout's), got {d}")
    check_paged_cache(kv_cache)  # the fp8 pages (132 bytes per token) or the FP4 ones (68)
    v.tensor("kv_cache", kv_cache, device=q.device)
    v.tensor("weights", weights, dtype=torch.float32, shape=(b * n, h), device=q.device)
    v.tensor("context_lens", context_lens, dtype=torch.int32, shape=(b, n), device=q.device)
    v.tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=q.device)
    if block_table.shape[0] != b:
        raise v.IndexerInputError(f"block_table must have one row per request ({b}), got shape {list(block_table.shape)}")
    v.positive_int("max_context_len", max_context_len)
    capacity = block_table.shape[1] * PAGE_SIZE
    if max_context_len > capacity:
        raise v.IndexerInputError(f"max_context_len {max_context_len} exceeds the block table's capacity "
                                  f"{block_table.shape[1]} pages x {PAGE_SIZE} = {capacity}")
    v.in_range("context_lens", context_lens, 0, max_context_len + 1, "max_context_len")
    if v.ranges_checked(block_table):  # the reduction is a kernel launch of its own: only when the check runs
        v.used_pages_in_range("block_table", block_table, context_lens.max(dim=1).values, PAGE_SIZE,
                              kv_cache.shape[0], "cache pages, for the pages a context uses")

def _check_request_runs(positions: torch.Tensor, row_request: torch.Tensor, state_slot: torch.Tensor) -> None:
    """The pooling's precondition: each request's (non-padding) rows are one consecutive run at consecutive
    positions (the window of a row is read from the rows before it); anything else would pool other tokens."""
    keep = state_slot >= 0
    req, pos = row_request[keep].long(), positions[keep].long()
    if req.numel() < 2:
        return
    same = req[1:] == req[:-1]
    runs = int((~same).sum()) + 1
    if runs != int(torch.unique(req).numel()):
        raise v.IndexerInputError("row_request: a request's rows must be consecutive (one run per request), got "
                                  f"{runs} runs for {int(torch.unique(req).numel())} requests")
    gaps = same & (pos[1:] != pos[:-1] + 1)
    if bool(gaps.any()):
        i = int(gaps.nonzero()[0, 0])
        raise v.IndexerInputError(f"positions: a request's rows must be at consecutive positions; request "
                                  f"{int(req[i])} has position {int(pos[i])} then {int(pos[i + 1])}")

def _check_format(key_format: str) -> None:
    if key_format not in KEY_FORMATS:
        raise v.IndexerInputError(f"key_format must be one of {KEY_FORMATS}, got {key_format!r}")

def _check_plain_cache(key_cache: torch.Tensor, key_scales: torch.Tensor, key_format: str,
                       device: torch.device) -> None:
    layout = LAYOUT_PAGED64_BF16 if key_format == "bf16" else LAYOUT_PAGED64_INT8
    v.tensor("key_cache", key_cache, device=device)
    v.tensor("key_scales", key_scales, device=device)
    try:
        check_plain_cache(key_cache, key_scales if key_format == "int8" else None, layout)
    except (TypeError, ValueError) as exc:
        raise v.IndexerInputError(str(exc)) from None

def _check_out(out: torch.Tensor, rows: int, width: int, device: torch.device, /,
               **inputs: torch.Tensor | None) -> torch.Tensor:
    """A top-k op's ``out=`` (given: without one the op allocates): the caller's int32 ``[rows, width]`` buffer on
    the inputs' device, contiguous, sharing no memory with ``inputs`` (`validate.output_buffer`)."""
    return v.output_buffer("out", out, dtype=torch.int32, shape=(rows, width), device=device, inputs=inputs.items())

# --- the ops --------------------------------------------------------------------------------------------------------
@declare(facts={"group_size": "group_size", "ue8m0": "ue8m0", "fp8": "fp8_name(fp8_dtype)", "width": "x.shape[-1]"},
         fake=lambda x, group_size, fp8_dtype, **_: (
             torch.empty_like(x, dtype=fp8_dtype),
             x.new_empty((*x.shape[:-1], x.shape[-1] // group_size), dtype=torch.float32)),
         example=dict(group_size=128, ue8m0=False, fp8="fn", width=1536), target_fp8="fp8_dtype")
def quant_fp8_groups(x: torch.Tensor, group_size: int = 128, *, ue8m0: bool = False,
                     fp8_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group fp8 e4m3 quantization along the last dim: ``(x_fp8 like x, scales [..., N // group_size] f32)``.

    ``s = max(|group|, 1e-4) / fp8_max`` (448 for e4m3fn, 224 for e4m3fnuz), rounded up to a power of two when
    ``ue8m0``; ``x_fp8 = clamp(x / s)``. ``fp8_dtype`` defaults to the target's (e4m3fnuz on gfx942).
    """
    v.tensor("x", x, dtype=v.ACT_DTYPES)
    v.positive_int("group_size", group_size)
    v.boolean("ue8m0", ue8m0)
    if x.dim() == 0 or x.shape[-1] % group_size:
        raise v.IndexerInputError(f"x's last dim ({list(x.shape)}) must be a multiple of group_size={group_size}")
    return x, group_size, ue8m0, _fp8_or_target(fp8_dtype)


@declare(facts={"group_size": "group_size", "ue8m0": "ue8m0", "fp8": "fp8_name(fp8_dtype)", "width": "x.shape[-1]"},
         fake=lambda x, group_size, fp8_dtype, **_: (
             torch.empty_like(x), torch.empty_like(x, dtype=fp8_dtype),
             x.new_empty((x.shape[0], x.shape[1] // group_size), dtype=torch.float32)),
         example=dict(group_size=128, ue8m0=False, fp8="fn", width=1536), target_fp8="fp8_dtype",
         # The implementations return (normed, x_fp8, scales); the public function wraps the last two with their
         # layout and the producer tag of the implementation that ran (`dsa_indexer.ops`).
         results=tuple[torch.Tensor, torch.Tensor, torch.Tensor])
def rmsnorm_quant_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, group_size: int = 128, *,
                      ue8m0: bool = False, fp8_dtype: torch.dtype | None = None
                      ) -> tuple[torch.Tensor, QuantizedActivation]:
    """Fused RMSNorm + fp8 group quant: ``(normed [T, N] in x's dtype, QuantizedActivation of normed)``.

    The library's producers (reference, Triton) quantize the rounded ``normed`` tensor that is returned, so feeding
    it to the indexer as ``q_lora_quant`` is bit-identical to letting the indexer quantize ``normed`` itself
    (``layout.producer == PRODUCER_ROUNDED``). A vendor producer may quantize the fp32 value before rounding (aiter's
    fused kernel on AMD: at most 1 fp8 ulp apart on some elements); the implementation declares it (registry info
    ``producer``) and the layout carries it, so each consumer decides (docs/ops.md, "q_lora quant reuse").
    """
    v.tensor("x", x, dtype=(torch.bfloat16, torch.float16), ndim=2)
    v.tensor("weight", weight, shape=(x.shape[1],), device=x.device)
    v.positive_int("group_size", group_size)
    v.boolean("ue8m0", ue8m0)
    if x.shape[1] % group_size:
        raise v.IndexerInputError(f"x's width {x.shape[1]} must be a multiple of group_size={group_size}")
    if not eps > 0:
        raise v.IndexerInputError(f"eps must be > 0, got {eps}")
    return x, weight, float(eps), group_size, ue8m0, _fp8_or_target(fp8_dtype)


_Q_PROLOGUE_FACTS = {"heads": "q.shape[1]", "dim": "q.shape[2]", "rope_dim": "cos_sin.shape[1]",
                     "interleaved": "interleaved"}


@declare(facts={**_Q_PROLOGUE_FACTS, "ue8m0": "ue8m0", "fp8": "fp8_name(fp8_dtype)"},
         fake=lambda q, fp8_dtype, **_: (
             torch.empty_like(q, dtype=fp8_dtype), q.new_empty(q.shape[:2], dtype=torch.float32)),
         example=dict(heads=64, dim=128, rope_dim=64, interleaved=False, ue8m0=True, fp8="fn"), target_fp8="fp8_dtype")
def q_prologue(q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, head_weights: torch.Tensor,
               weight_scale: float, *, rope_offset: int = 0, interleaved: bool = False, ue8m0: bool = False,
               fp8_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE + Hadamard + per-head fp8 quant of q ``[T, H, D]``; folds the q scale into the head weights.

    Returns ``(q_fp8 [T, H, D], weights [T, H] f32 = head_weights * weight_scale * q_scale)``.
    RoPE rotates dims ``[rope_offset, rope_offset + cos_sin.shape[1])``: NeoX pairs (V3.2, offset 0) or
    interleaved pairs (V4, trailing dims). ``head_weights`` is the raw ``weights_proj(x)`` output.
    """
    _check_q_inputs(q, positions, cos_sin, head_weights, weight_scale, rope_offset, hadamard=True)
    v.boolean("interleaved", interleaved)
    v.boolean("ue8m0", ue8m0)
    return (q, positions, cos_sin, head_weights, float(weight_scale), rope_offset, interleaved, ue8m0,
            _fp8_or_target(fp8_dtype))


@declare(facts={**_Q_PROLOGUE_FACTS, "block": "block", "fp8": "fp8_name(fp8_dtype)"},
         fake=lambda q, fp8_dtype, **_: (
             torch.empty_like(q, dtype=fp8_dtype), q.new_empty(q.shape[:2], dtype=torch.float32)),
         example=dict(heads=64, dim=128, rope_dim=64, interleaved=True, block=32, fp8="fn"), target_fp8="fp8_dtype")
def q_prologue_fp4(q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, head_weights: torch.Tensor,
                   weight_scale: float, *, rope_offset: int = 0, interleaved: bool = False, block: int = 32,
                   fp8_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """V4's FP4 q prologue (`dsa_indexer.fp4`): RoPE (rounded to q's dtype, as DeepSeek's in-place RoPE), the
    Hadamard (rounded to bf16), e2m1 quant per ``block`` with power-of-two scales, folded exactly into fp8 with one
    power-of-two scale per (token, head). Returns ``(q_fp8 [T, H, D], weights [T, H] f32 = head_weights *
    weight_scale * row_scale)``, what the fp8 logits ops read."""
    _check_q_inputs(q, positions, cos_sin, head_weights, weight_scale, rope_offset, hadamard=True)
    v.boolean("interleaved", interleaved)
    v.positive_int("block", block)
    if q.shape[2] % block:
        raise v.IndexerInputError(f"q's head dim {q.shape[2]} must be a multiple of the FP4 block {block}")
    return (q, positions, cos_sin, head_weights, float(weight_scale), rope_offset, interleaved, block,
            _fp8_or_target(fp8_dtype))


@declare(facts={"dim": "k.shape[1]", "rope_dim": "cos_sin.shape[1]", "interleaved": "interleaved", "norm": "norm",
                "ue8m0": "ue8m0", "fp8": "fp8_name(fp8_dtype)"},
         fake=lambda **_: None, mutates=("kv_cache",),
         example=dict(dim=128, rope_dim=64, interleaved=False, norm="layernorm", ue8m0=True, fp8="fn"),
         target_fp8="fp8_dtype")
def k_prologue_store(k: torch.Tensor, norm_weight: torch.Tensor | None, norm_bias: torch.Tensor | None, eps: float,
                     positions: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, *, rope_offset: int = 0, interleaved: bool = False,
                     ue8m0: bool = False, fp8_dtype: torch.dtype | None = None, norm: str = "layernorm") -> None:
    """Norm + RoPE + Hadamard + fp8 quant of k ``[T, D]`` and the store into the paged cache, in place.

    ``norm``: "layernorm" (V3.2's k_norm, weight and bias), "rmsnorm" (weight: V4's compressor norms its pooled
    entries here) or "none" (keys normed by the caller). ``slot_mapping [T]``: the cache slot of each token; -1 skips it.
    """
    t = _check_k_inputs(k, norm_weight, norm_bias, eps, positions, cos_sin, rope_offset, norm)
    v.boolean("interleaved", interleaved)
    v.boolean("ue8m0", ue8m0)
    check_kv_cache(kv_cache)
    v.tensor("kv_cache", kv_cache, device=k.device)
    v.tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), shape=(t,), device=k.device)
    v.in_range("slot_mapping", slot_mapping, -1, kv_cache.shape[0] * PAGE_SIZE, "cache slots, -1 = skip")
    v.in_range("positions", positions, 0, cos_sin.shape[0], "rows of cos_sin")
    return (k, norm_weight, norm_bias, float(eps), positions, cos_sin, kv_cache, slot_mapping, rope_offset,
            interleaved, ue8m0, _fp8_or_target(fp8_dtype), norm)


# fp8: b's flavour, which equals a's (checked): `ops.gemm_problem` asks with the weight alone. scale_fmt: the
# caller's host fact about BOTH scale tensors ("ue8m0": all powers of two), never read from the values here (a plan
# may be built during graph capture); DeepGEMM on sm100 takes "ue8m0" only.
@declare(facts={"n": "b.shape[0]", "k": "b.shape[1]", "out": "str(out_dtype)", "fp8": "fp8_name(b.dtype)",
                "scale_fmt": "scale_fmt"},
         fake=lambda a, b, out_dtype, **_: a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype),
         example=dict(n=8192, k=1536, out="torch.bfloat16", fp8="fn"))
def gemm_fp8_blockscale(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                        out_dtype: torch.dtype = torch.bfloat16, scale_fmt: str = "fp32") -> torch.Tensor:
    """``(a * a_scales) @ (b * b_scales).T``: a [M, K] fp8 with per-token-group-128 scales [M, K/128],
    b [N, K] fp8 with per-128x128-block scales [N/128, K/128] (rounded up); out [M, N] ``out_dtype``.
    ``scale_fmt``: "ue8m0" when both ``a_scales`` and ``b_scales`` are powers of two (checked where ranges are
    checked: CPU tensors, or ``DSA_INDEXER_CHECK_RANGES=1``), else "fp32" (the default: true of any scales)."""
    if scale_fmt not in SCALE_FMTS:
        raise v.IndexerInputError(f"scale_fmt must be one of {', '.join(map(repr, SCALE_FMTS))}, got {scale_fmt!r}")
    v.tensor("a", a, dtype=v.FP8_DTYPES, ndim=2)
    m, kdim = a.shape
    groups = -(-kdim // 128)
    v.tensor("a_scales", a_scales, dtype=torch.float32, shape=(m, groups), device=a.device)
    v.tensor("b", b, dtype=a.dtype, ndim=2, device=a.device)
    if b.shape[1] != kdim:
        raise v.IndexerInputError(f"b must have K={kdim} columns like a, got shape {list(b.shape)}")
    v.tensor("b_scales", b_scales, dtype=torch.float32, shape=(-(-b.shape[0] // 128), groups), device=a.device)
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise v.IndexerInputError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    if scale_fmt == "ue8m0":
        for name, scales in (("a_scales", a_scales), ("b_scales", b_scales)):
            if v.ranges_checked(scales) and scale_format(scales) != "ue8m0":
                raise v.IndexerInputError(f"{name} are not all powers of two, but scale_fmt='ue8m0' says both scale "
                                          "tensors are: pass scale_fmt='fp32'")
    return a, a_scales, b, b_scales, out_dtype, scale_fmt


# keys: what the ragged key rows hold, by k's dtype: "fp8" (fp8 [N, 128] with fp32 row scales, the gathered
# 132-byte pages or the FP4 keys folded into fp8) or "fp4" (uint8 [N, 64] packed e2m1 with uint8 [N, 4] ue8m0 block
# scales, the 68-byte pages' bytes as stored); an implementation declares the formats it reads.
RAGGED_KEYS_FACT = "'fp4' if k.dtype == torch.uint8 else 'fp8'"


@declare(facts={"heads": "q.shape[1]", "dim": "q.shape[2]", "fp8": "fp8_name(q.dtype)", "keys": RAGGED_KEYS_FACT},
         fake=lambda q, k, **_: q.new_empty((q.shape[0], k.shape[0]), dtype=torch.float32),
         example=dict(heads=64, dim=128, fp8="fn"))
def ragged_mqa_logits(q: torch.Tensor, k: torch.Tensor, k_scales: torch.Tensor, weights: torch.Tensor,
                      ks: torch.Tensor, ke: torch.Tensor) -> torch.Tensor:
    """Prefill logits: ``L[s, n] = k_scales[n] * sum_h weights[s, h] * relu(q[s, h] . k[n])`` for
    ``ks[s] <= n < ke[s]``, -inf elsewhere. q [S, H, D] fp8, k [N, D] fp8, k_scales [N] f32, weights [S, H] f32,
    ks/ke [S] int32. Returns [S, N] f32. Callers bound S x N (the Indexer chunks rows under a memory budget).

    FP4 keys (problem fact ``keys="fp4"``, V4's ``paged64_fp4_e2m1`` pages as stored, `IndexKCache.gather_packed`):
    k uint8 [N, 64] packed e2m1 (element 2i in byte i's low nibble), k_scales uint8 [N, 4] the ue8m0 byte of each
    block of 32 dims; then ``L[s, n] = sum_h weights[s, h] * relu(sum_b 2^(k_scales[n, b] - 127) * q[s, h, b] .
    e2m1(k[n, b]))`` over the four blocks b (D = 128)."""
    _check_ragged(q, k, k_scales, weights, ks, ke)
    return q, k, k_scales, weights, ks, ke


# keys: what the pages hold, by their bytes per token: "fp8" (132, paged64_fp8_e4m3) or "fp4" (68, paged64_fp4_e2m1);
# an implementation declares the formats it reads. pages: the cache's page count, for kernels whose addresses stop
# short of a large cache (aiter's paged kernel: int32 offsets).
@declare(facts={"heads": "q.shape[2]", "dim": "q.shape[3]", "next_n": "q.shape[1]", "fp8": "fp8_name(q.dtype)",
                "keys": "'fp4' if kv_cache.shape[-1] == 68 else 'fp8'", "pages": "kv_cache.shape[0]"},
         fake=lambda q, max_context_len, **_: q.new_empty((q.shape[0] * q.shape[1], max_context_len),
                                                          dtype=torch.float32),
         example=dict(heads=64, dim=128, next_n=1, fp8="fn"))
def paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor,
                     block_table: torch.Tensor, max_context_len: int) -> torch.Tensor:
    """Decode logits over the paged cache: q [B, N, H, 128] fp8, kv_cache uint8 [pages, 64, 1, 132] (fp8 keys) or
    [pages, 64, 1, 68] (FP4 keys, ``paged64_fp4_e2m1``; problem fact ``keys``), weights [B*N, H] f32,
    context_lens [B, N] int32 (row (b, n) sees keys < context_lens[b, n]),
    block_table [B, max_pages] int32. Returns [B*N, max_context_len] f32, -inf past each row's length."""
    _check_paged(q, kv_cache, weights, context_lens, block_table, max_context_len)
    return q, kv_cache, weights, context_lens, block_table, max_context_len


@declare(facts={"k": "k", "slots": "block_table is not None", "starts": "starts is not None"},
         fake=lambda logits, k, **_: logits.new_empty((logits.shape[0], k), dtype=torch.int32),
         example=dict(k=2048, slots=False, starts=False),
         public_only=("max_len",),  # a host bound the checks apply (a view of the logits), not an argument
         out="out")
def topk_indices(logits: torch.Tensor, k: int, ends: torch.Tensor, starts: torch.Tensor | None = None, *,
                 block_table: torch.Tensor | None = None, row_request: torch.Tensor | None = None,
                 max_len: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The k largest logits of each row among columns ``[starts, ends)`` (starts default 0): int32 [R, k].

    Values are positions relative to the row's start (request-local), -1 padded when a row has fewer than k
    visible columns; ties go to the lower index. With ``block_table`` [B, max_pages] (and ``row_request`` [R]
    mapping rows to requests, default row r -> request r) the positions become physical cache slots.

    ``max_len``: a host bound on every row's ``ends`` where the caller has one (vLLM's ``max_seq_len``), for logits
    padded wider than the rows (engines pad decode logits to max_model_len). The kernels then see only the first
    ``max_len`` columns (a view, no copy), so the launch is planned for the rows' real length, not the padding;
    the result is the same. Without it the CUDA kernels route each row by its own ``ends`` on the device.
    A row ending past ``max_len`` is refused (``ends``' range check, see ``DSA_INDEXER_CHECK_RANGES``).

    ``out``: a caller's int32 [R, k] buffer (contiguous, on the logits' device, sharing no memory with an input)
    the result is written into, every element (-1 padding included); the op then returns ``out`` itself. Engines
    keep such persistent buffers (a CUDA graph replays into the same one).
    """
    v.tensor("logits", logits, dtype=torch.float32, ndim=2)
    if max_len is not None:
        if isinstance(max_len, bool) or not isinstance(max_len, int) or not 0 <= max_len:
            raise v.IndexerInputError(f"max_len must be a non-negative int (a bound on every row's ends) or None; "
                                      f"got {max_len!r}")
        logits = logits[:, : max_len]  # wider than the logits: the whole width, as without a bound
    r, c = logits.shape
    v.index_count("k", k)
    v.tensor("ends", ends, dtype=torch.int32, shape=(r,), device=logits.device)
    columns = "logits columns" if max_len is None else f"logits columns, bounded by max_len={max_len}"
    v.in_range("ends", ends, 0, c + 1, columns)
    if starts is not None:
        v.tensor("starts", starts, dtype=torch.int32, shape=(r,), device=logits.device)
        v.in_range("starts", starts, 0, c + 1, columns)
        if v.ranges_checked(starts) and r and bool((ends < starts).any()):
            raise v.IndexerInputError("ends must be >= starts on every row")
    if row_request is not None and block_table is None:
        raise v.IndexerInputError("row_request is only meaningful together with block_table")
    if block_table is not None:
        v.tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=logits.device)
        if row_request is None:
            if block_table.shape[0] != r:
                raise v.IndexerInputError(f"block_table needs one row per logits row ({r}) when row_request is not "
                                          f"given, got shape {list(block_table.shape)}")
        else:
            v.tensor("row_request", row_request, dtype=torch.int32, shape=(r,), device=logits.device)
            v.in_range("row_request", row_request, 0, block_table.shape[0], "block_table rows")
        width = (ends - (starts if starts is not None else 0)) if v.ranges_checked(ends) else None
        if width is not None and r and int(width.max()) > block_table.shape[1] * PAGE_SIZE:
            raise v.IndexerInputError(f"a row sees {int(width.max())} keys but block_table maps only "
                                      f"{block_table.shape[1] * PAGE_SIZE} positions")
        if width is not None:  # no cache here to bound the pages by: they must be >= 0 and give int32 slots
            v.used_pages_in_range("block_table", block_table, width, PAGE_SIZE, MAX_PAGES,
                                  "cache pages whose slots fit int32, for the pages a row's window uses",
                                  table_rows=row_request)
    if out is not None:  # (the kwargs of the check cost 0.15 us a call: built only for a buffer)
        out = _check_out(out, r, k, logits.device, logits=logits, ends=ends, starts=starts, block_table=block_table,
                         row_request=row_request)
    return logits, k, ends, starts, block_table, row_request, out


@declare(facts={"heads": "q.shape[2]", "dim": "q.shape[3]", "next_n": "q.shape[1]", "k": "k",
                "fp8": "fp8_name(q.dtype)", "slots": "return_slots",
                # the cache's facts as paged_mqa_logits' (the composition binds its paged logits with them)
                "keys": "'fp4' if kv_cache.shape[-1] == 68 else 'fp8'", "pages": "kv_cache.shape[0]"},
         fake=lambda q, k, **_: q.new_empty((q.shape[0] * q.shape[1], k), dtype=torch.int32),
         example=dict(heads=64, dim=128, next_n=1, k=2048, fp8="fn"), out="out")
def lightning_indexer(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor,
                      block_table: torch.Tensor, max_context_len: int, k: int, *,
                      return_slots: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """Paged logits + top-k in one op: int32 [B*N, k] request-local positions, -1 padded (same contract as
    `paged_mqa_logits` followed by `topk_indices` with ends = context_lens). ``return_slots=True`` returns
    physical cache slots ``block_table[b, pos // 64] * 64 + pos % 64`` instead (-1 stays -1), what FlashMLA's
    sparse decode and SGLang read. ``out``: a caller's int32 [B*N, k] buffer to write the result into (as
    `topk_indices`' ``out``; returned itself)."""
    _check_paged(q, kv_cache, weights, context_lens, block_table, max_context_len)
    v.index_count("k", k)
    if not isinstance(return_slots, bool):
        raise v.IndexerInputError(f"return_slots must be a bool, got {return_slots!r}")
    if out is not None:  # (the kwargs of the check cost 0.15 us a call: built only for a buffer)
        out = _check_out(out, q.shape[0] * q.shape[1], k, q.device, q=q, kv_cache=kv_cache, weights=weights,
                         context_lens=context_lens, block_table=block_table)
    return q, kv_cache, weights, context_lens, block_table, max_context_len, k, return_slots, out


@declare(facts={"heads": "q.shape[1]", "dim": "q.shape[2]", "fp8": "fp8_name(q.dtype)", "k": "topk",
                "keys": RAGGED_KEYS_FACT},  # k's fp8 rows or FP4 bytes, as ragged_mqa_logits'
         fake=lambda q, topk, **_: q.new_empty((q.shape[0], topk), dtype=torch.int32),
         example=dict(heads=64, dim=128, fp8="fn", k=2048), out="out")
def ragged_mqa_topk(q: torch.Tensor, k: torch.Tensor, k_scales: torch.Tensor, weights: torch.Tensor,
                    ks: torch.Tensor, ke: torch.Tensor, topk: int, *, out: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """The prefill scoring in one op: int32 [S, topk], the same set as
    ``topk_indices(ragged_mqa_logits(q, k, k_scales, weights, ks, ke), topk, ke, ks)`` (positions relative to ks,
    ties to the lower column, -1 padded; the order within a row is not part of the contract). A fused
    implementation never holds the [S, N] logits; the composed one (generic) runs the two ops. ``out``: a caller's
    int32 [S, topk] buffer to write the result into (as `topk_indices`' ``out``; returned itself)."""
    _check_ragged(q, k, k_scales, weights, ks, ke)
    v.index_count("topk", topk)
    if out is not None:  # (the kwargs of the check cost 0.15 us a call: built only for a buffer)
        out = _check_out(out, q.shape[0], topk, q.device, q=q, k=k, k_scales=k_scales, weights=weights, ks=ks, ke=ke)
    return q, k, k_scales, weights, ks, ke, topk, out


@declare(facts={"dim": "ape.shape[1] // 2", "window": "state.shape[1]"},
         fake=lambda proj, ape, rows, **_: proj.new_empty((rows.shape[0], ape.shape[1] // 2), dtype=torch.bfloat16),
         mutates=("state",), example=dict(dim=128, window=8))
def c4_compress_pool(proj: torch.Tensor, state: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
                     row_request: torch.Tensor, state_slot: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4 C4 compressor pooling of one step (`dsa_indexer.compressor` states the math).

    ``proj [T, 4d]`` fp32: ``[wkv(x) | wgate(x)]`` of the step's rows (no ape); ``state [S + 1, 8, 4d]`` fp32: the
    same for each state slot's last 8 positions (ring index position % 8; row S is scratch); ``ape [4, 2d]``;
    ``positions [T]``; ``row_request [T]`` (a request's rows are consecutive, at consecutive positions);
    ``state_slot [T]`` (-1: padding, touches no slot); ``rows [E]``: the rows whose entry to pool. Returns the
    pooled entries bf16 ``[E, d]`` (rounded, before the norm) and then writes each request's last 8 rows of
    ``proj`` into its state slot."""
    v.tensor("proj", proj, dtype=torch.float32, ndim=2)
    t, width = proj.shape
    v.tensor("ape", ape, dtype=torch.float32, ndim=2, device=proj.device)
    if width != 2 * ape.shape[1] or ape.shape[1] % 2:
        raise v.IndexerInputError(f"proj must be [T, 2 * ape width = {2 * ape.shape[1]}], got {list(proj.shape)}")
    v.tensor("state", state, dtype=torch.float32, shape=(None, 2 * ape.shape[0], width), device=proj.device,
             contiguous=True)
    for name, value in (("positions", positions), ("row_request", row_request), ("state_slot", state_slot)):
        v.tensor(name, value, dtype=(torch.int32, torch.int64), shape=(t,), device=proj.device)
    v.tensor("rows", rows, dtype=(torch.int32, torch.int64), ndim=1, device=proj.device)
    v.in_range("rows", rows, 0, t, "rows of proj")
    v.in_range("state_slot", state_slot, -1, state.shape[0] - 1, "state slots, -1 = padding")
    v.in_range("positions", positions, 0, 1 << 62, "token positions")
    if t > 1 and v.ranges_checked(positions):
        _check_request_runs(positions, row_request, state_slot)
    return proj.contiguous(), state, ape.contiguous(), positions, row_request, state_slot, rows


# The plain paged layouts (paged64_bf16, paged64_int8: contract/cache.py), for fused indexers that read a plain
# [pages, 64, 1, 128] key tensor (torch_npu's lightning indexers): q prologue, k store, and the fused indexer.
def _fake_q_prologue_plain(q, key_format, **_):
    if key_format == "int8":
        return (torch.empty_like(q, dtype=torch.int8), q.new_empty(q.shape[:2], dtype=torch.float16),
                q.new_empty(q.shape[:2], dtype=torch.float32))
    return torch.empty_like(q), q.new_empty(0, dtype=torch.float16), q.new_empty(q.shape[:2], dtype=torch.float32)


@declare(facts={**_Q_PROLOGUE_FACTS, "format": "key_format"},
         fake=_fake_q_prologue_plain,
         example=dict(heads=64, dim=128, rope_dim=64, interleaved=False, format="bf16"))
def q_prologue_plain(q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, head_weights: torch.Tensor,
                     weight_scale: float, *, rope_offset: int = 0, interleaved: bool = False, key_format: str
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q prologue for a plain-layout cache: ``(q_out [T, H, D], q_scales, weights [T, H] f32)``.

    ``key_format="bf16"``: RoPE only (no Hadamard: the bf16 keys are not rotated either), ``q_out`` in q's dtype,
    ``q_scales`` empty. ``"int8"``: RoPE, Hadamard, symmetric int8 per (token, head): ``q_scales [T, H]`` fp16 =
    ``max(|row|, 1e-4) / 127`` rounded to fp16, ``q_out = round(row / scale)`` in [-127, 127]. In both,
    ``weights = head_weights * weight_scale`` (the q scale is NOT folded in: the int8 kernels take it apart)."""
    _check_format(key_format)
    _check_q_inputs(q, positions, cos_sin, head_weights, weight_scale, rope_offset, hadamard=key_format == "int8")
    v.boolean("interleaved", interleaved)
    return q, positions, cos_sin, head_weights, float(weight_scale), rope_offset, interleaved, key_format


@declare(facts={"dim": "k.shape[1]", "rope_dim": "cos_sin.shape[1]", "interleaved": "interleaved", "norm": "norm",
                "format": "key_format"},
         fake=lambda **_: None, mutates=("key_cache", "key_scales"),
         example=dict(dim=128, rope_dim=64, interleaved=False, norm="layernorm", format="bf16"))
def k_prologue_store_plain(k: torch.Tensor, norm_weight: torch.Tensor | None, norm_bias: torch.Tensor | None,
                           eps: float, positions: torch.Tensor, cos_sin: torch.Tensor, key_cache: torch.Tensor,
                           key_scales: torch.Tensor, slot_mapping: torch.Tensor, *, rope_offset: int = 0,
                           interleaved: bool = False, norm: str = "layernorm", key_format: str) -> None:
    """Norm + RoPE of k ``[T, 128]`` and the store into a plain-layout cache ``key_cache [pages, 64, 1, 128]``, in
    place. ``"bf16"``: the rotated keys as bf16 (``key_scales`` an empty tensor). ``"int8"``: then Hadamard and a
    symmetric int8 per key, its fp16 scale into ``key_scales [pages, 64, 1]``. ``slot_mapping`` -1 skips a row."""
    _check_format(key_format)
    t = _check_k_inputs(k, norm_weight, norm_bias, eps, positions, cos_sin, rope_offset, norm)
    v.boolean("interleaved", interleaved)
    _check_plain_cache(key_cache, key_scales, key_format, k.device)
    v.tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), shape=(t,), device=k.device)
    v.in_range("slot_mapping", slot_mapping, -1, key_cache.shape[0] * PAGE_SIZE, "cache slots, -1 = skip")
    v.in_range("positions", positions, 0, cos_sin.shape[0], "rows of cos_sin")
    return (k, norm_weight, norm_bias, float(eps), positions, cos_sin, key_cache, key_scales, slot_mapping,
            rope_offset, interleaved, norm, key_format)


@declare(facts={"heads": "q.shape[1]", "dim": "q.shape[2]", "k": "k",
                "format": "'int8' if key_cache.dtype == torch.int8 else 'bf16'", "ratio": "compress_ratio"},
         fake=lambda q, k, **_: q.new_empty((q.shape[0], k), dtype=torch.int32),
         example=dict(heads=64, dim=128, k=2048, format="bf16", ratio=1), out="out")
def lightning_indexer_ragged(q: torch.Tensor, q_scales: torch.Tensor, key_cache: torch.Tensor,
                             key_scales: torch.Tensor, weights: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             seq_lens_k: torch.Tensor, block_table: torch.Tensor, k: int, *, compress_ratio: int = 1,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """Logits + top-k over a plain-layout paged cache for ragged query rows (decode, speculative and prefill alike):
    int32 ``[T, k]`` request-local key (entry) positions, best first, ties to the lower position, -1 padded.

    ``q [T, H, 128]``: bf16/fp16 (bf16 cache, ``q_scales`` empty) or int8 with ``q_scales [T, H]`` fp16 (int8
    cache, ``key_scales [pages, 64, 1]`` fp16). ``weights [T, H]`` f32. ``cu_seqlens_q [B + 1]`` int32 from 0:
    request b owns rows ``[cu[b], cu[b + 1])``. ``seq_lens_k [B]`` int32: request b's tokens up to and including its
    last row (its n rows are its last n tokens). ``block_table [B, pages]`` int32 maps entry j to slot
    ``block_table[b, j // 64] * 64 + j % 64``. ``compress_ratio`` 1 or 4 (C4: the cache holds entries of 4 tokens).
    Row i of request b (n rows, L tokens) sees entries ``j < (L - n + i + 1) // compress_ratio``; score
    ``sum_h w[t, h] * relu(q[t, h] . k[j])`` (int8: both dequantized by their scales). ``out``: a caller's int32
    [T, k] buffer to write the result into (as `topk_indices`' ``out``; returned itself)."""
    v.tensor("q", q, dtype=(*v.ACT_DTYPES, torch.int8), ndim=3)
    t, h, d = q.shape
    if d != 128:
        raise v.IndexerInputError(f"q's head dim must be 128 (the cache layout's), got {d}")
    key_format = "int8" if q.dtype == torch.int8 else "bf16"
    _check_plain_cache(key_cache, key_scales, key_format, q.device)
    if key_format == "int8":
        v.tensor("q_scales", q_scales, dtype=torch.float16, shape=(t, h), device=q.device)
    elif key_cache.dtype != q.dtype:
        raise v.IndexerInputError(f"q ({q.dtype}) and key_cache ({key_cache.dtype}) must have one dtype")
    v.tensor("weights", weights, dtype=torch.float32, shape=(t, h), device=q.device)
    v.tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=q.device)
    b = block_table.shape[0]
    v.tensor("cu_seqlens_q", cu_seqlens_q, dtype=torch.int32, shape=(b + 1,), device=q.device)
    v.tensor("seq_lens_k", seq_lens_k, dtype=torch.int32, shape=(b,), device=q.device)
    v.index_count("k", k)
    if compress_ratio not in (1, 4):
        raise v.IndexerInputError(f"compress_ratio must be 1 or 4, got {compress_ratio!r}")
    if v.ranges_checked(cu_seqlens_q):
        counts = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        if int(cu_seqlens_q[0]) != 0 or int(cu_seqlens_q[-1]) != t or bool((counts < 0).any()):
            raise v.IndexerInputError(f"cu_seqlens_q must start at 0, not decrease and end at T={t}, got "
                                      f"{cu_seqlens_q.tolist()}")
        if bool((seq_lens_k < counts).any()):
            raise v.IndexerInputError("seq_lens_k must be >= each request's query rows (they are its last tokens)")
        entries = seq_lens_k.long() // compress_ratio
        v.in_range("seq_lens_k", entries, 0, block_table.shape[1] * PAGE_SIZE + 1,
                   "entries the block table maps (seq_lens_k // compress_ratio)")
        used = torch.arange(block_table.shape[1], device=q.device)[None, :] < \
            ((entries + PAGE_SIZE - 1) // PAGE_SIZE)[:, None]
        v.in_range("block_table", block_table[used], 0, key_cache.shape[0], "cache pages, for the pages in use")
        v.check_page_sharing("block_table", block_table, entries, PAGE_SIZE)
    if out is not None:  # (the kwargs of the check cost 0.15 us a call: built only for a buffer)
        out = _check_out(out, t, k, q.device, q=q, q_scales=q_scales, key_cache=key_cache, key_scales=key_scales,
                         weights=weights, cu_seqlens_q=cu_seqlens_q, seq_lens_k=seq_lens_k, block_table=block_table)
    return (q.contiguous(), q_scales, key_cache, key_scales, weights.contiguous(), cu_seqlens_q, seq_lens_k,
            block_table, k, compress_ratio, out)


@declare(facts={"hidden": "x.shape[1]", "heads": "weights_proj.shape[0]", "dim": "wk.shape[0]",
                "head_proj": "str(weights_proj.dtype)"},
         fake=lambda x, weights_proj, wk, **_: (
             x.new_empty((x.shape[0], weights_proj.shape[0]), dtype=weights_proj.dtype),
             x.new_empty((x.shape[0], wk.shape[0]))),
         example=dict(hidden=7168, heads=64, dim=128, head_proj="torch.float32"))
def x_projections(x: torch.Tensor, weights_proj: torch.Tensor, wk: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """V3.2's two projections of x: ``(weights_proj(x) [T, H], wk(x) [T, D])``. x [T, hidden] in the activation
    dtype; ``weights_proj`` [H, hidden] fp32 (the head weights computed in fp32 from x widened, as DeepSeek's code
    runs them) or x's dtype; ``wk`` [D, hidden] in x's dtype (k out in x's dtype)."""
    v.tensor("x", x, dtype=v.ACT_DTYPES, ndim=2)
    hidden = x.shape[1]
    v.tensor("weights_proj", weights_proj, dtype=tuple({torch.float32, x.dtype}), ndim=2, shape=(None, hidden),
             device=x.device)
    v.tensor("wk", wk, dtype=x.dtype, ndim=2, shape=(None, hidden), device=x.device)
    return x, weights_proj, wk



@declare(facts={"next_n": "next_n", "compress_ratio": "compress_ratio"},
         fake=lambda seq_lens, next_n, **_: (
             seq_lens.new_empty((seq_lens.shape[0], next_n), dtype=torch.int32),
             *(seq_lens.new_empty(seq_lens.shape[0] * next_n, dtype=torch.int64) for _slot in range(3))),
         example=dict(next_n=1, compress_ratio=1))
def decode_metadata(seq_lens: torch.Tensor, block_table: torch.Tensor, state_slots: torch.Tensor, *,
                    next_n: int = 1, compress_ratio: int = 1
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's batch metadata from device ``seq_lens`` [B] (tokens of each request including its
    ``next_n`` new ones; 0 = padding request), ``block_table`` [B, pages] int32 and ``state_slots`` [B] (C4
    `CompressorState` slot per request), with device ops only (capturable in a CUDA graph): ``(context_lens
    [B, next_n] int32, positions [B * next_n] int64, slot_mapping [B * next_n] int64, state_slot [B * next_n]
    int64)``. Row ``b * next_n + j`` is token ``p = seq_lens[b] - next_n + j``; it sees ``(p + 1) // ratio`` keys
    and stores key ``p // ratio`` (page ``block_table[b, (p // ratio) // 64]``) when ``(p + 1) % ratio == 0``, else
    slot -1. A row with ``p < 0`` is padding: position 0, no key, slot -1, state slot -1. Page columns are clamped
    to the table (lengths are checked on the host, `DecodeBuffers.load`), so no gather leaves the table."""
    v.tensor("seq_lens", seq_lens, dtype=(torch.int32, torch.int64), ndim=1)
    batch = seq_lens.shape[0]
    v.tensor("block_table", block_table, dtype=torch.int32, ndim=2, shape=(batch, None), device=seq_lens.device)
    if block_table.shape[1] < 1:
        raise v.IndexerInputError("block_table must have at least one page column")
    v.tensor("state_slots", state_slots, dtype=(torch.int32, torch.int64), shape=(batch,), device=seq_lens.device)
    v.positive_int("next_n", next_n)
    if compress_ratio not in (1, 4):
        raise v.IndexerInputError(f"compress_ratio must be 1 or 4, got {compress_ratio!r}")
    v.in_range("seq_lens", seq_lens, 0, 2**31, "tokens per request, 0 for a padding request")
    if v.ranges_checked(block_table):
        # The slots derived here are trusted by the step: a negative page, or a page shared with a writer, would
        # store keys into another request's slots. (CPU tensors, or DSA_INDEXER_CHECK_RANGES=1: never in a graph.)
        seq = seq_lens.long().clamp_min(0)
        keys = seq // compress_ratio
        pages = ((keys + PAGE_SIZE - 1) // PAGE_SIZE).clamp_max(block_table.shape[1])
        used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < pages[:, None]
        v.in_range("block_table", block_table[used], 0, MAX_PAGES, "cache pages whose slots fit int32, for the "
                   "pages in use")
        v.check_page_sharing("block_table", block_table, keys, PAGE_SIZE, (seq - next_n).clamp_min(0) // compress_ratio,
                             "keys" if compress_ratio == 1 else "entries")
    return seq_lens.contiguous(), block_table, state_slots.contiguous(), next_n, compress_ratio


OPS = tuple(DECLARED)  # every op, in declaration order
