"""The AMD (aiter) and Ascend (torch_npu) backends without their hardware: resolution tables, the probes, and the
adapters' argument handling.

Most adapter tests use FAKE ``aiter`` / ``torch_npu`` modules installed in ``sys.modules``: plain Python functions
that record their arguments and compute their results with the reference kernels (or, for aiter's ragged logits,
with a torch emulation of the documented block walk, bug included). They test only how the adapters call the
vendor functions and post-process their output; they say nothing about the vendor kernels themselves.

One test runs aiter's REAL Triton logits kernel (from ``$DSA_AITER_PKG``, default ``.deps/aiter_pkg``, skipped when
absent) in Triton's CPU interpreter behind a test-only ``sys.modules`` shim, so the alignment workaround is also
checked against the real bug. tests/gpu/test_rocm_aiter_kernels_on_h200.py does the same on the H200.

Tolerances: ragged logits within 1e-4 x the row's largest |logit| on CPU (the same fp32 products summed in another
order), 2e-3 on a GPU (fp8 MMA accumulation); -inf patterns and top-k index sets exactly.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from pathlib import Path

import pytest
import torch

from dsa_indexer.backends import npu as npu_backend
from dsa_indexer.backends import rocm as rocm_backend
from dsa_indexer.backends.reference import kernels as ref
from dsa_indexer.backends.rocm import aiter_api
from dsa_indexer.backends.rocm import logits as rocm_logits
from dsa_indexer.backends.rocm import topk as rocm_topk
from dsa_indexer.dispatch import Environment, Problem, Registry, Target, load_plugins
from dsa_indexer.contract.quant import PRODUCER_UNROUNDED
from dsa_indexer.contract.validate import IndexerInputError
from doubles.aiter import (PlainPagedKernelDouble, emulated_fp8_mqa_logits, emulated_top_k_per_row_decode,
                           install_fake_aiter, pretend_rocm_gpu)

GFX942, GFX950, GFX1250 = Target("rocm", "gfx942"), Target("rocm", "gfx950"), Target("rocm", "gfx1250")
NPU = Target("npu", "npu")
ROCM_TARGETS = {GFX942: "fnuz", GFX950: "fn"}
WITH_AITER = Environment.simulated(gpu=True, triton=True, aiter=True)
WITHOUT_AITER = Environment.simulated(gpu=True, triton=True, aiter="aiter is not installed (simulated)")
RAGGED = dict(heads=64, dim=128)
TOPK = dict(k=2048, slots=False, starts=False)
AITER_PKG = Path(os.environ.get("DSA_AITER_PKG", Path(__file__).parents[2] / ".deps" / "aiter_pkg"))


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _candidate(res, impl_id):
    return next(c for c in res.candidates if c.impl.impl_id == impl_id)


def _ragged(target, **facts):
    return Problem(**{**RAGGED, "fp8": ROCM_TARGETS.get(target, "fn"), **facts})


# --- resolution: ragged logits -------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", [GFX942, GFX950])
def test_aiter_ragged_logits_chosen_with_aiter_triton_without(registry, target):
    res = registry.resolve("ragged_mqa_logits", target, _ragged(target), environment=WITH_AITER)
    assert res.chosen.impl_id == "ragged_mqa_logits.rocm.aiter"
    assert _candidate(res, "ragged_mqa_logits.triton.logits").reason.startswith("usable, lower priority")
    assert "workaround" in res.explain()
    res = registry.resolve("ragged_mqa_logits", target, _ragged(target), environment=WITHOUT_AITER)
    assert res.chosen.impl_id == "ragged_mqa_logits.triton.logits"
    assert _candidate(res, "ragged_mqa_logits.rocm.aiter").reason == "aiter is not installed (simulated)"


@pytest.mark.parametrize("target, fp8, words", [
    (GFX950, "fnuz", "fp8=fnuz on gfx950: aiter there takes float8_e4m3fn"),
    (GFX942, "fn", "fp8=fn on gfx942: aiter there takes float8_e4m3fnuz"),
])
def test_fp8_flavour_of_the_other_arch_is_rejected(registry, target, fp8, words):
    res = registry.resolve("ragged_mqa_logits", target, _ragged(target, fp8=fp8), environment=WITH_AITER)
    verdict = _candidate(res, "ragged_mqa_logits.rocm.aiter")
    assert not verdict.accepted and words in verdict.reason
    assert res.chosen.impl_id == "ragged_mqa_logits.triton.logits"


def test_gfx1250_is_named_and_not_enabled(registry):
    res = registry.resolve("ragged_mqa_logits", GFX1250, _ragged(GFX1250), environment=WITH_AITER)
    assert res.chosen.impl_id == "ragged_mqa_logits.triton.logits"
    reason = _candidate(res, "ragged_mqa_logits.rocm.aiter").reason
    assert reason.startswith("gfx1250: no public integration runs aiter's fp8_mqa_logits")
    res = registry.resolve("topk_indices", GFX1250, Problem(**TOPK), environment=WITH_AITER)
    assert "gfx1250" in _candidate(res, "topk_indices.rocm.aiter").reason


@pytest.mark.parametrize("facts, words", [
    (dict(heads=48), "heads=48"), (dict(heads=8), "heads=8"), (dict(heads=256), "heads=256"),
    (dict(dim=64), "head dim 64"),
])
def test_ragged_shapes_outside_the_kernel_are_rejected(registry, facts, words):
    res = registry.resolve("ragged_mqa_logits", GFX950, _ragged(GFX950, **facts), environment=WITH_AITER)
    verdict = _candidate(res, "ragged_mqa_logits.rocm.aiter")
    assert not verdict.accepted and words in verdict.reason


@pytest.mark.parametrize("heads", [16, 32, 64, 128])
def test_ragged_power_of_two_heads_accepted(registry, heads):
    res = registry.resolve("ragged_mqa_logits", GFX950, _ragged(GFX950, heads=heads), environment=WITH_AITER)
    assert res.chosen.impl_id == "ragged_mqa_logits.rocm.aiter"


# --- resolution: top-k and the ops aiter does not serve -------------------------------------------------------------
def test_aiter_topk_ranks_below_triton_and_is_usable_when_forced(registry, monkeypatch):
    # With stable=True (newer aiter: lower-index ties, deterministic) aiter's top-k is the default; the plain one
    # (non-deterministic ties) ranks below Triton.
    res = registry.resolve("topk_indices", GFX950, Problem(**TOPK), environment=WITH_AITER)
    assert res.chosen.impl_id == "topk_indices.rocm.aiter_stable"
    assert _candidate(res, "topk_indices.rocm.aiter").reason.startswith("usable, lower priority")
    # An aiter whose top-k has no stable argument: Triton serves, the plain aiter top-k stays below it.
    probed = Environment(probes={}, facts={"gpu": None, "triton": None, "aiter": None}, name="probed-no-stable")
    monkeypatch.setattr(aiter_api.LIBRARY, "detected", (None, aiter_api.AiterApi(
        version="0.0-fake", fp8_dtype=torch.float8_e4m3fn, topk_decode="t")))
    res = registry.resolve("topk_indices", GFX950, Problem(**TOPK), environment=probed)
    assert res.chosen.impl_id == "topk_indices.triton.topk"
    assert "has no function for topk_indices (stable)" in _candidate(res, "topk_indices.rocm.aiter_stable").reason
    assert _candidate(res, "topk_indices.rocm.aiter").reason == "usable, lower priority than topk_indices.triton.topk"
    res = registry.resolve("topk_indices", GFX950, Problem(**TOPK), environment=WITH_AITER,
                           force="topk_indices.rocm.aiter")
    assert res.chosen.impl_id == "topk_indices.rocm.aiter"
    assert "not deterministic" in res.explain()
    no_triton = Environment.simulated(gpu=True, triton=False, aiter=True)
    res = registry.resolve("topk_indices", GFX942, Problem(**TOPK), environment=no_triton)
    assert res.chosen.impl_id == "topk_indices.rocm.aiter_stable"


@pytest.mark.parametrize("facts, words", [(dict(k=512), "k=512"), (dict(starts=True), "ragged row starts")])
def test_aiter_topk_rejects_other_k_and_ragged_starts(registry, facts, words):
    res = registry.resolve("topk_indices", GFX950, Problem(**{**TOPK, **facts}), environment=WITH_AITER,
                           force="topk_indices.rocm.aiter")
    assert res.chosen is None and words in _candidate(res, "topk_indices.rocm.aiter").reason


@pytest.mark.parametrize("op", sorted(rocm_backend.UNREGISTERED))
def test_ops_aiter_cannot_serve_have_no_rocm_implementation(registry, op):
    res = registry.resolve(op, GFX950, Problem(), environment=WITH_AITER)
    assert not [c for c in res.candidates if c.impl.vendor == "rocm"]
    assert res.chosen is not None  # Triton or the reference serves it, visibly


@pytest.mark.parametrize("target", [GFX942, GFX950])
def test_paged_logits_on_rocm_take_aiters_block_kernel_for_next_n_1(registry, target):
    fp8 = ROCM_TARGETS[target]
    res = registry.resolve("paged_mqa_logits", target, Problem(heads=64, dim=128, next_n=1, fp8=fp8),
                           environment=WITH_AITER)
    assert res.chosen.impl_id == "paged_mqa_logits.rocm.aiter"
    res = registry.resolve("paged_mqa_logits", target, Problem(heads=64, dim=128, next_n=2, fp8=fp8),
                           environment=WITH_AITER)
    assert res.chosen.impl_id == "paged_mqa_logits.triton.logits"
    assert "one length per request" in _candidate(res, "paged_mqa_logits.rocm.aiter").reason
    res = registry.resolve("paged_mqa_logits", GFX1250, Problem(heads=64, dim=128, next_n=1, fp8="fn"),
                           environment=WITH_AITER)
    assert "KVBlockSize 1" in _candidate(res, "paged_mqa_logits.rocm.aiter").reason
    res = registry.resolve("paged_mqa_logits", target, Problem(heads=64, dim=128, next_n=1, fp8=fp8),
                           environment=WITHOUT_AITER)
    assert res.chosen.impl_id == "paged_mqa_logits.triton.logits"


def _paged_case(seed, heads=16, requests=3, fp8=torch.float8_e4m3fn):
    """Random 64-token pages (a pool larger than the table), ragged lengths that are not multiples of 64, a
    shuffled block table, next_n 1: (q, cache, weights, lens [B, 1], table, max_context_len)."""
    from dsa_indexer.testing import random_cache

    gen = torch.Generator().manual_seed(seed)
    width = 5
    pool = requests * width + 2
    cache = random_cache(pool, "cpu", seed=seed).data
    table = torch.randperm(pool, generator=gen)[: requests * width].to(torch.int32).view(requests, width)
    lens = torch.randint(1, width * 64, (requests, 1), generator=gen, dtype=torch.int32)
    lens[lens % 64 == 0] += 1
    q = (torch.randn(requests, 1, heads, 128, generator=gen) * 30).to(fp8)
    w = torch.randn(requests, heads, generator=gen)
    return q, cache, w, lens, table, width * 64


def _close(got, want):
    finite = torch.isfinite(want)
    assert torch.equal(torch.isneginf(got), ~finite), "-inf pattern differs"
    return float((got - want)[finite].abs().max() / want[finite].abs().max())


@pytest.mark.parametrize("triton_version, gfx", [("3.5.0", "gfx950"), ("3.5.0", "gfx942"), ("3.4.0", "gfx950")])
def test_paged_double_keeps_upstreams_routing(monkeypatch, triton_version, gfx):
    """The double is only useful if it keeps upstream's rules: with Triton >= 3.5 on a Gluon arch,
    Preshuffle=False with KVBlockSize 64 reads page size 1 (wrong keys, no error: relative error ~1); on older
    Triton the same call reaches the plain kernel (right); gfx1250 asserts KVBlockSize == 1."""
    fake = install_fake_aiter(monkeypatch, paged=dict(triton_version=triton_version, gfx=gfx))
    wrapper = fake.paged_wrapper_module.deepgemm_fp8_paged_mqa_logits
    q, cache, w, lens, table, width = _paged_case(4)
    want = ref.paged_mqa_logits(q, cache, w, lens, table, width)
    out = torch.full_like(want, float("-inf"))
    wrapper(q, cache, w, out, lens.view(-1), table, width, Preshuffle=False, KVBlockSize=64)
    finite = torch.isfinite(want)
    gluon = fake.paged_wrapper_module.enable_gluon_pa_mqa_logits
    assert gluon == (triton_version >= "3.5")
    rel = float((out - want)[finite].abs().max() / want[finite].abs().max())
    assert rel > 0.5 if gluon else rel < 1e-5
    if gluon:  # the preshuffled addressing on this row-major cache is wrong too
        out = torch.full_like(want, float("-inf"))
        wrapper(q, cache, w, out, lens.view(-1), table, width, Preshuffle=True, KVBlockSize=64)
        assert float((out - want)[finite].abs().max() / want[finite].abs().max()) > 0.5
    else:
        with pytest.raises(AssertionError, match="only supported on gluon"):
            wrapper(q, cache, w, out, lens.view(-1), table, width, Preshuffle=True, KVBlockSize=64)
    install_fake_aiter(monkeypatch, paged=dict(triton_version="3.5.0", gfx="gfx1250"))
    with pytest.raises(AssertionError, match="KVBlockSize==1"):
        sys.modules["aiter.ops.triton.attention.pa_mqa_logits"].deepgemm_fp8_paged_mqa_logits(
            q, cache, w, out, lens.view(-1), table, width, Preshuffle=False, KVBlockSize=64)


@pytest.mark.parametrize("triton_version, gfx", [("3.5.0", "gfx950"), ("3.5.0", "gfx942"), ("3.4.0", "gfx950"),
                                                 ("3.5.0", "gfx1250")])
def test_registered_paged_adapter_reads_64_token_pages_whatever_aiter_routes(monkeypatch, triton_version, gfx):
    """The registered factory (what resolution runs) over aiter main's doubles: equal to the reference on 64-token
    pages wherever aiter's wrapper would route to its page-size-1 Gluon kernel, because it launches the plain
    kernel itself: every program of the grid, all visible columns written, the wrapper never called."""
    fake = install_fake_aiter(monkeypatch, paged=dict(triton_version=triton_version, gfx=gfx))
    reg = Registry(environment=WITH_AITER)
    load_plugins(reg, entry_points=False)
    problem = Problem(heads=16, dim=128, next_n=1, fp8="fn")
    fn = reg.function("paged_mqa_logits", GFX950, problem)
    assert reg.used[("paged_mqa_logits", GFX950, problem)].chosen.impl_id == "paged_mqa_logits.rocm.aiter"
    for seed in (1, 2, 3):
        args = _paged_case(seed)
        assert _close(fn(*args), ref.paged_mqa_logits(*args)) < 1e-5
    assert fake.paged_wrapper_module.wrapper_calls == []
    (grid, kw), *_ = fake.paged_kernel_module._deepgemm_fp8_paged_mqa_logits.launches
    assert kw["KVBlockSize"] == 64 and kw["stride_k_token"] == 128 and kw["stride_k_block"] == 64 * 132
    assert kw["stride_scale_token"] == 1 and kw["stride_scale_block"] == 64 * 132 // 4
    assert grid[0] == 3 * kw["SplitKV"]


def test_paged_wrapper_launch_only_where_aiter_routes_to_the_plain_kernel(monkeypatch):
    from dsa_indexer.backends.rocm import paged

    install_fake_aiter(monkeypatch, paged=dict(triton_version="3.5.0", gfx="gfx950"))
    with pytest.raises(RuntimeError, match="_gluon_deepgemm_fp8_paged_mqa_logits.*page size 1"):
        paged.make_paged_mqa_logits("wrapper")
    fake = install_fake_aiter(monkeypatch, paged=dict(triton_version="3.4.0", gfx="gfx950"))
    fn = paged.make_paged_mqa_logits("wrapper")
    args = _paged_case(5)
    assert _close(fn(*args), ref.paged_mqa_logits(*args)) < 1e-5
    assert fake.paged_wrapper_module.wrapper_calls == [dict(Preshuffle=False, KVBlockSize=64, ChunkK=256)]
    del fake.paged_wrapper_module.enable_gluon_pa_mqa_logits  # an aiter that does not say where it routes
    with pytest.raises(RuntimeError, match="cannot be told"):
        paged.make_paged_mqa_logits("wrapper")
    with pytest.raises(ValueError, match="next_n 1"):
        q, cache, w, lens, table, width = args
        paged.make_paged_mqa_logits("kernel")(q.view(1, 3, 16, 128), cache, w, lens.view(1, 3), table[:1], width)


def test_paged_self_test_catches_the_gluon_route_and_passes_the_kernel_launch(monkeypatch):
    from dsa_indexer.backends.rocm import paged

    fake = install_fake_aiter(monkeypatch, paged=dict(triton_version="3.5.0", gfx="gfx950"))
    paged.check_paged_adapter(paged.make_paged_mqa_logits("kernel"), "cpu", heads=16)
    wrapper = fake.paged_wrapper_module.deepgemm_fp8_paged_mqa_logits

    def old_adapter(q, kv_cache, weights, context_lens, block_table, max_context_len):  # the call of main before
        out = torch.full((q.shape[0], max_context_len), float("-inf"))
        wrapper(q, kv_cache, weights.float(), out, context_lens.view(-1).to(torch.int32), block_table,
                max_context_len, Preshuffle=False, KVBlockSize=64, ChunkK=256)
        return out

    with pytest.raises(AssertionError, match="paged logit error|-inf pattern"):
        paged.check_paged_adapter(old_adapter, "cpu", heads=16)


@pytest.mark.skipif(not (Path(os.environ.get("DSA_AITER_HEAD_PKG", Path(__file__).parents[2] / ".deps" /
                                             "aiter_head_pkg")) / "aiter").is_dir(),
                    reason="the newest aiter's Python package is not at .deps/aiter_head_pkg (set DSA_AITER_HEAD_PKG)")
def test_paged_adapter_over_aiters_real_block_kernel(device):
    """aiter's real ``_deepgemm_fp8_paged_mqa_logits`` (ROCm/aiter HEAD e4048607; the interpreter without CUDA)
    through the adapter's kernel launch, on a shuffled block table, against the reference: -inf pattern exact,
    finite values within 1e-5 x the largest |logit| (fp32 sums in another order)."""
    from dsa_indexer.backends.rocm import paged
    from dsa_indexer.testing import random_cache

    head = Path(os.environ.get("DSA_AITER_HEAD_PKG", Path(__file__).parents[2] / ".deps" / "aiter_head_pkg"))
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    with _aiter_shim(head):
        fn = paged.make_paged_mqa_logits("kernel")
        cache = random_cache(12, device, seed=3)
        table = torch.randperm(12, generator=gen).to(torch.int32).view(3, 4).to(device)
        lens = torch.tensor([[70], [256], [5]], dtype=torch.int32, device=device)
        q = (torch.randn(3, 1, 16, 128, generator=gen) * 50).to(torch.float8_e4m3fn).to(device)
        w = torch.randn(3, 16, generator=gen).to(device)
        got = fn(q, cache.data, w, lens, table, 256).cpu()
    want = ref.paged_mqa_logits(q.cpu(), cache.data.cpu(), w.cpu(), lens.cpu(), table.cpu(), 256)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)
    assert (got - want)[finite].abs().max() <= 1e-5 * want[finite].abs().max()


def test_simulated_environment_keeps_its_aiter_and_torch_npu_facts():
    env = Environment.simulated(gpu=True, aiter=True, torch_npu=True)
    reg = Registry(environment=env)
    load_plugins(reg, entry_points=False)
    assert env.missing("aiter") is None and env.missing("torch_npu") is None  # not replaced by the real probes


def test_detected_api_decides_availability(registry, monkeypatch):
    """After a real probe (here: a patched detection result) the detected functions, the self-test outcome and the
    fp8 flavour of the aiter build decide; a simulated environment ignores them."""
    probed = Environment(probes={}, facts={"gpu": None, "triton": None, "aiter": None}, name="probed")
    full = aiter_api.AiterApi(version="0.0-fake", fp8_dtype=torch.float8_e4m3fn, ragged_wrapper="w",
                              topk_decode="t")
    monkeypatch.setattr(aiter_api.LIBRARY, "detected", (None, full))
    assert registry.resolve("ragged_mqa_logits", GFX950, _ragged(GFX950),
                            environment=probed).chosen.impl_id == "ragged_mqa_logits.rocm.aiter"
    res = registry.resolve("ragged_mqa_logits", GFX942, _ragged(GFX942), environment=probed)
    assert "this aiter build uses float8_e4m3fn, target gfx942 takes float8_e4m3fnuz" in \
        _candidate(res, "ragged_mqa_logits.rocm.aiter").reason
    monkeypatch.setattr(aiter_api.LIBRARY, "detected", (None, aiter_api.AiterApi(
        version="0.0-fake", fp8_dtype=torch.float8_e4m3fn, ragged_wrapper="w", ragged_self_test="boom")))
    probed2 = Environment(probes={}, facts={"gpu": None, "triton": None, "aiter": None}, name="probed2")
    res = registry.resolve("ragged_mqa_logits", GFX950, _ragged(GFX950), environment=probed2)
    assert _candidate(res, "ragged_mqa_logits.rocm.aiter").reason.endswith("self-test failed: boom")
    res = registry.resolve("topk_indices", GFX950, Problem(**TOPK), environment=probed2,
                           force="topk_indices.rocm.aiter")
    assert "has no function for topk_indices" in _candidate(res, "topk_indices.rocm.aiter").reason
    res = registry.resolve("ragged_mqa_logits", GFX950, _ragged(GFX950), environment=WITH_AITER)
    assert res.chosen.impl_id == "ragged_mqa_logits.rocm.aiter"


# --- resolution: npu -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("torch_npu", [True, False])
def test_npu_resolves_the_fp8_ops_to_the_reference_with_reasons(registry, torch_npu):
    """The fp8 ops (the 132-byte pages) have no torch_npu kernel: reference (or the generic composition), each
    accelerated candidate saying why, and a fallback. The plain-layout ops: tests/backends/test_npu_backend.py."""
    env = Environment.simulated(gpu=True, triton=True, torch_npu=torch_npu, aiter=True)
    plain = {"q_prologue_plain", "k_prologue_store_plain", "lightning_indexer_ragged", "indexer_pipeline"}
    # lightning_indexer reads the fp8 pages on Ascend 950 only: unknown without the probe, so refused, with why
    res = registry.resolve("lightning_indexer", NPU, Problem(), environment=env)
    assert res.chosen.vendor == "generic"
    reason = _candidate(res, "lightning_indexer.npu.torch_npu_fp8").reason
    assert ("known only after the torch_npu probe" in reason) if torch_npu else ("torch_npu" in reason), reason
    for op in sorted(set(registry.ops()) - plain - {"lightning_indexer"}):
        res = registry.resolve(op, NPU, Problem(), environment=env)
        assert res.chosen is not None and res.chosen.vendor in ("reference", "generic"), op
        assert not [c for c in res.candidates if c.impl.vendor == "npu"], op
        assert op in npu_backend.UNREGISTERED, op  # each says why
        for cand in res.candidates:
            if cand.impl.vendor in ("triton", "rocm", "cuda"):
                assert cand.reason.startswith("serves ") and cand.reason.endswith("not npu")
        # Nothing accelerated serves npu: that is a fallback (the warning and strict mode say so), naming why.
        assert res.is_fallback == (res.chosen.vendor == "reference"), op
        if res.is_fallback:
            assert res.fallback_reasons() == "no accelerated implementation serves target npu"


def test_strict_mode_raises_on_npu_naming_what_is_missing(monkeypatch):
    from dsa_indexer.dispatch.registry import NoImplementationError

    monkeypatch.setenv("DSA_INDEXER_STRICT", "1")
    reg = Registry(environment=Environment.simulated(gpu=True, triton=True, torch_npu=False))
    load_plugins(reg, entry_points=False)
    with pytest.raises(NoImplementationError, match="strict mode.*no accelerated implementation serves target npu"):
        reg.choose("topk_indices", NPU, Problem(k=2048))
    monkeypatch.delenv("DSA_INDEXER_STRICT")
    reg.clear_cache()
    with pytest.warns(RuntimeWarning, match="topk_indices on npu falls back to the slow reference"):
        reg.choose("topk_indices", NPU, Problem(k=2048))


# --- probes --------------------------------------------------------------------------------------------------------
def _real_module_installed(name: str) -> bool:
    import importlib.util

    return name not in sys.modules and importlib.util.find_spec(name) is not None


def test_aiter_probe_returns_reasons_and_never_raises(monkeypatch):
    monkeypatch.setattr(aiter_api.LIBRARY, "detected", None)
    if not _real_module_installed("aiter"):
        monkeypatch.delitem(sys.modules, "aiter", raising=False)
        assert aiter_api.probe().startswith("aiter is not installed (")
    install_fake_aiter(monkeypatch)
    monkeypatch.setattr(torch.version, "hip", None)
    assert aiter_api.probe() == "aiter needs a ROCm build of torch (torch.version.hip is None)"
    monkeypatch.setattr(torch.version, "hip", "6.4.0-fake")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert aiter_api.probe() == "aiter is installed but torch sees no ROCm GPU"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    def exits():
        raise SystemExit("rocminfo not found")  # what a ROCm-less aiter import can do

    monkeypatch.setattr(aiter_api, "detect_api", exits)
    assert aiter_api.probe() == "aiter is installed but failed to import (SystemExit: rocminfo not found)"
    assert aiter_api.detected_api() is None




def test_aiter_probe_detects_functions_and_self_tests_the_workaround(monkeypatch):
    """The probe's logic with a fake aiter whose ragged kernel has the documented alignment bug: the adapter's
    workaround makes the self-test pass. Not aiter, not a GPU."""
    fake = install_fake_aiter(monkeypatch)
    pretend_rocm_gpu(monkeypatch)
    assert aiter_api.probe() is None
    api = aiter_api.detected_api()
    assert api.ragged_wrapper == "aiter.ops.triton.fp8_mqa_logits.fp8_mqa_logits"
    assert api.topk_decode == "aiter.ops.topk.top_k_per_row_decode"
    assert api.fused_rms_quant == "aiter.ops.triton.fused_fp8_quant.fused_rms_fp8_group_quant"
    assert api.fp8_dtype == torch.float8_e4m3fn and api.ragged_self_test is None
    assert fake.calls and all(c[0] == "fp8_mqa_logits" for c in fake.calls)

    pretend_rocm_gpu(monkeypatch)
    fake.ops.triton.fp8_mqa_logits.fp8_mqa_logits = lambda q, kv, *a: torch.zeros(q.shape[0], kv.shape[0])
    assert aiter_api.probe() is None  # aiter itself is fine; only the ragged implementation is turned off
    assert aiter_api.detected_api().ragged_self_test.startswith("AssertionError: row 0")


def test_probe_self_tests_the_paged_path_and_turns_off_only_it(monkeypatch, tmp_path, registry):
    """aiter main's doubles (Triton 3.5, gfx950): the probe finds the plain paged kernel, reports the wrapper's
    Gluon route as not used, self-tests the kernel launch on 64-token pages. A kernel that ignores KVBlockSize
    (reads page size 1) fails the self-test: only paged_mqa_logits.rocm.aiter is off, with the reason in explain."""
    prebuilt = ("module_top_k_per_row", "module_gemm_a8w8_blockscale")
    fake = install_fake_aiter(monkeypatch, paged=dict(triton_version="3.5.0", gfx="gfx950"),
                               jit=dict(tmp_path=tmp_path, prebuilt=prebuilt))
    pretend_rocm_gpu(monkeypatch)
    assert aiter_api.probe() is None
    api = aiter_api.detected_api()
    assert api.paged_logits == ("aiter.ops.triton._triton_kernels.attention.pa_mqa_logits."
                                "_deepgemm_fp8_paged_mqa_logits")
    assert api.paged_self_test is None and api.ragged_self_test is None and api.unbuilt == {}
    assert "page size 1" in api.paged_wrapper_route and "not used" in api.describe()
    assert fake.paged_kernel_module._deepgemm_fp8_paged_mqa_logits.launches  # the self-test ran the kernel

    real_run = PlainPagedKernelDouble._run

    def page_size_one(programs, **kw):  # a kernel that addresses block_table[b, t] and token 0: wrong keys
        real_run(programs, **{**kw, "KVBlockSize": 1, "stride_k_token": 0, "stride_scale_token": 0,
                              "max_blk_len": kw["max_blk_len"] * 64})

    monkeypatch.setattr(PlainPagedKernelDouble, "_run", staticmethod(page_size_one))
    pretend_rocm_gpu(monkeypatch)
    assert aiter_api.probe() is None
    api = aiter_api.detected_api()
    assert api.paged_self_test and api.ragged_self_test is None
    probed = Environment(probes={}, facts={"gpu": None, "triton": None, "aiter": None}, name="probed-paged")
    res = registry.resolve("paged_mqa_logits", GFX950, Problem(heads=64, dim=128, next_n=1, fp8="fn"),
                           environment=probed)
    assert res.chosen.impl_id == "paged_mqa_logits.triton.logits"
    assert "paged logits self-test (64-token pages) failed" in _candidate(res, "paged_mqa_logits.rocm.aiter").reason
    assert "paged logits self-test (64-token pages) failed: AssertionError" in res.explain()
    res = registry.resolve("ragged_mqa_logits", GFX950, _ragged(GFX950), environment=probed)
    assert res.chosen.impl_id == "ragged_mqa_logits.rocm.aiter"


def test_aiter_0_1_7_provides_no_paged_logits_and_says_which_aiter_does(monkeypatch, tmp_path, registry):
    """An aiter without the block-level kernel (0.1.7's paths): the probe passes, paged logits are absent, and the
    reason names what is needed and where it was found."""
    install_fake_aiter(monkeypatch, jit=dict(tmp_path=tmp_path, prebuilt=("module_top_k_per_row",)))
    pretend_rocm_gpu(monkeypatch)
    assert aiter_api.probe() is None
    api = aiter_api.detected_api()
    assert api.paged_logits is None and "paged logits: - (needs the block-level Triton kernel" in api.describe()
    probed = Environment(probes={}, facts={"gpu": None, "triton": None, "aiter": None}, name="probed-017")
    res = registry.resolve("paged_mqa_logits", GFX950, Problem(heads=64, dim=128, next_n=1, fp8="fn"),
                           environment=probed)
    reason = _candidate(res, "paged_mqa_logits.rocm.aiter").reason
    assert "has no function for paged_mqa_logits" in reason and "e4048607" in reason
    res = registry.resolve("topk_indices", GFX950, Problem(**TOPK), environment=probed)
    assert "stable=True) (ROCm/aiter v0.1.20 on, main e4048607" in _candidate(res, "topk_indices.rocm.aiter_stable").reason


@pytest.mark.parametrize("how", ["absent", "rebuild", "jit_dir", "package"])
def test_compiled_modules_must_be_prebuilt_never_built_in_a_call(monkeypatch, tmp_path, registry, how):
    """HIP / CK modules that aiter would build with hipcc at the first call: an implementation needing one that is
    not built is off, with how to prebuild it; built ones (in aiter/jit or $AITER_JIT_DIR) are used; AITER_REBUILD
    (rebuild at the first call) counts as not built."""
    prebuilt = () if how == "absent" else ("module_top_k_per_row",)
    fake = install_fake_aiter(monkeypatch, with_stable=True,
                               jit=dict(tmp_path=tmp_path, prebuilt=prebuilt if how != "jit_dir" else (),
                                        rebuild=int(how == "rebuild")))
    if how == "jit_dir":
        import importlib.machinery

        elsewhere = tmp_path / "user_jit"
        elsewhere.mkdir()
        (elsewhere / f"module_top_k_per_row{importlib.machinery.EXTENSION_SUFFIXES[0]}").write_bytes(b"")
        monkeypatch.setenv("AITER_JIT_DIR", str(elsewhere))
    else:
        monkeypatch.delenv("AITER_JIT_DIR", raising=False)
    pretend_rocm_gpu(monkeypatch)
    assert aiter_api.probe() is None
    api = aiter_api.detected_api()
    probed = Environment(probes={}, facts={"gpu": None, "triton": None, "aiter": None}, name=f"probed-jit-{how}")
    res = registry.resolve("topk_indices", GFX950, Problem(**TOPK), environment=probed)
    verdict = _candidate(res, "topk_indices.rocm.aiter_stable")
    if how in ("absent", "rebuild"):
        assert api.unbuilt["topk_stable"] == ("module_top_k_per_row",)
        assert not verdict.accepted and "module_top_k_per_row is not built" in verdict.reason
        assert "PREBUILD_KERNELS=1" in verdict.reason and "hipcc" in verdict.reason
        assert res.chosen.impl_id == "topk_indices.triton.topk"
    else:
        assert "topk_stable" not in api.unbuilt and res.chosen.impl_id == "topk_indices.rocm.aiter_stable"
    assert not [c for c in fake.calls if c[0] == "top_k_per_row_decode"]  # the probe never calls a HIP function


def test_gemm_needs_its_ck_tile_module_where_aiter_has_that_variant(monkeypatch, tmp_path, registry):
    fake = install_fake_aiter(monkeypatch, jit=dict(tmp_path=tmp_path, prebuilt=("module_gemm_a8w8_blockscale",)))
    fake.gemm_a8w8_blockscale = lambda *a, **k: None
    pretend_rocm_gpu(monkeypatch)
    assert aiter_api.probe() is None
    assert "gemm_blockscale" not in aiter_api.detected_api().unbuilt
    fake.gemm_a8w8_blockscale_cktile = lambda *a, **k: None  # main: tuned shapes may dispatch to CK-tile
    pretend_rocm_gpu(monkeypatch)
    assert aiter_api.probe() is None
    assert aiter_api.detected_api().unbuilt["gemm_blockscale"] == ("module_gemm_a8w8_blockscale_cktile",)
    probed = Environment(probes={}, facts={"gpu": None, "triton": None, "aiter": None}, name="probed-cktile")
    res = registry.resolve("gemm_fp8_blockscale", GFX950, Problem(), environment=probed)
    assert "module_gemm_a8w8_blockscale_cktile is not built" in _candidate(res, "gemm_fp8_blockscale.rocm.aiter").reason


def test_an_aiter_without_fp8_for_this_gpu_is_named(registry, monkeypatch):
    """amd-aiter 0.1.7's aiter.dtypes falls back to uint8 on a GPU it does not know (gfx1250)."""
    monkeypatch.setattr(aiter_api.LIBRARY, "detected", (None, aiter_api.AiterApi(
        version="0.1.7-fake", fp8_dtype=torch.uint8, gemm_blockscale="aiter.gemm_a8w8_blockscale")))
    probed = Environment(probes={}, facts={"gpu": None, "triton": None, "aiter": None}, name="probed-uint8")
    res = registry.resolve("gemm_fp8_blockscale", GFX1250, Problem(), environment=probed)
    reason = _candidate(res, "gemm_fp8_blockscale.rocm.aiter").reason
    assert "aiter.dtypes has no fp8 type for this GPU (uint8 fallback" in reason


def test_torch_npu_probe_returns_reasons(monkeypatch):
    if not _real_module_installed("torch_npu"):
        monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
        assert npu_backend.torch_npu_probe().startswith("torch_npu is not installed (")
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: False), raising=False)
    assert npu_backend.torch_npu_probe() == "torch_npu imported but torch.npu.is_available() is False (no NPU visible)"

    def broken():
        raise RuntimeError("drv error")

    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=broken), raising=False)
    assert "is_available() failed (RuntimeError: drv error)" in npu_backend.torch_npu_probe()
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: True), raising=False)
    assert npu_backend.torch_npu_probe() == "torch_npu ? has neither npu_lightning_indexer nor npu_quant_lightning_indexer"
    # A function whose signature lacks the keywords the adapter passes is refused, naming the argument.
    module = types.ModuleType("torch_npu")
    module.npu_lightning_indexer = lambda query, key, weights, *, sparse_count=2048: None
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    monkeypatch.setattr(npu_backend.LIBRARY, "detected", None)
    assert "has no argument 'actual_seq_lengths_query'" in npu_backend.torch_npu_probe()
    # The published operator schemas (tests/doubles/torch_npu.py registers them through torch.library) pass.
    from doubles.torch_npu import install_schema_ops

    install_schema_ops(monkeypatch)
    monkeypatch.setattr(npu_backend.LIBRARY, "detected", None)
    assert npu_backend.torch_npu_probe() is None
    assert npu_backend.LIBRARY.detected_api().indexer is not None


# --- ragged logits adapter -------------------------------------------------------------------------------------------
def _ragged_inputs(rows, keys, heads=16, seed=0, fp8=torch.float8_e4m3fn, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(rows, heads, 128, generator=gen) * 30).to(fp8)
    k = (torch.randn(keys, 128, generator=gen) * 30).to(fp8)
    scales = torch.rand(keys, generator=gen) * 1e-2 + 1e-3
    weights = torch.randn(rows, heads, generator=gen)
    ks = torch.randint(0, keys + 1, (rows,), generator=gen, dtype=torch.int32)
    edge = torch.tensor([0, 1, 127, 128, 129, 255, 256, keys], dtype=torch.int32).clamp_max(keys)
    ks[: min(rows, edge.numel())] = edge[: min(rows, edge.numel())]
    ke = torch.minimum(ks + torch.randint(0, 400, (rows,), generator=gen, dtype=torch.int32),
                       torch.tensor(keys, dtype=torch.int32))
    return [t.to(device) for t in (q, k, scales, weights, ks, ke)]


def _check_logits(out, expected):
    """-inf exactly where the reference masks, no NaN, finite values within the stated tolerance."""
    out, expected = out.cpu(), expected.cpu()
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert not torch.isnan(out).any()
    visible = torch.isfinite(expected)
    assert torch.equal(torch.isneginf(out), ~visible)
    tol = 2e-3 if torch.cuda.is_available() else 1e-4
    row_max = torch.where(visible, expected.abs(), torch.zeros_like(expected)).amax(dim=1, keepdim=True)
    err = torch.where(visible, (out - expected).abs(), torch.zeros_like(out))
    assert bool((err <= tol * row_max + tol * expected.abs().nan_to_num(posinf=0, neginf=0)).all())


def test_emulated_kernel_reproduces_the_alignment_bug():
    """The fake is only useful if it has the bug: unaligned starts give wrong windows, aligned ones do not."""
    q, k, s, w, ks, ke = _ragged_inputs(12, 600)
    raw = emulated_fp8_mqa_logits(q, k, s, w, ks, ke)
    want = ref.ragged_mqa_logits(q, k, s, w, ks, ke)
    unaligned = (ks % 128 != 0) & (ke > ks)
    assert unaligned.any()
    wrong = (torch.isneginf(raw) != torch.isneginf(want)).any(dim=1)
    # Every wrong row has an unaligned start; an unaligned row can come out right only when its window ends at
    # the last key (its stray stores fall outside the buffer, which the emulation drops).
    assert not bool(wrong[~unaligned].any())
    assert bool(wrong[unaligned & (ke < k.shape[0])].all())


def test_ragged_adapter_aligns_starts_and_masks_the_head():
    """Argument handling: starts passed rounded down to 128, ends and scales unchanged (contiguous), the
    [aligned, ks) columns re-masked; the result equals the reference although the fake has the bug."""
    calls = []

    def recording(q, kv, kv_scales, weights, starts, ends):
        calls.append((q, kv, kv_scales, weights, starts, ends))
        return emulated_fp8_mqa_logits(q, kv, kv_scales, weights, starts, ends)

    q, k, s, w, ks, ke = _ragged_inputs(16, 700)
    s_strided = torch.stack([s, s], dim=1)[:, 0]  # non-contiguous scales
    fn = rocm_logits.make_ragged_mqa_logits(recording)
    out = fn(q, k, s_strided, w, ks, ke)
    _check_logits(out, ref.ragged_mqa_logits(q, k, s, w, ks, ke))
    (cq, ck, cs, cw, starts, ends), = calls
    assert cq is q and ck is k and cw is w and cs.is_contiguous() and torch.equal(cs, s)
    assert starts.dtype == torch.int32 and torch.equal(starts, ks - ks % 128) and torch.equal(ends, ke)


def test_ragged_adapter_empty_shapes_and_clean_logits():
    fn = rocm_logits.make_ragged_mqa_logits(lambda *a: pytest.fail("no launch for empty shapes"))
    q, k, s, w, ks, ke = _ragged_inputs(4, 200)
    assert fn(q[:0], k, s, w[:0], ks[:0], ke[:0]).shape == (0, 200)
    out = fn(q, k[:0], s[:0], w, torch.zeros_like(ks), torch.zeros_like(ke))
    assert out.shape == (4, 0) and out.dtype == torch.float32
    seen = {}

    def newer(Q, KV, kv_scales, weights, cu_starts, cu_ends, clean_logits=False):
        seen["clean_logits"] = clean_logits
        return emulated_fp8_mqa_logits(Q, KV, kv_scales, weights, cu_starts, cu_ends)

    out = rocm_logits.make_ragged_mqa_logits(newer)(q, k, s, w, ks, ke)
    _check_logits(out, ref.ragged_mqa_logits(q, k, s, w, ks, ke))
    assert seen == {"clean_logits": True}


def test_mask_head_triton_kernel_matches_the_torch_mask(device):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 300, generator=gen)
    hi = torch.tensor([0, 1, 127, 128, 130, 255, 257, 299, 300], dtype=torch.int32)
    lo = torch.bitwise_and(hi, -128)
    want = rocm_logits.mask_head_(logits.clone(), lo, hi, use_triton=False)
    got = rocm_logits.mask_head_(logits.clone().to(device), lo.to(device), hi.to(device), use_triton=True)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(torch.isneginf(want), (torch.arange(300)[None, :] >= lo[:, None].long())
                       & (torch.arange(300)[None, :] < hi[:, None].long()))


def test_registry_builds_the_ragged_adapter_from_the_installed_aiter(monkeypatch):
    """The registered factory finds aiter's wrapper by feature (fake module here) and the op runs end to end."""
    fake = install_fake_aiter(monkeypatch, with_clean_logits=True)
    reg = Registry(environment=WITH_AITER)
    load_plugins(reg, entry_points=False)
    problem = _ragged(GFX950, heads=16)
    fn = reg.function("ragged_mqa_logits", GFX950, problem)
    assert reg.used[("ragged_mqa_logits", GFX950, problem)].chosen.impl_id == "ragged_mqa_logits.rocm.aiter"
    args = _ragged_inputs(10, 450)
    _check_logits(fn(*args), ref.ragged_mqa_logits(*args))
    assert fake.calls[-1][2] == {"clean_logits": True}


@contextlib.contextmanager
def _aiter_shim(pkg: Path):
    """Test-only: ``import aiter`` needs ROCm, but its Triton kernel files are plain Triton. An empty ``aiter``
    module whose ``__path__`` is the installed package lets ``aiter.ops.triton...`` import; everything imported
    under ``aiter`` is removed afterwards."""
    before = {name: mod for name, mod in sys.modules.items() if name == "aiter" or name.startswith("aiter.")}
    for name in before:
        del sys.modules[name]
    shim = types.ModuleType("aiter")
    shim.__path__ = [str(pkg / "aiter")]
    dtypes = types.ModuleType("aiter.dtypes")
    dtypes.fp8 = torch.float8_e4m3fn
    shim.dtypes = dtypes
    sys.modules["aiter"], sys.modules["aiter.dtypes"] = shim, dtypes
    try:
        yield shim
    finally:
        for name in [n for n in sys.modules if n == "aiter" or n.startswith("aiter.")]:
            del sys.modules[name]
        sys.modules.update(before)


@pytest.mark.skipif(not (AITER_PKG / "aiter" / "ops" / "triton").is_dir(),
                    reason=f"aiter's Python package not found at {AITER_PKG} (set DSA_AITER_PKG)")
def test_workaround_with_aiters_real_kernel_in_the_interpreter(device):
    """aiter's real ``_fp8_mqa_logits_kernel`` (Triton's CPU interpreter without CUDA), launched by
    `kernel_launcher` through the adapter, on starts that are not multiples of 128. The raw kernel is not run
    with such starts here: its out-of-bounds stores crash the interpreter."""
    with _aiter_shim(AITER_PKG):
        fn = rocm_logits.make_ragged_mqa_logits(launch="kernel")
        args = _ragged_inputs(10, 300, heads=16, seed=5, device=device)
        _check_logits(fn(*args), ref.ragged_mqa_logits(*[a.cpu() for a in args]))


# --- top-k adapter --------------------------------------------------------------------------------------------------
def _topk_logits(rows, cols, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen)  # continuous values: no ties


def _same_sets(out, expected):
    assert out.shape == expected.shape and out.dtype == torch.int32
    for row in range(out.shape[0]):
        assert sorted(out[row].tolist()) == sorted(expected[row].tolist()), f"row {row}"


@pytest.mark.parametrize("with_stable", [False, True])
def test_topk_adapter_passes_decode_arguments(monkeypatch, with_stable):
    fake = install_fake_aiter(monkeypatch, with_stable=with_stable)
    fn = rocm_topk.make_topk_indices()
    logits = _topk_logits(5, 3000)
    ends = torch.tensor([0, 10, 2048, 2049, 3000], dtype=torch.int32)
    out = fn(logits, 2048, ends)
    _same_sets(out, ref.topk_indices(logits, 2048, ends))
    (name, (lg, next_n, seq_lens, indices, num_rows, s0, s1), kwargs), = fake.calls
    assert torch.equal(lg, logits) and lg.is_contiguous() and lg.data_ptr() % 16 == 0  # the NaN pre-pass's copy
    assert next_n == 1 and torch.equal(seq_lens, ends) and num_rows == 5 and (s0, s1) == (3000, 1)
    assert indices.dtype == torch.int32 and indices.shape == (5, 2048)
    assert kwargs == ({"k": 2048, "stable": True} if with_stable else {})


def test_topk_adapter_copies_strided_logits_and_converts_to_slots(monkeypatch):
    fake = install_fake_aiter(monkeypatch)
    fn = rocm_topk.make_topk_indices()
    wide = _topk_logits(6, 4400, seed=2)
    logits = wide[:, ::2]  # column stride 2
    ends = torch.tensor([2200, 5, 100, 2100, 0, 2049], dtype=torch.int32)
    table = torch.randint(0, 50, (3, 40), dtype=torch.int32)
    rows = torch.tensor([0, 0, 1, 2, 1, 2], dtype=torch.int32)
    out = fn(logits, 2048, ends, None, table, rows)
    _same_sets(out, ref.topk_indices(logits, 2048, ends, None, table, rows))
    passed = fake.calls[0][1][0]
    assert passed.stride(1) == 1 and torch.equal(passed, logits)


def test_double_ranks_nan_as_aiters_kernel_does():
    """The top-k double orders twiddled fp32 bits as aiter's kernel: a positive NaN beats every finite value."""
    logits = torch.randn(1, 3000, generator=torch.Generator().manual_seed(8))
    logits[0, 2999] = float("nan")
    indices = torch.empty(1, 2048, dtype=torch.int32)
    emulated_top_k_per_row_decode(logits, 1, torch.tensor([3000], dtype=torch.int32), indices, 1, 3000, 1)
    assert 2999 in indices[0].tolist()


@pytest.mark.parametrize("with_stable", [False, True])
def test_topk_adapter_ranks_nan_as_minus_inf(monkeypatch, with_stable):
    """The library's NaN rule: the result equals the top-k of where(isnan(x), -inf, x) with the usual ties. NaN
    positions in long rows must not be chosen over finite values; short rows keep all their columns; the caller's
    logits are not modified."""
    fake = install_fake_aiter(monkeypatch, with_stable=with_stable)
    fn = rocm_topk.make_topk_indices()
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 4000, generator=gen)
    nan_cols = torch.randint(0, 4000, (4, 300), generator=gen)
    logits.scatter_(1, nan_cols, float("nan"))
    logits[3, :1990] = float("nan")  # fewer finite visible values than k: NaN columns fill the rest, as -inf does
    ends = torch.tensor([4000, 2500, 1000, 4000], dtype=torch.int32)
    before = logits.clone()
    out = fn(logits, 2048, ends)
    as_minus_inf = torch.where(torch.isnan(logits), float("-inf"), logits)
    _same_sets(out, ref.topk_indices(as_minus_inf, 2048, ends))
    for row in (0, 1):
        assert not torch.isnan(logits[row, out[row].long()]).any()
    assert torch.equal(torch.isnan(logits), torch.isnan(before))
    passed = fake.calls[0][1][0]
    assert not torch.isnan(passed).any()


def test_topk_adapter_refuses_what_resolution_should_have_refused(monkeypatch):
    install_fake_aiter(monkeypatch)
    fn = rocm_topk.make_topk_indices()
    logits = _topk_logits(2, 100)
    ends = torch.tensor([50, 100], dtype=torch.int32)
    with pytest.raises(ValueError, match="k=2048"):
        fn(logits, 512, ends)
    with pytest.raises(ValueError, match="starts given"):
        fn(logits, 2048, ends, torch.zeros(2, dtype=torch.int32))


# --- fused RMSNorm + quant adapter (not registered) ------------------------------------------------------------------
def _fp8_ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|ordinal(a) - ordinal(b)| for e4m3 codes (sign-magnitude bytes; +0 and -0 both ordinal 0)."""
    def ordinal(x):
        code = x.view(torch.uint8).to(torch.int32)
        mag = code & 0x7F
        return torch.where(code >= 0x80, -mag, mag)

    return (ordinal(a) - ordinal(b)).abs()


def test_fused_rms_quant_adapter_arguments_and_layout_tag(monkeypatch):
    fake = install_fake_aiter(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(7, 512, generator=gen).to(torch.bfloat16)
    w = torch.rand(512, generator=gen).to(torch.bfloat16) + 0.5
    normed, quant = rocm_backend.aiter_fused_rms_fp8_group_quant(x, w, 1e-6)
    (name, args, kwargs), = fake.calls
    assert args[0] is x and args[1] is w and args[2] == 1e-6
    assert kwargs == dict(group_size=128, dtype_quant=torch.float8_e4m3fn, output_unquantized_inp1=True,
                          transpose_scale=False)
    lay = quant.layout
    assert lay.producer == PRODUCER_UNROUNDED
    assert (lay.group_size, lay.ue8m0, lay.scale_major, lay.rows) == (128, False, "row", 7)
    assert lay.fp8_dtype == torch.float8_e4m3fn and quant.scales.shape == (7, 4)
    # The recipe difference the tag stands for (emulated here): within 1 fp8 ulp of the library's contract.
    r_normed, r_fp8, r_scale = ref.rmsnorm_quant_fp8(x, w, 1e-6)
    assert torch.equal(normed, r_normed)
    assert int(_fp8_ulp_distance(quant.data, r_fp8).max()) <= 1
    torch.testing.assert_close(quant.scales, r_scale, rtol=2 ** -8, atol=0)


def test_fused_rms_quant_adapter_refuses_fnuz_and_bad_input(monkeypatch):
    install_fake_aiter(monkeypatch, fp8=torch.float8_e4m3fnuz)
    x = torch.randn(2, 256).to(torch.bfloat16)
    w = torch.ones(256, dtype=torch.bfloat16)
    with pytest.raises(IndexerInputError, match="224"):
        rocm_backend.aiter_fused_rms_fp8_group_quant(x, w)  # default dtype from aiter.dtypes.fp8 (gfx942 build)
    with pytest.raises(IndexerInputError, match="multiple of 128"):
        rocm_backend.aiter_fused_rms_fp8_group_quant(x[:, :200], w[:200], fp8_dtype=torch.float8_e4m3fn)
    with pytest.raises(IndexerInputError, match="eps"):
        rocm_backend.aiter_fused_rms_fp8_group_quant(x, w, 0.0, fp8_dtype=torch.float8_e4m3fn)


def test_old_aiter_page_size_one_paged_kernel_is_not_adapted(monkeypatch):
    """aiter 0.1.7's deepgemm_fp8_paged_mqa_logits (no KVBlockSize: a page-size-1 cache) is rejected by the feature
    check, so the detected API has no paged logits and Triton serves them."""
    from dsa_indexer.backends.rocm import paged

    def old(q_fp8, kv_cache, weights, out_logits, context_lens, kv_indices, max_model_len, Preshuffle=False,
            ChunkK=256, SplitKV=5):
        raise AssertionError("must not be called")

    module = types.ModuleType("aiter.ops.triton.pa_mqa_logits")
    module.deepgemm_fp8_paged_mqa_logits = old
    monkeypatch.setitem(sys.modules, "aiter.ops.triton.attention.pa_mqa_logits", None)
    monkeypatch.setitem(sys.modules, "aiter.ops.triton.pa_mqa_logits", module)
    assert not paged._takes_block_size(old)
    assert paged.find_wrapper() is None

    class OldKernel:  # 0.1.7's _deepgemm_fp8_paged_mqa_logits: one stride per key (page size 1)
        arg_names = ["batch_size", "next_n", "heads_num", "Q_buffer", "stride_q_batch", "stride_q_next_n",
                     "stride_q_heads", "KV_buffer", "stride_k_seq", "scale_buffer", "stride_scale_seq",
                     "context_len_ptr", "kv_indices", "weights", "stride_w_batch", "OutLogits_buffer",
                     "stride_out_batch", "max_model_len", "max_blk_len", "ChunkQ", "ChunkK", "HiddenDim", "SplitKV"]

    kernels = types.ModuleType("aiter.ops.triton._triton_kernels.attention.pa_mqa_logits")
    kernels._deepgemm_fp8_paged_mqa_logits = OldKernel()
    monkeypatch.setitem(sys.modules, kernels.__name__, kernels)
    assert paged.find_kernel() is None
    with pytest.raises(RuntimeError, match="lacks parameters"):
        paged.make_paged_mqa_logits("kernel", OldKernel())


# --- issue 40 item 3: aiter main's V4 kernels, refused in the registry with the reason ------------------------------
@pytest.mark.parametrize("op", ["paged_mqa_logits", "ragged_mqa_logits"])
def test_fp4_keys_name_aiters_flydsl_fp4_kernel_and_why_not(registry, op):
    problem = Problem(heads=64, dim=128, fp8="fn", keys="fp4", next_n=1)
    res = registry.resolve(op, GFX950, problem, environment=WITH_AITER)
    reason = _candidate(res, f"{op}.rocm.aiter").reason
    assert "flydsl_pa_mqa_logits_fp4" in reason and "preshuffled FP4 cache" in reason and "68-byte" in reason
    assert res.chosen.impl_id != f"{op}.rocm.aiter"


def test_aiters_v4_q_kernels_and_flydsl_fp8_logits_are_refused_with_their_reasons(registry):
    for op, words in (("q_prologue", ("rope_rotate_activation", "240 on e4m3fnuz", "1e-10", "weight fold")),
                      ("q_prologue_fp4", ("rope_rotate_activation", "rounds both to bf16", "packed e2m1"))):
        assert all(w in rocm_backend.UNREGISTERED[op] for w in words), op
        res = registry.resolve(op, GFX950, Problem(), environment=WITH_AITER)
        assert not [c for c in res.candidates if c.impl.vendor == "rocm"] and res.chosen is not None
    ragged = next(i for i in registry.implementations("ragged_mqa_logits") if i.impl_id == "ragged_mqa_logits.rocm.aiter")
    assert "flydsl_fp8_mqa_logits" in ragged.info["not_used"]
