"""A decode step's batch metadata in one launch: positions, context lengths, cache slots and state slots.

A CUDA-graph decode derives these on the device from ``seq_lens`` and the block table every step (`DecodeGraph`).
Written with torch ops that is about 19 elementwise kernels for V3.2 and 27 for V4's C4 (33-46 us per step on the
H200, `benchmarks/results/decode_metadata_h200.json`), each moving a few hundred bytes. Here one program handles a
block of rows: a row reads its request's length, its state slot and one block-table entry, and writes its four
outputs. Same contract as the reference (`decode_metadata` in `backends/reference/kernels.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...contract.cache import PAGE_SIZE
from .pdl import pdl_options, wait_for_predecessor

BLOCK_ROWS = 64  # rows per program: a 128-request step is two programs (their dependent loads overlap)


@triton.jit
def _decode_metadata_kernel(seq_lens_ptr, table_ptr, state_slots_ptr, context_ptr, pos_ptr, slot_ptr, state_ptr,
                            rows, table_stride, table_width, NEXT_N: tl.constexpr, RATIO: tl.constexpr,
                            PAGE: tl.constexpr, BLOCK: tl.constexpr,
                            PDL: tl.constexpr = False):
    wait_for_predecessor(PDL)
    row = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = row < rows
    request = row // NEXT_N
    seq = tl.load(seq_lens_ptr + request, mask=live, other=0).to(tl.int64)
    pos = seq - NEXT_N + (row % NEXT_N)
    valid = pos >= 0
    pos = tl.maximum(pos, 0)
    tl.store(context_ptr + row, tl.where(valid, (pos + 1) // RATIO, 0).to(tl.int32), mask=live)
    tl.store(pos_ptr + row, pos, mask=live)
    if RATIO == 1:
        stores = valid
    else:
        stores = valid & ((pos + 1) % RATIO == 0)
    entry = pos // RATIO
    page_col = tl.minimum(entry // PAGE, table_width - 1)
    page = tl.load(table_ptr + request.to(tl.int64) * table_stride + page_col, mask=live & stores, other=0)
    slot = page.to(tl.int64) * PAGE + entry % PAGE
    tl.store(slot_ptr + row, tl.where(stores, slot, -1), mask=live)
    state = tl.load(state_slots_ptr + request, mask=live, other=-1).to(tl.int64)
    tl.store(state_ptr + row, tl.where(valid, state, -1), mask=live)


def decode_metadata(seq_lens: torch.Tensor, block_table: torch.Tensor, state_slots: torch.Tensor, next_n: int,
                    compress_ratio: int, *, out: tuple[torch.Tensor, ...] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``out``: the four outputs preallocated (tests pre-fill them to check that every element is written)."""
    batch = seq_lens.shape[0]
    rows = batch * next_n
    device = seq_lens.device
    if out is None:
        out = (torch.empty((batch, next_n), dtype=torch.int32, device=device),
               *(torch.empty(rows, dtype=torch.int64, device=device) for _ in range(3)))
    context_lens, positions, slots, state_slot = out
    if rows == 0:
        return context_lens, positions, slots, state_slot
    table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    _decode_metadata_kernel[(triton.cdiv(rows, BLOCK_ROWS),)](
        seq_lens, table, state_slots, context_lens, positions, slots, state_slot, rows, table.stride(0),
        table.shape[1], NEXT_N=next_n, RATIO=compress_ratio, PAGE=PAGE_SIZE, BLOCK=BLOCK_ROWS, num_warps=4,
        **pdl_options(device))
    return context_lens, positions, slots, state_slot
