"""Triton kernels for the indexer logits: ragged (prefill) and paged (decode).

Both compute ``L[row, key] = k_scale[key] * sum_h w[row, h] * relu(q[row, h] . k[key])`` with an fp8 x fp8
``tl.dot`` accumulating in fp32, and write every element of their output (-inf where a row may not look).

The matrix product is laid out keys x (rows * heads): a key tile is the MMA's M side and the query heads of a
few rows are its N side, so the per-key sum over heads is a reduction along the accumulator's columns
(in-thread adds plus a couple of lane shuffles on NVIDIA) instead of a reduction across warps. Both fp8 operands
are K-major (the key tile is row-major [keys, 128], q is [heads, 128] transposed), which is what fp8 MMAs take.

Signatures, positional order and results are those of ``dsa_indexer.backends.reference.kernels``.
On CPU tensors (``TRITON_INTERPRET=1``) the same kernels run in Triton's interpreter with small tiles.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from ...contract.cache import BYTES_PER_TOKEN, FP4_BLOCK, HEAD_DIM, PAGE_BYTES, PAGE_SIZE
from .fp4_codes import fp4_key_scores, q_block_t
from .pdl import pdl_options, wait_for_predecessor

# Query rows x heads per MMA tile of the ragged kernel (its N side): 128 = 2 rows of 64 heads.
_RAGGED_TILE_COLS = 128
_OVERRIDE: dict[str, dict] = {"ragged": {}, "paged": {}}


@contextlib.contextmanager
def config_override(kernel: str, **cfg):
    """Force tile choices of the ``"ragged"`` or ``"paged"`` kernel within the block (benchmark sweeps, tests).
    Ragged keys: block_m, block_n, num_warps, num_stages, splits. Paged: chunk, tile, num_warps, num_stages.
    Not thread-safe; not for production use."""
    saved = dict(_OVERRIDE[kernel])
    _OVERRIDE[kernel].update(cfg)
    try:
        yield
    finally:
        _OVERRIDE[kernel] = saved


@functools.lru_cache(maxsize=16)
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # interpreter: only the number of programs it creates matters
    return torch.cuda.get_device_properties(device).multi_processor_count


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# ----------------------------------------------------------------------------------------------------------------
# Ragged (prefill) logits


@triton.jit
def ragged_q_tile(q_ptr, w_ptr, row_block, S, H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr):
    """The q tile of BLOCK_M rows, [D, BLOCK_M * H] K-major (MMA column c is row c // H, head c % H), its head
    weights [BLOCK_M * H] and the dim offsets. Shared with the fused top-k (`fused_topk.py`): one layout, so both
    compute bit-identical logits."""
    cols = tl.arange(0, BLOCK_M * H)
    col_rows = row_block * BLOCK_M + cols // H
    col_ok = col_rows < S
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + (col_rows.to(tl.int64) * H + cols % H)[:, None] * D + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    w = tl.load(w_ptr + col_rows.to(tl.int64) * H + cols % H, mask=col_ok, other=0.0)
    return tl.trans(q), w, offs_d


@triton.jit
def relu_keeping_nan(x):
    """``relu`` as torch computes it: NaN stays NaN (``tl.maximum(x, 0)`` would turn it into 0, a plausible score
    where the reference has NaN; the top-k then ranks the NaN as -inf on every backend)."""
    return tl.where(x < 0.0, 0.0, x)


@triton.jit
def ragged_key_logits(k_ptr, k_scale_ptr, q_t, w, n0, N, offs_n, offs_d,
                      H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(keys, logits [BLOCK_N, BLOCK_M]) of keys n0 .. n0 + BLOCK_N - 1 against the q tile (unmasked: callers apply
    the windows). The one definition of the logits arithmetic, shared with the fused top-k."""
    keys = n0 + offs_n
    key_ok = keys < N
    k_tile = tl.load(k_ptr + keys.to(tl.int64)[:, None] * D + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    k_scale = tl.load(k_scale_ptr + keys, mask=key_ok, other=0.0)
    scores = tl.dot(k_tile, q_t)  # [BLOCK_N, BLOCK_M * H] fp32
    scores = relu_keeping_nan(scores) * w[None, :]
    logits = tl.sum(tl.reshape(scores, (BLOCK_N, BLOCK_M, H)), axis=2) * k_scale[:, None]
    return keys, logits


@triton.jit
def ragged_q_blocks(q_ptr, w_ptr, row_block, S, H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK: tl.constexpr):
    """`ragged_q_tile` for FP4 keys: the q tile as its four blocks of 32 dims, each [32, BLOCK_M * H] K-major
    (same columns), and the head weights."""
    cols = tl.arange(0, BLOCK_M * H)
    col_rows = row_block * BLOCK_M + cols // H
    col_ok = col_rows < S
    q_row = col_rows.to(tl.int64) * H + cols % H
    w = tl.load(w_ptr + q_row, mask=col_ok, other=0.0)
    return (q_block_t(q_ptr, q_row, col_ok, 0, D, BLOCK), q_block_t(q_ptr, q_row, col_ok, 1, D, BLOCK),
            q_block_t(q_ptr, q_row, col_ok, 2, D, BLOCK), q_block_t(q_ptr, q_row, col_ok, 3, D, BLOCK), w)


@triton.jit
def ragged_fp4_key_logits(k_ptr, k_scale_ptr, q_t0, q_t1, q_t2, q_t3, w, n0, N, offs_n, H: tl.constexpr,
                          D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK: tl.constexpr):
    """`ragged_key_logits` for FP4 keys as stored (k uint8 [N, D / 2] packed e2m1, k_scale uint8 [N, D / 32] ue8m0
    bytes): each block's scale inside the dot, no row scale."""
    keys = n0 + offs_n
    key_ok = keys < N
    rows = keys.to(tl.int64)
    scores = fp4_key_scores(k_ptr + rows * (D // 2), k_scale_ptr + rows * (D // BLOCK), key_ok,
                            q_t0, q_t1, q_t2, q_t3, BLOCK)
    scores = relu_keeping_nan(scores) * w[None, :]
    return keys, tl.sum(tl.reshape(scores, (BLOCK_N, BLOCK_M, H)), axis=2)


@triton.jit
def _ragged_logits_kernel(q_ptr, k_ptr, k_scale_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr,
                          S, N, split_len,
                          H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          FP4: tl.constexpr, FP4_BLOCK: tl.constexpr,
                          PDL: tl.constexpr = False):
    """One program: BLOCK_M query rows x the keys [split * split_len, +split_len) (one split of N).

    q [S, H, D], k [N, D], w [S, H], out [S, N], all contiguous. The q tile of the rows stays on chip while the
    program walks the key blocks that intersect the union of the rows' windows [ks, ke); blocks outside it are
    only filled with -inf (no loads, no MMA): a causal prefill skips about half of the work that way. ``FP4``: the
    keys are FP4 rows as stored (`ragged_fp4_key_logits`), else fp8 rows with fp32 row scales.
    """
    wait_for_predecessor(PDL)
    # A 1-D grid (no 65535 limit on row blocks), splits fastest, heaviest rows first: in a causal prefill
    # later rows see more keys, and programs launch roughly in pid order.
    splits = tl.cdiv(N, split_len)
    split = tl.program_id(0) % splits
    row_block = tl.cdiv(S, BLOCK_M) - 1 - tl.program_id(0) // splits
    n_lo = split * split_len
    n_hi = tl.minimum(n_lo + split_len, N)

    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < S
    ks = tl.load(ks_ptr + rows, mask=row_ok, other=0)
    ke = tl.load(ke_ptr + rows, mask=row_ok, other=0)
    nonempty = row_ok & (ke > ks)
    lo_key = tl.min(tl.where(nonempty, ks, N), axis=0)
    hi_key = tl.max(tl.where(nonempty, ke, 0), axis=0)

    if FP4:
        q_t0, q_t1, q_t2, q_t3, w = ragged_q_blocks(q_ptr, w_ptr, row_block, S, H, D, BLOCK_M, FP4_BLOCK)
    else:
        q_t, w, offs_d = ragged_q_tile(q_ptr, w_ptr, row_block, S, H, D, BLOCK_M)

    out_rows = out_ptr + rows.to(tl.int64) * N  # [BLOCK_M] row bases
    neg_inf = tl.full((BLOCK_N, BLOCK_M), float("-inf"), tl.float32)
    offs_n = tl.arange(0, BLOCK_N)

    # Key blocks [c_start, c_stop) hold every visible key of this split (block aligned; split_len is a
    # multiple of BLOCK_N). The clamps make an empty window give c_start == c_stop.
    c_start = tl.minimum(tl.maximum(n_lo, (lo_key // BLOCK_N) * BLOCK_N), n_hi)
    c_end = tl.minimum(hi_key, n_hi)
    c_stop = c_start + tl.maximum((c_end - c_start + BLOCK_N - 1) // BLOCK_N, 0) * BLOCK_N

    for n0 in range(n_lo, c_start, BLOCK_N):
        keys = n0 + offs_n
        tl.store(out_rows[None, :] + keys[:, None], neg_inf, mask=row_ok[None, :] & (keys < N)[:, None])

    for n0 in range(c_start, c_stop, BLOCK_N):
        if FP4:
            keys, logits = ragged_fp4_key_logits(k_ptr, k_scale_ptr, q_t0, q_t1, q_t2, q_t3, w, n0, N, offs_n, H, D,
                                                 BLOCK_M, BLOCK_N, FP4_BLOCK)
        else:
            keys, logits = ragged_key_logits(k_ptr, k_scale_ptr, q_t, w, n0, N, offs_n, offs_d, H, D, BLOCK_M,
                                             BLOCK_N)
        key_ok = keys < N
        visible = (keys[:, None] >= ks[None, :]) & (keys[:, None] < ke[None, :])
        tl.store(out_rows[None, :] + keys[:, None], tl.where(visible, logits, neg_inf),
                 mask=row_ok[None, :] & key_ok[:, None])

    for n0 in range(c_stop, n_hi, BLOCK_N):
        keys = n0 + offs_n
        tl.store(out_rows[None, :] + keys[:, None], neg_inf, mask=row_ok[None, :] & (keys < N)[:, None])


def ragged_config(s: int, n: int, heads: int, device: torch.device) -> dict:
    """Tile sizes and the key split; a pure function of the shapes (no host sync, graph-capturable)."""
    over = _OVERRIDE["ragged"]
    block_m = over.get("block_m", max(1, _RAGGED_TILE_COLS // heads))
    if device.type == "cuda":
        block_n, num_warps, num_stages = 128, 8, 3
    else:
        block_n, num_warps, num_stages = 16, 4, 1
    block_n = over.get("block_n", block_n)
    num_warps = over.get("num_warps", num_warps)
    num_stages = over.get("num_stages", num_stages)
    row_blocks = triton.cdiv(s, block_m)
    key_blocks = triton.cdiv(n, block_n)
    # Enough programs to fill the machine when there are few rows (short prefill chunk, long prefix).
    target = 4 * sm_count(device)
    splits = over.get("splits", max(1, min(key_blocks, triton.cdiv(target, row_blocks))))
    split_len = triton.cdiv(key_blocks, min(splits, key_blocks)) * block_n
    splits = triton.cdiv(n, split_len)
    return dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                splits=splits, split_len=split_len, row_blocks=row_blocks)


def ragged_mqa_logits(q: torch.Tensor, k: torch.Tensor, k_scales: torch.Tensor, weights: torch.Tensor,
                      ks: torch.Tensor, ke: torch.Tensor) -> torch.Tensor:
    """Prefill logits [S, N] f32: q [S, H, 128] fp8, k [N, 128] fp8, k_scales [N], weights [S, H], ks/ke [S] int32."""
    if k.dtype == torch.uint8:
        raise ValueError("logits.ragged_mqa_logits reads fp8 keys; FP4 keys (uint8) are read by "
                         "logits_fp4.ragged_mqa_logits_fp4")
    return launch_ragged_logits(q, k, k_scales.float(), weights, ks, ke, fp4=False)


def launch_ragged_logits(q: torch.Tensor, k: torch.Tensor, k_scales: torch.Tensor, weights: torch.Tensor,
                         ks: torch.Tensor, ke: torch.Tensor, fp4: bool) -> torch.Tensor:
    """The ragged logits kernel over fp8 keys (``fp4=False``) or FP4 keys as stored (``fp4=True``)."""
    s, heads, dim = q.shape
    n = k.shape[0]
    out = torch.empty((s, n), dtype=torch.float32, device=q.device)
    if s == 0 or n == 0:
        return out
    if dim != HEAD_DIM or heads & (heads - 1):
        raise ValueError(f"the Triton ragged logits kernel takes D=128 and a power-of-two head count, got {heads}x{dim}")
    cfg = ragged_config(s, n, heads, q.device)
    grid = (cfg["splits"] * cfg["row_blocks"],)
    _ragged_logits_kernel[grid](
        q.contiguous(), k.contiguous(), k_scales.contiguous(), weights.contiguous().float(),
        ks.contiguous(), ke.contiguous(), out, s, n, cfg["split_len"],
        H=heads, D=dim, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], FP4=fp4, FP4_BLOCK=FP4_BLOCK,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_options(q.device))
    return out


# ----------------------------------------------------------------------------------------------------------------
# Paged (decode) logits


@triton.jit
def _paged_logits_kernel(q_ptr, kv_ptr, kv_scale_ptr, w_ptr, ctx_ptr, bt_ptr, out_ptr,
                         max_ctx, chunk, bt_stride,
                         NEXT_N: tl.constexpr, NN: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                         PAGE: tl.constexpr, PAGE_WORDS: tl.constexpr, TILE: tl.constexpr,
                         PDL: tl.constexpr = False):
    """One program: request b, context positions [c * chunk, +chunk), all next_n rows and all heads.

    q [B, NEXT_N, H, D]; the request's q ([NEXT_N * H, D], padded to NN rows) is loaded once and every
    64-token page (8 KB of keys + 256 B of scales) is read once for all its rows and heads. ``kv_ptr`` and
    ``kv_scale_ptr`` are fp8 and fp32 views of the same cache bytes; a page is PAGE_WORDS fp32 words.
    """
    wait_for_predecessor(PDL)
    b = tl.program_id(0)
    start = tl.program_id(1) * chunk
    stop = tl.minimum(start + chunk, max_ctx)

    cols = tl.arange(0, NN * H)  # MMA column c = (query n = c // H, head c % H)
    col_n = cols // H
    col_ok = col_n < NEXT_N
    q_row = (b * NEXT_N + col_n).to(tl.int64) * H + cols % H
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + q_row[:, None] * D + offs_d[None, :], mask=col_ok[:, None], other=0.0)
    q_t = tl.trans(q)  # [D, NN * H], K-major
    w = tl.load(w_ptr + q_row, mask=col_ok, other=0.0)

    offs_n = tl.arange(0, NN)
    n_ok = offs_n < NEXT_N
    lens = tl.load(ctx_ptr + b * NEXT_N + offs_n, mask=n_ok, other=0)
    ctx_max = tl.max(lens, axis=0)
    out_rows = out_ptr + (b * NEXT_N + offs_n).to(tl.int64) * max_ctx  # [NN]
    neg_inf = tl.full((TILE, NN), float("-inf"), tl.float32)
    offs_t = tl.arange(0, TILE)
    bt_row = bt_ptr + b.to(tl.int64) * bt_stride

    # Tiles holding positions < ctx_max are computed (start and chunk are multiples of TILE and of PAGE);
    # the rest of the chunk is only filled with -inf.
    valid_end = tl.minimum(stop, ctx_max)
    c_stop = start + tl.maximum((valid_end - start + TILE - 1) // TILE, 0) * TILE

    for t0 in range(start, c_stop, TILE):
        pos = t0 + offs_t
        in_ctx = pos < ctx_max  # never read a block-table entry or page the request does not use
        page = tl.load(bt_row + pos // PAGE, mask=in_ctx, other=0).to(tl.int64)
        slot = pos % PAGE
        k_tile = tl.load(kv_ptr + page[:, None] * (PAGE_WORDS * 4) + slot[:, None] * D + offs_d[None, :],
                         mask=in_ctx[:, None], other=0.0)
        k_scale = tl.load(kv_scale_ptr + page * PAGE_WORDS + (PAGE * D) // 4 + slot, mask=in_ctx, other=0.0)
        scores = tl.dot(k_tile, q_t)  # [TILE, NN * H] fp32
        scores = relu_keeping_nan(scores) * w[None, :]
        logits = tl.sum(tl.reshape(scores, (TILE, NN, H)), axis=2) * k_scale[:, None]
        visible = pos[:, None] < lens[None, :]
        tl.store(out_rows[None, :] + pos[:, None], tl.where(visible, logits, neg_inf),
                 mask=n_ok[None, :] & (pos < stop)[:, None])

    for t0 in range(c_stop, stop, TILE):
        pos = t0 + offs_t
        tl.store(out_rows[None, :] + pos[:, None], neg_inf, mask=n_ok[None, :] & (pos < stop)[:, None])


def paged_config(batch: int, max_context_len: int, device: torch.device) -> dict:
    """Context chunk per program: large enough to amortize the q load, small enough that B=1 with a long
    context still gives several programs per SM. A pure function of the shapes."""
    if device.type != "cuda":
        cfg = dict(chunk=128, tile=64, num_warps=4, num_stages=1)
    else:
        target = 4 * sm_count(device)
        chunk = 2048
        while chunk > 256 and batch * triton.cdiv(max_context_len, chunk) < target:
            chunk //= 2
        cfg = dict(chunk=chunk, tile=64, num_warps=4, num_stages=4)
    cfg.update(_OVERRIDE["paged"])
    return cfg


def paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor,
                     block_table: torch.Tensor, max_context_len: int) -> torch.Tensor:
    """Decode logits [B * next_n, max_context_len] f32 over the paged cache; -inf past each row's length."""
    batch, next_n, heads, dim = q.shape
    out = torch.empty((batch * next_n, max_context_len), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    if dim != HEAD_DIM or heads & (heads - 1):
        raise ValueError(f"the Triton paged logits kernel takes D=128 and a power-of-two head count, got {heads}x{dim}")
    cfg = paged_config(batch, max_context_len, q.device)
    assert cfg["chunk"] % cfg["tile"] == 0 and cfg["tile"] % PAGE_SIZE == 0
    pages = kv_cache.shape[0]
    kv_fp8 = kv_cache.view(q.dtype)  # same bytes; element size 1
    kv_f32 = kv_cache.view(pages, PAGE_BYTES).view(torch.float32)  # [pages, PAGE_BYTES // 4]
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    grid = (batch, triton.cdiv(max_context_len, cfg["chunk"]))
    _paged_logits_kernel[grid](
        q.contiguous(), kv_fp8, kv_f32, weights.contiguous().float(), context_lens.contiguous(), block_table, out,
        max_context_len, cfg["chunk"], block_table.stride(0),
        NEXT_N=next_n, NN=next_pow2(next_n), H=heads, D=dim, PAGE=PAGE_SIZE, PAGE_WORDS=PAGE_BYTES // 4,
        TILE=cfg["tile"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_options(q.device))
    return out


assert PAGE_BYTES == PAGE_SIZE * BYTES_PER_TOKEN and PAGE_BYTES % 4 == 0
