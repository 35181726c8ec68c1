"""Fused ragged (prefill) logits + exact top-k in Triton: the [S, N] logits never go to HBM.

``fused_ragged_topk(q, k, k_scales, weights, ks, ke, topk)`` returns exactly
``reference.topk_indices(triton.logits.ragged_mqa_logits(q, k, k_scales, weights, ks, ke), topk, ke, ks)``: per row
the ``topk`` largest logits among columns [ks, ke), as positions relative to ks, in the reference's order (value
descending, ties to the lower column; a NaN logit counts as the largest, -0.0 equals +0.0), -1 padded when the row
has fewer than ``topk`` columns. The logits are the Triton ragged kernel's own, bit for bit: the key-block loop
below is that kernel's arithmetic with the same tiles (taken from its config), so near-ties cannot resolve
differently than in the unfused path. (Against the pure-torch logits the results can differ at near-ties, as the
Triton logits themselves do: different fp32 accumulation order, and on Hopper an fp8 MMA that accumulates with
fewer mantissa bits.)

Design (exact; three launches per row chunk, then one host sync):

1. ``_threshold_kernel``: one program owns BLOCK_M query rows (BLOCK_M * H = 128 MMA columns: the logits kernel's
   tile) and, for rows wider than the take-all width (see 2), samples their key blocks with a stride R (default 64,
   smaller for short windows so that a row sees >= 8 sampled blocks): a sparser sample (every 4R-th block) gives
   each row the mean and standard deviation of its logits (per-block moments merged by Chan's formula, so a large
   common offset does not cancel); the R-strided sample fills a per-row 256-bin histogram in VALUE bins of width
   std/16 from mean - 2 std up (one ``tl.histogram`` over the flattened row * 256 + bin). tau = the lower edge of
   the highest bin such that the sample holds >= target * (sampled / visible) values at or above it: the row is
   then expected to keep ``target`` candidates. Value bins (not float-key bins) stay sharp when the logits sit at
   a large offset from 0 relative to their spread. Other rows get tau = -inf (take every column).
2. ``_candidates_kernel``: the same programs walk every key block of their rows' windows in key order (the real
   cost: one MMA pass, as in the unfused logits kernel) and keep the columns with value >= tau (NaN counts as -inf) as
   int64 sort keys ``(~order_key(value) as signed 32 bits) << 32 | column`` (ascending key = the reference
   order). Appending without any communication between threads: key offset j of a block (0 <= j < BLOCK_N) goes
   to the row's sub-buffer j (slots j, j + BLOCK_N, j + 2 BLOCK_N, ... of the row's C = CJ * BLOCK_N), with a
   per-thread counter [BLOCK_N, BLOCK_M] that keeps counting past CJ. (A scan over the block's keys crosses warps:
   barriers in the MMA loop; that version ran at 2.7x the logits kernel on the H200, this one at 1.2x.) Rows of
   width <= (CJ - 1) * BLOCK_N touch at most CJ blocks, so they keep every column and never overflow.
3. ``_finish_kernel``, one program per row. The row is exact when no sub-buffer overflowed and it kept >= topk
   candidates or all of its columns: then tau <= the row's topk-th value, every member of the true top-k is a
   candidate and every column left out is strictly below it. The buffer is not in column order, so the
   selection is on the full, unique sort key: a radix select of the k-th smallest high word (four 256-bin
   histogram passes), and, only where ties at that value straddle the cut, a second radix select on the column
   among them (the lowest columns win). The k selected keys go to a [S, pow2(topk)] scratch row (INT64_MAX
   padded), which ``tl.sort`` orders in the same program (``sort="torch"``: ``torch.sort`` afterwards); the
   output is the low 32 bits of each key (-1 for padding).
4. Rows that overflowed or kept fewer than topk candidates (a threshold estimate off by ~2x) are recomputed with
   the unfused Triton path (ragged logits of their BLOCK_M-aligned row blocks, so their logits are bit-identical
   too, then the Triton top-k set, then the reference order): correct but slow; ``stats["fallback_rows"]``.

Cost: for rows wider than the take-all width, (1 + 1/R + 1/(4R)) MMA passes over the program's key range (the
sampled blocks cost ~5x a plain one: histogram and cross-warp reductions); other rows one pass. Then the finish:
~5 passes over the ~1.6 * topk candidates of a row (up to C for take-all rows) and one sort of topk keys. The
unfused path: one MMA pass + an [S, N] fp32 write + the top-k's passes over it. Memory: S x (C + pow2(topk)) x 8
bytes, processed in row chunks under ``budget_bytes``, instead of S x N x 4 bytes of logits (plus the Triton
top-k's scratch of the same size). On the H200 (Triton 3.6; ``benchmarks/bench_fused_prefill.py``): for a 128K-token
causal prefill, the set-only variant beat logits + Triton top-k in time and the ordered one about matched it.

Not graph-capturable (the fallback check is a host sync). The key axis is not split over programs: with few
rows (S / BLOCK_M programs below the SM count) and very long windows the GPU is underused. Candidates whose
keys share an offset modulo BLOCK_N fill one sub-buffer: data with such a period overflows (falls back) sooner.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...contract import validate as v
from ...contract.cache import HEAD_DIM
from .logits import next_pow2, ragged_config, ragged_key_logits, ragged_q_tile
from .logits import ragged_mqa_logits as _triton_ragged_logits
from .topk import topk_indices as _triton_topk_indices

_INT64_MAX = (1 << 63) - 1
_NBINS = 256          # histogram bins per row
_BINS_PER_STD = 16.0  # bin width = std / 16
_LOW_STDS = 2.0       # the bins start 2 std below the mean
_STAT_EVERY = 4       # the moments' sample is every (4 R)-th block
_MIN_SAMPLE_BLOCKS = 8
_FALLBACK_BUDGET = 256 << 20  # fp32 logits per chunk of the fallback (the Triton top-k adds as much scratch)
_CAND_LAUNCH: dict = {}  # extra launch options of the candidates kernel (tuning experiments, e.g. maxnreg)


# ----------------------------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _value_order_key(x):
    """fp32 -> uint32 with the float order (-0.0 equal to +0.0; callers map NaN to -inf first)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = tl.where(bits == 0x80000000, tl.zeros_like(bits), bits)  # -0.0 -> +0.0
    neg = (bits >> 31) == 1
    key = tl.where(neg, ~bits, bits | 0x80000000)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, tl.full(bits.shape, 0xFFFFFFFF, tl.uint32), key)


@triton.jit
def _row_block_setup(q_ptr, w_ptr, ks_ptr, ke_ptr, S, N, H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """The program's rows (heaviest, i.e. latest in a causal prefill, first), their windows, the block-aligned
    start of the union of the windows, and the q tile and head weights as the logits kernel lays them out."""
    row_block = tl.cdiv(S, BLOCK_M) - 1 - tl.program_id(0)
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < S
    ks = tl.load(ks_ptr + rows, mask=row_ok, other=0)
    ke = tl.load(ke_ptr + rows, mask=row_ok, other=0)
    nonempty = row_ok & (ke > ks)
    width_row = tl.where(nonempty, ke - ks, 0)
    lo_key = tl.min(tl.where(nonempty, ks, N), axis=0)
    hi_key = tl.max(tl.where(nonempty, ke, 0), axis=0)
    c_start = (lo_key // BLOCK_N) * BLOCK_N  # as in the logits kernel; no window: lo_key = N > hi_key = 0

    q_t, w, offs_d = ragged_q_tile(q_ptr, w_ptr, row_block, S, H, D, BLOCK_M)
    return rows, row_ok, ks, ke, width_row, c_start, hi_key, q_t, w, offs_d


@triton.jit
def _threshold_kernel(q_ptr, k_ptr, k_scale_ptr, w_ptr, ks_ptr, ke_ptr, tau_ptr,
                      S, N, long_width, target, max_stride,
                      H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      NBINS: tl.constexpr, BINS_PER_STD: tl.constexpr, LOW_STDS: tl.constexpr,
                      STAT_EVERY: tl.constexpr, MIN_SAMPLE_BLOCKS: tl.constexpr):
    """Per row: tau, from a strided sample of its key blocks (rows wider than long_width; -inf for the others)."""
    rows, row_ok, ks, ke, width_row, c_start, hi_key, q_t, w, offs_d = _row_block_setup(
        q_ptr, w_ptr, ks_ptr, ke_ptr, S, N, H, D, BLOCK_M, BLOCK_N)
    offs_n = tl.arange(0, BLOCK_N)
    tau = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    long_row = width_row > long_width
    if tl.max(long_row.to(tl.int32), axis=0) > 0:
        n_blocks = tl.cdiv(hi_key - c_start, BLOCK_N)
        stride = tl.minimum(tl.maximum(n_blocks // MIN_SAMPLE_BLOCKS, 1), max_stride)

        # Moments of each row's visible finite logits over a sparse sample of blocks.
        cnt = tl.zeros((BLOCK_M,), tl.float32)
        mean = tl.zeros((BLOCK_M,), tl.float32)
        m2 = tl.zeros((BLOCK_M,), tl.float32)
        for n0 in range(c_start, hi_key, stride * (STAT_EVERY * BLOCK_N)):
            keys, logits = ragged_key_logits(k_ptr, k_scale_ptr, q_t, w, n0, N, offs_n, offs_d, H, D, BLOCK_M, BLOCK_N)
            use = (keys[:, None] >= ks[None, :]) & (keys[:, None] < ke[None, :]) & (tl.abs(logits) < float("inf"))
            nb = tl.sum(use.to(tl.float32), axis=0)
            mb = tl.sum(tl.where(use, logits, 0.0), axis=0) / tl.maximum(nb, 1.0)
            dev = tl.where(use, logits - mb[None, :], 0.0)
            m2b = tl.sum(dev * dev, axis=0)
            tot = cnt + nb
            frac = nb / tl.maximum(tot, 1.0)
            delta = mb - mean
            mean = mean + delta * frac
            m2 = m2 + m2b + delta * delta * cnt * frac
            cnt = tot
        std = tl.sqrt(m2 / tl.maximum(cnt, 1.0))
        std = tl.where((std > 0.0) & (std < float("inf")), std, 1.0)
        mean = tl.where(tl.abs(mean) < float("inf"), mean, 0.0)
        bin_w = std / BINS_PER_STD
        inv_w = BINS_PER_STD / std
        lo = mean - LOW_STDS * std

        # Per-row histogram of a denser sample in value bins [lo + b * bin_w, +bin_w); below lo -> bin 0, above
        # the last bin -> the last bin. Columns a row may not see land in its bin 0, which is never selected.
        hist = tl.zeros((BLOCK_M * NBINS,), tl.int32)
        n_s = tl.zeros((BLOCK_M,), tl.float32)
        row_bins = (tl.arange(0, BLOCK_M) * NBINS)[None, :]
        for n0 in range(c_start, hi_key, stride * BLOCK_N):
            keys, logits = ragged_key_logits(k_ptr, k_scale_ptr, q_t, w, n0, N, offs_n, offs_d, H, D, BLOCK_M, BLOCK_N)
            use = (keys[:, None] >= ks[None, :]) & (keys[:, None] < ke[None, :]) & (logits == logits)
            pos = (logits - lo[None, :]) * inv_w[None, :]
            pos = tl.minimum(tl.maximum(pos, 0.0), NBINS - 1.0)
            b = tl.where(use, pos.to(tl.int32), 0) + row_bins
            hist += tl.histogram(tl.reshape(b, (BLOCK_N * BLOCK_M,)), BLOCK_M * NBINS)
            n_s += tl.sum(use.to(tl.float32), axis=0)
        h2 = tl.reshape(hist, (BLOCK_M, NBINS))
        ge = tl.sum(h2, axis=1)[:, None] - tl.cumsum(h2, axis=1) + h2  # sampled values in bins >= b
        want = target * n_s / tl.maximum(width_row.to(tl.float32), 1.0)
        b_star = tl.sum((ge.to(tl.float32) >= want[:, None]).to(tl.int32), axis=1) - 1
        tau = tl.where(long_row & (n_s > 0.0) & (b_star > 0), lo + b_star.to(tl.float32) * bin_w, tau)
    tl.store(tau_ptr + rows, tau, mask=row_ok)


@triton.jit
def _candidates_kernel(q_ptr, k_ptr, k_scale_ptr, w_ptr, ks_ptr, ke_ptr, tau_ptr, cand_ptr, sub_ptr, S, N, CJ,
                       H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Every key block of the program's rows: the (value, column) sort keys with value >= tau (or NaN).

    Key offset j of a block appends to the row's sub-buffer j (entries j, j + BLOCK_N, j + 2 BLOCK_N, ...) with a
    counter of its own: no communication between threads in this loop (a scan over the block's keys would cross
    warps: barriers in the MMA loop). The counters go on past the CJ slots (overflow: the row is recomputed)."""
    rows, row_ok, ks, ke, width_row, c_start, hi_key, q_t, w, offs_d = _row_block_setup(
        q_ptr, w_ptr, ks_ptr, ke_ptr, S, N, H, D, BLOCK_M, BLOCK_N)
    offs_n = tl.arange(0, BLOCK_N)
    tau = tl.load(tau_ptr + rows, mask=row_ok, other=float("-inf"))
    sub_count = tl.zeros((BLOCK_N, BLOCK_M), tl.int32)
    cand_rows = cand_ptr + rows.to(tl.int64) * CJ * BLOCK_N
    for n0 in range(c_start, hi_key, BLOCK_N):
        keys, logits = ragged_key_logits(k_ptr, k_scale_ptr, q_t, w, n0, N, offs_n, offs_d, H, D, BLOCK_M, BLOCK_N)
        visible = (keys[:, None] >= ks[None, :]) & (keys[:, None] < ke[None, :])
        logits = tl.where(logits != logits, float("-inf"), logits)  # the NaN rule: a NaN score ranks as -inf
        keep = visible & (logits >= tau[None, :])
        okey = _value_order_key(logits).to(tl.int64)
        sort_key = ((0x7FFFFFFF - okey) << 32) | (keys[:, None] - ks[None, :]).to(tl.int64)
        tl.store(cand_rows[None, :] + (sub_count * BLOCK_N + offs_n[:, None]), sort_key,
                 mask=keep & (sub_count < CJ))
        sub_count += keep.to(tl.int32)
    tl.store(sub_ptr + rows.to(tl.int64)[None, :] * BLOCK_N + offs_n[:, None], sub_count, mask=row_ok[None, :])


@triton.jit
def _rank_word(sort_key):
    """The high word of a sort key as an unsigned rank in [0, 2**32): smaller = larger logit."""
    return (sort_key >> 32) + (tl.full((), 1, tl.int64) << 31)


@triton.jit
def _radix_select(cand_row, sub, n_slots, k_rem, eq_word, FIELD: tl.constexpr, BLOCK_N: tl.constexpr,
                  SUB: tl.constexpr):
    """The k_rem-th smallest 32-bit field among a row's valid candidates, one byte per pass (4 passes of a 256-bin
    histogram; entries not matching the bytes chosen so far count in bin 0 and are taken out once per pass).
    FIELD 0: the rank word, over every candidate; FIELD 1: the column, over the candidates whose rank word is
    ``eq_word``. Returns (the field value, how many entries equal to it are still needed, how many equal it)."""
    bins = tl.arange(0, 256)
    offs_j = tl.arange(0, BLOCK_N)[None, :]
    offs_s = tl.arange(0, SUB)[:, None]
    prefix = tl.full((), 0, tl.int64)
    n_eq = tl.zeros((), tl.int32)
    for level in tl.static_range(4):
        acc = tl.zeros((256,), tl.int32)
        unmatched = tl.zeros((SUB * BLOCK_N,), tl.int32)
        for s0 in range(0, n_slots, SUB):
            slot = s0 + offs_s
            match = slot < sub[None, :]
            key = tl.load(cand_row + slot * BLOCK_N + offs_j, mask=match, other=0)
            if FIELD == 0:
                field = _rank_word(key)
            else:
                field = key & 0xFFFFFFFF
                match = match & (_rank_word(key) == eq_word)
            if level > 0:
                match = match & ((field >> (32 - 8 * level)) == prefix)
            digit = ((field >> (24 - 8 * level)) & 255).to(tl.int32)
            acc += tl.histogram(tl.reshape(tl.where(match, digit, 0), (SUB * BLOCK_N,)), 256)
            unmatched += tl.reshape((~match).to(tl.int32), (SUB * BLOCK_N,))
        acc -= tl.where(bins == 0, tl.sum(unmatched, axis=0), 0)
        digit_k = tl.sum((tl.cumsum(acc, axis=0) < k_rem).to(tl.int32), axis=0)
        k_rem -= tl.sum(tl.where(bins < digit_k, acc, 0), axis=0)
        n_eq = tl.sum(tl.where(bins == digit_k, acc, 0), axis=0)
        prefix = (prefix << 8) | digit_k.to(tl.int64)
    return prefix, k_rem, n_eq


@triton.jit
def _finish_kernel(cand_ptr, sub_ptr, keys_ptr, out_ptr, CJ, k,
                   BLOCK_N: tl.constexpr, SUB: tl.constexpr, TOPK_P2: tl.constexpr, PAD_BLOCK: tl.constexpr,
                   WRITE: tl.constexpr, SORT: tl.constexpr):
    """One program per row: the k smallest sort keys among the row's candidates (all of them when there are at
    most k) into keys [S, TOPK_P2] (INT64_MAX padded); with WRITE, their low words (sorted with SORT) into
    out [S, k]. Sort keys are unique (they hold the column), so the selection does not depend on where in the
    buffer a candidate sits."""
    row = tl.program_id(0)
    offs_j = tl.arange(0, BLOCK_N)
    sub = tl.load(sub_ptr + row.to(tl.int64) * BLOCK_N + offs_j)
    overflow = tl.max(sub, axis=0) > CJ  # the caller recomputes such a row: write padding only
    n_slots = tl.where(overflow, 0, tl.max(sub, axis=0))
    total = tl.where(overflow, 0, tl.sum(sub, axis=0))
    cand_row = cand_ptr + row.to(tl.int64) * CJ * BLOCK_N
    keys_row = keys_ptr + row.to(tl.int64) * TOPK_P2

    # Take the keys (word, column) with word < u_star, or word == u_star and column <= c_star.
    u_star = tl.full((), 1, tl.int64) << 32  # above every word: take everything
    c_star = tl.full((), 0x7FFFFFFF, tl.int64)
    if total > k:
        u_star, k_rem, n_eq = _radix_select(cand_row, sub, n_slots, k + tl.zeros((), tl.int32), u_star, 0,
                                            BLOCK_N, SUB)
        if n_eq > k_rem:  # ties at the k-th value straddle the cut: the lowest columns among them
            c_star, k_rem2, n_eq2 = _radix_select(cand_row, sub, n_slots, k_rem, u_star, 1, BLOCK_N, SUB)
    offs_s = tl.arange(0, SUB)[:, None]
    n_out = tl.zeros((), tl.int32)
    for s0 in range(0, n_slots, SUB):
        slot = s0 + offs_s
        valid = slot < sub[None, :]
        key = tl.load(cand_row + slot * BLOCK_N + offs_j[None, :], mask=valid, other=0)
        word = _rank_word(key)
        take = valid & ((word < u_star) | ((word == u_star) & ((key & 0xFFFFFFFF) <= c_star)))
        take = tl.reshape(take, (SUB * BLOCK_N,))
        rank = n_out + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(keys_row + rank, tl.reshape(key, (SUB * BLOCK_N,)), mask=take)
        n_out += tl.sum(take.to(tl.int32), axis=0)
    for j0 in range(0, TOPK_P2, PAD_BLOCK):
        j = j0 + tl.arange(0, PAD_BLOCK)
        tl.store(keys_row + j, tl.full((PAD_BLOCK,), 0x7FFFFFFFFFFFFFFF, tl.int64), mask=(j >= n_out) & (j < TOPK_P2))
    if WRITE:
        tl.debug_barrier()  # the scratch row was written by all threads of the program
        j = tl.arange(0, TOPK_P2)
        found = tl.load(keys_row + j)
        if SORT:
            found = tl.sort(found)
        # The low word is the column (INT64_MAX padding -> 0xFFFFFFFF = -1).
        tl.store(out_ptr + row.to(tl.int64) * k + j, found.to(tl.int32), mask=j < k)


# ----------------------------------------------------------------------------------------------------------------
# Host side


def _keys_to_indices(keys: torch.Tensor, topk: int) -> torch.Tensor:
    """Sorted int64 sort keys -> int32 positions (the low word; INT64_MAX padding -> -1)."""
    low = keys[:, :topk] & 0xFFFFFFFF
    return torch.where(low == 0xFFFFFFFF, torch.full_like(low, -1), low).to(torch.int32)


def _torch_sort_keys(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64 sort keys of (value, position) pairs, ascending = value descending then position ascending, with the
    float order of ``torch.sort`` (NaN largest, -0.0 == +0.0). Positions < 0 become INT64_MAX (padding)."""
    bits = values.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    bits = torch.where(bits == 0x80000000, torch.zeros_like(bits), bits)
    okey = torch.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits + 0x80000000)
    okey = torch.where((bits & 0x7FFFFFFF) > 0x7F800000, torch.full_like(okey, 0xFFFFFFFF), okey)
    keys = ((0x7FFFFFFF - okey) << 32) | positions.long().clamp_min(0)
    return torch.where(positions >= 0, keys, torch.full_like(keys, _INT64_MAX))


def _unfused_rows(q, k, k_scales, weights, ks, ke, topk: int, rows: torch.Tensor, block_m: int,
                  budget_bytes: int) -> torch.Tensor:
    """The reference result of ``rows`` (sorted, unique, int64) by the unfused Triton path: logits of the
    BLOCK_M-aligned row blocks holding them (the same row grouping as a full-size logits call, hence bit-identical
    logits), the Triton top-k set, then the reference order."""
    s = q.shape[0]
    n = k.shape[0]
    blocks = torch.unique(rows // block_m)
    full = (blocks[:, None] * block_m + torch.arange(block_m, device=rows.device)[None, :]).reshape(-1)
    full = full[full < s]  # only the last block can be partial, and it comes last: the alignment holds
    per_chunk = max(block_m, (budget_bytes // max(1, 4 * n)) // block_m * block_m)
    result = torch.empty((full.numel(), topk), dtype=torch.int32, device=q.device)
    for c0 in range(0, full.numel(), per_chunk):
        sel = full[c0:c0 + per_chunk]
        sks, ske = ks[sel], ke[sel]
        logits = _triton_ragged_logits(q[sel], k, k_scales, weights[sel], sks, ske)
        idx = _triton_topk_indices(logits, topk, ske, sks)
        vals = logits.gather(1, (idx.long() + sks[:, None].long()).clamp(0, max(n - 1, 0)))
        keys = torch.sort(_torch_sort_keys(vals, idx), dim=1).values
        result[c0:c0 + sel.numel()] = _keys_to_indices(keys, topk)
        del logits
    pick = torch.searchsorted(full, rows)
    return result[pick]


def fused_ragged_topk(q_fp8: torch.Tensor, k_fp8: torch.Tensor, k_scales: torch.Tensor, weights: torch.Tensor,
                      ks: torch.Tensor, ke: torch.Tensor, topk: int, *, capacity: int | None = None,
                      target: float | None = None, sample_stride: int | None = None,
                      budget_bytes: int = 1 << 30, sort: str = "kernel", stats: dict | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [S, topk]: ``reference.topk_indices(ragged_mqa_logits(q, k, k_scales, weights, ks, ke), topk, ke, ks)``
    with the Triton logits, computed without materializing them (see the module docstring).

    q [S, H, 128] fp8, k [N, 128] fp8 (same dtype), k_scales [N] f32, weights [S, H] f32, ks/ke [S] int32 with
    0 <= ks <= ke <= N (rows with ke <= ks see nothing).

    * ``capacity``: candidate slots per row (default 4 * topk; rounded up to a multiple of the key block). Any
      value >= 1 is exact; a small one only sends more rows to the fallback.
    * ``target``: the candidates a long row is expected to keep (default sqrt(topk * 0.65 * capacity), at least
      topk: ~3300 for topk 2048).
    * ``sample_stride``: R, the largest sampling stride in key blocks (default 64 on a GPU, 4 in the interpreter).
    * ``budget_bytes``: the candidate and key scratch of one pass stays under it (the rows go in chunks).
    * ``sort``: ``"kernel"`` (``tl.sort`` in the finish kernel), ``"torch"`` (``torch.sort`` of the scratch), or
      ``"none"``: the top-k SET only, in no documented order (like ``ops.topk_indices``), without the sort.
    * ``stats``: if a dict, filled with rows, long_rows (rows that took a sampled threshold), fallback_rows,
      candidates_max / candidates_mean (over long rows), capacity.
    * ``out``: an optional contiguous int32 [S, topk] tensor for the result (every element is written).
    """
    v.tensor("q_fp8", q_fp8, dtype=v.FP8_DTYPES, ndim=3)
    s, heads, dim = q_fp8.shape
    device = q_fp8.device
    v.tensor("k_fp8", k_fp8, dtype=q_fp8.dtype, shape=(None, dim), device=device)
    n = k_fp8.shape[0]
    v.tensor("k_scales", k_scales, dtype=torch.float32, shape=(n,), device=device)
    v.tensor("weights", weights, dtype=torch.float32, shape=(s, heads), device=device)
    v.tensor("ks", ks, dtype=torch.int32, shape=(s,), device=device)
    v.tensor("ke", ke, dtype=torch.int32, shape=(s,), device=device)
    v.positive_int("topk", topk)
    if dim != HEAD_DIM or heads < 1 or heads & (heads - 1):
        raise v.IndexerInputError(f"fused_ragged_topk takes D={HEAD_DIM} and a power-of-two head count, "
                                  f"got H={heads}, D={dim}")
    cap = 4 * topk if capacity is None else v.positive_int("capacity", capacity)
    if sort not in ("kernel", "torch", "none"):
        raise v.IndexerInputError(f"sort must be 'kernel', 'torch' or 'none', got {sort!r}")
    if out is None:
        out = torch.empty((s, topk), dtype=torch.int32, device=device)
    else:
        v.tensor("out", out, dtype=torch.int32, shape=(s, topk), device=device, contiguous=True)
    st = {"rows": s, "long_rows": 0, "fallback_rows": 0, "candidates_max": 0, "candidates_mean": 0.0,
          "capacity": cap}
    if stats is not None:
        stats.update(st)
    if s == 0:
        return out
    if n == 0:
        return out.fill_(-1)

    on_gpu = device.type == "cuda"
    cfg = ragged_config(s, n, heads, device)  # the logits kernel's tiles: bit-identical logits
    block_m, block_n = cfg["block_m"], cfg["block_n"]
    # CJ slots in each of the BLOCK_N sub-buffers of a row. A row of width <= (CJ - 1) * BLOCK_N touches at most
    # CJ key blocks, so it keeps every column without overflow; wider rows take a sampled threshold.
    cj = min(triton.cdiv(cap, block_n), triton.cdiv(n, block_n) + 1)
    cap = cj * block_n
    long_width = (cj - 1) * block_n
    # The expected candidates of a long row: the geometric middle of topk (fewer -> fallback) and ~65% of the
    # capacity (the fullest of the BLOCK_N sub-buffers overflows its CJ slots near there). For topk 2048 and the
    # default capacity: ~3300; on the H200, target 4096 sent 0.45% of a 128K prefill's rows to the fallback.
    tgt = float(max(topk, (topk * 0.65 * cap) ** 0.5) if target is None else target)
    stride = max(1, int(sample_stride if sample_stride is not None else (64 if on_gpu else 4)))
    # On NVIDIA the candidates kernel fits in 128 registers a thread with a few spills: two 8-warp programs per
    # SM instead of one (measured on the H200: 2.85 ms instead of 3.34 ms for 4096 rows x 32K keys; the logits
    # kernel alone takes 2.37 ms there).
    cand_launch = dict(_CAND_LAUNCH)
    if on_gpu and torch.version.hip is None and cfg["num_warps"] == 8:
        cand_launch.setdefault("maxnreg", 128)
    topk_p2 = next_pow2(topk)
    sub_rows = max(1, (1024 if on_gpu else 64) // block_n)
    pad_block = min(topk_p2, 1024)

    q_c = q_fp8.contiguous()
    k_c = k_fp8.contiguous()
    k_scales_c = k_scales.contiguous()
    w_c = weights.contiguous()
    ks_c, ke_c = ks.contiguous(), ke.contiguous()

    per_row = 8 * (cap + topk_p2)
    chunk = max(block_m, (budget_bytes // per_row) // block_m * block_m)
    chunk = min(chunk, triton.cdiv(s, block_m) * block_m)
    cand = torch.empty((chunk, cap), dtype=torch.int64, device=device)
    keys = torch.empty((chunk, topk_p2), dtype=torch.int64, device=device)
    sub = torch.empty((s, block_n), dtype=torch.int32, device=device)
    tau = torch.empty(s, dtype=torch.float32, device=device)
    for r0 in range(0, s, chunk):  # r0 is a multiple of block_m: the row grouping of a full-size call
        r1 = min(s, r0 + chunk)
        rows = r1 - r0
        grid = (triton.cdiv(rows, block_m),)
        args = (q_c[r0:r1], k_c, k_scales_c, w_c[r0:r1], ks_c[r0:r1], ke_c[r0:r1], tau[r0:r1])
        tiles = dict(H=heads, D=dim, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=cfg["num_warps"],
                     num_stages=cfg["num_stages"])
        _threshold_kernel[grid](*args, rows, n, long_width, tgt, stride, NBINS=_NBINS, BINS_PER_STD=_BINS_PER_STD,
                                LOW_STDS=_LOW_STDS, STAT_EVERY=_STAT_EVERY, MIN_SAMPLE_BLOCKS=_MIN_SAMPLE_BLOCKS,
                                **tiles)
        _candidates_kernel[grid](*args, cand, sub[r0:r1], rows, n, cj, **tiles, **cand_launch)
        _finish_kernel[(rows,)](cand, sub[r0:r1], keys, out[r0:r1], cj, topk,
                                BLOCK_N=block_n, SUB=sub_rows, TOPK_P2=topk_p2, PAD_BLOCK=pad_block,
                                WRITE=sort != "torch", SORT=sort == "kernel", num_warps=4)
        if sort == "torch":
            out[r0:r1] = _keys_to_indices(torch.sort(keys[:rows], dim=1).values, topk)

    del cand, keys
    width = (ke_c.long() - ks_c.long()).clamp_min(0)
    total = sub.sum(dim=1, dtype=torch.int64)
    ok = (sub.amax(dim=1) <= cj) & ((total >= topk) | (total == width))
    bad = torch.nonzero(~ok).squeeze(1)
    if bad.numel():
        out[bad] = _unfused_rows(q_c, k_c, k_scales_c, w_c, ks_c, ke_c, topk, bad, block_m,
                                 min(budget_bytes, _FALLBACK_BUDGET))
    if stats is not None:
        long_rows = width > long_width
        n_long = int(long_rows.sum())
        st.update(long_rows=n_long, fallback_rows=int(bad.numel()), capacity=cap,
                  candidates_max=int(total[long_rows].max()) if n_long else 0,
                  candidates_mean=float(total[long_rows].float().mean()) if n_long else 0.0)
        stats.update(st)
    return out


def scratch_bytes_per_row(topk: int, capacity: int | None = None) -> int:
    """Device bytes one row of `fused_ragged_topk` holds at once, whatever its width: the int64 candidate buffer
    (``capacity``, default 4 * topk, rounded up to a key block of at most 128) and the pow2(topk) selected keys, plus
    its sub-buffer counters and threshold (~80 KiB for topk 2048). What the Indexer plans prefill chunks by when
    this kernel scores them (no [rows, keys] logits: about 16x more rows per chunk than the logits' 4 B per key)."""
    cap = 4 * topk if capacity is None else capacity
    cap = -(-cap // 128) * 128
    return 8 * (cap + next_pow2(topk)) + 4 * 128 + 4


def ragged_mqa_topk(q_fp8: torch.Tensor, k_fp8: torch.Tensor, k_scales: torch.Tensor, weights: torch.Tensor,
                    ks: torch.Tensor, ke: torch.Tensor, topk: int, *, out: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """The op ``ragged_mqa_topk`` (a set per row, like ``topk_indices``): `fused_ragged_topk` without its sort,
    into ``out`` if given."""
    return fused_ragged_topk(q_fp8, k_fp8, k_scales, weights, ks, ke, topk, sort="none", out=out)
