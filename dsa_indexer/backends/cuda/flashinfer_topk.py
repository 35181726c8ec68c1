"""FlashInfer's top-k (PyPI ``flashinfer-python``, extra ``flashinfer``) as ``topk_indices.cuda.flashinfer``.

FlashInfer 0.7's ``top_k_ragged_transform(input, offsets, lengths, k, deterministic, tie_break, ...)`` takes
per-row lengths, pads rows shorter than k with -1 and returns int32 ``[rows, k]`` positions (plus ``offsets``,
zero here): the contract of ``topk_indices`` for windows that start at column 0. Its ties are arbitrary unless
``tie_break=TopKTieBreak.SMALL`` (lower index wins at the k-th value) and ``deterministic=True`` are passed,
which the adapter always does. Windows with ``starts`` and the slot transform are not adapted (its
``row_starts`` / page-table variants index differently); ``supports`` says so and the other top-k serve them.

Ranked at priority 60, below the Triton (100) and CUDA (200) top-k: the H200 numbers in
``benchmarks/results/decode_topk.json`` decide whether it should rank higher; force it with
``DSA_INDEXER_FORCE=topk_indices=topk_indices.cuda.flashinfer``. ``flashinfer`` is imported only by the probe
and the factory.
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable

import torch

from ...dispatch.capabilities import Capabilities, Rule
from ...dispatch.vendor import VendorLibrary

IMPL_ID = "topk_indices.cuda.flashinfer"
PRIORITY = 60
MAX_K = 2048  # FlashInfer's tie-break needs k <= 2048 (its filtered path)
INSTALL_HINT = "pip install 'dsa-indexer[flashinfer]' (flashinfer-python; it JIT-builds its kernels with nvcc)"


def probe() -> str | None:
    """None when ``flashinfer`` imports and has the ragged top-k with a tie-break, else the reason (the shared
    vendor-library probe: installed, import, feature detection)."""
    return LIBRARY.probe()


def api_problem(module: ModuleType) -> str | None:
    if not callable(getattr(module, "top_k_ragged_transform", None)):
        return f"flashinfer {getattr(module, '__version__', '?')} has no top_k_ragged_transform (needs >= 0.6)"
    if getattr(getattr(module, "TopKTieBreak", None), "SMALL", None) is None:
        return f"flashinfer {getattr(module, '__version__', '?')} has no TopKTieBreak.SMALL (deterministic ties)"
    return None


LIBRARY = VendorLibrary(module="flashinfer", install_hint=INSTALL_HINT, usable=lambda module: api_problem(module),
                        describe=lambda module: f"flashinfer {getattr(module, '__version__', '?')}")


# What the adapter takes, declared (every failing fact reported at once).
CAPABILITIES = Capabilities(
    "FlashInfer's top-k adapter",
    starts=Rule(lambda starts: not starts, "false (windows with starts are not adapted: FlashInfer's row_starts "
                                           "offsets the output differently)"),
    slots=Rule(lambda slots: not slots, "false (the slot transform is not adapted: FlashInfer's page-table variant "
                                        "takes its own table layout)"),
    k=Rule(lambda k: k <= MAX_K, f"at most {MAX_K} (FlashInfer's lower-index tie-break needs it)"))


def make_topk_indices(module: ModuleType) -> Callable[..., torch.Tensor]:
    """The adapter, with the reference's signature, around ``module`` (flashinfer, or a test double)."""
    reason = api_problem(module)
    if reason is not None:
        raise RuntimeError(reason)
    ragged = module.top_k_ragged_transform
    small = module.TopKTieBreak.SMALL
    zeros: dict[tuple, torch.Tensor] = {}

    def topk_indices(logits: torch.Tensor, k: int, ends: torch.Tensor, starts: torch.Tensor | None = None,
                     block_table: torch.Tensor | None = None, row_request: torch.Tensor | None = None
                     ) -> torch.Tensor:
        if starts is not None or block_table is not None or row_request is not None:
            raise ValueError("topk_indices.cuda.flashinfer takes windows starting at 0 and returns positions "
                             "(its supports() check rejects starts and slots)")
        rows = logits.shape[0]
        key = (rows, logits.device)
        offsets = zeros.get(key)
        if offsets is None:
            offsets = zeros.setdefault(key, torch.zeros(rows, dtype=torch.int32, device=logits.device))
        # The NaN rule (a NaN ranks as -inf) in one elementwise pass: FlashInfer's own NaN order is not documented.
        x = torch.nan_to_num(logits, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
        out = ragged(x, offsets, ends.to(torch.int32).contiguous(), k, deterministic=True, tie_break=small)
        return out if out.dtype == torch.int32 else out.to(torch.int32)

    return topk_indices
