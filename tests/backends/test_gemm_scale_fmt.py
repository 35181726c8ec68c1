"""The ``scale_fmt`` fact of ``gemm_fp8_blockscale`` ("ue8m0" | "fp32", both operands' scales): what resolution does
with it on a simulated sm100 (DeepGEMM reads packed ue8m0 scales there), where the Indexer takes the weight's half of
it (read once at weight load), and that nothing in a step's GEMM path reads a value to know it.

DeepGEMM here is `FakeDeepGemmSm100` (tests/doubles/deep_gemm_sm100.py), a TEST DOUBLE of DeepGEMM's sm100 API, not
DeepGEMM: it checks the packed arguments and computes with the reference kernels on independently decoded scales.
"""

import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsa_indexer import IndexerConfig, PrefillBatch, ops
from dsa_indexer.backends.cuda import deepgemm as dg
from dsa_indexer.backends.cuda import deepgemm_kernels
from dsa_indexer.backends.reference import kernels as ref
from dsa_indexer.contract.validate import IndexerInputError
from dsa_indexer.dispatch import Environment, Problem, Registry, load_plugins
from dsa_indexer.dispatch.target import Target
from dsa_indexer.indexer import Indexer
from doubles.deep_gemm_sm100 import FakeDeepGemmSm100, random_pow2

SM90, SM100 = Target("cuda", "sm90"), Target("cuda", "sm100")
DG = "gemm_fp8_blockscale.cuda.deepgemm"
GEMM = dict(n=8192, k=1536, out="torch.bfloat16", fp8="fn")
TRITON_AND_DG = Environment.simulated(gpu=True, triton=True, deep_gemm=True)


def _verdict(res, impl_id):
    return next(c for c in res.candidates if c.impl.impl_id == impl_id)


# --- resolution ------------------------------------------------------------------------------------------------------
def test_sm100_ue8m0_gets_deepgemm(registry):
    res = registry.resolve("gemm_fp8_blockscale", SM100, Problem(**GEMM, scale_fmt="ue8m0"), environment=TRITON_AND_DG)
    assert res.chosen.impl_id == DG, res.explain()
    assert "ue8m0" in res.chosen.capabilities.describe()["scale_fmt"]


def test_sm100_fp32_goes_to_triton_with_the_reason(registry):
    res = registry.resolve("gemm_fp8_blockscale", SM100, Problem(**GEMM, scale_fmt="fp32"), environment=TRITON_AND_DG)
    assert res.chosen.impl_id == "gemm_fp8_blockscale.triton.gemm"
    verdict = _verdict(res, DG)
    assert not verdict.accepted and "scale_fmt=fp32" in verdict.reason and "sm100 takes ue8m0" in verdict.reason
    assert "scale_fmt=fp32" in res.explain()
    # Without Triton the reference takes it (never DeepGEMM).
    no_triton = Environment.simulated(gpu=True, deep_gemm=True)
    res = registry.resolve("gemm_fp8_blockscale", SM100, Problem(**GEMM, scale_fmt="fp32"), environment=no_triton)
    assert res.chosen.impl_id == "gemm_fp8_blockscale.reference.torch"


def test_sm100_problem_without_the_fact_is_refused(registry):
    res = registry.resolve("gemm_fp8_blockscale", SM100, Problem(**GEMM), environment=TRITON_AND_DG)
    assert res.chosen.impl_id != DG and "does not say its scale_fmt" in _verdict(res, DG).reason


@pytest.mark.parametrize("fmt", ["fp32", "ue8m0"])
def test_sm90_takes_both_formats(registry, fmt):
    res = registry.resolve("gemm_fp8_blockscale", SM90, Problem(**GEMM, scale_fmt=fmt), environment=TRITON_AND_DG)
    assert res.chosen.impl_id == DG


def test_the_op_builds_the_fact_from_its_argument_alone():
    """The fact is the caller's host fact: building the problem reads no tensor value (meta tensors have none)."""
    meta = dict(device="meta")
    a = torch.empty(4, 256, dtype=torch.float8_e4m3fn, **meta)
    b = torch.empty(128, 256, dtype=torch.float8_e4m3fn, **meta)
    sa, sb = torch.empty(4, 2, **meta), torch.empty(1, 2, **meta)
    for fmt in ("ue8m0", "fp32"):
        assert ops.gemm_fp8_blockscale.problem(a, sa, b, sb, torch.bfloat16, fmt)["scale_fmt"] == fmt
    assert ops.gemm_problem(b, torch.bfloat16, "ue8m0")["scale_fmt"] == "ue8m0"


def test_the_op_checks_the_claim_where_ranges_are_checked():
    gen = torch.Generator().manual_seed(11)
    a = torch.randn(4, 256, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(128, 256, generator=gen).to(torch.float8_e4m3fn)
    pow2_a, pow2_b = random_pow2((4, 2), gen), random_pow2((1, 2), gen)
    want = ref.gemm_fp8_blockscale(a, pow2_a, b, pow2_b)
    assert torch.equal(ops.gemm_fp8_blockscale(a, pow2_a, b, pow2_b, torch.bfloat16, "ue8m0"), want)
    with pytest.raises(IndexerInputError, match="b_scales are not all powers of two"):
        ops.gemm_fp8_blockscale(a, pow2_a, b, pow2_b * 1.5, torch.bfloat16, "ue8m0")
    with pytest.raises(IndexerInputError, match="scale_fmt must be one of"):
        ops.gemm_fp8_blockscale(a, pow2_a, b, pow2_b, torch.bfloat16, "e8m0")
    # "fp32" is true of any scales.
    assert torch.equal(ops.gemm_fp8_blockscale(a, pow2_a, b, pow2_b * 1.5, torch.bfloat16, "fp32"),
                       ref.gemm_fp8_blockscale(a, pow2_a, b, pow2_b * 1.5))


def test_scale_format_reads_powers_of_two():
    assert ops.scale_format(torch.tensor([1.0, 0.5, 2.0 ** -126, 2.0 ** 127])) == "ue8m0"
    for bad in (0.3, 0.0, -1.0, float("inf"), float("nan"), 2.0 ** -127):  # 2^-127 is subnormal: no ue8m0 byte
        assert ops.scale_format(torch.tensor([1.0, bad])) == "fp32", bad


# --- the weight's half: read once at load -------------------------------------------------------------------------
def _config(**overrides):
    fields = dict(hidden_size=256, q_lora_rank=256, n_heads=4, topk=16, max_position=2048, scale_fmt="ue8m0",
                  wk_gemm="fp8")
    return IndexerConfig.deepseek_v32(**{**fields, **overrides})


def _pow2_block_quant(weight: torch.Tensor):
    """A block-fp8 weight with power-of-two 128 x 128 scales (2^ceil(log2(amax / 448))), as V4's e8m0 checkpoints
    and DeepSeek's ue8m0 recipe store them."""
    n, k = weight.shape
    blocks = weight.float().view(n // 128, 128, k // 128, 128)
    scale = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448)))
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).view(n, k).to(torch.float8_e4m3fn)
    return q, scale


def _checkpoint(indexer: Indexer, pow2: bool, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    state = {k: v.clone() for k, v in indexer.state_dict().items()}
    for name, (n, k) in (("wq_b", indexer.wq_b.weight.shape), ("wk", indexer.wk.weight.shape)):
        dense = torch.randn(n, k, generator=gen) * k ** -0.5
        if pow2:
            q, s = _pow2_block_quant(dense)
        else:
            from dsa_indexer.contract.weights import quantize_block_fp8

            q, s = quantize_block_fp8(dense)
        state[f"{name}.weight"], state[f"{name}.weight_scale_inv"] = q, s
    return state


def test_load_records_each_weights_format_and_the_gemm_fact_needs_both():
    indexer = Indexer(_config(), device="cpu", target="sm100").init_random(1)
    # init_random's amax scales are not powers of two
    assert indexer.record_weight_scale_formats() == {"wq_b": "fp32", "wk": "fp32"}
    assert indexer.gemm_scale_fmt("wq_b") == "fp32"
    indexer.load_checkpoint(_checkpoint(indexer, pow2=True))
    assert (indexer.weight_scale_fmt("wq_b"), indexer.weight_scale_fmt("wk")) == ("ue8m0", "ue8m0")
    assert indexer.gemm_scale_fmt("wq_b") == "ue8m0"
    # The activation's half: an fp32 recipe makes the GEMM's fact fp32 whatever the weight holds.
    fp32_recipe = Indexer(_config(scale_fmt="fp32"), device="cpu", target="sm100")
    fp32_recipe.load_checkpoint(_checkpoint(fp32_recipe, pow2=True))
    assert fp32_recipe.weight_scale_fmt("wq_b") == "ue8m0" and fp32_recipe.gemm_scale_fmt("wq_b") == "fp32"


def test_non_power_of_two_block_scales_are_marked_fp32_at_load():
    indexer = Indexer(_config(), device="cpu", target="sm100")
    indexer.load_checkpoint(_checkpoint(indexer, pow2=False))
    assert (indexer.weight_scale_fmt("wq_b"), indexer.weight_scale_fmt("wk")) == ("fp32", "fp32")
    plan = indexer.step_plan(8, False)
    assert (plan.wq_b_scale_fmt, plan.wk_scale_fmt) == ("fp32", "fp32")


def test_an_in_place_write_makes_the_format_unknown_until_recorded_again():
    indexer = Indexer(_config(), device="cpu", target="sm100")
    indexer.load_checkpoint(_checkpoint(indexer, pow2=True))
    with torch.no_grad():
        indexer.wq_b.weight_scale_inv.mul_(1.5)  # no longer powers of two, and nobody re-read them
    assert indexer.weight_scale_fmt("wq_b") == "fp32"  # unknown: the safe answer, without a read
    assert indexer.step_plan(8, False).wq_b_scale_fmt == "fp32"
    with torch.no_grad():
        indexer.wq_b.weight_scale_inv.div_(1.5)
    assert indexer.weight_scale_fmt("wq_b") == "fp32"
    assert indexer.record_weight_scale_formats()["wq_b"] == "ue8m0"
    assert indexer.step_plan(8, False).wq_b_scale_fmt == "ue8m0"  # a new plan: the recorded format changed


def test_load_state_dict_and_assigning_a_block_fp8_module_are_loads():
    src = Indexer(_config(), device="cpu", target="sm100")
    src.load_checkpoint(_checkpoint(src, pow2=True))
    dst = Indexer(_config(), device="cpu", target="sm100").init_random(2)
    assert dst.weight_scale_fmt("wq_b") == "fp32"
    dst.load_state_dict(src.state_dict())
    assert dst.weight_scale_fmt("wq_b") == "ue8m0" and dst.weight_scale_fmt("wk") == "ue8m0"
    other = Indexer(_config(), device="cpu", target="sm100").init_random(3)
    other.wq_b = src.wq_b  # what transformers' swap_indexers does
    assert other.weight_scale_fmt("wq_b") == "ue8m0"


# --- end to end on a simulated sm100, with the DeepGEMM double -------------------------------------------------------
@pytest.fixture
def sm100_deepgemm(monkeypatch):
    """A registry that sees an sm100 GPU with deep_gemm (the double) and no Triton; the adapter takes the sm100 forms
    on these CPU tensors. The single-stream strategy: the dual stream needs real CUDA streams."""
    fake = FakeDeepGemmSm100()
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    monkeypatch.setattr(dg.LIBRARY, "detected", None)
    monkeypatch.setattr(deepgemm_kernels, "device_arch_major", lambda device: 10)
    reg = Registry(environment=Environment.simulated(gpu=True, deep_gemm=True))
    load_plugins(reg, entry_points=False)
    reg.force("indexer_pipeline", "indexer_pipeline.generic.single_stream")
    return reg, fake


def _step_inputs(tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 256, generator=gen).to(torch.bfloat16)
    q_lora = torch.randn(tokens, 256, generator=gen).to(torch.bfloat16)
    batch = PrefillBatch.build([0], [tokens], torch.arange(8, dtype=torch.int32).view(1, 8))
    return x, q_lora, batch


def _run(indexer: Indexer, tokens: int = 200, seed: int = 5):
    x, q_lora, batch = _step_inputs(tokens, seed)
    cache = indexer.allocate_cache(8)
    return indexer(x, q_lora, batch.positions, batch, cache), cache


def test_sm100_indexer_runs_deepgemm_for_ue8m0_weights_and_matches_the_reference(sm100_deepgemm):
    reg, fake = sm100_deepgemm
    indexer = Indexer(_config(), device="cpu", target="sm100")
    state = _checkpoint(indexer, pow2=True, seed=7)
    indexer.load_checkpoint(state)
    indexer._registry = reg
    got, got_cache = _run(indexer)
    plan = indexer.step_plan(200, False)
    assert (plan.wq_b_scale_fmt, plan.wk_scale_fmt) == ("ue8m0", "ue8m0")
    chosen = {role: reg.used[key].chosen.impl_id for role in ("wq_b_gemm", "wk_gemm")
              for key in reg.used if key[0] == "gemm_fp8_blockscale"}
    assert set(chosen.values()) == {DG}
    assert [c for c in fake.calls if c[0] == "fp8_fp4_gemm_nt"] == [("fp8_fp4_gemm_nt", (1, 1, 128))] * 2
    # The reference on the CPU target, same weights and inputs. Tolerance: exact. The double decodes the packed
    # ue8m0 bytes (exact for powers of two) and computes with the reference GEMM, so every later step sees the
    # same bits; a packing or fact error would change the keys in the cache or the top-k.
    oracle = Indexer(_config(), device="cpu", target="cpu")
    oracle.load_checkpoint(state)
    want, want_cache = _run(oracle)
    assert torch.equal(got_cache.data, want_cache.data)
    assert torch.equal(got, want)
    assert bool((got[:, 0] >= 0).all())  # every row wrote its first slot (each sees at least its own key)


def test_sm100_indexer_with_fp32_weight_scales_never_calls_deepgemm(sm100_deepgemm):
    reg, fake = sm100_deepgemm
    indexer = Indexer(_config(), device="cpu", target="sm100")
    state = _checkpoint(indexer, pow2=False, seed=8)
    indexer.load_checkpoint(state)
    indexer._registry = reg
    got, _ = _run(indexer, seed=6)
    assert not [c for c in fake.calls if c[0] == "fp8_fp4_gemm_nt"]
    gemms = [res for key, res in reg.used.items() if key[0] == "gemm_fp8_blockscale"]
    assert gemms and all(res.chosen.impl_id == "gemm_fp8_blockscale.reference.torch" for res in gemms)
    assert all("scale_fmt=fp32" in _verdict(res, DG).reason for res in gemms)
    oracle = Indexer(_config(), device="cpu", target="cpu")
    oracle.load_checkpoint(state)
    want, _ = _run(oracle, seed=6)
    assert torch.equal(got, want)


class _NoHostReads(TorchDispatchMode):
    """Fails on any op that hands a tensor's value to the host (``.item()``, ``bool(t)``, ``int(t)``: what a CUDA
    graph capture forbids), and on ``aten.equal`` (a host bool)."""

    FORBIDDEN = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default,
                 torch.ops.aten.is_nonzero.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.FORBIDDEN:
            raise AssertionError(f"host read {func} inside the guarded region")
        return func(*args, **(kwargs or {}))


def test_plan_build_and_the_gemm_call_read_no_value(sm100_deepgemm, monkeypatch):
    """The plan takes the fact from what load recorded, and the sm100 GEMM's path (packing, the memo) reads no value
    where ranges are not checked (a GPU's serving default; patched here because these are CPU tensors)."""
    reg, fake = sm100_deepgemm
    indexer = Indexer(_config(), device="cpu", target="sm100")
    indexer.load_checkpoint(_checkpoint(indexer, pow2=True, seed=9))
    indexer._registry = reg
    monkeypatch.setattr(ops, "scale_format", lambda scales: pytest.fail("scale format read at plan build"))
    # The double's own checks read values (it is not DeepGEMM): inside the guard it only records its arguments.
    # Patched before the plan is built: building it binds the GEMM, whose adapter takes the module's function then.
    recorded = []

    def record(a, b, d, c=None, recipe=None, recipe_a=None, recipe_b=None, compiled_dims="nk",
               disable_ue8m0_cast=False):
        recorded.append((a, b, d, recipe))

    double = fake.fp8_fp4_gemm_nt
    monkeypatch.setattr(fake, "fp8_fp4_gemm_nt", record, raising=False)
    with _NoHostReads():
        plan = indexer.step_plan(64, False)
    assert plan.wq_b_scale_fmt == "ue8m0"
    monkeypatch.setattr(deepgemm_kernels, "ranges_checked", lambda t: False)
    gen = torch.Generator().manual_seed(3)
    a, sa = ref.quant_fp8_groups(torch.randn(64, 256, generator=gen), 128, ue8m0=True)
    fn = reg.function("gemm_fp8_blockscale", indexer.target,
                      ops.gemm_fp8_blockscale.problem(a, sa, plan.weights.wq_b, plan.weights.wq_b_scale,
                                                      torch.bfloat16, plan.wq_b_scale_fmt))
    with _NoHostReads():
        got = fn(a, sa, plan.weights.wq_b, plan.weights.wq_b_scale, torch.bfloat16, plan.wq_b_scale_fmt)
    (packed_a, packed_b, out, recipe), = recorded
    assert out is got
    double(packed_a, packed_b, out, recipe=recipe)  # the double's checks and math, outside the guard
    assert torch.equal(got, ref.gemm_fp8_blockscale(a, sa, plan.weights.wq_b, plan.weights.wq_b_scale))


def test_the_guard_catches_a_host_read():
    with pytest.raises(AssertionError, match="host read"):
        with _NoHostReads():
            bool(torch.ones(3).all())
