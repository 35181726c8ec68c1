"""A TEST DOUBLE of flashinfer 0.7's documented ``top_k_ragged_transform`` (not FlashInfer): its semantics in plain
torch, recording each call's arguments, so the adapter's marshalling is checked without the library or a GPU."""

import types

import torch

from dsa_indexer.backends.reference import kernels as ref


def flashinfer_double():
    """A test double, named as such: implements FlashInfer's documented semantics in plain torch (per-row
    lengths, -1 padding for rows shorter than k, lower-index ties with TopKTieBreak.SMALL, + offsets)."""
    calls = []

    def top_k_ragged_transform(x, offsets, lengths, k, deterministic=False, tie_break=0, dsa_graph_safe=False,
                               row_starts=None):
        calls.append(dict(deterministic=deterministic, tie_break=tie_break, offsets=offsets, lengths=lengths,
                          dtype=lengths.dtype))
        out = ref.topk_indices(x, k, lengths)
        return torch.where(out >= 0, out + offsets[:, None], out)

    module = types.SimpleNamespace(top_k_ragged_transform=top_k_ragged_transform, __version__="0.7.4-double",
                                   TopKTieBreak=types.SimpleNamespace(NONE=0, SMALL=1, LARGE=2))
    return module, calls
