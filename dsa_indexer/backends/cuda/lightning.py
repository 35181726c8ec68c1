"""``lightning_indexer`` (decode) and ``ragged_mqa_topk`` (prefill) on sm90 / sm100: DeepGEMM's logits feeding the
CUDA top-k, the logits consumed as DeepGEMM leaves them.

Against the generic composition (paged_mqa_logits op, then topk_indices op) this drops two launches per layer:
- no -inf mask over the logits' tail: the top-k reads only columns [0, context_lens[row]) of each row, so the
  garbage DeepGEMM leaves past a row's length (and in its padded row stride) is never looked at, and the padded
  view is consumed as it is (no contiguous copy);
- DeepGEMM's schedule metadata once per decode step, shared by every layer (the step's `contract.step.StepContext`).
The slot transform (``return_slots``) runs inside the top-k's store.
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable

import torch

from ...contract.cache import decode_row_requests
from ...contract.step import StepContext
from .deepgemm import DeepGemmApi, make_paged_mqa_logits
from .deepgemm_kernels import launching_with_pdl, make_ragged_mqa_logits
from .topk import topk_indices


def _row_requests(context_lens: torch.Tensor, context: StepContext | None) -> torch.Tensor:
    """Row b * next_n + j -> request b, made once per step (kept in the step's context)."""
    batch, next_n = context_lens.shape
    if context is None:
        return decode_row_requests(batch, next_n, context_lens.device)
    return context.row_requests(batch, next_n, context_lens.device)


def make_lightning_indexer(module: ModuleType, api: DeepGemmApi) -> Callable[..., torch.Tensor]:
    # DeepGEMM launches with its own PDL where the step's kernels do (`launching_with_pdl`)
    paged = launching_with_pdl(make_paged_mqa_logits(module, api), module)
    unmasked = paged.unmasked  # type: ignore[attr-defined]

    def lightning_indexer(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor,
                          block_table: torch.Tensor, max_context_len: int, k: int, return_slots: bool = False, *,
                          context: StepContext | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = unmasked(q, kv_cache, weights, context_lens, block_table, max_context_len, context)
        ends = context_lens.reshape(-1)
        if not return_slots:
            return topk_indices(logits, k, ends, out=out)
        return topk_indices(logits, k, ends, None, block_table, _row_requests(context_lens, context), out=out)

    lightning_indexer.api = api  # type: ignore[attr-defined]
    return lightning_indexer


def make_ragged_mqa_topk(module: ModuleType, api: DeepGemmApi) -> Callable[..., torch.Tensor]:
    """A prefill chunk's scoring: DeepGEMM's ragged logits (masked outside [ks, ke) by DeepGEMM) read in their
    padded rows by the CUDA top-k within the same windows. Against the composition this drops the contiguous
    copy of the [rows, keys] fp32 logits (H200, 128K-token V3.2 layer: 27 of 203 ms, and a second
    chunk-sized buffer; `benchmarks/results/profile_prefill_h200.json`)."""
    padded = launching_with_pdl(make_ragged_mqa_logits(module, api), module).padded  # type: ignore[attr-defined]

    def ragged_mqa_topk(q: torch.Tensor, k: torch.Tensor, k_scales: torch.Tensor, weights: torch.Tensor,
                        ks: torch.Tensor, ke: torch.Tensor, topk: int, *, out: torch.Tensor | None = None
                        ) -> torch.Tensor:
        return topk_indices(padded(q, k, k_scales, weights, ks, ke), topk, ke, ks, out=out)

    ragged_mqa_topk.api = api  # type: ignore[attr-defined]
    return ragged_mqa_topk
