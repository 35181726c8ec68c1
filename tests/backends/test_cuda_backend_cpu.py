"""The NVIDIA backend without a GPU: resolution tables, the dual-stream strategy's rules, DeepGEMM API detection,
the adapters' argument handling and masking, and the decode-graph buffers.

The DeepGEMM tests use FAKE ``deep_gemm`` modules (plain Python functions built on the reference kernels, installed
in ``sys.modules``). They test only how the adapters call each API generation and post-process its output
(argument forms, context-length conversion, masking of garbage, contiguity); they say nothing about DeepGEMM's
kernels, which tests/gpu/test_cuda_backend_gpu.py checks on the H200.
"""

import dataclasses
import inspect
import sys
import types

import pytest
import torch

from dsa_indexer import DecodeBatch, IndexKCache, Indexer, IndexerConfig
from dsa_indexer.backends.cuda import GEMM_INPUT_LAYOUT
from dsa_indexer.backends.cuda import deepgemm as dg_adapt
from dsa_indexer.backends.cuda import dual_stream
from dsa_indexer.backends.reference import kernels as ref
from dsa_indexer.contract.cache import PAGE_SIZE, store_rows
from dsa_indexer.dispatch import Environment, Problem, Registry, Target, load_plugins
from dsa_indexer.graphs import DecodeBuffers, DecodeGraph
from dsa_indexer.pipeline import single_stream
from dsa_indexer.contract.quant import Fp8GroupLayout, QuantizedActivation, reuse_rejection
from dsa_indexer.contract.validate import IndexerInputError

SM90, SM100 = Target("cuda", "sm90"), Target("cuda", "sm100")
WITH_DG = Environment.simulated(gpu=True, triton=True, deep_gemm=True)
WITHOUT_DG = Environment.simulated(gpu=True, triton=True, deep_gemm="deep_gemm is not installed (simulated)")
PAGED = dict(heads=64, dim=128, next_n=1, fp8="fn")
RAGGED = dict(heads=64, dim=128, fp8="fn")
GEMM = dict(n=8192, k=1536, out="torch.bfloat16", fp8="fn")


def _candidate(res, impl_id):
    return next(c for c in res.candidates if c.impl.impl_id == impl_id)


# --- resolution table --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", [SM90, SM100])
@pytest.mark.parametrize("op, facts", [("paged_mqa_logits", PAGED), ("ragged_mqa_logits", RAGGED)])
def test_deepgemm_logits_chosen_when_present_triton_when_absent(registry, target, op, facts):
    res = registry.resolve(op, target, Problem(**facts), environment=WITH_DG)
    assert res.chosen.impl_id == f"{op}.cuda.deepgemm"
    assert _candidate(res, f"{op}.triton.logits").reason.startswith("usable, lower priority")
    res = registry.resolve(op, target, Problem(**facts), environment=WITHOUT_DG)
    assert res.chosen.impl_id == f"{op}.triton.logits"
    assert "deep_gemm is not installed" in _candidate(res, f"{op}.cuda.deepgemm").reason


@pytest.mark.parametrize("op", ["paged_mqa_logits", "ragged_mqa_logits"])
@pytest.mark.parametrize("facts, words", [
    (dict(heads=128), "heads=128"), (dict(heads=16), "heads=16"), (dict(dim=64), "head dim 64"),
    (dict(fp8="fnuz"), "fp8=fnuz"),
])
def test_deepgemm_logits_reject_unsupported_shapes_with_a_reason(registry, op, facts, words):
    problem = Problem(**{**(PAGED if op == "paged_mqa_logits" else RAGGED), **facts})
    res = registry.resolve(op, SM90, problem, environment=WITH_DG)
    verdict = _candidate(res, f"{op}.cuda.deepgemm")
    assert not verdict.accepted and words in verdict.reason
    assert res.chosen.impl_id != f"{op}.cuda.deepgemm"  # the next one that fits takes over, visibly


def test_paged_next_n_limits_per_arch(registry):
    res = registry.resolve("paged_mqa_logits", SM90, Problem(**{**PAGED, "next_n": 3}), environment=WITH_DG)
    verdict = _candidate(res, "paged_mqa_logits.cuda.deepgemm")
    assert not verdict.accepted and "next_n=3" in verdict.reason and "sm90" in verdict.reason
    for next_n in (1, 2):
        res = registry.resolve("paged_mqa_logits", SM90, Problem(**{**PAGED, "next_n": next_n}), environment=WITH_DG)
        assert res.chosen.impl_id == "paged_mqa_logits.cuda.deepgemm"
    res = registry.resolve("paged_mqa_logits", SM100, Problem(**{**PAGED, "next_n": 3}), environment=WITH_DG)
    assert res.chosen.impl_id == "paged_mqa_logits.cuda.deepgemm"


def test_deepgemm_serves_only_sm90_and_sm100(registry):
    for target in (Target("cuda", "sm120"), Target("rocm", "gfx950")):
        res = registry.resolve("paged_mqa_logits", target, Problem(**PAGED), environment=WITH_DG)
        assert "serves sm90, sm100" in _candidate(res, "paged_mqa_logits.cuda.deepgemm").reason


def test_gemm_sm90_chosen_with_its_input_layout_sm100_rejected(registry):
    res = registry.resolve("gemm_fp8_blockscale", SM90, Problem(**GEMM), environment=WITH_DG)
    assert res.chosen.impl_id == "gemm_fp8_blockscale.cuda.deepgemm"
    layout = res.chosen.info["input_layout"]
    assert layout == GEMM_INPUT_LAYOUT
    assert (layout.group_size, layout.ue8m0, layout.scale_major, layout.packed_scales) == (128, False, "row", False)
    # Our quant op's output (what attention's fused RMSNorm + quant hands over) is reusable as is.
    quant = QuantizedActivation(torch.zeros(4, 1536, dtype=torch.float8_e4m3fn), torch.ones(4, 12),
                                Fp8GroupLayout(rows=4))
    assert reuse_rejection(quant, torch.zeros(4, 1536, dtype=torch.bfloat16), True, layout) is None
    res = registry.resolve("gemm_fp8_blockscale", SM100, Problem(**GEMM), environment=WITH_DG)
    verdict = _candidate(res, "gemm_fp8_blockscale.cuda.deepgemm")
    assert not verdict.accepted and "scale_fmt" in verdict.reason  # a problem that does not say its scale format
    res = registry.resolve("gemm_fp8_blockscale", SM90, Problem(**{**GEMM, "out": "torch.float16"}),
                           environment=WITH_DG)
    assert "bf16" in _candidate(res, "gemm_fp8_blockscale.cuda.deepgemm").reason


def test_detected_api_without_an_op_rejects_it(monkeypatch):
    registry = Registry()  # fresh: resolutions are cached, and the probe runs before the first one in real use
    load_plugins(registry, entry_points=False)
    api = dg_adapt.DeepGemmApi(version="9.9-fake", gemm_fn="gemm_fp8_fp8_bf16_nt")
    monkeypatch.setattr(dg_adapt.LIBRARY, "detected", (types.ModuleType("deep_gemm"), api))
    res = registry.resolve("paged_mqa_logits", SM90, Problem(**PAGED), environment=WITH_DG)
    assert "has no paged_mqa_logits function" in _candidate(res, "paged_mqa_logits.cuda.deepgemm").reason
    res = registry.resolve("gemm_fp8_blockscale", SM90, Problem(**GEMM), environment=WITH_DG)
    assert res.chosen.impl_id == "gemm_fp8_blockscale.cuda.deepgemm"


def test_simulated_environment_keeps_its_deep_gemm_fact():
    env = Environment.simulated(gpu=True, deep_gemm=True)
    reg = Registry(environment=env)
    load_plugins(reg, entry_points=False)
    assert env.missing("deep_gemm") is None  # not replaced by the real probe


# --- dual-stream strategy ----------------------------------------------------------------------------------------
@pytest.fixture
def fresh_registry():
    reg = Registry()
    load_plugins(reg, entry_points=False)
    return reg


GPU_ENV = Environment.simulated(gpu=True, triton=True)


@pytest.mark.parametrize("target", [SM90, SM100, Target("cuda", "sm120")])
@pytest.mark.parametrize("tokens", [1, 32, 1024])
def test_dual_stream_chosen_for_small_steps_on_cuda(fresh_registry, monkeypatch, target, tokens):
    monkeypatch.delenv(dual_stream.ENABLE_ENV, raising=False)
    monkeypatch.delenv(dual_stream.MAX_TOKENS_ENV, raising=False)
    res = fresh_registry.resolve("indexer_pipeline", target, Problem(tokens=tokens, decode=True, q_lora_quant=False),
                                 environment=GPU_ENV)
    assert res.chosen.impl_id == "indexer_pipeline.cuda.dual_stream"


def test_dual_stream_rejected_above_threshold_when_disabled_and_off_cuda(fresh_registry, monkeypatch):
    monkeypatch.delenv(dual_stream.ENABLE_ENV, raising=False)
    monkeypatch.delenv(dual_stream.MAX_TOKENS_ENV, raising=False)
    problem = Problem(tokens=2048, decode=False, q_lora_quant=False)
    res = fresh_registry.resolve("indexer_pipeline", SM90, problem, environment=GPU_ENV)
    assert res.chosen.impl_id == "indexer_pipeline.generic.single_stream"
    assert "tokens bucket 2048 > 1024" in _candidate(res, dual_stream.IMPL_ID).reason

    small = Problem(tokens=128, decode=True, q_lora_quant=False)
    monkeypatch.setenv(dual_stream.MAX_TOKENS_ENV, "64")
    fresh_registry.clear_cache()  # the variables are read at first resolution; resolutions are cached
    res = fresh_registry.resolve("indexer_pipeline", SM90, small, environment=GPU_ENV)
    assert "tokens bucket 128 > 64" in _candidate(res, dual_stream.IMPL_ID).reason
    monkeypatch.setenv(dual_stream.MAX_TOKENS_ENV, "lots")
    fresh_registry.clear_cache()
    res = fresh_registry.resolve("indexer_pipeline", SM90, small, environment=GPU_ENV)
    assert "is not an integer" in _candidate(res, dual_stream.IMPL_ID).reason

    monkeypatch.delenv(dual_stream.MAX_TOKENS_ENV)
    monkeypatch.setenv(dual_stream.ENABLE_ENV, "0")
    fresh_registry.clear_cache()
    res = fresh_registry.resolve("indexer_pipeline", SM90, small, environment=GPU_ENV)
    assert res.chosen.impl_id == "indexer_pipeline.generic.single_stream"
    assert "DSA_INDEXER_DUAL_STREAM=0" in _candidate(res, dual_stream.IMPL_ID).reason

    monkeypatch.delenv(dual_stream.ENABLE_ENV)
    fresh_registry.clear_cache()
    res = fresh_registry.resolve("indexer_pipeline", Target("rocm", "gfx950"), small, environment=GPU_ENV)
    assert res.chosen.impl_id == "indexer_pipeline.generic.single_stream"
    res = fresh_registry.resolve("indexer_pipeline", SM90, small, environment=Environment.simulated(gpu=False))
    assert res.chosen.impl_id == "indexer_pipeline.generic.single_stream"


def _tiny_indexer(**overrides):
    cfg = IndexerConfig.deepseek_v32(hidden_size=256, q_lora_rank=256, n_heads=4, topk=16, max_position=2048,
                                     **overrides)
    return Indexer(cfg, device="cpu").init_random(3)


def test_dual_stream_on_host_tensors_is_the_single_stream_order():
    indexer = _tiny_indexer()
    t = 5
    x = torch.randn(t, 256, dtype=torch.bfloat16)
    q_lora = torch.randn(t, 256, dtype=torch.bfloat16)
    positions = torch.arange(t) + 40
    slots = torch.arange(t) + 40
    caches = [IndexKCache.allocate(2).data for _ in range(2)]
    plan = indexer.step_plan(t, decode=True)
    got = dual_stream.make_dual_stream()(plan, x, q_lora, positions, slots, caches[0], None)
    want = single_stream(plan, x, q_lora, positions, slots, caches[1], None)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    assert torch.equal(caches[0], caches[1])


# --- fake deep_gemm modules ----------------------------------------------------------------------------------------
def _garbage_view(valid: torch.Tensor, width: int, keep_neginf: bool) -> torch.Tensor:
    """Like DeepGEMM: a view into rows padded to 256 columns; with keep_neginf False, garbage (including NaN)
    where the reference has -inf."""
    rows = valid.shape[0]
    stride = -(-max(width, 1) // 256) * 256 + 256
    buf = torch.full((rows, stride), 777.0)
    junk = torch.randn(rows, width) * 1e4
    junk[:, ::7] = float("nan")
    buf[:, :width] = valid if keep_neginf else torch.where(torch.isneginf(valid), junk, valid)
    return buf[:, :width]


def _fake_module(generation: str) -> types.ModuleType:
    """A fake deep_gemm of one API generation (see the module docstring: argument handling only).

    "legacy_1d": fp8_paged_mqa_logits with 1-D context lens (causal next_n semantics), fp8_mqa_logits without
    max_seqlen_k, gemm_fp8_fp8_bf16_nt. "legacy_2d": the legacy names but 2-D lens only (a later build).
    "fp8_fp4": tuple q, logits_dtype, 2-D lens only, clean_logits=True asserts for paged, fp8_gemm_nt.
    """
    mod = types.ModuleType("deep_gemm")
    mod.__version__ = f"0.0-fake-{generation}"
    mod.calls = []

    def record(name, *args, **kwargs):
        mod.calls.append((name, args, kwargs))

    def get_num_sms():
        return 6

    def metadata(context_lens, block_kv, num_sms):
        record("get_paged_mqa_logits_metadata", context_lens, block_kv, num_sms)
        if generation == "legacy_1d" and context_lens.dim() != 1:
            raise RuntimeError("Assertion error: context_lens.dim() == 1")
        if generation != "legacy_1d" and context_lens.dim() != 2:
            raise RuntimeError("Assertion error: context_lens.dim() == 2")
        return torch.zeros(num_sms + 1, 2, dtype=torch.int32)

    def paged_compute(q, kv_cache, weights, context_lens, block_table, max_context_len):
        if context_lens.dim() == 1:
            n = q.shape[1]
            lens = (context_lens[:, None].long() - n + torch.arange(n)[None, :] + 1).clamp_min(0).to(torch.int32)
        else:
            lens = context_lens
        valid = ref.paged_mqa_logits(q, kv_cache, weights, lens, block_table, max_context_len)
        return _garbage_view(valid, max_context_len, keep_neginf=False)

    def ragged_compute(q, kv, weights, ks, ke, clean):
        valid = ref.ragged_mqa_logits(q, kv[0], kv[1], weights, ks, ke)
        return _garbage_view(valid, kv[0].shape[0], keep_neginf=clean)

    def gemm_compute(a, b, d):
        d.copy_(ref.gemm_fp8_blockscale(a[0], a[1], b[0], b[1], d.dtype))

    mod.get_num_sms = get_num_sms
    mod.get_paged_mqa_logits_metadata = metadata
    if generation in ("legacy_1d", "legacy_2d"):
        def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                                 clean_logits=False):
            record("fp8_paged_mqa_logits", q, kv_cache, weights, context_lens, block_table, schedule_meta,
                   max_context_len, clean_logits=clean_logits)
            assert isinstance(q, torch.Tensor), "the legacy API takes a bare q"
            if (context_lens.dim() == 1) != (generation == "legacy_1d"):
                raise RuntimeError(f"Assertion error: context_lens has {context_lens.dim()} dims")
            return paged_compute(q, kv_cache, weights, context_lens, block_table, max_context_len)

        def fp8_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=True):
            record("fp8_mqa_logits", q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=clean_logits)
            assert isinstance(q, torch.Tensor)
            return ragged_compute(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits)

        def gemm_fp8_fp8_bf16_nt(lhs, rhs, out):
            record("gemm_fp8_fp8_bf16_nt", lhs, rhs, out)
            gemm_compute(lhs, rhs, out)

        def get_col_major_tma_aligned_tensor(x):
            record("get_col_major_tma_aligned_tensor", x)
            return x

        mod.fp8_paged_mqa_logits = fp8_paged_mqa_logits
        mod.fp8_mqa_logits = fp8_mqa_logits
        mod.gemm_fp8_fp8_bf16_nt = gemm_fp8_fp8_bf16_nt
        mod.get_col_major_tma_aligned_tensor = get_col_major_tma_aligned_tensor
    else:
        def fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                                     clean_logits=False, logits_dtype=torch.float32, indices=None):
            record("fp8_fp4_paged_mqa_logits", q, kv_cache, weights, context_lens, block_table, schedule_meta,
                   max_context_len, clean_logits=clean_logits, logits_dtype=logits_dtype)
            assert isinstance(q, tuple) and q[1] is None, "the fp8_fp4 API takes (q, None)"
            if context_lens.dim() != 2:
                raise RuntimeError("Assertion error: context_lens.dim() == 2")
            if clean_logits:
                raise RuntimeError("Assertion error: not is_context_lens_2d")
            return paged_compute(q[0], kv_cache, weights, context_lens, block_table, max_context_len)

        def fp8_fp4_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=True,
                               max_seqlen_k=0, logits_dtype=torch.float32):
            record("fp8_fp4_mqa_logits", q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end,
                   clean_logits=clean_logits, max_seqlen_k=max_seqlen_k, logits_dtype=logits_dtype)
            assert isinstance(q, tuple) and q[1] is None
            return ragged_compute(q[0], kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits)

        def fp8_gemm_nt(a, b, d, c=None, recipe=None, compiled_dims="nk", disable_ue8m0_cast=False):
            record("fp8_gemm_nt", a, b, d, c=c, recipe=recipe)
            gemm_compute(a, b, d)

        mod.fp8_fp4_paged_mqa_logits = fp8_fp4_paged_mqa_logits
        mod.fp8_fp4_mqa_logits = fp8_fp4_mqa_logits
        mod.fp8_gemm_nt = fp8_gemm_nt
    return mod


def _paged_problem(next_n: int, heads: int = 32, seed: int = 0, seq=(300, 70, 129)):
    gen = torch.Generator().manual_seed(seed)
    batch = len(seq)
    pages = 3 * 6
    cache = torch.zeros(pages, PAGE_SIZE, 1, 132, dtype=torch.uint8)
    k_fp8, k_scale = ref.quant_fp8_groups(torch.randn(pages * PAGE_SIZE, 128, generator=gen), 128)
    store_rows(cache, torch.arange(pages * PAGE_SIZE), k_fp8, k_scale.squeeze(-1))
    table = torch.randperm(pages, generator=gen).to(torch.int32).view(batch, 6)
    db = DecodeBatch.build(list(seq), table, next_n=next_n, max_context_len=333)
    q, _ = ref.quant_fp8_groups(torch.randn(batch, next_n, heads, 128, generator=gen), 128)
    weights = torch.randn(batch * next_n, heads, generator=gen)
    return q, cache, weights, db.context_lens, db.block_table, db.max_context_len


@pytest.mark.parametrize("generation, paged, ragged, gemm, lens_2d", [
    ("legacy_1d", "fp8_paged_mqa_logits", "fp8_mqa_logits", "gemm_fp8_fp8_bf16_nt", None),
    ("legacy_2d", "fp8_paged_mqa_logits", "fp8_mqa_logits", "gemm_fp8_fp8_bf16_nt", None),
    ("fp8_fp4", "fp8_fp4_paged_mqa_logits", "fp8_fp4_mqa_logits", "fp8_gemm_nt", True),
])
def test_api_generation_detected_by_names_and_signatures(generation, paged, ragged, gemm, lens_2d):
    """Fake deep_gemm modules (adapter argument handling only, not DeepGEMM): names and parameters decide."""
    api = dg_adapt.detect_api(_fake_module(generation))
    assert (api.paged_fn, api.ragged_fn, api.gemm_fn, api.context_lens_2d) == (paged, ragged, gemm, lens_2d)
    assert api.version == f"0.0-fake-{generation}"
    assert ("logits_dtype" in api.paged_params) == (generation == "fp8_fp4")
    assert ("max_seqlen_k" in api.ragged_params) == (generation == "fp8_fp4")
    assert api.generation == ("fp8_fp4" if generation == "fp8_fp4" else "legacy")


@pytest.mark.parametrize("generation, lens_2d", [("legacy_1d", False), ("legacy_2d", True), ("fp8_fp4", True)])
def test_self_test_settles_the_context_lens_form(generation, lens_2d):
    """Fakes (argument handling only, not DeepGEMM): a legacy API tries 1-D lengths first, then 2-D."""
    mod = _fake_module(generation)
    api = dg_adapt.self_test(mod, dg_adapt.detect_api(mod), "cpu")
    assert api.context_lens_2d is lens_2d and api.self_tested


def test_self_test_reports_a_wrong_kernel():
    mod = _fake_module("fp8_fp4")
    real = mod.fp8_fp4_paged_mqa_logits

    def off_by_a_bit(*args, **kwargs):
        out = real(*args, **kwargs)
        return out * 1.01
    mod.fp8_fp4_paged_mqa_logits = off_by_a_bit
    with pytest.raises(RuntimeError, match="differ from the reference"):
        dg_adapt.self_test(mod, dg_adapt.detect_api(mod), "cpu")


def test_gemm_only_module_is_detected_and_self_tested_on_the_gemm():
    mod = _fake_module("legacy_1d")
    for name in ("fp8_paged_mqa_logits", "fp8_mqa_logits", "get_paged_mqa_logits_metadata"):
        delattr(mod, name)
    api = dg_adapt.detect_api(mod)
    assert (api.generation, api.paged_fn, api.ragged_fn) == ("gemm only", None, None)
    assert dg_adapt.self_test(mod, api, "cpu").self_tested
    with pytest.raises(RuntimeError, match="no paged MQA logits API"):
        dg_adapt.make_paged_mqa_logits(mod, api)
    assert dg_adapt.detect_api(types.ModuleType("deep_gemm")).generation == "none"


class _PybindLike:
    """A callable without an inspectable signature, documented the way pybind11 documents its functions."""

    __name__ = "fp8_fp4_paged_mqa_logits"
    __doc__ = ("fp8_fp4_paged_mqa_logits(q: tuple[torch.Tensor, typing.Optional[torch.Tensor]], kv_cache: torch.Tensor, "
               "weights: torch.Tensor, context_lens: torch.Tensor, block_table: torch.Tensor, schedule_meta: "
               "torch.Tensor, max_context_len: int, clean_logits: bool = False, logits_dtype: torch.dtype = "
               "torch.float32, indices: typing.Optional[torch.Tensor] = None) -> torch.Tensor\n")

    @property
    def __signature__(self):
        raise ValueError("no signature found for builtin")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError


def test_parameter_names_read_from_pybind_docstrings():
    with pytest.raises(ValueError):
        inspect.signature(_PybindLike())
    assert dg_adapt.param_names(_PybindLike()) == (
        "q", "kv_cache", "weights", "context_lens", "block_table", "schedule_meta", "max_context_len", "clean_logits",
        "logits_dtype", "indices")


@pytest.mark.parametrize("next_n", [1, 2])
def test_paged_adapter_legacy_1d_passes_last_lengths_and_masks_garbage(next_n):
    """Fake legacy API (argument handling only, not DeepGEMM): 1-D lengths in, garbage and NaN out -> -inf."""
    mod = _fake_module("legacy_1d")
    api = dg_adapt.self_test(mod, dg_adapt.detect_api(mod), "cpu")
    mod.calls.clear()
    args = _paged_problem(next_n)
    got = dg_adapt.make_paged_mqa_logits(mod, api)(*args)
    want = ref.paged_mqa_logits(*args)
    assert got.is_contiguous() and got.shape == want.shape  # 333 columns: DeepGEMM's view is padded, so a copy
    assert torch.equal(got, want)  # garbage and NaN past each row's length became -inf
    meta_call, kernel_call = mod.calls
    lens_1d = args[3][:, -1]
    assert meta_call[1][0].dim() == 1 and torch.equal(meta_call[1][0], lens_1d)
    assert meta_call[1][1:] == (64, 6)
    assert isinstance(kernel_call[1][0], torch.Tensor) and torch.equal(kernel_call[1][3], lens_1d)
    assert kernel_call[2] == {"clean_logits": False}


def test_paged_adapter_legacy_1d_refuses_non_causal_lengths_on_the_host():
    mod = _fake_module("legacy_1d")
    adapter = dg_adapt.make_paged_mqa_logits(mod, dataclasses.replace(dg_adapt.detect_api(mod), context_lens_2d=False))
    q, cache, weights, lens, table, width = _paged_problem(2)
    lens = lens.clone()
    lens[1, 0] -= 5
    with pytest.raises(IndexerInputError, match="causal next_n semantics"):
        adapter(q, cache, weights, lens, table, width)
    assert dg_adapt.causal_lens_hold(torch.zeros(3, 2, dtype=torch.int32))  # padding rows are fine


def test_paged_adapter_2d_refuses_rows_longer_than_the_last_on_the_host():
    mod = _fake_module("fp8_fp4")
    q, cache, weights, lens, table, width = _paged_problem(2)
    lens = lens.clone()
    lens[0, 0] = lens[0, 1] + 1
    with pytest.raises(IndexerInputError, match="must be <= context_lens\\[b, -1\\]"):
        dg_adapt.make_paged_mqa_logits(mod, dg_adapt.detect_api(mod))(q, cache, weights, lens, table, width)


@pytest.mark.parametrize("next_n", [1, 2])
def test_paged_adapter_fp8_fp4_passes_tuple_q_2d_lengths_and_masks_garbage(next_n):
    """Fake fp8_fp4 API (argument handling only, not DeepGEMM): (q, None), 2-D lengths, tail masked."""
    mod = _fake_module("fp8_fp4")
    args = _paged_problem(next_n)
    got = dg_adapt.make_paged_mqa_logits(mod, dg_adapt.detect_api(mod))(*args)
    assert got.is_contiguous() and torch.equal(got, ref.paged_mqa_logits(*args))
    meta_call, kernel_call = mod.calls
    assert torch.equal(meta_call[1][0], args[3]) and meta_call[1][0].dim() == 2
    q_arg = kernel_call[1][0]
    assert isinstance(q_arg, tuple) and q_arg[1] is None and torch.equal(q_arg[0].view(torch.uint8),
                                                                          args[0].view(torch.uint8))
    assert kernel_call[2] == {"clean_logits": False, "logits_dtype": torch.float32}


def test_paged_adapter_returns_the_view_when_it_is_already_contiguous():
    mod = _fake_module("fp8_fp4")
    q, cache, weights, lens, table, _ = _paged_problem(1, seq=(200, 256, 3))
    real = mod.fp8_fp4_paged_mqa_logits

    def exact_width(*args, **kwargs):  # DeepGEMM's view spans the whole row when the width is a multiple of 256
        out = real(*args, **kwargs)
        full = torch.full((out.shape[0], out.shape[1]), 5.0)
        full.copy_(out)
        return full
    mod.fp8_fp4_paged_mqa_logits = exact_width
    adapter = dg_adapt.make_paged_mqa_logits(mod, dg_adapt.detect_api(mod))
    got = adapter(q, cache, weights, lens, table[:, :4], 256)
    assert got.is_contiguous() and torch.equal(got, ref.paged_mqa_logits(q, cache, weights, lens, table[:, :4], 256))


def _ragged_problem(seed=0, s=40, n=100, heads=32):
    gen = torch.Generator().manual_seed(seed)
    q, _ = ref.quant_fp8_groups(torch.randn(s, heads, 128, generator=gen), 128)
    k, k_scale = ref.quant_fp8_groups(torch.randn(n, 128, generator=gen), 128)
    weights = torch.randn(s, heads, generator=gen)
    ke = (torch.arange(s) + n - s + 1).to(torch.int32)  # causal: query i sees keys < n - s + i + 1
    ks = torch.zeros(s, dtype=torch.int32)
    ks[s // 2:] = 10  # a second "request" starting at key 10
    return q, k, k_scale.squeeze(-1), weights, ks, ke


@pytest.mark.parametrize("generation", ["legacy_1d", "fp8_fp4"])
def test_ragged_adapter_asks_for_clean_logits_and_returns_contiguous(generation):
    """Fakes (argument handling only, not DeepGEMM): clean_logits=True, max_seqlen_k left at 0, a copy back."""
    mod = _fake_module(generation)
    args = _ragged_problem()
    got = dg_adapt.make_ragged_mqa_logits(mod, dg_adapt.detect_api(mod))(*args)
    assert got.is_contiguous() and torch.equal(got, ref.ragged_mqa_logits(*args))
    (name, call_args, kwargs), = mod.calls
    assert kwargs["clean_logits"] is True
    assert "max_seqlen_k" not in kwargs or kwargs["max_seqlen_k"] == 0  # 0: absolute column indices
    if generation == "fp8_fp4":
        assert isinstance(call_args[0], tuple) and call_args[0][1] is None
        assert kwargs["logits_dtype"] == torch.float32
    else:
        assert isinstance(call_args[0], torch.Tensor) and set(kwargs) == {"clean_logits"}
    assert isinstance(call_args[1], tuple) and len(call_args[1]) == 2


def test_ragged_adapter_masks_itself_when_the_api_cannot_clean():
    mod = _fake_module("legacy_1d")
    real = mod.fp8_mqa_logits

    def no_clean_option(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end):
        return real(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=False)
    mod.fp8_mqa_logits = no_clean_option
    args = _ragged_problem(seed=2)
    got = dg_adapt.make_ragged_mqa_logits(mod, dg_adapt.detect_api(mod))(*args)
    assert torch.equal(got, ref.ragged_mqa_logits(*args))


@pytest.mark.parametrize("generation, m", [("legacy_1d", 1), ("legacy_1d", 70), ("fp8_fp4", 1), ("fp8_fp4", 130)])
def test_gemm_adapter_argument_forms(generation, m):
    """Fakes (argument handling only, not DeepGEMM): ((a, sfa), (b, sfb), d) and the recipe where it exists."""
    mod = _fake_module(generation)
    gen = torch.Generator().manual_seed(m)
    a, sa = ref.quant_fp8_groups(torch.randn(m, 256, generator=gen), 128)
    b = (torch.randn(384, 256, generator=gen) * 0.3).to(torch.float8_e4m3fn)
    sb = torch.rand(3, 2, generator=gen) + 0.5
    got = dg_adapt.make_gemm_fp8_blockscale(mod, dg_adapt.detect_api(mod))(a, sa, b, sb, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (m, 384) and got.is_contiguous()
    assert torch.equal(got, ref.gemm_fp8_blockscale(a, sa, b, sb))
    name, call_args, kwargs = mod.calls[-1]
    assert isinstance(call_args[0], tuple) and isinstance(call_args[1], tuple) and call_args[2] is got
    if generation == "fp8_fp4":
        assert name == "fp8_gemm_nt" and kwargs["recipe"] == (1, 128, 128)
    else:
        assert name == "gemm_fp8_fp8_bf16_nt" and mod.calls[0][0] == "get_col_major_tma_aligned_tensor"
    with pytest.raises(IndexerInputError, match="bf16"):
        dg_adapt.make_gemm_fp8_blockscale(mod, dg_adapt.detect_api(mod))(a, sa, b, sb, torch.float32)


# --- the probe and the factories ---------------------------------------------------------------------------------
def _real_deep_gemm_installed() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("deep_gemm") is not None
    except (ImportError, ValueError):
        return False


def test_probe_without_cuda_returns_a_reason(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if not _real_deep_gemm_installed():
        monkeypatch.delitem(sys.modules, "deep_gemm", raising=False)
        reason = dg_adapt.probe()
        assert reason.startswith("deep_gemm is not installed (")
    monkeypatch.setitem(sys.modules, "deep_gemm", _fake_module("fp8_fp4"))
    assert dg_adapt.probe() == "deep_gemm is installed but torch sees no CUDA device"


def _pretend_gpu(monkeypatch, fake):
    """The probe's GPU path with a fake module: CUDA queries patched, the self-test run on the CPU."""
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.version, "hip", None)
    real = dg_adapt.self_test
    monkeypatch.setattr(dg_adapt, "self_test", lambda module, api, device: real(module, api, "cpu"))
    monkeypatch.setattr(dg_adapt.LIBRARY, "detected", None)


def test_probe_records_the_self_tested_api_and_reports_failures(monkeypatch):
    """The probe's logic with fakes and patched CUDA queries (not DeepGEMM, not a GPU)."""
    fake = _fake_module("legacy_1d")
    _pretend_gpu(monkeypatch, fake)
    assert dg_adapt.probe() is None
    assert dg_adapt.detected_api().context_lens_2d is False
    assert dg_adapt.api_for(fake) is dg_adapt.detected_api()

    broken = _fake_module("fp8_fp4")
    broken.fp8_fp4_paged_mqa_logits = lambda *a, **k: torch.zeros(1, 1)
    _pretend_gpu(monkeypatch, broken)
    reason = dg_adapt.probe()
    assert reason.startswith("deep_gemm 0.0-fake-fp8_fp4 self-test failed: fp8_fp4_paged_mqa_logits with 2-D")
    assert dg_adapt.detected_api() is None

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (12, 0))
    assert "this GPU is sm120" in dg_adapt.probe()


def test_registry_builds_the_adapter_from_the_installed_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", _fake_module("fp8_fp4"))
    monkeypatch.setattr(dg_adapt.LIBRARY, "detected", None)
    reg = Registry()
    load_plugins(reg, entry_points=False)
    reg.set_environment(Environment.simulated(gpu=True, triton=True, deep_gemm=True))
    problem = Problem(heads=32, dim=128, next_n=2, fp8="fn")
    fn = reg.function("paged_mqa_logits", SM90, problem)
    assert reg.used[("paged_mqa_logits", SM90, problem)].chosen.impl_id == "paged_mqa_logits.cuda.deepgemm"
    args = _paged_problem(2)
    assert torch.equal(fn(*args), ref.paged_mqa_logits(*args))


# --- decode-graph buffers (the on-device derivation runs on CPU tensors too) ---------------------------------------
@pytest.mark.parametrize("next_n, ratio", [(1, 1), (2, 1), (1, 4)])
def test_derived_batch_matches_decode_batch_build(next_n, ratio):
    overrides = dict(compress_ratio=4, k_norm="none", topk=16) if ratio == 4 else {}
    cfg = IndexerConfig.deepseek_v32(hidden_size=256, q_lora_rank=256, n_heads=4, max_position=4096, **overrides)
    indexer = Indexer(cfg, device="cpu")
    buffers = DecodeBuffers.allocate(indexer, batch_size=4, max_context_len=512, next_n=next_n,
                                     device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(next_n * 10 + ratio)
    seq = torch.randint(next_n, 512 * ratio, (3,), generator=gen)
    table = torch.randperm(64, generator=gen)[:24].view(3, 8).to(torch.int32)
    rows = buffers.load(torch.zeros(3 * next_n, 256, dtype=torch.bfloat16),
                        torch.zeros(3 * next_n, 256, dtype=torch.bfloat16), seq, table)
    assert rows == 3 * next_n
    got = buffers.derive()
    want = DecodeBatch.build(seq, table, next_n=next_n, compress_ratio=ratio, max_context_len=512)
    live = slice(0, rows)
    assert torch.equal(got.context_lens[:3], want.context_lens)
    assert torch.equal(got.positions[live], want.positions)
    assert torch.equal(got.slot_mapping[live], want.slot_mapping)
    assert torch.equal(got.row_request[live], want.row_request)
    assert (got.max_context_len, got.next_n, got.compress_ratio) == (512, next_n, ratio)
    # Request 3 is padding: it sees nothing and stores nothing.
    assert got.context_lens[3].tolist() == [0] * next_n and got.slot_mapping[rows:].tolist() == [-1] * next_n


def test_buffer_load_validates_arguments_by_name():
    indexer = Indexer(IndexerConfig.deepseek_v32(hidden_size=256, q_lora_rank=256, n_heads=4, max_position=4096),
                      device="cpu")
    buffers = DecodeBuffers.allocate(indexer, 2, 256, 2, torch.device("cpu"))
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    table = torch.zeros(2, 4, dtype=torch.int32)
    seq = torch.tensor([10, 20])
    cases = [
        ((x.float(), x, seq, table), "x must have dtype bfloat16"),
        ((x[:3], x, seq, table), "x must have shape"),
        ((x, x[:, :128], seq, table), "q_lora must have shape"),
        ((x, x, seq.float(), table), "seq_lens must have dtype"),
        ((torch.zeros(6, 256, dtype=torch.bfloat16), x, torch.tensor([5, 5, 5]), table), "1..2 requests"),
        ((x, x, seq, torch.zeros(2, 5, dtype=torch.int32)), "block_table must be"),
        ((x, x, torch.tensor([1, 20]), table), "0 \\(padding\\) or >= next_n=2"),
        ((x, x, torch.tensor([10, 300]), table), "max_context_len=256"),
        ((x, x, torch.tensor([10, 200]), table[:, :2]), "block_table has 2 pages"),
    ]
    for args, words in cases:
        with pytest.raises(IndexerInputError, match=words):
            buffers.load(*args)


def test_derived_batch_drives_the_indexer_like_an_eager_batch():
    indexer = _tiny_indexer()
    cache_graph, cache_eager = IndexKCache.allocate(16), IndexKCache.allocate(16)
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(16 * PAGE_SIZE, 256, generator=gen).to(torch.bfloat16)
    for cache in (cache_graph, cache_eager):  # the same prefix in both caches
        indexer(keys[:300], keys[:300, :256], torch.arange(300), _prefill_batch(300), cache)
    buffers = DecodeBuffers.allocate(indexer, batch_size=3, max_context_len=512, next_n=2, device=torch.device("cpu"))
    seq = torch.tensor([250, 90])
    table = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]], dtype=torch.int32)
    x = torch.randn(4, 256, generator=gen).to(torch.bfloat16)
    q_lora = torch.randn(4, 256, generator=gen).to(torch.bfloat16)
    rows = buffers.load(x, q_lora, seq, table)
    batch = buffers.derive()
    got = indexer(buffers.x, buffers.q_lora, batch.positions, batch, cache_graph)[:rows]
    eager = DecodeBatch.build(seq, table, next_n=2, max_context_len=512)
    want = indexer(x, q_lora, eager.positions, eager, cache_eager)
    assert torch.equal(got, want)
    assert torch.equal(cache_graph.data, cache_eager.data)


def _prefill_batch(tokens):
    from dsa_indexer import PrefillBatch

    return PrefillBatch.build([0], [tokens], torch.arange(8, dtype=torch.int32).view(1, 8))


def test_capture_needs_a_cuda_cache():
    indexer = _tiny_indexer()
    with pytest.raises(IndexerInputError, match="CUDA"):
        DecodeGraph.capture(indexer, IndexKCache.allocate(4), batch_size=2, max_context_len=128)
    with pytest.raises(IndexerInputError, match="warmup must be an int >= 1"):
        indexer.capture_decode(IndexKCache.allocate(4), 2, 128, warmup=0)


def test_prefill_scoring_reads_deepgemms_padded_logits_without_a_copy(monkeypatch):
    """`ragged_mqa_topk.cuda.deepgemm_radix`: the CUDA top-k (here the reference stands in for it: the CUDA
    kernel runs in tests/gpu) gets DeepGEMM's padded-row view itself, with the windows [ks, ke), and selects what
    the top-k of the contiguous logits selects. The fake pads each row with garbage, as DeepGEMM's stride may."""
    from dsa_indexer.backends.cuda import lightning

    mod = _fake_module("fp8_fp4")
    api = dg_adapt.detect_api(mod)
    real = getattr(mod, api.ragged_fn)

    def padded_rows(*args, **kwargs):
        out = real(*args, **kwargs)
        wide = torch.full((out.shape[0], out.shape[1] + 28), 1e30)  # garbage a reader must never select
        wide[:, :out.shape[1]] = out
        return wide[:, :out.shape[1]]

    setattr(mod, api.ragged_fn, padded_rows)
    seen = []

    def recording_topk(logits, k, ends, starts=None, *rest, **out):
        seen.append(logits)
        return ref.topk_indices(logits, k, ends, starts, *rest, **out)

    monkeypatch.setattr(lightning, "topk_indices", recording_topk)
    q, k, k_scales, weights, ks, ke = _ragged_problem(heads=64)
    got = lightning.make_ragged_mqa_topk(mod, api)(q, k, k_scales, weights, ks, ke, 16)
    want = ref.topk_indices(ref.ragged_mqa_logits(q, k, k_scales, weights, ks, ke), 16, ke, ks)
    assert torch.equal(got, want)
    assert not seen[0].is_contiguous() and seen[0].stride(0) == seen[0].shape[1] + 28


@pytest.mark.parametrize("call", ["decode", "decode_slots", "prefill"])
def test_deepgemm_radix_hands_the_callers_out_to_the_cuda_top_k(monkeypatch, call):
    """``lightning_indexer`` / ``ragged_mqa_topk`` ``.cuda.deepgemm_radix`` declare writes_out: the caller's buffer
    goes to the CUDA top-k (the reference stands in for it here, as above), which writes it; the op returns it."""
    from dsa_indexer.backends.cuda import lightning

    mod = _fake_module("fp8_fp4")
    api = dg_adapt.detect_api(mod)
    received = []

    def recording_topk(logits, k, ends, starts=None, *rest, out=None):
        received.append(out)
        return ref.topk_indices(logits, k, ends, starts, *rest, out=out)

    monkeypatch.setattr(lightning, "topk_indices", recording_topk)
    if call == "prefill":
        args = (*_ragged_problem(heads=64), 16)
        run, want = lightning.make_ragged_mqa_topk(mod, api), ref.ragged_mqa_topk(*args)
    else:
        args = (*_paged_problem(next_n=2), 16, call == "decode_slots")
        run, want = lightning.make_lightning_indexer(mod, api), ref.lightning_indexer(*args)
    out = torch.full(want.shape, 12345, dtype=torch.int32)  # no index of this problem: an unwritten one shows
    assert run(*args, out=out) is out
    assert received == [out] and torch.equal(out, want)


def test_prefill_scoring_resolves_to_deepgemm_and_the_cuda_top_k_when_both_are_there():
    registry = Registry()
    load_plugins(registry)
    problem = Problem(heads=64, dim=128, fp8="fn", k=2048)
    both = Environment.simulated(gpu=True, triton=True, deep_gemm=True, cuda_jit=True)
    res = registry.resolve("ragged_mqa_topk", SM90, problem, environment=both)
    assert res.chosen.impl_id == "ragged_mqa_topk.cuda.deepgemm_radix"
    no_jit = Environment.simulated(gpu=True, triton=True, deep_gemm=True, cuda_jit="no nvcc (simulated)")
    res = registry.resolve("ragged_mqa_topk", SM90, problem, environment=no_jit)
    assert res.chosen.impl_id == "ragged_mqa_topk.generic.composed"
    res = registry.resolve("ragged_mqa_topk", SM90, Problem(heads=16, dim=128, fp8="fn", k=2048),
                           environment=both)
    verdict = next(c for c in res.candidates if c.impl.impl_id == "ragged_mqa_topk.cuda.deepgemm_radix")
    assert not verdict.accepted and "heads" in verdict.reason


def test_deepgemm_launches_with_its_pdl_only_around_a_pdl_steps_calls(monkeypatch):
    """`launching_with_pdl`: DeepGEMM's process-wide ``set_pdl`` is on during an adapter call only where the step's
    kernels launch with PDL, and is restored after (an engine's own setting survives, also when the call raises);
    a DeepGEMM without the setting gets the adapter unchanged."""
    import types

    from dsa_indexer.backends.cuda import deepgemm_kernels

    module = types.SimpleNamespace(pdl="engine's own")
    module.set_pdl = lambda value: setattr(module, "pdl", value)
    module.get_pdl = lambda: module.pdl
    seen = []

    def adapter(a, *, fail=False):
        seen.append(module.pdl)
        if fail:
            raise RuntimeError("kernel failed")
        return a

    adapter.api = "the detected api"
    adapter.unmasked = lambda a: seen.append(("unmasked", module.pdl)) or a  # another entry point (lightning.py's)
    wrapped = deepgemm_kernels.launching_with_pdl(adapter, module)
    assert wrapped.api == "the detected api"
    x = torch.zeros(2)
    monkeypatch.setattr(deepgemm_kernels, "pdl_options", lambda device: {})
    assert wrapped(x) is x
    monkeypatch.setattr(deepgemm_kernels, "pdl_options", lambda device: {"PDL": True, "launch_pdl": True})
    assert wrapped(x) is x
    with pytest.raises(RuntimeError, match="kernel failed"):
        wrapped(x, fail=True)
    assert wrapped.unmasked(x) is x
    assert seen == ["engine's own", True, True, ("unmasked", True)] and module.pdl == "engine's own"
    assert deepgemm_kernels.launching_with_pdl(adapter, types.SimpleNamespace()) is adapter
