"""Pure-torch implementations of every op: the oracle for all other backends and the last-resort fallback.

Arguments are validated by the public op layer (`dsa_indexer.ops`) before they get here. The math is the
contract of `docs/ops.md` (written from the DeepSeek-V3.2 / V4 reference code): fp32 throughout, no
intermediate rounding, quantization by division with ``amax`` clamped to 1e-4.
"""

from __future__ import annotations

import functools

import torch

from ...contract.cache import (FP4_BYTES_PER_TOKEN, PAGE_SIZE, decode_row_requests, dequant_fp4_pages,
                               dequant_fp4_rows, gather_plain_keys, indices_to_slots, page_views, store_plain_rows,
                               store_rows)

# The shared numerics, re-exported under the oracle's names (`ref.apply_rope`, `ref.quant_fp4_e2m1`, ...).
from ...contract.recipe import (FP4_AMAX_FLOOR, FP4_INV_MAX, FP4_MAX, apply_rope, dequant_fp4_e2m1,  # noqa: F401
                                fold_fp4_to_fp8, fp4_fold_shift, fp8_max, hadamard_butterfly, quant_fp4_e2m1,
                                rmsnorm, rotate_quant_fp4, round_to_e2m1, ue8m0_round_up)

# Row-chunk budget for the intermediate [rows, heads, keys] scores of the logits references.
_SCORES_BUDGET_BYTES = 256 << 20


def quant_fp8_groups(x: torch.Tensor, group_size: int = 128, ue8m0: bool = False,
                     fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    fmax = fp8_max(fp8_dtype)
    shape = x.shape
    groups = x.float().reshape(*shape[:-1], shape[-1] // group_size, group_size)
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4)
    # Tensor / tensor: the correctly rounded quotient on every device (torch divides by a Python scalar on CUDA
    # as a multiplication by its reciprocal, which can differ in the last bit).
    scale = amax / torch.full_like(amax, fmax)
    if ue8m0:
        scale = ue8m0_round_up(scale)
    x_fp8 = (groups / scale).clamp(-fmax, fmax).to(fp8_dtype)
    return x_fp8.reshape(shape), scale.reshape(*shape[:-1], shape[-1] // group_size)


def rmsnorm_quant_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int = 128, ue8m0: bool = False,
                      fp8_dtype: torch.dtype = torch.float8_e4m3fn
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Quantize the bf16-rounded normed value: exactly the tensor returned, so reusing the fp8 copy
    # can never change a downstream result.
    normed = rmsnorm(x, weight, eps).to(x.dtype)
    x_fp8, scale = quant_fp8_groups(normed, group_size, ue8m0, fp8_dtype)
    return normed, x_fp8, scale


@functools.lru_cache(maxsize=8)
def _hadamard_cpu(dim: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * dim ** -0.5).float()


def hadamard_matrix(dim: int, device: torch.device) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix of size ``dim`` (a power of two), fp32."""
    return _hadamard_cpu(dim).to(device)


def q_prologue(q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, head_weights: torch.Tensor,
               weight_scale: float, rope_offset: int = 0, interleaved: bool = False, ue8m0: bool = False,
               fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    x = apply_rope(q.float(), positions, cos_sin, rope_offset, interleaved)
    x = x @ hadamard_matrix(x.shape[-1], x.device)
    q_fp8, q_scale = quant_fp8_groups(x, x.shape[-1], ue8m0, fp8_dtype)
    weights = head_weights.float() * weight_scale * q_scale.squeeze(-1)
    return q_fp8, weights


def key_norm(k: torch.Tensor, norm_weight: torch.Tensor | None, norm_bias: torch.Tensor | None, eps: float,
             norm: str) -> torch.Tensor:
    """fp32 ``k`` normed as the config says: "layernorm" (V3.2's k_norm), "rmsnorm" (V4's compressor), "none"."""
    x = k.float()
    if norm == "layernorm":
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), norm_weight.float(), norm_bias.float(), eps)
    if norm == "rmsnorm":
        return rmsnorm(x, norm_weight, eps)
    return x


def k_prologue(k: torch.Tensor, norm_weight: torch.Tensor | None, norm_bias: torch.Tensor | None, eps: float,
               positions: torch.Tensor, cos_sin: torch.Tensor, rope_offset: int, interleaved: bool, ue8m0: bool,
               fp8_dtype: torch.dtype, norm: str) -> tuple[torch.Tensor, torch.Tensor]:
    x = apply_rope(key_norm(k, norm_weight, norm_bias, eps, norm), positions, cos_sin, rope_offset, interleaved)
    x = x @ hadamard_matrix(x.shape[-1], x.device)
    k_fp8, k_scale = quant_fp8_groups(x, x.shape[-1], ue8m0, fp8_dtype)
    return k_fp8, k_scale.squeeze(-1)


def k_prologue_store(k: torch.Tensor, norm_weight: torch.Tensor | None, norm_bias: torch.Tensor | None, eps: float,
                     positions: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     rope_offset: int = 0, interleaved: bool = False, ue8m0: bool = False,
                     fp8_dtype: torch.dtype = torch.float8_e4m3fn, norm: str = "layernorm") -> None:
    k_fp8, k_scale = k_prologue(k, norm_weight, norm_bias, eps, positions, cos_sin, rope_offset, interleaved, ue8m0,
                                fp8_dtype, norm)
    store_rows(kv_cache, slot_mapping, k_fp8, k_scale)


def gemm_fp8_blockscale(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                        out_dtype: torch.dtype = torch.bfloat16, scale_fmt: str = "fp32") -> torch.Tensor:
    # scale_fmt changes no arithmetic here: power-of-two scales are fp32 values like any other.
    m, kdim = a.shape
    n = b.shape[0]
    a_deq = a.float() * a_scales.float().repeat_interleave(128, dim=1)[:, :kdim]
    b_full = b_scales.float().repeat_interleave(128, dim=0)[:n].repeat_interleave(128, dim=1)[:, :kdim]
    return (a_deq @ (b.float() * b_full).t()).to(out_dtype)


def x_projections(x: torch.Tensor, weights_proj: torch.Tensor, wk: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    head_in = x.float() if weights_proj.dtype == torch.float32 else x
    return torch.nn.functional.linear(head_in, weights_proj), torch.nn.functional.linear(x, wk)


def _weighted_relu_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_h w[t, h] * relu(q[t, h] . k[s]) for q [T, H, D] fp32, k [S, D] fp32, w [T, H] -> [T, S]."""
    scores = torch.einsum("thd,sd->ths", q, k).clamp_min_(0)
    return torch.einsum("ths,th->ts", scores, weights)


def ragged_mqa_logits(q: torch.Tensor, k: torch.Tensor, k_scales: torch.Tensor, weights: torch.Tensor,
                      ks: torch.Tensor, ke: torch.Tensor) -> torch.Tensor:
    rows, heads, _ = q.shape
    n = k.shape[0]
    out = torch.full((rows, n), float("-inf"), dtype=torch.float32, device=q.device)
    if k.dtype == torch.uint8:  # FP4 keys as stored: each block's own scale inside the dot, no row scale
        kf, k_scales = dequant_fp4_rows(k, k_scales), torch.ones(n, device=q.device)
    else:
        kf = k.float()
    chunk = max(1, _SCORES_BUDGET_BYTES // max(1, heads * n * 4))
    cols = torch.arange(n, device=q.device)
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        logits = _weighted_relu_scores(q[start:stop].float(), kf, weights[start:stop].float()) * k_scales.float()
        visible = (cols >= ks[start:stop, None]) & (cols < ke[start:stop, None])
        out[start:stop] = torch.where(visible, logits, out[start:stop])
    return out


def paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor,
                     block_table: torch.Tensor, max_context_len: int) -> torch.Tensor:
    batch, next_n, heads, dim = q.shape
    fp4 = kv_cache.shape[-1] == FP4_BYTES_PER_TOKEN  # paged64_fp4_e2m1: the keys are dequantized, scales are 1
    keys, scales = (None, None) if fp4 else page_views(kv_cache, q.dtype)
    out = torch.full((batch * next_n, max_context_len), float("-inf"), dtype=torch.float32, device=q.device)
    lens = context_lens.reshape(batch, next_n).to("cpu", torch.int64)
    cols = torch.arange(max_context_len, device=q.device)
    for b in range(batch):
        length = min(int(lens[b].max()), max_context_len)
        if length <= 0:
            continue
        pages = block_table[b, : (length + PAGE_SIZE - 1) // PAGE_SIZE].long()
        if fp4:
            k, k_scale = dequant_fp4_pages(kv_cache, pages)[:length], 1.0
        else:
            k = keys[pages].reshape(-1, dim)[:length].float()
            k_scale = scales[pages].reshape(-1)[:length]
        rows = slice(b * next_n, (b + 1) * next_n)
        logits = _weighted_relu_scores(q[b].float(), k, weights[rows].float()) * k_scale
        visible = cols[:length] < context_lens.reshape(batch, next_n)[b, :, None].long()
        out[rows, :length] = torch.where(visible, logits, out[rows, :length])
    return out


def topk_indices(logits: torch.Tensor, k: int, ends: torch.Tensor, starts: torch.Tensor | None = None,
                 block_table: torch.Tensor | None = None, row_request: torch.Tensor | None = None, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``out``: the caller's int32 [rows, k] buffer (checked by the op), written whole and returned."""
    rows, cols = logits.shape
    device = logits.device
    starts_l = torch.zeros(rows, dtype=torch.long, device=device) if starts is None else starts.long()
    ends_l = ends.long()
    col = torch.arange(cols, device=device)
    visible = (col >= starts_l[:, None]) & (col < ends_l[:, None])
    # The NaN rule (every backend): a NaN score ranks exactly as -inf, so it is never selected ahead of a number.
    scores = logits.float().masked_fill(torch.isnan(logits), float("-inf"))
    masked = torch.where(visible, scores, torch.full_like(scores, float("-inf")))
    take = min(k, cols)
    # A stable descending sort keeps the lower index first among equal values: the tie rule. A second stable sort
    # on visibility keeps a visible -inf logit ahead of the masked columns it ties with.
    order = torch.sort(masked, dim=1, descending=True, stable=True).indices
    by_visibility = torch.sort(visible.gather(1, order).to(torch.int8), dim=1, descending=True, stable=True).indices
    order = order.gather(1, by_visibility)[:, :take]
    count = (ends_l - starts_l).clamp(0, k)
    slot = torch.arange(take, device=device)
    local = torch.where(slot[None, :] < count[:, None], order - starts_l[:, None], torch.full_like(order, -1))
    if block_table is not None:
        req = torch.arange(rows, device=device) if row_request is None else row_request
        positions = torch.full((rows, k), -1, dtype=torch.int32, device=device)
        positions[:, :take] = local.to(torch.int32)
        slots = indices_to_slots(positions, block_table, req)
        # The slot transform makes a tensor of its own (a gather): into the caller's buffer by one copy.
        return slots if out is None else out.copy_(slots)
    if out is None:
        out = torch.empty((rows, k), dtype=torch.int32, device=device)
    out[:, take:] = -1
    out[:, :take] = local
    return out


def lightning_indexer(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor,
                      block_table: torch.Tensor, max_context_len: int, k: int, return_slots: bool = False, *,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch paged logits, then pure-torch top-k (the oracle of fused implementations), into ``out`` if given."""
    logits = paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len)
    if not return_slots:
        return topk_indices(logits, k, context_lens.reshape(-1), out=out)
    return topk_indices(logits, k, context_lens.reshape(-1), None, block_table,
                        decode_row_requests(q.shape[0], q.shape[1], q.device), out=out)


def c4_compress_pool(proj: torch.Tensor, state: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
                     row_request: torch.Tensor, state_slot: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """V4 C4 compressor pooling (see `dsa_indexer.compressor`): bf16 [E, d] pooled entries of ``rows``, then the
    state rolls forward (each request's last 8 rows of ``proj`` written at ring index position % 8)."""
    t, width = proj.shape
    two_d = width // 2
    d = two_d // 2
    window = state.shape[1]
    ratio = ape.shape[0]
    scratch = state.shape[0] - 1
    request = row_request.long()
    slot = torch.where(state_slot >= 0, state_slot, torch.full_like(state_slot, scratch)).long()
    back = (window - 1) - torch.arange(window, device=proj.device)  # offset o is (7 - o) rows before the entry's last
    src = rows[:, None] - back[None, :]
    token = positions[rows, None] - back[None, :]
    # A window token is in this step when the row that many places back belongs to the same request (a request's
    # rows are consecutive, at consecutive positions); otherwise it is in the state.
    in_step = (src >= 0) & (request[src.clamp_min(0)] == request[rows, None])
    ring = token.clamp_min(0) % window
    win = torch.where(in_step[..., None], proj[src.clamp(0, t - 1)], state[slot[rows, None], ring])
    kv = torch.cat([win[:, :ratio, :d], win[:, ratio:, d:two_d]], dim=1)
    score = torch.cat([win[:, :ratio, two_d:two_d + d], win[:, ratio:, two_d + d:]], dim=1)
    ape_of = ape[token.clamp_min(0) % ratio]  # [E, 8, 2d]
    score = score + torch.cat([ape_of[:, :ratio, :d], ape_of[:, ratio:, d:]], dim=1)
    missing = (token < 0)[..., None]
    kv = kv.masked_fill(missing, 0.0)
    score = score.masked_fill(missing, float("-inf"))
    pooled = (torch.softmax(score, dim=1) * kv).sum(dim=1).to(torch.bfloat16)
    # Roll the state: a row is among its request's last `window` rows when the row `window` places on is not.
    later = torch.full_like(request, -1)
    later[:-window] = request[window:]
    target = torch.where((later != request) & (state_slot >= 0), slot, torch.full_like(slot, scratch))
    state[target, positions % window] = proj
    return pooled


def ragged_mqa_topk(q: torch.Tensor, k: torch.Tensor, k_scales: torch.Tensor, weights: torch.Tensor,
                    ks: torch.Tensor, ke: torch.Tensor, topk: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    return topk_indices(ragged_mqa_logits(q, k, k_scales, weights, ks, ke), topk, ke, ks, out=out)


# --- the plain paged layouts (paged64_bf16, paged64_int8) ------------------------------------------------------
INT8_MAX = 127.0


def quant_int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over the last dim: (int8 like x, fp16 scale [...]); the scale is rounded to fp16 FIRST and
    the values divided by that rounded scale, so ``q * scale`` is the dequantized value the kernels compute."""
    amax = x.abs().amax(dim=-1).clamp_min(1e-4)
    scale = (amax / torch.full_like(amax, INT8_MAX)).to(torch.float16)
    q = torch.round(x / scale.float()[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def q_prologue_plain(q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, head_weights: torch.Tensor,
                     weight_scale: float, rope_offset: int = 0, interleaved: bool = False, key_format: str = "bf16"
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = apply_rope(q.float(), positions, cos_sin, rope_offset, interleaved)
    weights = head_weights.float() * weight_scale
    if key_format == "bf16":
        return x.to(q.dtype), q.new_empty(0, dtype=torch.float16), weights
    q_int8, scale = quant_int8_rows(x @ hadamard_matrix(x.shape[-1], x.device))
    return q_int8, scale, weights


def plain_keys(k: torch.Tensor, norm_weight: torch.Tensor | None, norm_bias: torch.Tensor | None, eps: float,
               positions: torch.Tensor, cos_sin: torch.Tensor, rope_offset: int, interleaved: bool, norm: str,
               key_format: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The keys a plain-layout cache stores: (bf16 keys, None) or (int8 keys, fp16 scales)."""
    x = apply_rope(key_norm(k, norm_weight, norm_bias, eps, norm), positions, cos_sin, rope_offset, interleaved)
    if key_format == "bf16":
        return x.to(torch.bfloat16), None
    return quant_int8_rows(x @ hadamard_matrix(x.shape[-1], x.device))


def k_prologue_store_plain(k: torch.Tensor, norm_weight: torch.Tensor | None, norm_bias: torch.Tensor | None,
                           eps: float, positions: torch.Tensor, cos_sin: torch.Tensor, key_cache: torch.Tensor,
                           key_scales: torch.Tensor, slot_mapping: torch.Tensor, rope_offset: int = 0,
                           interleaved: bool = False, norm: str = "layernorm", key_format: str = "bf16") -> None:
    keys, scales = plain_keys(k, norm_weight, norm_bias, eps, positions, cos_sin, rope_offset, interleaved, norm,
                              key_format)
    store_plain_rows(key_cache, key_scales, slot_mapping, keys, scales)


def lightning_indexer_ragged(q: torch.Tensor, q_scales: torch.Tensor, key_cache: torch.Tensor,
                             key_scales: torch.Tensor, weights: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             seq_lens_k: torch.Tensor, block_table: torch.Tensor, k: int, compress_ratio: int = 1,
                             *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Request by request: its visible entries dequantized to fp32, fp32 scores, the reference top-k (into ``out``
    if given: a request's rows are written in place, rows that see no entry get -1)."""
    rows, heads, _ = q.shape
    out = torch.full((rows, k), -1, dtype=torch.int32, device=q.device) if out is None else out.fill_(-1)
    qf = q.float()
    if q.dtype == torch.int8:
        qf = qf * q_scales.float()[..., None]
    cu = cu_seqlens_q.tolist()
    lens = seq_lens_k.tolist()
    for b, length in enumerate(lens):
        start, stop = cu[b], cu[b + 1]
        n = stop - start
        if n == 0:
            continue
        entries = length // compress_ratio
        ends = (length - n + torch.arange(1, n + 1, device=q.device)) // compress_ratio
        if entries == 0:
            continue
        keys = gather_plain_keys(key_cache, key_scales, block_table[b], entries)
        chunk = max(1, _SCORES_BUDGET_BYTES // max(1, heads * entries * 4))
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            logits = _weighted_relu_scores(qf[start + lo:start + hi], keys, weights[start + lo:start + hi].float())
            topk_indices(logits, k, ends[lo:hi], out=out[start + lo:start + hi])
    return out


def q_prologue_fp4(q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, head_weights: torch.Tensor,
                   weight_scale: float, rope_offset: int = 0, interleaved: bool = False, block: int = 32,
                   fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """V4's FP4 q: RoPE rounded to q's dtype (DeepSeek rotates in place), then `rotate_quant_fp4`; the row scale
    joins the head weights like the fp8 q scale does."""
    roped = apply_rope(q.float(), positions, cos_sin, rope_offset, interleaved).to(q.dtype)
    q_fp8, row_scale = rotate_quant_fp4(roped, block, fp8_dtype)
    return q_fp8, head_weights.float() * weight_scale * row_scale


def decode_metadata(seq_lens: torch.Tensor, block_table: torch.Tensor, state_slots: torch.Tensor, next_n: int,
                    compress_ratio: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row (b, j) is token ``seq_lens[b] - next_n + j``; a negative position is a padding row (no key, no store,
    state slot -1). Positions are clamped to 0 and page columns to the table's width, so a padding row or a length
    only the host could check never makes an out-of-range gather."""
    n, ratio = next_n, compress_ratio
    offsets = torch.arange(n, dtype=torch.int64, device=seq_lens.device)
    pos = seq_lens.long()[:, None] - n + offsets[None, :]  # [B, N]
    valid = pos >= 0
    pos = pos.clamp_min(0)
    context_lens = torch.where(valid, (pos + 1) // ratio, torch.zeros_like(pos)).to(torch.int32)
    stores = valid if ratio == 1 else valid & ((pos + 1) % ratio == 0)  # C4: (p + 1) % 4 == 0 completes entry p // 4
    entry = pos // ratio
    page_col = (entry // PAGE_SIZE).clamp_max(block_table.shape[1] - 1)
    pages = torch.gather(block_table, 1, page_col).long()
    slots = torch.where(stores, pages * PAGE_SIZE + entry % PAGE_SIZE, torch.full_like(pos, -1))
    request_slot = state_slots.long()[:, None].expand(-1, n)
    state_slot = torch.where(valid, request_slot, torch.full_like(request_slot, -1))
    return context_lens, pos.reshape(-1), slots.reshape(-1), state_slot.reshape(-1)
