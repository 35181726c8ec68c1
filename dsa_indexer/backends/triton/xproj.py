"""Triton x projections of a decode step: ``weights_proj(x)`` and ``wk(x)`` from one read of x, in two launches (or one).

V3.2 runs ``weights_proj`` in fp32 (no bf16 rounding of the head weights) and ``wk`` in bf16, so the two cannot
share one cuBLAS GEMM. Run by torch, a 32-row step paid a cast of x to fp32, an fp32 SIMT sgemm with its split-K
reduce, and a bf16 split-K GEMM with its own reduce: five launches (21.6 us on the H200 at 32 rows) for 3.7 MB of
weights (about 1 us of HBM). Here:

1. `_x_projections_partial_kernel`: the [H + D] output columns in tiles of 16, each tile's K range split so that
   the grid fills the GPU; a program reads its slice of x once (bf16) and runs bf16 tensor-core dots with fp32
   accumulation: for wk one, for the fp32 weights_proj three (the weight split into bf16 hi + mid + lo in
   registers: 24 significant bits, the fp32 weight exactly), and writes its fp32 partial.
2. `_x_projections_reduce_kernel`: sums the partials of each output in split order (a fixed order: the result is
   the same on every run and every stream, as the strategies' bit-identity needs) and writes both outputs in
   their dtypes (head weights fp32, or the weight's dtype; k in x's dtype, rounded to nearest even).

`x_projections_one_launch` runs both in one launch (`_x_projections_one_launch_kernel`): each program writes its
partial, then counts itself in on its tile's arrival counter, and the last of the tile's split programs to arrive
reduces the tile as step 2 does. The split order of the sum is unchanged, so the result is bit-identical. It saves a
launch on the decode step's k path; it is registered below the two launches until it is timed (issue 38).

Accuracy: each output is an fp32 sum of exact products (bf16 x bf16 or widened bf16 x fp32 in IEEE fp32), in
another order than cuBLAS; tests/gpu/test_x_projections_gpu.py states the bounds. Above `MAX_SPLIT_ROWS` rows
(prefill) the projection is compute bound and cuBLAS's tiles win: those calls run ``F.linear`` (the reference's
math, in the same call, so every strategy still gets the same kernels for the same shapes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .pdl import pdl_options, wait_for_predecessor
from .quant import interpreted, round_to_dtype_grid

BLOCK_N = 16
BLOCK_K = 128
MAX_SPLIT_ROWS = 256  # above this (prefill) the two GEMMs run as cuBLAS F.linear calls
PROGRAMS_PER_SM = 2   # target grid of the partial kernel: enough programs in flight to stream the weights


@triton.jit
def _tile_dot(x_rows, mmask, offs_k0, w_ptr, stride_w, first_col, N, K, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_FP32: tl.constexpr, WIDEN: tl.constexpr):
    """x rows [BLOCK_M, this split's CHUNK of K] times weight rows [first_col, + BLOCK_N) transposed, fp32."""
    offs_n = first_col + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, CHUNK, BLOCK_K):
        offs_k = offs_k0 + kk
        kmask = offs_k < K
        xt = tl.load(x_rows + offs_k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        wt = tl.load(w_rows + offs_k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        if WIDEN:
            acc += tl.dot(xt.to(tl.float32), tl.trans(wt.to(tl.float32)), input_precision="ieee")
        elif W_FP32:
            # The fp32 weight as three bf16 terms, hi + mid + lo (each the bf16 rounding of what is left: together
            # 24 significant bits: the fp32 weight exactly for normal values), each times the bf16 x on the tensor
            # cores: exact products, fp32 sums. An IEEE fp32 (FMA) dot of the same tile measured 10-18 us.
            hi = wt.to(tl.bfloat16)
            rest = wt - hi.to(tl.float32)
            mid = rest.to(tl.bfloat16)
            lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
            acc += tl.dot(xt, tl.trans(lo))
            acc += tl.dot(xt, tl.trans(mid))
            acc += tl.dot(xt, tl.trans(hi))
        else:
            acc += tl.dot(xt, tl.trans(wt))
    return acc


@triton.jit
def _store_tile(out_ptr, stride_out, total, offs_m, mmask, first_col, N, BLOCK_N: tl.constexpr,
                INTERPRET: tl.constexpr):
    offs_n = first_col + tl.arange(0, BLOCK_N)
    out = round_to_dtype_grid(total, out_ptr.dtype.element_ty, INTERPRET)
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mmask[:, None] & (offs_n < N)[None, :])


@triton.jit
def _partial_tile(x_ptr, wp_ptr, wk_ptr, T, K, H, D, stride_x, stride_wp, stride_wk, CHUNK: tl.constexpr,
                  HEAD_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  WP_FP32: tl.constexpr, WIDEN: tl.constexpr):
    """This program's fp32 partial: its column tile over its split of K (the grid: split, column tile, row tile)."""
    # WIDEN: every dot in IEEE fp32 on widened tiles: for an fp32 x (F.linear's fp32 GEMM uses no TF32; fp16 x too,
    # whose values the bf16 terms would not hold), and under the interpreter, whose bf16 dot is wrong (Triton 3.9;
    # the products are exact either way, only the order of the fp32 sums differs from the GPU's).
    pid_s = tl.program_id(0)  # split of K (fastest: the splits of a tile run side by side and share x in L2)
    pid_n = tl.program_id(1)  # column tile: [0, HEAD_TILES) of weights_proj, then wk's
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k0 = pid_s * CHUNK + tl.arange(0, BLOCK_K)
    mmask = offs_m < T
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    # A runtime branch: each side's locals live in its helper (Triton wants one type per name across branches).
    if pid_n < HEAD_TILES:
        acc = _tile_dot(x_rows, mmask, offs_k0, wp_ptr, stride_wp, pid_n * BLOCK_N, H, K, CHUNK, BLOCK_M, BLOCK_N,
                        BLOCK_K, WP_FP32, WIDEN)
    else:
        acc = _tile_dot(x_rows, mmask, offs_k0, wk_ptr, stride_wk, (pid_n - HEAD_TILES) * BLOCK_N, D, K, CHUNK,
                        BLOCK_M, BLOCK_N, BLOCK_K, False, WIDEN)
    return acc


@triton.jit
def _tile_partials(part_ptr, pid_n, pid_m, splits, N_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """The pointers of split 0's partial of one output tile. Partials are laid out [m tile, n tile, split, BLOCK_M,
    BLOCK_N]: a tile's splits lie in one run."""
    offs_tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    return part_ptr + ((pid_m * N_TILES + pid_n) * splits).to(tl.int64) * (BLOCK_M * BLOCK_N) + offs_tile


@triton.jit
def _reduce_tile(part_ptr, hw_ptr, k_ptr, pid_n, pid_m, T, H, D, stride_hw, stride_k, SPLITS: tl.constexpr,
                 HEAD_TILES: tl.constexpr, N_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CACHE: tl.constexpr, INTERPRET: tl.constexpr):
    """Sum one output tile's partials in split order (a fixed order: the same sum on every run and every stream, as
    the strategies' bit-identity needs) and write it in its output's dtype. ``CACHE``: the loads' cache modifier."""
    base = _tile_partials(part_ptr, pid_n, pid_m, SPLITS, N_TILES, BLOCK_M, BLOCK_N)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLITS):  # unrolled: every load in flight at once
        total += tl.load(base + s * (BLOCK_M * BLOCK_N), cache_modifier=CACHE)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = offs_m < T
    if pid_n < HEAD_TILES:
        _store_tile(hw_ptr, stride_hw, total, offs_m, mmask, pid_n * BLOCK_N, H, BLOCK_N, INTERPRET)
    else:
        _store_tile(k_ptr, stride_k, total, offs_m, mmask, (pid_n - HEAD_TILES) * BLOCK_N, D, BLOCK_N, INTERPRET)


@triton.jit
def _x_projections_partial_kernel(x_ptr, wp_ptr, wk_ptr, part_ptr, T, K, H, D, stride_x, stride_wp, stride_wk,
                                  CHUNK: tl.constexpr, HEAD_TILES: tl.constexpr, N_TILES: tl.constexpr,
                                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                  WP_FP32: tl.constexpr, WIDEN: tl.constexpr,
                                  PDL: tl.constexpr = False):
    wait_for_predecessor(PDL)
    acc = _partial_tile(x_ptr, wp_ptr, wk_ptr, T, K, H, D, stride_x, stride_wp, stride_wk, CHUNK, HEAD_TILES,
                        BLOCK_M, BLOCK_N, BLOCK_K, WP_FP32, WIDEN)
    base = _tile_partials(part_ptr, tl.program_id(1), tl.program_id(2), tl.num_programs(0), N_TILES, BLOCK_M,
                          BLOCK_N)
    tl.store(base + tl.program_id(0) * (BLOCK_M * BLOCK_N), acc)


@triton.jit
def _x_projections_reduce_kernel(part_ptr, hw_ptr, k_ptr, T, H, D, stride_hw, stride_k, SPLITS: tl.constexpr,
                                 HEAD_TILES: tl.constexpr, N_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
                                 PDL: tl.constexpr = False):
    wait_for_predecessor(PDL)
    _reduce_tile(part_ptr, hw_ptr, k_ptr, tl.program_id(0), tl.program_id(1), T, H, D, stride_hw, stride_k, SPLITS,
                 HEAD_TILES, N_TILES, BLOCK_M, BLOCK_N, "", INTERPRET)


@triton.jit
def _x_projections_one_launch_kernel(x_ptr, wp_ptr, wk_ptr, part_ptr, arrivals_ptr, hw_ptr, k_ptr, T, K, H, D,
                                     stride_x, stride_wp, stride_wk, stride_hw, stride_k, CHUNK: tl.constexpr,
                                     SPLITS: tl.constexpr, HEAD_TILES: tl.constexpr, N_TILES: tl.constexpr,
                                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                     WP_FP32: tl.constexpr, WIDEN: tl.constexpr, INTERPRET: tl.constexpr,
                                     PDL: tl.constexpr = False):
    """The partial kernel, then the reduce done by the last of a tile's SPLITS programs to arrive (`one_launch`)."""
    wait_for_predecessor(PDL)
    pid_n = tl.program_id(1)
    pid_m = tl.program_id(2)
    acc = _partial_tile(x_ptr, wp_ptr, wk_ptr, T, K, H, D, stride_x, stride_wp, stride_wk, CHUNK, HEAD_TILES,
                        BLOCK_M, BLOCK_N, BLOCK_K, WP_FP32, WIDEN)
    base = _tile_partials(part_ptr, pid_n, pid_m, SPLITS, N_TILES, BLOCK_M, BLOCK_N)
    tl.store(base + tl.program_id(0) * (BLOCK_M * BLOCK_N), acc)
    # Every thread's partial is stored before the program arrives: the barrier orders them before the arrival, whose
    # release (gpu scope) publishes them to the program that arrives last, whose acquire sees them all.
    tl.debug_barrier()
    counter = arrivals_ptr + pid_m * N_TILES + pid_n
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
        # L2 reads (".cg"): the other programs' partials were never in this SM's L1. Then the counter goes back to
        # 0 for the next launch on this stream (launches on one stream run in order).
        _reduce_tile(part_ptr, hw_ptr, k_ptr, pid_n, pid_m, T, H, D, stride_hw, stride_k, SPLITS, HEAD_TILES,
                     N_TILES, BLOCK_M, BLOCK_N, ".cg", INTERPRET)
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


_SM_COUNT: dict[int, int] = {}


_PARTIAL_INTERPRETED = interpreted(_x_projections_partial_kernel)
_REDUCE_INTERPRETED = interpreted(_x_projections_reduce_kernel)
_ONE_LAUNCH_INTERPRETED = interpreted(_x_projections_one_launch_kernel)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 24  # the interpreter: a few K splits on small shapes, so CPU tests exercise the split path
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _SM_COUNT.get(index)
    if count is None:
        count = _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


def split_plan(rows: int, hidden: int, heads: int, dim: int, sms: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, chunk, splits, n_tiles)`` for ``rows`` x ``hidden`` against ``heads + dim`` output columns:
    BLOCK_M the rows' power of two (16 .. 64), K split in chunks of whole BLOCK_K steps so that the grid holds
    about `PROGRAMS_PER_SM` programs per SM."""
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    n_tiles = triton.cdiv(heads, BLOCK_N) + triton.cdiv(dim, BLOCK_N)
    tiles = triton.cdiv(rows, block_m) * n_tiles
    steps = triton.cdiv(hidden, BLOCK_K)
    splits = max(1, min(steps, round(PROGRAMS_PER_SM * sms / tiles)))
    chunk = triton.cdiv(steps, splits) * BLOCK_K
    return block_m, chunk, triton.cdiv(hidden, chunk), n_tiles


def x_projections(x: torch.Tensor, weights_proj: torch.Tensor, wk: torch.Tensor, *,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights_proj(x) [T, H], wk(x) [T, D])``: head weights in fp32 from x widened (``weights_proj`` fp32)
    or in the weight's dtype; k in x's dtype. Same contract as the reference (`x_projections` in
    backends/reference/kernels.py). ``out``: two contiguous tensors to write (tests pre-fill them with NaN to
    see that every output is written); at most `MAX_SPLIT_ROWS` rows."""
    return _launch(x, weights_proj, wk, out, one_launch=False)


def x_projections_one_launch(x: torch.Tensor, weights_proj: torch.Tensor, wk: torch.Tensor, *,
                             out: tuple[torch.Tensor, torch.Tensor] | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """`x_projections` in one launch: the last of an output tile's split programs to finish sums the tile's
    partials (same order, so bit-identical to the two launches), counted by an arrival counter per tile that the
    last one sets back to 0. The counters belong to the current stream (`_arrival_counters`), so launches on two
    streams never share one. Opt-in (``DSA_INDEXER_FORCE=x_projections=x_projections.triton.one_launch``): it saves
    the reduce's launch, but was not timed yet (issue 38)."""
    return _launch(x, weights_proj, wk, out, one_launch=True)


_ARRIVALS: dict[tuple[torch.device, int], torch.Tensor] = {}
_MIN_ARRIVAL_COUNTERS = 1024


def _arrival_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters, one per output tile, of the current stream on ``device``: made once per stream (each
    launch leaves them at 0), grown when a launch has more tiles."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    counters = _ARRIVALS.get((device, stream))
    if counters is None or counters.numel() < tiles:
        counters = _ARRIVALS[(device, stream)] = torch.zeros(max(tiles, _MIN_ARRIVAL_COUNTERS), dtype=torch.int32,
                                                            device=device)
    return counters


def _launch(x: torch.Tensor, weights_proj: torch.Tensor, wk: torch.Tensor,
            out: tuple[torch.Tensor, torch.Tensor] | None, one_launch: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rows, hidden = x.shape
    heads, dim = weights_proj.shape[0], wk.shape[0]
    wp_fp32 = weights_proj.dtype == torch.float32
    if rows > MAX_SPLIT_ROWS:
        if out is not None:
            raise ValueError(f"out= is for at most {MAX_SPLIT_ROWS} rows (the Triton path), got {rows}")
        return F.linear(x.float() if wp_fp32 else x, weights_proj), F.linear(x, wk)
    if out is not None:
        head_weights, k = out
    else:
        head_weights = torch.empty(rows, heads, dtype=weights_proj.dtype, device=x.device)
        k = torch.empty(rows, dim, dtype=x.dtype, device=x.device)
    if rows == 0:
        return head_weights, k
    if hidden == 0:
        return head_weights.zero_(), k.zero_()
    x = x if x.stride(1) == 1 else x.contiguous()
    weights_proj = weights_proj if weights_proj.stride(1) == 1 else weights_proj.contiguous()
    wk = wk if wk.stride(1) == 1 else wk.contiguous()
    block_m, chunk, splits, n_tiles = split_plan(rows, hidden, heads, dim, _sm_count(x.device))
    m_tiles = triton.cdiv(rows, block_m)
    head_tiles = triton.cdiv(heads, BLOCK_N)
    partials = torch.empty(m_tiles * n_tiles * splits * block_m * BLOCK_N, dtype=torch.float32, device=x.device)
    pdl = pdl_options(x.device)
    widen = x.dtype != torch.bfloat16 or _PARTIAL_INTERPRETED
    if one_launch:
        _x_projections_one_launch_kernel[(splits, n_tiles, m_tiles)](
            x, weights_proj, wk, partials, _arrival_counters(x.device, m_tiles * n_tiles), head_weights, k, rows,
            hidden, heads, dim, x.stride(0), weights_proj.stride(0), wk.stride(0), head_weights.stride(0),
            k.stride(0), CHUNK=chunk, SPLITS=splits, HEAD_TILES=head_tiles, N_TILES=n_tiles, BLOCK_M=block_m,
            BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, WP_FP32=wp_fp32, WIDEN=widen, INTERPRET=_ONE_LAUNCH_INTERPRETED,
            num_warps=4, num_stages=3, **pdl)
        return head_weights, k
    _x_projections_partial_kernel[(splits, n_tiles, m_tiles)](
        x, weights_proj, wk, partials, rows, hidden, heads, dim, x.stride(0), weights_proj.stride(0), wk.stride(0),
        CHUNK=chunk, HEAD_TILES=head_tiles, N_TILES=n_tiles, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        WP_FP32=wp_fp32, num_warps=4, WIDEN=widen, num_stages=3, **pdl)
    _x_projections_reduce_kernel[(n_tiles, m_tiles)](
        partials, head_weights, k, rows, heads, dim, head_weights.stride(0), k.stride(0), splits,
        HEAD_TILES=head_tiles, N_TILES=n_tiles, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        INTERPRET=_REDUCE_INTERPRETED, num_warps=4, **pdl)
    return head_weights, k
