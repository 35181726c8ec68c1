"""The one -inf column mask that the logits adapters need: ``logits[r, c] = -inf`` for ``lo[r] <= c < hi[r]``.

DeepGEMM's paged logits leave garbage past each row's length (a tail mask, ``lo = lens``, ``hi = width``); aiter's
ragged kernel needs the columns between an aligned start and the true start hidden (a head mask, ``hi - lo < 128``).
One kernel serves both: a row's programs start at the block holding ``lo[r]``, and ``span`` (a host-known bound on
``hi - lo``) sizes the grid, so a narrow head mask launches one or two programs per row, not a whole row's worth.
"""

from __future__ import annotations

import torch

try:  # triton is a dependency; without it the torch mask below still serves
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

BLOCK = 1024


def _mask_columns_kernel(logits_ptr, row_stride, lo_ptr, hi_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    lo = tl.load(lo_ptr + row)
    hi = tl.minimum(tl.load(hi_ptr + row), width)
    start = (lo // BLOCK) * BLOCK + tl.program_id(1) * BLOCK
    if start < hi:
        cols = start + tl.arange(0, BLOCK)
        ninf = tl.full([BLOCK], float("-inf"), tl.float32)
        tl.store(logits_ptr + row.to(tl.int64) * row_stride + cols, ninf, mask=(cols >= lo) & (cols < hi))


if triton is not None:
    _mask_columns_kernel = triton.jit(_mask_columns_kernel)


def mask_columns_(logits: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor | None = None, *, span: int | None = None,
                  use_triton: bool | None = None) -> torch.Tensor:
    """In place on fp32 ``logits`` [R, W]: -inf at columns ``[lo[r], hi[r])`` (``hi`` None: to the end of the row).
    ``span``: an upper bound on ``hi - lo`` (default W). ``use_triton`` None: the kernel for GPU tensors with unit
    column stride, a torch mask otherwise (True forces the kernel, e.g. under TRITON_INTERPRET=1)."""
    rows, width = logits.shape
    if rows == 0 or width == 0:
        return logits
    lo = lo.reshape(-1)
    hi = torch.full_like(lo, width) if hi is None else hi.reshape(-1)
    if use_triton is None:
        use_triton = logits.device.type != "cpu"
    if use_triton and triton is not None and logits.stride(1) == 1 and logits.dtype == torch.float32:
        blocks = triton.cdiv(min(width, span or width), BLOCK) + 1  # the first block may start left of lo
        _mask_columns_kernel[(rows, blocks)](logits, logits.stride(0), lo.to(torch.int32).contiguous(),
                                             hi.to(torch.int32).contiguous(), width, BLOCK=BLOCK)
        return logits
    cols = torch.arange(width, device=logits.device)[None, :]
    lo_, hi_ = lo.to(logits.device).long()[:, None], hi.to(logits.device).long()[:, None]
    return logits.masked_fill_((cols >= lo_) & (cols < hi_), float("-inf"))
