"""`c4_compress_pool` in Triton: DeepSeek-V4's C4 window pooling in one kernel, the state roll in a second.

The pure-torch version is about 25 small launches per decode step (gathers, wheres, softmax, index writes); on the
H200 that was 106 us of a 130 us V4 decode step at B = 1 (benchmarks/results/v4_compressor.json). Here:
- pool: one program per entry row. For each of the 8 window offsets it reads the token's 128 kv and 128 score
  channels of its part (offsets 0-3: channels [:d], 4-7: [d:]) from this step's projections when the token is in
  the step (the row that many places back belongs to the same request) or else from the request's state slot
  (ring index position % 8), adds ape, softmaxes over the 8 offsets per channel in fp32 and writes bf16.
- state roll: one program per row; a row among its request's last 8 writes its 512 projections to its slot (other
  rows and padding rows write the scratch slot). It runs after pool on the same stream, so pool reads the old state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_options, wait_for_predecessor


@triton.jit
def _c4_pool_kernel(proj_ptr, state_ptr, ape_ptr, pos_ptr, req_ptr, slot_ptr, rows_ptr, out_ptr, n_rows, scratch,
                    D: tl.constexpr, WINDOW: tl.constexpr, RATIO: tl.constexpr,
                    PDL: tl.constexpr = False):
    wait_for_predecessor(PDL)
    W: tl.constexpr = 4 * D  # [kv part A | kv part B | score part A | score part B]
    e = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + e).to(tl.int64)
    p = tl.load(pos_ptr + r).to(tl.int64)
    req = tl.load(req_ptr + r)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    slot = tl.where(slot >= 0, slot, scratch)
    offset = tl.arange(0, WINDOW)  # window offset o: the token (7 - o) positions before the entry's last one
    cols = tl.arange(0, D)
    back = (WINDOW - 1 - offset).to(tl.int64)
    src = r - back
    token = p - back
    present = token >= 0
    src_req = tl.load(req_ptr + tl.maximum(src, 0))
    in_step = (src >= 0) & (src_req == req) & present
    from_state = present & (in_step == 0)
    part = tl.where(offset < RATIO, 0, D)  # previous group: channels [:d]; the entry's own group: [d:]
    ring = tl.maximum(token, 0) % WINDOW
    step_ptrs = proj_ptr + (tl.maximum(src, 0) * W + part)[:, None] + cols[None, :]
    state_ptrs = state_ptr + ((slot * WINDOW + ring) * W + part)[:, None] + cols[None, :]
    m_step = in_step[:, None]
    m_state = from_state[:, None]
    kv = tl.load(step_ptrs, mask=m_step, other=0.0) + tl.load(state_ptrs, mask=m_state, other=0.0)
    ape = tl.load(ape_ptr + ((tl.maximum(token, 0) % RATIO) * 2 * D + part)[:, None] + cols[None, :])
    score = (tl.load(step_ptrs + 2 * D, mask=m_step, other=0.0)
             + tl.load(state_ptrs + 2 * D, mask=m_state, other=0.0) + ape)
    score = tl.where(present[:, None], score, float("-inf"))
    top = tl.max(score, axis=0)
    w = tl.exp(score - top[None, :])
    pooled = tl.sum(w * kv, axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + e * D + cols, pooled.to(tl.bfloat16))


@triton.jit
def _c4_state_roll_kernel(proj_ptr, state_ptr, pos_ptr, req_ptr, slot_ptr, n_rows, scratch,
                          W: tl.constexpr, WINDOW: tl.constexpr,
                          PDL: tl.constexpr = False):
    wait_for_predecessor(PDL)
    r = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + r).to(tl.int64)
    req = tl.load(req_ptr + r)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    later = r + WINDOW
    later_req = tl.load(req_ptr + tl.minimum(later, n_rows - 1))
    keep = (later >= n_rows) | (later_req != req)
    target = tl.where(keep & (slot >= 0), slot, scratch)
    cols = tl.arange(0, W)
    tl.store(state_ptr + (target * WINDOW + p % WINDOW) * W + cols, tl.load(proj_ptr + r * W + cols))


def c4_compress_pool(proj: torch.Tensor, state: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
                     row_request: torch.Tensor, state_slot: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    t, width = proj.shape
    d = width // 4
    window = state.shape[1]
    scratch = state.shape[0] - 1
    out = torch.empty(rows.shape[0], d, dtype=torch.bfloat16, device=proj.device)
    if t == 0:
        return out
    positions, row_request, state_slot = positions.contiguous(), row_request.contiguous(), state_slot.contiguous()
    if rows.shape[0]:
        _c4_pool_kernel[(rows.shape[0],)](proj, state, ape, positions, row_request, state_slot, rows.contiguous(),
                                          out, t, scratch, D=d, WINDOW=window, RATIO=ape.shape[0], num_warps=4,
                                          **pdl_options(proj.device))
    _c4_state_roll_kernel[(t,)](proj, state, positions, row_request, state_slot, t, scratch, W=width,
                                WINDOW=window, num_warps=4, **pdl_options(proj.device))
    return out
