"""The step plan: a table role -> bound kernel, built from the facts it is given; explained as one table."""

import dataclasses

import pytest
import torch

from dsa_indexer import DecodeBatch, Indexer, IndexerConfig, IndexKCache, ops
from dsa_indexer.dispatch import Problem
from dsa_indexer.plan import role_problem

V32_TINY = dataclasses.replace(IndexerConfig.deepseek_v32(), name="v32-tiny", hidden_size=256, q_lora_rank=256,
                               n_heads=4, topk=16, max_position=4096)
V4_TINY = dataclasses.replace(IndexerConfig.deepseek_v4_flash(), name="v4-tiny", hidden_size=256, q_lora_rank=256,
                              n_heads=4, topk=16, max_position=4096)


def test_a_missing_or_unknown_fact_is_an_error_at_plan_build():
    with pytest.raises(ValueError, match=r"without fact\(s\) \['scale_fmt'\]"):
        role_problem("gemm_fp8_blockscale", n=512, k=256, out="torch.bfloat16", fp8="fn")
    with pytest.raises(ValueError, match=r"with unknown \['tokens'\]"):
        role_problem("x_projections", hidden=256, heads=4, dim=128, head_proj="torch.float32", tokens=8)


@pytest.mark.parametrize("cfg, roles", [
    (V32_TINY, {"pipeline", "wq_b_gemm", "q_lora_quant", "x_projections", "q_prologue", "k_store", "score"}),
    (V4_TINY, {"pipeline", "wq_b_gemm", "q_lora_quant", "q_prologue", "c4_pool", "c4_store", "score"}),
])
def test_each_role_is_bound_for_the_problem_its_call_makes(cfg, roles):
    """The plan binds every role at build; the facts of each role's real call (the op's own facts function, run
    here on the step's tensors) equal the problem it was bound for."""
    indexer = Indexer(cfg).init_random(int(torch.randint(0, 1 << 30, ())))
    pages = 12
    plan = indexer.step_plan(2, True, cache_pages=pages)  # a decode step's scorer is bound with its cache's pages
    assert set(plan.kernels) == roles
    seen, used = {}, set()
    real = type(plan).run

    def recording(self, role, op, *args, **kwargs):
        seen[role] = ops.OPERATORS[op].problem(*args)
        used.add(id(self))
        return real(self, role, op, *args, **kwargs)

    type(plan).run = recording
    try:
        cache = IndexKCache.allocate(pages)
        batch = DecodeBatch.build([100, 260], [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], num_cache_pages=pages,
                                  compress_ratio=cfg.compress_ratio)
        x = torch.randn(2, cfg.hidden_size).to(torch.bfloat16)
        q_lora = torch.randn(2, cfg.q_lora_rank).to(torch.bfloat16)
        from dsa_indexer import CompressorState

        state = CompressorState.allocate(2, cfg) if cfg.compress_ratio > 1 else None
        indexer(x, q_lora, batch.positions, batch, cache, compressor_state=state)
    finally:
        type(plan).run = real
    assert set(seen) == roles - {"pipeline"} and used == {id(plan)}  # the call ran the plan compared with
    for role, problem in seen.items():
        assert problem == plan.kernels[role].problem, role


def test_the_first_call_with_other_facts_than_the_bound_problem_is_refused():
    indexer = Indexer(V32_TINY).init_random(1)
    plan = indexer.step_plan(2, True)
    x = torch.randn(2, 256).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="was bound for quant_fp8_groups"):
        plan.run("q_lora_quant", "quant_fp8_groups", x, 64, False, torch.float8_e4m3fn)  # group 64, bound for 128
    with pytest.raises(RuntimeError, match="bound to quant_fp8_groups, but the step calls it as q_prologue"):
        indexer.step_plan(4, True).run("q_lora_quant", "q_prologue", x)
    with pytest.raises(KeyError, match="binds no kernel for role 'wk_gemm'"):
        plan.run("wk_gemm", "gemm_fp8_blockscale", x)


def test_plans_are_kept_per_problem_class():
    indexer = Indexer(V32_TINY).init_random(2)
    decode, prefill = indexer.step_plan(2, True), indexer.step_plan(2, False)
    assert indexer.step_plan(2, True) is decode and prefill is not decode
    assert decode.kernels["score"].op == "lightning_indexer" and prefill.kernels["score"].op == "ragged_mqa_topk"
    two = indexer.step_plan(4, True, next_n=2)
    assert two.kernels["score"].problem["next_n"] == 2 and decode.kernels["score"].problem["next_n"] == 1
    assert isinstance(two.kernels["score"].problem, Problem)


def test_explain_step_is_one_row_per_role_with_its_implementation_and_why():
    indexer = Indexer(V4_TINY).init_random(3)
    text = indexer.explain_step(2, True)
    head, columns, *rows = text.splitlines()
    assert head == "v4-tiny on cpu: a decode step of 2 token(s), next_n 1, paged64_fp8_e4m3 cache"
    assert columns.split() == ["role", "op", "implementation", "why"]
    plan = indexer.step_plan(2, True)
    assert [row.split()[0] for row in rows] == list(plan.kernels)
    by_role = {row.split()[0]: row for row in rows}
    assert by_role["c4_pool"].split()[1:3] == ["c4_compress_pool", "c4_compress_pool.reference.torch"]
    assert "C4: pool the entries" in by_role["c4_pool"]
    assert "lightning_indexer.generic.composed" in by_role["score"] and "priority 1" in by_role["score"]
    prefill = Indexer(V32_TINY).init_random(3).explain_step(8, False)
    assert "ragged_mqa_topk" in prefill and "a prefill step of 8 token(s)" in prefill
