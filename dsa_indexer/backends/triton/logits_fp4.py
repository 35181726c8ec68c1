"""Triton decode logits over V4's FP4 cache (``paged64_fp4_e2m1``, 68 bytes per token; `contract/cache.py`).

``L[row, key] = sum_h w[row, h] * relu(q[row, h] . k[key])`` with ``k`` the FP4 key dequantized in the kernel: each
packed byte gives two e2m1 values (low nibble: element 2i, high: 2i + 1; ``sign << 3 | code``), each block of 32
its ue8m0 scale (byte b of the token's scale word). Same signature, output contract and tiling as the fp8 kernel
(`logits.paged_mqa_logits`): one program per (request, context chunk), all next_n rows and heads of the request in
the MMA's N side, every output element written (-inf past each row's length and in the chunk's tail).

Numerics: per block of 32 dims, the key's e2m1 values are exact in fp8 e4m3 (and e4m3fnuz): one fp8 dot of K = 32
with q's same dims (the library's folded fp8 q; its row scale is in ``weights``), then times the block's scale in
fp32, the four blocks summed in fp32. No range limit (the fold into the fp8 cache loses a block more than 2^14 below
its row's largest; here each block keeps its own scale). Products are exact; only the order of the fp32 sums
differs from the reference (and, on Hopper, the fp8 MMA's accumulator inside each K = 32 dot). bf16 operands
(dequantizing in the kernel to bf16) were not used: Triton's CPU interpreter computes bf16 dots wrongly here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...contract.cache import (FP4_BLOCK, FP4_BYTES_PER_TOKEN, FP4_PAGE_BYTES, FP4_VALUE_BYTES, HEAD_DIM, PAGE_SIZE,
                               SCALE_BYTES)
from .fp4_codes import fp4_key_scores, q_block_t
from .logits import next_pow2, paged_config, launch_ragged_logits, relu_keeping_nan
from .pdl import pdl_options, wait_for_predecessor


@triton.jit
def _paged_fp4_logits_kernel(q_ptr, kv_ptr, w_ptr, ctx_ptr, bt_ptr, out_ptr, max_ctx, chunk, bt_stride,
                             NEXT_N: tl.constexpr, NN: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                             PAGE: tl.constexpr, PAGE_BYTES: tl.constexpr, VALUE_BYTES: tl.constexpr,
                             SCALE_BYTES: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr,
                             PDL: tl.constexpr = False):
    """One program: request b, context positions [c * chunk, +chunk), all next_n rows and all heads (q [B, NEXT_N,
    H, D] fp8; a page is PAGE_BYTES bytes: PAGE x VALUE_BYTES packed values, then PAGE x SCALE_BYTES scales)."""
    wait_for_predecessor(PDL)
    b = tl.program_id(0)
    start = tl.program_id(1) * chunk
    stop = tl.minimum(start + chunk, max_ctx)

    cols = tl.arange(0, NN * H)  # MMA column c = (query n = c // H, head c % H)
    col_n = cols // H
    col_ok = col_n < NEXT_N
    q_row = (b * NEXT_N + col_n).to(tl.int64) * H + cols % H
    # D = 4 blocks of 32 (checked by the wrapper): q loaded once, per block.
    q_t0 = q_block_t(q_ptr, q_row, col_ok, 0, D, BLOCK)
    q_t1 = q_block_t(q_ptr, q_row, col_ok, 1, D, BLOCK)
    q_t2 = q_block_t(q_ptr, q_row, col_ok, 2, D, BLOCK)
    q_t3 = q_block_t(q_ptr, q_row, col_ok, 3, D, BLOCK)
    w = tl.load(w_ptr + q_row, mask=col_ok, other=0.0)

    offs_n = tl.arange(0, NN)
    n_ok = offs_n < NEXT_N
    lens = tl.load(ctx_ptr + b * NEXT_N + offs_n, mask=n_ok, other=0)
    ctx_max = tl.max(lens, axis=0)
    out_rows = out_ptr + (b * NEXT_N + offs_n).to(tl.int64) * max_ctx  # [NN]
    neg_inf = tl.full((TILE, NN), float("-inf"), tl.float32)
    offs_t = tl.arange(0, TILE)
    bt_row = bt_ptr + b.to(tl.int64) * bt_stride

    valid_end = tl.minimum(stop, ctx_max)
    c_stop = start + tl.maximum((valid_end - start + TILE - 1) // TILE, 0) * TILE

    for t0 in range(start, c_stop, TILE):
        pos = t0 + offs_t
        in_ctx = pos < ctx_max  # never read a block-table entry or page the request does not use
        page = tl.load(bt_row + pos // PAGE, mask=in_ctx, other=0).to(tl.int64)
        slot = pos % PAGE
        page_base = kv_ptr + page * PAGE_BYTES
        scores = fp4_key_scores(page_base + slot * VALUE_BYTES, page_base + PAGE * VALUE_BYTES + slot * SCALE_BYTES,
                                in_ctx, q_t0, q_t1, q_t2, q_t3, BLOCK)
        scores = relu_keeping_nan(scores) * w[None, :]  # [TILE, NN * H] fp32
        logits = tl.sum(tl.reshape(scores, (TILE, NN, H)), axis=2)
        visible = pos[:, None] < lens[None, :]
        tl.store(out_rows[None, :] + pos[:, None], tl.where(visible, logits, neg_inf),
                 mask=n_ok[None, :] & (pos < stop)[:, None])

    for t0 in range(c_stop, stop, TILE):
        pos = t0 + offs_t
        tl.store(out_rows[None, :] + pos[:, None], neg_inf, mask=n_ok[None, :] & (pos < stop)[:, None])


def paged_mqa_logits_fp4(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor,
                         block_table: torch.Tensor, max_context_len: int) -> torch.Tensor:
    """Decode logits [B * next_n, max_context_len] f32 over the FP4 pages ``[pages, 64, 1, 68]``; -inf past each
    row's length. q [B, next_n, H, 128] fp8 (either flavour), weights [B * next_n, H] f32 (q's row scale in them)."""
    batch, next_n, heads, dim = q.shape
    if kv_cache.shape[-1] != FP4_BYTES_PER_TOKEN:
        raise ValueError(f"the Triton FP4 logits kernel reads the paged64_fp4_e2m1 pages ({FP4_BYTES_PER_TOKEN} bytes "
                         f"per token), got {kv_cache.shape[-1]}: the fp8 pages are read by logits.paged_mqa_logits")
    out = torch.empty((batch * next_n, max_context_len), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    if dim != HEAD_DIM or dim != 4 * FP4_BLOCK or heads & (heads - 1):
        raise ValueError(f"the Triton FP4 logits kernel takes D=128 and a power-of-two head count, got {heads}x{dim}")
    cfg = paged_config(batch, max_context_len, q.device)
    assert cfg["chunk"] % cfg["tile"] == 0 and cfg["tile"] % PAGE_SIZE == 0
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    grid = (batch, triton.cdiv(max_context_len, cfg["chunk"]))
    _paged_fp4_logits_kernel[grid](
        q.contiguous(), kv_cache, weights.contiguous().float(), context_lens.contiguous(), block_table, out,
        max_context_len, cfg["chunk"], block_table.stride(0),
        NEXT_N=next_n, NN=next_pow2(next_n), H=heads, D=dim, PAGE=PAGE_SIZE, PAGE_BYTES=FP4_PAGE_BYTES,
        VALUE_BYTES=FP4_VALUE_BYTES, SCALE_BYTES=SCALE_BYTES, BLOCK=FP4_BLOCK,
        TILE=cfg["tile"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_options(q.device))
    return out


def ragged_mqa_logits_fp4(q: torch.Tensor, k: torch.Tensor, k_scales: torch.Tensor, weights: torch.Tensor,
                          ks: torch.Tensor, ke: torch.Tensor) -> torch.Tensor:
    """Prefill logits [S, N] f32 over FP4 keys as the pages store them (`IndexKCache.gather_packed`): k uint8
    [N, 64] packed e2m1, k_scales uint8 [N, 4] ue8m0 block bytes; q [S, H, 128] fp8 (its row scale in ``weights``).
    The fp8 ragged kernel's tiling and window skipping (`logits.launch_ragged_logits`), each key block dequantized
    in the kernel as here for the pages."""
    if k.dtype != torch.uint8 or k.shape[-1] != FP4_VALUE_BYTES:
        raise ValueError(f"the Triton FP4 ragged logits kernel reads packed FP4 keys (uint8 [N, {FP4_VALUE_BYTES}]), "
                         f"got {k.dtype} {list(k.shape)}: fp8 keys are read by logits.ragged_mqa_logits")
    return launch_ragged_logits(q, k, k_scales, weights, ks, ke, fp4=True)
