"""Triton top-k for the indexer: exact selection by histograms (no sort), and the lightning indexer built on it.

``topk_indices`` returns, per row, the k largest logits among columns [start, end) with ties going to the
lower column: exactly the reference's set. Rows whose window holds <= k columns need no selection: every
visible column in ascending order, then -1. Otherwise, with T the k-th largest value of the row:

* Each fp32 logit becomes an order-preserving uint32 key (flip all bits of negatives, set the sign bit of
  positives; -0.0 is folded into +0.0 and every NaN becomes the largest key, as ``torch.sort`` orders them).
* Histograms narrow down T's key; the columns that can still matter are compacted, in column order, into
  scratch lists; an exact radix select over a list (4 passes of 256-bin histograms, one per key byte) ends
  it. Ties at T go to the lowest columns because every list is in column order and ranks are exclusive
  prefix counts.
* ``tl.histogram``'s cost grows with the bin count where it lowers to warp ballots (Triton <= 3.6: ~50
  instructions per element at 128 bins, ~60-80 at 256), so full passes over a row are few and use few bins.

Two execution paths, picked from the shapes only by a small cost model (no host sync; every launch grid is
fixed by the shapes, so a call can be captured in a CUDA graph):

* ``rows``: one program per row, one launch, no atomics, no memset. Pass 1 takes a 128-bin histogram in
  equal-width value bins below an anchor (the largest value of a few sampled tiles), 1/32 of the samples' mean
  distance below it
  (keys above the anchor and keys below the window have a bin each, so any data is handled exactly) and finds the bin b* holding T. Pass 2 compacts the
  columns of bins < b* ("sure": fewer than k) and of bin b* ("candidates", usually a small fraction of the
  row) into two lists; the radix select then runs over the candidates only. Output order: the sure columns,
  then the candidates > T, then the first candidates == T, each group in ascending column order.
* ``split``: a row is split over several programs (chunks) so that a few long rows still fill the GPU. One
  launch per pass (kernel boundaries are the grid-wide sync): passes 1-3 histogram key bytes 1-3 over the
  row with atomics into a global [R, 4, 256] buffer (each pass's programs derive the next byte from it);
  pass 3 also compacts every column whose key is >= T's 16-bit prefix into per-chunk lists; pass 4 takes the
  last byte over the lists and stores per-chunk counts (entries above T's 24-bit prefix, suffix sums of the
  byte histogram) from which pass 5 ranks each chunk's output without atomics. Output order: the columns > T,
  then the first columns == T, each group in ascending column order. One memset and five launches.

Scratch: an int32 list as large as the logits (the worst case, massive ties at T, fills it) and small
per-row buffers.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ...contract.cache import PAGE_SIZE
from .logits import next_pow2, sm_count, paged_mqa_logits
from .pdl import pdl_options, wait_for_predecessor

_BINS = 256
_LEVELS = 4  # bytes of a 32-bit key
_OVERRIDE: dict = {}


@contextlib.contextmanager
def config_override(**cfg):
    """Force top-k choices (``path="rows"|"split"``, ``block``, ``split``, ``num_warps``) within the block:
    for tests (both paths on tiny shapes) and benchmark sweeps. Not thread-safe; not for production use."""
    saved = dict(_OVERRIDE)
    _OVERRIDE.update(cfg)
    try:
        yield
    finally:
        _OVERRIDE.clear()
        _OVERRIDE.update(saved)


# ----------------------------------------------------------------------------------------------------------------
# Building blocks shared by both paths


NEG_INF_KEY: tl.constexpr = tl.constexpr(0x007FFFFF)  # _order_key(-inf): ~0xFF800000


@triton.jit
def _order_key(x):
    """fp32 -> uint32 whose unsigned order is the float order (-0.0 == +0.0), with every NaN given the key of -inf:
    the library's NaN rule (a NaN score ranks exactly as -inf, never ahead of a number)."""
    u = x.to(tl.uint32, bitcast=True)
    u = tl.where(u == 0x80000000, tl.zeros_like(u), u)
    flipped = tl.where((u >> 31) != 0, ~u, u | 0x80000000)
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    return tl.where(is_nan, tl.full(u.shape, NEG_INF_KEY, tl.uint32), flipped)


@triton.jit
def _select_bin(h, k_rem):
    """From a 256-bin histogram: the bin holding the k_rem-th largest element, and k_rem within that bin."""
    bins = tl.arange(0, 256)
    ge = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h  # elements in bins >= b; non-increasing in b
    digit = tl.sum((ge >= k_rem).to(tl.int32), axis=0) - 1
    above = tl.sum(tl.where(bins > digit, h, 0), axis=0)
    return digit, k_rem - above


@triton.jit
def _binned(digits, selected, BINS: tl.constexpr):
    """Histogram of digits[selected], except that unselected lanes land in bin 0: callers count them in a
    per-lane vector and take them out once per pass (one cross-warp reduction per pass instead of per tile;
    tl.histogram's mask argument is missing from older Triton releases)."""
    return tl.histogram(tl.where(selected, digits, 0), BINS)


@triton.jit
def _unbin(acc, unselected, BINS: tl.constexpr):
    return acc - tl.where(tl.arange(0, BINS) == 0, tl.sum(unselected, axis=0), 0)


@triton.jit
def _row_window(starts_ptr, ends_ptr, row, HAS_STARTS: tl.constexpr):
    end = tl.load(ends_ptr + row)
    if HAS_STARTS:
        start = tl.load(starts_ptr + row)
    else:
        start = end * 0
    return start, end


@triton.jit
def _tile_cols(c0, BLOCK: tl.constexpr):
    """Columns c0 .. c0 + BLOCK - 1 as a [BLOCK // 4, 4] tile of rows of 4 consecutive columns (a 16-byte
    vector each): compaction then scans row counts and, in-thread, within rows. (A scan over a flat tile
    whose result feeds scattered stores costs about 3x more instructions.)"""
    return c0 + tl.arange(0, BLOCK // 4)[:, None] * 4 + tl.arange(0, 4)[None, :]


@triton.jit
def _append(list_base, length, keep, cols):
    """Append cols[keep] (a _tile_cols tile) to a list, in column order; returns the new length."""
    counts = keep.to(tl.int32)
    per_row = tl.sum(counts, axis=1)
    total = tl.sum(per_row, axis=0)
    if total > 0:
        rank = (tl.cumsum(per_row, axis=0) - per_row)[:, None] + tl.cumsum(counts, axis=1)
        tl.store(list_base + length + rank - 1, cols, mask=keep)
    return length + total


@triton.jit
def _append_two(a_base, a_len, a_keep, b_base, b_len, b_keep, cols):
    """_append to two lists (keeps disjoint) with one scan: the two counts share an int32 (16 bits each; a tile
    has fewer than 65536 columns)."""
    counts = a_keep.to(tl.int32) + (b_keep.to(tl.int32) << 16)
    per_row = tl.sum(counts, axis=1)
    total = tl.sum(per_row, axis=0)
    if total > 0:
        rank = (tl.cumsum(per_row, axis=0) - per_row)[:, None] + tl.cumsum(counts, axis=1)
        tl.store(a_base + a_len + (rank & 0xFFFF) - 1, cols, mask=a_keep)
        tl.store(b_base + b_len + (rank >> 16) - 1, cols, mask=b_keep)
    return a_len + (total & 0xFFFF), b_len + (total >> 16)


@triton.jit
def _scan_columns(x_row, n_cols, lo, hi, prefix, list_base, LEVEL: tl.constexpr, BLOCK: tl.constexpr):
    """One pass over columns [lo, hi) of a row: the histogram of key byte LEVEL (0, 1 or 2) among the columns
    whose higher bytes equal ``prefix``. LEVEL 2 also appends every column whose key is >= the 16-bit prefix
    to ``list_base`` in column order; returns (histogram, list length)."""
    acc = tl.zeros((256,), tl.int32)
    unselected = tl.zeros((BLOCK,), tl.int32)
    kept = 0
    # Tiles aligned to BLOCK and a load mask on the row length only: the loads vectorize; the window
    # [lo, hi) is applied after the load.
    for c0 in range((lo // BLOCK) * BLOCK, hi, BLOCK):
        cols = _tile_cols(c0, BLOCK)
        key = _order_key(tl.load(x_row + cols, mask=cols < n_cols, other=0.0))
        inside = (cols >= lo) & (cols < hi)
        if LEVEL == 0:
            match = inside
        else:
            match = inside & ((key >> (32 - 8 * LEVEL)) == prefix)
        digits = ((key >> (24 - 8 * LEVEL)) & 255).to(tl.int32)
        acc += _binned(tl.reshape(digits, (BLOCK,)), tl.reshape(match, (BLOCK,)), 256)
        unselected += tl.reshape((~match).to(tl.int32), (BLOCK,))
        if LEVEL == 2:
            kept = _append(list_base, kept, inside & ((key >> 16) >= prefix), cols)
    acc = _unbin(acc, unselected, 256)
    return acc, kept


@triton.jit
def _scan_list(x_row, list_base, length, prefix, LEVEL: tl.constexpr, BLOCK: tl.constexpr):
    """Over a list of columns: the histogram of key byte LEVEL among entries whose higher bytes equal
    ``prefix``, and the number of entries whose higher bytes are above it."""
    acc = tl.zeros((256,), tl.int32)
    unselected = tl.zeros((BLOCK,), tl.int32)
    above = tl.zeros((BLOCK,), tl.int32)
    for t0 in range(0, length, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        inside = t < length
        cols = tl.load(list_base + t, mask=inside, other=0)
        key = _order_key(tl.load(x_row + cols, mask=inside, other=0.0))
        if LEVEL == 0:
            match = inside
        else:
            top = key >> (32 - 8 * LEVEL)
            match = inside & (top == prefix)
            above += (inside & (top > prefix)).to(tl.int32)
        acc += _binned(((key >> (24 - 8 * LEVEL)) & 255).to(tl.int32), match, 256)
        unselected += (~match).to(tl.int32)
    return _unbin(acc, unselected, 256), tl.sum(above, axis=0)


@triton.jit
def _slots(pos, valid, bt_ptr, bt_stride, req, PAGE: tl.constexpr):
    """Request-local positions -> physical cache slots block_table[req, pos // PAGE] * PAGE + pos % PAGE."""
    safe = tl.where(valid, pos, 0)
    page = tl.load(bt_ptr + req.to(tl.int64) * bt_stride + safe // PAGE, mask=valid, other=0)
    return tl.where(valid, page * PAGE + safe % PAGE, -1)


@triton.jit
def _emit_window(out_row, j_lo, j_hi, visible, bt_ptr, bt_stride, req,
                 SLOTS: tl.constexpr, BLOCK: tl.constexpr, PAGE: tl.constexpr):
    """A row with <= k visible columns: output slot j holds position j if j < visible, else -1 (j in [j_lo, j_hi))."""
    for j0 in range(j_lo, j_hi, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        taken = j < visible
        val = tl.where(taken, j, -1)
        if SLOTS:
            val = _slots(val, taken, bt_ptr, bt_stride, req, PAGE)
        tl.store(out_row + j, val, mask=j < j_hi)


@triton.jit
def _emit_list(list_base, length, rank, start, out_row, bt_ptr, bt_stride, req,
               SLOTS: tl.constexpr, BLOCK: tl.constexpr, PAGE: tl.constexpr):
    """Write every entry of a list of columns at output slots rank, rank + 1, ... (list order)."""
    for t0 in range(0, length, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        inside = t < length
        val = tl.load(list_base + t, mask=inside, other=0) - start
        if SLOTS:
            val = _slots(val, inside, bt_ptr, bt_stride, req, PAGE)
        tl.store(out_row + rank + t, val, mask=inside)


@triton.jit
def _emit_selected(x_row, list_base, length, thr, need_eq, gt_rank, gt_total, eq_rank, start, out_row,
                   bt_ptr, bt_stride, req, SLOTS: tl.constexpr, BLOCK: tl.constexpr, PAGE: tl.constexpr):
    """Write the list's entries > thr at output slots gt_rank, gt_rank + 1, ... and its entries == thr at
    gt_total + eq_rank, ... while eq_rank < need_eq (the ranks count earlier chunks' entries)."""
    gt_rank += tl.zeros((), tl.int32)  # loop-carried: a tensor even when a caller passes a literal 0
    eq_rank += tl.zeros((), tl.int32)
    for t0 in range(0, length, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        inside = t < length
        cols = tl.load(list_base + t, mask=inside, other=0)
        key = _order_key(tl.load(x_row + cols, mask=inside, other=0.0))
        is_gt = inside & (key > thr)
        is_eq = inside & (key == thr)
        counts = is_gt.to(tl.int32) + (is_eq.to(tl.int32) << 16)  # one scan for both ranks
        scan = tl.cumsum(counts, axis=0)
        rank_gt = gt_rank + (scan & 0xFFFF) - 1
        rank_eq = eq_rank + (scan >> 16) - 1
        take = is_gt | (is_eq & (rank_eq < need_eq))
        val = cols - start
        if SLOTS:
            val = _slots(val, take, bt_ptr, bt_stride, req, PAGE)
        tl.store(out_row + tl.where(is_gt, rank_gt, gt_total + rank_eq), val, mask=take)
        total = tl.sum(counts, axis=0)
        gt_rank += total & 0xFFFF
        eq_rank += total >> 16


# ----------------------------------------------------------------------------------------------------------------
# Path "rows": one program per row, one launch


@triton.jit
def _sample_window(x_row, start, end, SAMPLES: tl.constexpr, BLOCK: tl.constexpr):
    """(anchor key, anchor value, bin width) of the window bins, from SAMPLES tiles spread over [start, end).

    The anchor is the largest sampled non-NaN value; the bins are of equal width in VALUE, 1/32 of the samples'
    mean distance below the anchor, so the k-th largest value lands a few dozen bins down whatever the row's
    scale and sign. Bins fixed in key space (1/8 octave, the first version) failed on real indexer logits:
    where a row's k-th value is negative and its maximum positive, every key in between spans the whole range
    of tiny exponents, the k-th value fell into the catch-all last bin with most of the row, and the row cost
    3x more (measured on the H200: 65 us vs 28 us per 8K row). The estimate only moves work between the two
    passes: keys above the anchor and below the last bin have bins of their own, so the result is exact."""
    step = (end - start) // SAMPLES
    best_key = tl.zeros((BLOCK,), tl.uint32)
    best_val = tl.full((BLOCK,), float("-inf"), tl.float32)
    for i in tl.static_range(SAMPLES):
        cols = start + i * step + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < end, other=float("nan"))
        ok = x == x  # not NaN (and inside: masked lanes load NaN)
        best_key = tl.maximum(best_key, tl.where(ok, _order_key(x), tl.zeros_like(best_key)))
        best_val = tl.maximum(best_val, tl.where(ok, x, float("-inf")))
    anchor = tl.max(best_key, axis=0)
    anchor_val = tl.max(best_val, axis=0)
    gap_sum = tl.zeros((BLOCK,), tl.float32)
    finite = tl.zeros((BLOCK,), tl.int32)
    for i in tl.static_range(SAMPLES):
        cols = start + i * step + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < end, other=float("nan"))
        gap = anchor_val - x
        ok = (gap == gap) & (gap < float("inf")) & (gap > float("-inf"))
        gap_sum += tl.where(ok, gap, 0.0)
        finite += ok.to(tl.int32)
    mean_gap = tl.sum(gap_sum, axis=0) / tl.maximum(tl.sum(finite, axis=0), 1).to(tl.float32)
    width = tl.where((mean_gap > 0) & (mean_gap < float("inf")), mean_gap / 32, 1.0)
    return anchor, anchor_val, width


@triton.jit
def _window_digit(key, x, anchor, anchor_val, width, BINS: tl.constexpr):
    """Bins of descending value: 0 above the anchor (NaN included), 1..BINS-2 of ``width`` each below it, BINS-1
    for everything further down. Non-increasing in the value (float rounding is monotone), which is all the
    selection needs."""
    q = (anchor_val - x) / width
    q = tl.where(q == q, q, BINS * 1.0)  # -inf under a -inf anchor: far down
    below = (tl.minimum(tl.maximum(q, 0.0), BINS - 2.0)).to(tl.int32) + 1
    return tl.where(key > anchor, 0, below).to(tl.int32)


@triton.jit
def _topk_rows_kernel(x_ptr, x_stride, starts_ptr, ends_ptr, cand_ptr, cand_stride, sure_ptr, out_ptr,
                      bt_ptr, bt_stride, req_ptr, n_cols, k,
                      HAS_STARTS: tl.constexpr, SLOTS: tl.constexpr, HAS_REQ: tl.constexpr,
                      BLOCK: tl.constexpr, LIST_BLOCK: tl.constexpr, PAGE: tl.constexpr, SAMPLES: tl.constexpr,
                      WINDOW_BINS: tl.constexpr,
                      PDL: tl.constexpr = False):
    """One row, two passes over it:

    1. a WINDOW_BINS-bin histogram of the keys in bins below an anchor (the largest key of a few sampled
       tiles), of equal width in value set from the samples (`_sample_window`). Few bins keep ``tl.histogram`` cheap where it lowers to warp ballots (Triton <= 3.6, where it
       costs ~50 instructions per element at 128 bins, ~60-80 at 256); the bin b* holding the k-th largest
       key follows. The anchor need not be the maximum: keys above it have their own bin, and so do keys
       below the window, so the result is exact whatever the data; only the amount of work varies.
    2. compaction, in column order, of the columns in bins < b* (certainly in the top-k, fewer than k) and of
       those in bin b* (the candidates; typically a small fraction of the row).

    The exact k-th largest key T then comes from a 4-byte radix select over the candidates only, and the
    output is: the sure columns, the candidates > T, the first candidates == T (each group in column order).
    """
    wait_for_predecessor(PDL)
    row = tl.program_id(0)
    start, end = _row_window(starts_ptr, ends_ptr, row, HAS_STARTS)
    out_row = out_ptr + row.to(tl.int64) * k
    req = row
    if SLOTS:
        if HAS_REQ:
            req = tl.load(req_ptr + row)
    if end - start <= k:
        _emit_window(out_row, 0, k, end - start, bt_ptr, bt_stride, req, SLOTS, LIST_BLOCK, PAGE)
    else:
        x_row = x_ptr + row.to(tl.int64) * x_stride
        anchor, anchor_val, width = _sample_window(x_row, start, end, SAMPLES, LIST_BLOCK)
        first_tile = (start // BLOCK) * BLOCK  # aligned tiles, load mask on the row length: vector loads

        acc = tl.zeros((WINDOW_BINS,), tl.int32)
        unselected = tl.zeros((BLOCK,), tl.int32)
        for c0 in range(first_tile, end, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0)
            key = _order_key(x)
            inside = (cols >= start) & (cols < end)
            acc += _binned(_window_digit(key, x, anchor, anchor_val, width, WINDOW_BINS), inside, WINDOW_BINS)
            unselected += (~inside).to(tl.int32)
        acc = _unbin(acc, unselected, WINDOW_BINS)
        b_star = tl.sum((tl.cumsum(acc, axis=0) < k).to(tl.int32), axis=0)
        n_sure = tl.sum(tl.where(tl.arange(0, WINDOW_BINS) < b_star, acc, 0), axis=0)

        cand_base = cand_ptr + row.to(tl.int64) * cand_stride
        sure_base = sure_ptr + row.to(tl.int64) * k
        n_cand = 0
        stored_sure = 0
        for c0 in range(first_tile, end, BLOCK):
            cols = _tile_cols(c0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0)
            key = _order_key(x)
            inside = (cols >= start) & (cols < end)
            digit = _window_digit(key, x, anchor, anchor_val, width, WINDOW_BINS)
            stored_sure, n_cand = _append_two(sure_base, stored_sure, inside & (digit < b_star),
                                              cand_base, n_cand, inside & (digit == b_star), cols)
        tl.debug_barrier()  # the lists were stored by all threads; Triton orders global memory only per thread

        prefix = tl.full((), 0, tl.uint32)
        k_rem = k - n_sure
        for level in tl.static_range(4):
            acc8, above = _scan_list(x_row, cand_base, n_cand, prefix, level, LIST_BLOCK)
            digit8, k_rem = _select_bin(acc8, k_rem)
            prefix = (prefix << 8) | digit8.to(tl.uint32)
        _emit_list(sure_base, n_sure, 0, start, out_row, bt_ptr, bt_stride, req, SLOTS, LIST_BLOCK, PAGE)
        _emit_selected(x_row, cand_base, n_cand, prefix, k_rem, n_sure, k - k_rem, 0, start, out_row,
                       bt_ptr, bt_stride, req, SLOTS, LIST_BLOCK, PAGE)


# ----------------------------------------------------------------------------------------------------------------
# Path "split": several programs per row, one launch per pass


@triton.jit
def _split_prefix(hist_ptr, state_ptr, row, part, k, LEVEL: tl.constexpr):
    """The top LEVEL (>= 1) bytes of the row's k-th largest key and how many elements equal to that prefix are
    still needed. Byte LEVEL-1 comes from global histogram LEVEL-1 (complete: the pass that built it has
    ended); the earlier bytes from ``state [R, 4, 2]`` (prefix bits, k remaining), which the first program of
    each row stores for the next pass, so that a pass scans one histogram and not all of them."""
    if LEVEL == 1:
        prev = tl.full((), 0, tl.uint32)
        k_prev = k
    else:
        prev = tl.load(state_ptr + (row * 4 + LEVEL - 1) * 2).to(tl.uint32, bitcast=True)
        k_prev = tl.load(state_ptr + (row * 4 + LEVEL - 1) * 2 + 1)
    h = tl.load(hist_ptr + (row * 4 + LEVEL - 1) * 256 + tl.arange(0, 256))
    digit, k_rem = _select_bin(h, k_prev)
    prefix = (prev << 8) | digit.to(tl.uint32)
    if LEVEL < 4:
        if part == 0:
            tl.store(state_ptr + (row * 4 + LEVEL) * 2, prefix.to(tl.int32, bitcast=True))
            tl.store(state_ptr + (row * 4 + LEVEL) * 2 + 1, k_rem)
    return prefix, k_rem


@triton.jit
def _split_scan_kernel(x_ptr, x_stride, starts_ptr, ends_ptr, hist_ptr, state_ptr, list_ptr, list_len_ptr,
                       n_cols, k, chunk, num_chunks,
                       LEVEL: tl.constexpr, HAS_STARTS: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = False):
    """Passes 1-3 over (row, chunk): histogram LEVEL into the global buffer; pass 3 also writes the chunk's
    list (at its slice of the row's list) and its length."""
    wait_for_predecessor(PDL)
    row = tl.program_id(0)
    part = tl.program_id(1)
    start, end = _row_window(starts_ptr, ends_ptr, row, HAS_STARTS)
    if end - start > k:  # shorter rows take everything: no selection
        prefix = tl.full((), 0, tl.uint32)
        if LEVEL > 0:
            prefix, k_rem = _split_prefix(hist_ptr, state_ptr, row, part, k, LEVEL)
        list_base = list_ptr + row.to(tl.int64) * num_chunks * chunk + part * chunk
        acc, kept = _scan_columns(x_ptr + row.to(tl.int64) * x_stride, n_cols,
                                  tl.maximum(start, part * chunk), tl.minimum(end, part * chunk + chunk),
                                  prefix, list_base, LEVEL, BLOCK)
        tl.atomic_add(hist_ptr + (row * 4 + LEVEL) * 256 + tl.arange(0, 256), acc, mask=acc > 0, sem="relaxed")
        if LEVEL == 2:
            tl.store(list_len_ptr + row * num_chunks + part, kept)


@triton.jit
def _split_list_kernel(x_ptr, x_stride, starts_ptr, ends_ptr, hist_ptr, state_ptr, list_ptr, list_len_ptr,
                       above_ptr, suffix_ptr, k, chunk, num_chunks,
                       HAS_STARTS: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = False):
    """Pass 4 over the chunk's list: histogram of the last byte; per chunk, the entries above T's 24-bit prefix
    and the suffix sums of the byte histogram (what the output pass needs to rank across chunks)."""
    wait_for_predecessor(PDL)
    row = tl.program_id(0)
    part = tl.program_id(1)
    start, end = _row_window(starts_ptr, ends_ptr, row, HAS_STARTS)
    if end - start > k:
        prefix, k_rem = _split_prefix(hist_ptr, state_ptr, row, part, k, 3)
        acc, above = _scan_list(x_ptr + row.to(tl.int64) * x_stride,
                                list_ptr + row.to(tl.int64) * num_chunks * chunk + part * chunk,
                                tl.load(list_len_ptr + row * num_chunks + part), prefix, 3, BLOCK)
        bins = tl.arange(0, 256)
        tl.atomic_add(hist_ptr + (row * 4 + 3) * 256 + bins, acc, mask=acc > 0, sem="relaxed")
        suffix = tl.sum(acc, axis=0) - tl.cumsum(acc, axis=0) + acc
        tl.store(suffix_ptr + (row * num_chunks + part).to(tl.int64) * 256 + bins, suffix)
        tl.store(above_ptr + row * num_chunks + part, above)


@triton.jit
def _split_output_kernel(x_ptr, x_stride, starts_ptr, ends_ptr, hist_ptr, state_ptr, list_ptr, list_len_ptr,
                         above_ptr, suffix_ptr, out_ptr, bt_ptr, bt_stride, req_ptr, k, chunk, num_chunks,
                         HAS_STARTS: tl.constexpr, SLOTS: tl.constexpr, HAS_REQ: tl.constexpr,
                         CHUNKS_POW2: tl.constexpr, BLOCK: tl.constexpr, PAGE: tl.constexpr,
                         PDL: tl.constexpr = False):
    """Pass 5: write the row's k indices; short rows are written by all programs of the row, k / chunks each."""
    wait_for_predecessor(PDL)
    row = tl.program_id(0)
    part = tl.program_id(1)
    start, end = _row_window(starts_ptr, ends_ptr, row, HAS_STARTS)
    out_row = out_ptr + row.to(tl.int64) * k
    req = row
    if SLOTS:
        if HAS_REQ:
            req = tl.load(req_ptr + row)
    if end - start <= k:
        per = tl.cdiv(k, num_chunks)
        _emit_window(out_row, part * per, tl.minimum(k, part * per + per), end - start, bt_ptr, bt_stride, req,
                     SLOTS, BLOCK, PAGE)
    else:
        thr, need_eq = _split_prefix(hist_ptr, state_ptr, row, part, k, 4)
        low = (thr & 255).to(tl.int32)
        # Per chunk: entries > T (above the 24-bit prefix, or on it with a larger last byte) and == T.
        parts = tl.arange(0, CHUNKS_POW2)
        part_ok = parts < num_chunks
        sfx = suffix_ptr + (row * num_chunks + parts).to(tl.int64) * 256
        ge = tl.load(sfx + low, mask=part_ok, other=0)
        gt_low = tl.load(sfx + tl.minimum(low + 1, 255), mask=part_ok, other=0)
        gt_low = tl.where(low < 255, gt_low, 0)  # no bin above 255
        gt = tl.load(above_ptr + row * num_chunks + parts, mask=part_ok, other=0) + gt_low
        before = parts < part
        _emit_selected(x_ptr + row.to(tl.int64) * x_stride,
                       list_ptr + row.to(tl.int64) * num_chunks * chunk + part * chunk,
                       tl.load(list_len_ptr + row * num_chunks + part), thr, need_eq,
                       tl.sum(tl.where(before, gt, 0), axis=0), k - need_eq,
                       tl.sum(tl.where(before, ge - gt_low, 0), axis=0), start, out_row,
                       bt_ptr, bt_stride, req, SLOTS, BLOCK, PAGE)


# ----------------------------------------------------------------------------------------------------------------
# Host side


# Cost model behind the path choice, from instruction counts of the sm90 code Triton 3.6 generates (about 130
# instructions per column for the rows path's two passes, 280 for the split path's three, where tl.histogram
# lowers to warp ballots) at ~4 warp instructions per clock per SM and 1.75 GHz, plus fixed latencies
# (one launch vs a memset and five launches). Estimates, not measurements: the benchmark's --sweep checks them.
def _rows_path_us(rows: int, cols: int, sms: int) -> float:
    waves = triton.cdiv(rows, sms)  # one 16-warp program per SM
    return waves * cols * (130 / 32 / 4) / 1750 + 3.0


def _split_path_us(rows: int, cols: int, sms: int) -> float:
    return rows * cols * (280 / 32 / 4) / (sms * 1750) + 12.0


def _topk_config(rows: int, cols: int, device: torch.device) -> dict:
    """Path, tile and split: a pure function of the shapes (graph-capturable)."""
    on_gpu = device.type == "cuda"
    sms = sm_count(device)
    if on_gpu:
        path = "rows" if _rows_path_us(rows, cols, sms) <= _split_path_us(rows, cols, sms) else "split"
    else:  # the interpreter: tiny tiles; tests force each path with config_override
        path = "rows" if cols <= 1024 or rows >= sms else "split"
    path = _OVERRIDE.get("path", path)
    if path == "rows":
        # 16 columns per thread (four 16-byte loads in flight) amortize tl.histogram's per-call work.
        block = min(8192, max(2048, next_pow2(cols))) if on_gpu else 256
        num_warps = max(4, min(16, block // 512))
    else:
        block = (2048 if cols > 16384 else 1024) if on_gpu else 256
        num_warps = max(4, min(16, block // 256))  # 8 columns per thread: many programs per SM
    block = _OVERRIDE.get("block", block)
    num_warps = num_warps if on_gpu else 4
    cfg = dict(path=path, block=block, num_warps=_OVERRIDE.get("num_warps", num_warps), split=1, chunk=cols,
               list_block=1024 if on_gpu else 64)
    if path == "split":
        tiles = triton.cdiv(max(cols, 1), block)
        split = _OVERRIDE.get("split", triton.cdiv(8 * sms if on_gpu else 4, rows))
        split = max(1, min(tiles, split, 256))
        cfg["chunk"] = triton.cdiv(tiles, split) * block
        cfg["split"] = triton.cdiv(max(cols, 1), cfg["chunk"])
    return cfg


def topk_indices(logits: torch.Tensor, k: int, ends: torch.Tensor, starts: torch.Tensor | None = None,
                 block_table: torch.Tensor | None = None, row_request: torch.Tensor | None = None, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [R, k]: the k largest of each row within [starts, ends) (see the module docstring). ``out``: the
    caller's contiguous int32 [R, k] buffer the kernels write (row r at ``out + r * k``, every element), returned."""
    rows, cols = logits.shape
    device = logits.device
    if out is None:
        out = torch.empty((rows, k), dtype=torch.int32, device=device)
    if rows == 0:
        return out
    if cols == 0:
        return out.fill_(-1)
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    x = x if x.dtype == torch.float32 else x.float()
    ends = ends.contiguous()
    cfg = _topk_config(rows, cols, device)
    has_starts = starts is not None
    starts_arg = starts.contiguous() if has_starts else ends
    slots = block_table is not None
    bt = block_table if slots else out
    if slots and bt.stride(-1) != 1:
        bt = bt.contiguous()
    req = row_request.contiguous() if row_request is not None else ends
    flags = dict(HAS_STARTS=has_starts, BLOCK=cfg["block"], num_warps=cfg["num_warps"], **pdl_options(device))
    out_flags = dict(SLOTS=slots, HAS_REQ=row_request is not None, PAGE=PAGE_SIZE)

    if cfg["path"] == "rows":
        cand = torch.empty((rows, cols), dtype=torch.int32, device=device)
        sure = torch.empty((rows, k), dtype=torch.int32, device=device)
        _topk_rows_kernel[(rows,)](x, x.stride(0), starts_arg, ends, cand, cols, sure, out, bt, bt.stride(0), req,
                                   cols, k, LIST_BLOCK=cfg["list_block"], SAMPLES=8, WINDOW_BINS=128,
                                   **flags, **out_flags)
        return out

    split, chunk = cfg["split"], cfg["chunk"]
    hist = torch.zeros((rows, _LEVELS, _BINS), dtype=torch.int32, device=device)
    state = torch.empty((rows, _LEVELS, 2), dtype=torch.int32, device=device)  # prefix bits, k remaining
    counters = torch.empty((2, rows, split), dtype=torch.int32, device=device)  # list lengths, above-prefix
    suffix = torch.empty((rows, split, _BINS), dtype=torch.int32, device=device)
    lists = torch.empty((rows, split * chunk), dtype=torch.int32, device=device)
    grid = (rows, split)
    for level in range(3):
        _split_scan_kernel[grid](x, x.stride(0), starts_arg, ends, hist, state, lists, counters[0], cols, k, chunk,
                                 split, LEVEL=level, **flags)
    _split_list_kernel[grid](x, x.stride(0), starts_arg, ends, hist, state, lists, counters[0], counters[1], suffix,
                             k, chunk, split, **flags)
    _split_output_kernel[grid](x, x.stride(0), starts_arg, ends, hist, state, lists, counters[0], counters[1],
                               suffix, out, bt, bt.stride(0), req, k, chunk, split,
                               CHUNKS_POW2=next_pow2(split), **flags, **out_flags)
    return out


def lightning_indexer(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor,
                      block_table: torch.Tensor, max_context_len: int, k: int, return_slots: bool = False, *,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Paged logits, then the top-k of each row over its context: int32 [B * next_n, k] request-local positions
    (or cache slots with ``return_slots``), written into ``out`` if given."""
    logits = paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len)
    if not return_slots:
        return topk_indices(logits, k, context_lens.reshape(-1), out=out)
    from ...contract.cache import decode_row_requests as _row_requests

    return topk_indices(logits, k, context_lens.reshape(-1), None, block_table,
                        _row_requests(q.shape[0], q.shape[1], q.device), out=out)
