"""The fused CUDA lightning indexer's registration, resolution and launch plan, without a GPU (issue 23)."""

from __future__ import annotations

import pytest

from dsa_indexer.backends.cuda import FUSED_LIGHTNING_PRIORITY, JIT_PRIORITY
from dsa_indexer.backends.cuda import lightning_fused
from dsa_indexer.contract.validate import IndexerInputError
from dsa_indexer.dispatch.environment import Environment
from dsa_indexer.dispatch.plugins import default_registry
from dsa_indexer.dispatch.problem import Problem
from dsa_indexer.dispatch.target import parse_target

FUSED = "lightning_indexer.cuda.fused"


def _resolve(problem: Problem, **facts):
    return default_registry().resolve("lightning_indexer", parse_target("sm90"), problem,
                                      environment=Environment.simulated(**facts))


def _candidate(res, impl_id):
    return next(c for c in res.candidates if c.impl.impl_id == impl_id)


def test_fused_is_accepted_for_the_v32_problem_and_ranked_by_its_measured_priority():
    problem = Problem(heads=64, dim=128, next_n=2, k=2048, fp8="fn", slots=True)
    res = _resolve(problem, gpu=True, triton=True, deep_gemm=True, cuda_jit=True)
    assert _candidate(res, FUSED).accepted
    expected = FUSED if FUSED_LIGHTNING_PRIORITY > JIT_PRIORITY else "lightning_indexer.cuda.deepgemm_radix"
    assert res.chosen.impl_id == expected


def test_fused_is_opt_in_without_deepgemm_too():
    # Measured slower than the composition (Triton paged logits + CUDA top-k) on the H200: never the default.
    problem = Problem(heads=64, dim=128, next_n=1, k=2048, fp8="fn", slots=False)
    res = _resolve(problem, gpu=True, triton=True, cuda_jit=True)
    assert _candidate(res, FUSED).accepted
    assert res.chosen.impl_id == "lightning_indexer.generic.composed"


def test_fused_needs_the_cuda_jit_fact():
    res = _resolve(Problem(heads=64, dim=128, next_n=1, k=2048, fp8="fn", slots=False), gpu=True, triton=True)
    assert not _candidate(res, FUSED).accepted


def test_fused_declines_other_heads_dims_and_fp8_with_every_reason():
    res = _resolve(Problem(heads=32, dim=64, next_n=1, k=2048, fp8="fnuz", slots=False), gpu=True, cuda_jit=True)
    reason = _candidate(res, FUSED).reason
    assert "heads=32" in reason and "head dim 64" in reason and "fp8=fnuz" in reason


@pytest.mark.parametrize("rows,width", [(1, 8192), (32, 8192), (128, 8192), (1, 131072), (32, 131072),
                                        (256, 131072), (3, 100), (1, 262144), (7, 70001)])
def test_plan_covers_every_column_within_the_kernel_limits(rows, width):
    plan = lightning_fused.plan(rows, width, 132)
    assert 1 <= plan.cluster <= lightning_fused.MAX_CLUSTER
    assert plan.chunk % 64 == 0 and plan.chunk <= lightning_fused.MAX_CHUNK
    assert plan.cluster * plan.chunk >= width
    assert plan.cluster * plan.chunk - width < plan.cluster * 64  # no CTA left with nothing but padding pages


def test_plan_fills_the_gpu_when_rows_are_few():
    assert lightning_fused.plan(1, 8192, 132).cluster == lightning_fused.MAX_CLUSTER
    assert lightning_fused.plan(128, 8192, 132).cluster == 1


def test_plan_names_the_alternative_past_its_width():
    with pytest.raises(IndexerInputError, match="max_context_len=.*deepgemm_radix"):
        lightning_fused.plan(1, lightning_fused.MAX_CONTEXT + 1, 132)
