"""Shared by the GPU tests."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _fp32_reference_matmul():
    """The reference's einsums, Hadamards and GEMMs run in true fp32 on the GPU (no TF32), whatever a test before set."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved
