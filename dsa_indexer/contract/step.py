"""The per-step context: what the kernels of one step share, and the seam through which an engine hands in its own.

One `StepContext` per step (one batch): every layer of the step reads the same one. `DecodeBatch.build` /
`PrefillBatch.build` (and the batches derived on the device) make one with the batch (``batch.context``);
`Indexer.forward(..., context=)` takes the caller's instead, e.g. an engine's that carries its own metadata,
schedule, output buffer or side stream. The plan hands it to the kernels that declare ``step_context`` in their
registry info (``info={"step_context": True}``): they receive it as ``context=`` (the public ops pass none, and such
a kernel then computes its scratch for the one call).

What it holds:
- ``scratch``: values derived once per step from the batch's metadata and read by every layer (DeepGEMM's paged
  schedule, the row -> request map), computed by the first kernel that asks (`StepContext.memo`). Nothing is
  memoised on a caller's tensor: a tensor made under ``torch.inference_mode`` keeps no version counter, so such a
  memo missed on every call; the context is the step's, whatever mode its tensors were made in. The scratch
  describes the batch's tensors as they are: a step that writes them in place makes a new context.
- ``topk_plan``: the top-k's plan of this step (what a top-k that plans per step keeps; None until one does).
- ``topk_out``: an optional caller-owned int32 ``[T, topk]`` buffer the step's result is written into (and returned).
- ``side_stream``: an optional caller-owned stream for a strategy that overlaps work (the CUDA dual stream's k path);
  None: the strategy's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import torch

STEP_CONTEXT_INFO = "step_context"  # the registry info key of a kernel that takes ``context=``


@dataclass(eq=False)
class StepContext:
    """What one step's kernels share (see the module docstring)."""

    scratch: dict[Hashable, Any] = field(default_factory=dict)
    topk_plan: Any = None
    topk_out: torch.Tensor | None = None
    side_stream: Any = None

    def memo(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """``compute()`` once per ``key`` in this step (the key names what is computed and from which facts)."""
        found = self.scratch.get(key)
        if found is None:
            found = self.scratch[key] = compute()
        return found

    def row_requests(self, batch_size: int, next_n: int, device: torch.device) -> torch.Tensor:
        """Decode row ``b * next_n + j`` -> request ``b`` (int32 [B * next_n]), made once per step."""
        from .cache import decode_row_requests

        return self.memo(("row_requests", batch_size, next_n, device),
                         lambda: decode_row_requests(batch_size, next_n, device))


def step_scratch(context: StepContext | None, key: Hashable, compute: Callable[[], Any]) -> Any:
    """``context.memo(key, compute)``, or ``compute()`` for a call without a step (a public op called alone)."""
    return compute() if context is None else context.memo(key, compute)


def takes_step_context(info) -> bool:
    """Whether an implementation with registry ``info`` receives the step's context as ``context=``."""
    return bool(info.get(STEP_CONTEXT_INFO, False))
