"""Test setup shared by every suite.

Without CUDA, Triton kernels run in the CPU interpreter (TRITON_INTERPRET must be set before triton is imported),
and tests marked `gpu` are skipped with a reason.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under xdist (`-n N`) the N workers share the machine's cores: each with torch's default of one intra-op thread per
# core runs N times as many threads as there are cores, and the OpenMP threads spin while they wait (measured on 2
# cores: tests/ops with -n 2 took 3x the wall time and twice the CPU time of one thread per worker). The variable
# reaches the subprocesses the tests start.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _XDIST_WORKERS > 1:
    _THREADS = max(1, torch.get_num_threads() // _XDIST_WORKERS)
    torch.set_num_threads(_THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))


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
