"""The shared -inf column mask kernel (`backends/triton/masks.py`) against the torch mask (interpreter on CPU,
compiled on a GPU)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not importable")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("kind", ["tail", "head", "wide_head"])
def test_the_shared_column_mask_kernel_matches_the_torch_mask(kind):
    """`backends/triton/masks.mask_columns_` (the DeepGEMM tail mask and the aiter head mask) against the torch mask
    on random rows: bit-identical (it only writes -inf), untouched columns keep their values."""
    from dsa_indexer.backends.triton.masks import mask_columns_

    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    rows, width = 9, 3000
    logits = torch.randn(rows, width, generator=g)
    lo = torch.randint(0, width, (rows,), generator=g)
    if kind == "tail":
        hi, span = None, None
    else:
        span = 127 if kind == "head" else 2100
        hi = (lo + torch.randint(0, span + 1, (rows,), generator=g)).clamp_max(width)
    want = mask_columns_(logits.clone(), lo, hi, span=span, use_triton=False)
    got = mask_columns_(logits.clone().to(DEVICE), lo.to(DEVICE), None if hi is None else hi.to(DEVICE), span=span,
                        use_triton=True).cpu()
    assert torch.equal(got, want)
    assert torch.isinf(want).any() and torch.isfinite(want).any()
