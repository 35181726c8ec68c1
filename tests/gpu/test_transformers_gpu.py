"""dsa_indexer.integrations.transformers on the GPU: the CPU suite's generate() checks against transformers' own
indexer (tests/model/test_transformers_integration.py), with the model and the swapped indexers on CUDA, so the
accelerated implementations (Triton / CUDA logits and top-k) run inside transformers' generate(). 64 index heads: the
Triton logits take 32, 64 or 128 (with 16, the H200 run of 2026-12-01 fell back to the reference, with its warning)."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="transformers (the 'transformers' extra) is not installed")
sys.path.insert(0, str(Path(__file__).parents[1] / "model"))  # the CPU suite's helpers (tests/model/)

from test_transformers_integration import (AGREEMENT, generate, prompts, record_against_hf, tiny_v4,  # noqa: E402
                                           tiny_v32, v4_agreement, v32_agreement)

from dsa_indexer.integrations.transformers import swap_indexers, swapped_indexers  # noqa: E402

pytestmark = pytest.mark.gpu


def on_host(calls):
    def host(value):
        return value.cpu() if torch.is_tensor(value) else value

    return [(host(ours), host(theirs), tuple(host(a) for a in args)) for ours, theirs, args in calls]


def test_v32_left_padded_generate_on_cuda_agrees_with_transformers():
    model = tiny_v32(index_heads=64).cuda()
    swap_indexers(model)
    assert swapped_indexers(model)[0].dsa_indexer.target.vendor == "cuda"
    calls = record_against_hf(model)
    ids, mask = prompts(2, 48, pad=7)
    generate(model, ids.cuda(), mask.cuda())
    assert v32_agreement(on_host(calls)) >= AGREEMENT


def test_v4_generate_on_cuda_agrees_with_transformers():
    model = tiny_v4(index_heads=64).cuda()
    swap_indexers(model)
    calls = record_against_hf(model)
    ids, mask = prompts(1, 48)
    generate(model, ids.cuda(), mask.cuda())
    assert v4_agreement(on_host(calls)) >= AGREEMENT
