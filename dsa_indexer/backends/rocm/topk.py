"""Top-k through aiter's HIP ``top_k_per_row_decode`` (k fixed at 2048), for rows that start at column 0.

What aiter 0.1.7.post2.dev18's HIP source (csrc/kernels/topk_per_row_kernels.cu) does, read for this adapter:

* ``top_k_per_row_decode(logits, next_n, seqLens, indices, numRows, stride0, stride1)`` writes int32
  ``indices [numRows, 2048]`` in place. Row r sees columns ``[0, seqLens[r // next_n] - next_n + r % next_n + 1)``.
  With ``next_n = 1`` and ``seqLens = ends`` that is exactly our ``[0, ends[r])``. Rows with at most 2048
  visible columns get ``0 .. len-1`` then -1; longer rows get the column numbers of a 2048-element top-k
  (radix histogram select). Column numbers are relative to column 0, i.e. request-local when starts are 0.
* Ties: the elements equal to the 2048-th value are collected with shared-memory atomics, so WHICH tied columns
  are kept is not deterministic and does not follow the library's lower-index rule. (The ReLU sum makes exact
  ties, e.g. many 0.0 logits, common.) Hence the registration ranks below the deterministic Triton top-k and is
  used only when forced (``DSA_INDEXER_FORCE=topk_indices=topk_indices.rocm.aiter``) or when Triton cannot run.
  Newer aiter releases add ``k=`` and ``stable=``; when present the adapter passes ``stable=True``.
* ``top_k_per_row_prefill(logits, rowStarts, rowEnds, indices, values, numRows, stride0, stride1)`` is NOT used:
  in that version rows with more than 2048 visible columns are selected from columns ``[0, rowEnd - rowStart)``
  (the row start is ignored) while short rows return absolute columns ``rowStart + i``. Ragged starts are
  therefore refused by ``supports`` (the problem fact ``starts``).

* NaN: the kernel orders fp32 bit patterns (``twiddle_in``: sign-magnitude -> unsigned), so a positive NaN ranks
  above +inf, i.e. it would be selected first. The library's rule is that a NaN score ranks exactly as -inf, so
  the adapter passes ``torch.where(isnan(x), -inf, x)``: one elementwise pass on the device, no host sync, so it
  stays graph-capturable; it also gives the kernel the contiguous, 16-byte-aligned rows it reads.

Physical-slot output (``block_table`` given) is converted from the request-local result with the reference's
`indices_to_slots` (a gather, no sync). A caller's ``out=`` buffer is the kernel's ``indices`` argument itself (no
copy); only the slot transform, which gathers into a tensor of its own, is copied back into it. Never run on AMD hardware in this project (the kernel is HIP-only); the
CPU tests check the argument handling against a fake built on the reference.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from .lookup import find_function

TOPK = 2048  # the kernels' compile-time k
DECODE_MODULES = ("aiter.ops.topk", "aiter")
DECODE_NAME = "top_k_per_row_decode"


def find_decode() -> tuple[str, Callable] | None:
    """aiter's ``top_k_per_row_decode`` (imports aiter)."""
    return find_function(DECODE_MODULES, DECODE_NAME, callable_only=True)


def takes_stable(fn: Callable) -> bool:
    """Newer aiter's top-k takes ``stable=True``: one-block kernel, ties at the k-th value to the smallest index."""
    try:
        return "stable" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def make_topk_indices(top_k_per_row_decode: Callable | None = None) -> Callable[..., torch.Tensor]:
    """``topk_indices`` with the reference's signature, computed by aiter's decode top-k. The registration's
    ``supports`` admits only k == 2048 and starts None; the adapter re-checks both and raises otherwise."""
    if top_k_per_row_decode is None:
        found = find_decode()
        if found is None:
            raise RuntimeError(f"aiter has no {DECODE_NAME} in {' / '.join(DECODE_MODULES)}; the aiter probe should "
                               "have rejected this implementation")
        top_k_per_row_decode = found[1]
    extra: dict[str, Any] = {}
    try:
        params = inspect.signature(top_k_per_row_decode).parameters
    except (TypeError, ValueError):
        params = {}
    if "stable" in params:
        extra["stable"] = True
    if "k" in params:
        extra["k"] = TOPK

    def topk_indices(logits: torch.Tensor, k: int, ends: torch.Tensor, starts: torch.Tensor | None = None,
                     block_table: torch.Tensor | None = None, row_request: torch.Tensor | None = None, *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        if k != TOPK or starts is not None:
            raise ValueError(f"aiter's top_k_per_row_decode serves k={TOPK} with rows starting at column 0 "
                             f"(got k={k}, starts {'given' if starts is not None else 'None'}); resolution should "
                             "have picked another implementation")
        rows = logits.shape[0]
        # -1 first: the kernel's own padding is read from its source, not relied on (every element is written).
        out = torch.full((rows, TOPK), -1, dtype=torch.int32, device=logits.device) if out is None else out.fill_(-1)
        if rows:
            # NaN ranks as -inf (the library's rule; the kernel would rank it first). The result is a fresh
            # contiguous tensor, as the kernel needs: it reads rows with 16-byte vector loads from the base pointer.
            logits = torch.where(torch.isnan(logits), float("-inf"), logits).contiguous()
            if logits.data_ptr() % 16:
                logits = logits.clone(memory_format=torch.contiguous_format)
            top_k_per_row_decode(logits, 1, ends.to(torch.int32).contiguous(), out, rows, logits.stride(0),
                                 logits.stride(1), **extra)
        if block_table is not None:
            from ...contract.cache import indices_to_slots

            req = torch.arange(rows, device=logits.device) if row_request is None else row_request
            return out.copy_(indices_to_slots(out, block_table, req))
        return out

    return topk_indices
