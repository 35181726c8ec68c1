"""Test setup shared by every suite.

Without CUDA, Triton kernels run in the CPU interpreter (TRITON_INTERPRET must be set before triton is imported),
and tests marked `gpu` are skipped with a reason.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    # Everything under tests/gpu is a GPU test, marked or not: the marker is where the skip lives (files add none).
    for item in items:
        if "gpu" in item.path.parts and "gpu" not in item.keywords:
            item.add_marker(pytest.mark.gpu)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the H200 test machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
