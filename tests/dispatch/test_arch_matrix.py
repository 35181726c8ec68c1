"""The arch matrix: for every target x every op, the implementation resolution picks, with vendor libraries
simulated as present or absent. The golden table below is the design, written down and reviewed by hand:
vendor libraries (DeepGEMM on sm90/sm100, aiter on gfx942/gfx950, aiter's CK block-scale GEMM there too but not on
gfx1250 (unverified there), aiter's fused RMSNorm + quant also on gfx1250 but not on gfx942's e4m3fnuz) where they
serve the shape, Triton on every NVIDIA and AMD arch, the pure-torch reference elsewhere; the dual-stream pipeline on
CUDA targets only."""

import pytest

from dsa_indexer.cli import _problem_for
from dsa_indexer.dispatch import Environment, Problem, Registry, load_plugins, parse_target

ENVIRONMENTS = {
    "none": dict(gpu=True),
    "triton": dict(gpu=True, triton=True),
    "vendor": dict(gpu=True, triton=True, deep_gemm=True, aiter=True, torch_npu=True),
}
OPS = ("gemm_fp8_blockscale", "indexer_pipeline", "k_prologue_store", "lightning_indexer", "paged_mqa_logits",
       "q_prologue", "quant_fp8_groups", "ragged_mqa_logits", "rmsnorm_quant_fp8", "topk_indices",
       "k_prologue_store_plain", "lightning_indexer_ragged", "q_prologue_plain", "ragged_mqa_topk")

# Columns follow OPS. ref = reference.torch, tri = triton.<module>, dg = cuda.deepgemm, ai = rocm.aiter,
# ais = rocm.aiter_stable (aiter's top-k with stable=True),
# 1s = generic.single_stream, 2s = cuda.dual_stream, cmp = generic.composed; npu: the plain cache layout its platform
# allocates (p1s = generic.plain_single_stream, n2s = npu.two_stream, npu = npu.torch_npu).
GOLDEN = """
sm90    none    ref 2s  ref cmp ref ref ref ref ref ref ref ref ref cmp
sm90    triton  tri 2s  tri cmp tri tri tri tri tri tri ref ref ref cmp
sm90    vendor  dg  2s  tri cmp dg  tri tri dg  tri tri ref ref ref cmp
sm100   none    ref 2s  ref cmp ref ref ref ref ref ref ref ref ref cmp
sm100   triton  tri 2s  tri cmp tri tri tri tri tri tri ref ref ref cmp
sm100   vendor  tri 2s  tri cmp dg  tri tri dg  tri tri ref ref ref cmp
sm120   none    ref 2s  ref cmp ref ref ref ref ref ref ref ref ref cmp
sm120   triton  tri 2s  tri cmp tri tri tri tri tri tri ref ref ref cmp
sm120   vendor  tri 2s  tri cmp tri tri tri tri tri tri ref ref ref cmp
gfx942  none    ref 1s  ref cmp ref ref ref ref ref ref ref ref ref cmp
gfx942  triton  tri 1s  tri cmp tri tri tri tri tri tri ref ref ref cmp
gfx942  vendor  ai  1s  tri cmp ai  tri tri ai  tri ais ref ref ref cmp
gfx950  none    ref 1s  ref cmp ref ref ref ref ref ref ref ref ref cmp
gfx950  triton  tri 1s  tri cmp tri tri tri tri tri tri ref ref ref cmp
gfx950  vendor  ai  1s  tri cmp ai  tri tri ai  ai  ais ref ref ref cmp
gfx1250 none    ref 1s  ref cmp ref ref ref ref ref ref ref ref ref cmp
gfx1250 triton  tri 1s  tri cmp tri tri tri tri tri tri ref ref ref cmp
gfx1250 vendor  tri 1s  tri cmp tri tri tri tri ai  tri ref ref ref cmp
npu     none    ref p1s ref cmp ref ref ref ref ref ref ref ref ref cmp
npu     triton  ref p1s ref cmp ref ref ref ref ref ref ref ref ref cmp
npu     vendor  ref n2s ref cmp ref ref ref ref ref ref npu npu npu cmp
cpu     none    ref 1s  ref cmp ref ref ref ref ref ref ref ref ref cmp
cpu     triton  ref 1s  ref cmp ref ref ref ref ref ref ref ref ref cmp
cpu     vendor  ref 1s  ref cmp ref ref ref ref ref ref ref ref ref cmp
"""
SHORT = {"ref": "reference.torch", "dg": "cuda.deepgemm", "ai": "rocm.aiter", "ais": "rocm.aiter_stable", "1s": "generic.single_stream",
         "2s": "cuda.dual_stream", "cmp": "generic.composed", "p1s": "generic.plain_single_stream",
         "n2s": "npu.two_stream", "npu": "npu.torch_npu"}
TRITON_MODULE = {"gemm_fp8_blockscale": "gemm", "k_prologue_store": "prologue", "q_prologue": "prologue",
                 "paged_mqa_logits": "logits", "ragged_mqa_logits": "logits", "quant_fp8_groups": "quant",
                 "rmsnorm_quant_fp8": "quant", "topk_indices": "topk", "ragged_mqa_topk": "fused_topk"}


def _expected():
    for line in GOLDEN.strip().splitlines():
        target, env, *cells = line.split()
        assert len(cells) == len(OPS)
        for op, cell in zip(OPS, cells):
            impl = f"triton.{TRITON_MODULE[op]}" if cell == "tri" else SHORT[cell]
            yield target, env, op, f"{op}.{impl}"


@pytest.fixture(scope="module")
def registry():
    reg = Registry(environment=Environment.simulated())
    load_plugins(reg, entry_points=False)  # the built-in backends only: third-party plugins must not change this
    assert not reg.plugins_failed, reg.plugins_failed
    return reg


@pytest.fixture(scope="module")
def environments():
    return {name: Environment.simulated(**facts) for name, facts in ENVIRONMENTS.items()}


@pytest.mark.parametrize("target, env, op, expected", list(_expected()),
                         ids=[f"{t}-{e}-{o}" for t, e, o, _ in _expected()])
def test_golden_arch_matrix(registry, environments, target, env, op, expected):
    tgt = parse_target(target)
    res = registry.resolve(op, tgt, _problem_for(op, tgt, {}), environment=environments[env])
    assert res.chosen is not None and res.chosen.impl_id == expected, res.explain()


def _reason(registry, env, target, op, impl_id, problem):
    res = registry.resolve(op, parse_target(target), problem, environment=env)
    return {c.impl.impl_id: c.reason for c in res.candidates}[impl_id], res


def test_reasons_name_the_missing_library(registry, environments):
    reason, _ = _reason(registry, environments["triton"], "sm90", "paged_mqa_logits",
                        "paged_mqa_logits.cuda.deepgemm", _problem_for("paged_mqa_logits", parse_target("sm90"), {}))
    assert "deep_gemm" in reason
    reason, _ = _reason(registry, environments["none"], "gfx950", "topk_indices", "topk_indices.triton.topk",
                        Problem(k=2048, slots=False, starts=False))
    assert "triton" in reason
    reason, _ = _reason(registry, environments["vendor"], "npu", "topk_indices", "topk_indices.triton.topk",
                        Problem(k=2048, slots=False, starts=False))
    assert reason == "serves sm90, sm100, sm120, gfx942, gfx950, gfx1250, not npu"


def test_unsupported_shapes_fall_to_triton_with_a_reason(registry, environments):
    env = environments["vendor"]
    problem = Problem(heads=128, dim=128, next_n=1, fp8="fn")
    reason, res = _reason(registry, env, "sm90", "paged_mqa_logits", "paged_mqa_logits.cuda.deepgemm", problem)
    assert "heads=128" in reason and res.chosen.impl_id == "paged_mqa_logits.triton.logits"
    problem = Problem(heads=64, dim=128, next_n=3, fp8="fn")
    reason, res = _reason(registry, env, "sm90", "paged_mqa_logits", "paged_mqa_logits.cuda.deepgemm", problem)
    assert "next_n=3" in reason and res.chosen.impl_id == "paged_mqa_logits.triton.logits"
    reason, res = _reason(registry, env, "sm90", "indexer_pipeline", "indexer_pipeline.cuda.dual_stream",
                          Problem(tokens=4096, decode=False, q_lora_quant=False))
    assert "4096 > 1024" in reason and res.chosen.impl_id == "indexer_pipeline.generic.single_stream"


def test_fp8_flavour_must_match_the_arch(registry, environments):
    env = environments["vendor"]
    reason, res = _reason(registry, env, "gfx950", "ragged_mqa_logits", "ragged_mqa_logits.rocm.aiter",
                          Problem(heads=64, dim=128, fp8="fnuz"))
    assert "fnuz" in reason
