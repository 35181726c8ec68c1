"""Shared by the GPU tests.

``DSA_INDEXER_TEST_TOPK_DEFINES=NAME=VALUE[,NAME=VALUE]``: run the session on that compile-time variant of the CUDA
register / streaming / prefill top-k kernels (`topk.use_register_variant`), to check a variant before it is made
the default."""

import os

import pytest
import torch

TOPK_DEFINES = tuple(d for d in os.environ.get("DSA_INDEXER_TEST_TOPK_DEFINES", "").split(",") if d)


@pytest.fixture(autouse=True, scope="session")
def _topk_variant():
    if not TOPK_DEFINES:
        yield
        return
    from dsa_indexer.backends.cuda import topk as cuda_topk

    cuda_topk.use_register_variant(TOPK_DEFINES)
    yield
    cuda_topk.use_register_variant()


@pytest.fixture(autouse=True)
def _fp32_reference_matmul():
    """The reference's einsums, Hadamards and GEMMs run in true fp32 on the GPU (no TF32), whatever a test before set."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved
