"""Issue 34, items 15-17: the AMD backend against upstream aiter (ROCm/aiter main e4048607, read from its source).

No AMD GPU and no aiter here: resolution runs on simulated environments, the adapters on the test doubles of
tests/doubles/aiter.py (written from aiter's source, not aiter), large caches as meta tensors (no allocation).

- 15: aiter's plain paged kernel (`aiter/ops/triton/_triton_kernels/attention/pa_mqa_logits.py`,
  `_deepgemm_fp8_paged_mqa_logits`) forms key offsets ``block * stride_k_block + token * stride_k_token + dim`` in
  int32, so a cache of more than 254,200 pages (8448 bytes each) reads wrong keys: refused, Triton serves it.
- 16: aiter >= v0.1.17 rebuilds, inside the first call, a prebuilt module whose ``.so`` carries code objects for other
  archs only (`aiter/jit/core.py`, `_needs_arch_rebuild`): such a module counts as not built.
- 17: the CK block-scale GEMM is refused on gfx1250 (`aiter/ops/gemm_op_a8w8.py` enables it there on one allowlist
  line, `_BLOCKSCALE_HIP_PREBUILT_ARCHES`, with no gfx1250 row in any tuned config; not run there).
"""

from __future__ import annotations

import pytest
import torch

from dsa_indexer import ops
from dsa_indexer.backends.reference import kernels as ref
from dsa_indexer.backends.rocm import aiter_api
from dsa_indexer.backends.rocm import paged
from dsa_indexer.dispatch import Environment, Problem, Target
from doubles.aiter import PlainPagedKernelDouble, install_fake_aiter, pretend_rocm_gpu

GFX942, GFX950, GFX1250 = Target("rocm", "gfx942"), Target("rocm", "gfx950"), Target("rocm", "gfx1250")
FP8 = {GFX942: "fnuz", GFX950: "fn", GFX1250: "fn"}
WITH_AITER = Environment.simulated(gpu=True, triton=True, aiter=True)
# Worked out by hand from the kernel's arithmetic and this cache's strides (8448 bytes per page, 128 per token):
# page 254199's last key byte is at 254199 * 8448 + 63 * 128 + 127 = 2,147,481,343 <= 2**31 - 1, page 254200's at
# 2,147,489,791 > 2**31 - 1. So caches of up to 254,200 pages are safe.
LAST_SAFE_PAGE_COUNT = 254_200


def _candidate(res, impl_id):
    return next(c for c in res.candidates if c.impl.impl_id == impl_id)


# --- 15: aiter's paged kernel and caches past its int32 addresses -------------------------------------------------
def _random_paged_case(seed, pages=9, requests=2, heads=16):
    """Random 64-token pages, a shuffled table over them, lengths not multiples of 64: the reference's arguments."""
    from dsa_indexer.testing import random_cache

    gen = torch.Generator().manual_seed(seed)
    width = pages // requests
    cache = random_cache(pages, "cpu", seed=seed).data
    table = torch.randperm(pages, generator=gen)[: requests * width].to(torch.int32).view(requests, width)
    lens = torch.randint(1, width * 64, (requests, 1), generator=gen, dtype=torch.int32)
    lens[lens % 64 == 0] += 1
    q = (torch.randn(requests, 1, heads, 128, generator=gen) * 30).to(torch.float8_e4m3fn)
    w = torch.randn(requests, heads, generator=gen)
    return q, cache, w, lens, table, width * 64


def test_the_strides_the_adapter_launches_make_page_254200_wrap_in_int32():
    """The limit from the strides the registered launch really passes (recorded by the kernel double), with the
    kernel's int32 offset of a page's last key byte: it fits for page 254199 and wraps for page 254200."""
    kernel = PlainPagedKernelDouble()
    args = _random_paged_case(1)
    got = paged.make_paged_mqa_logits("kernel", fn=kernel)(*args)
    finite = torch.isfinite(ref.paged_mqa_logits(*args))
    assert torch.equal(torch.isfinite(got), finite)  # the adapter itself is right on a small cache
    (_, kw), = kernel.launches
    last_key_byte = (kw["KVBlockSize"] - 1) * kw["stride_k_token"] + kw["HiddenDim"] - 1
    int32_max = 2**31 - 1
    assert (LAST_SAFE_PAGE_COUNT - 1) * kw["stride_k_block"] + last_key_byte <= int32_max
    assert LAST_SAFE_PAGE_COUNT * kw["stride_k_block"] + last_key_byte > int32_max
    assert paged.MAX_INT32_PAGES == LAST_SAFE_PAGE_COUNT


@pytest.mark.parametrize("target", [GFX942, GFX950])
def test_aiters_paged_kernel_is_refused_past_254200_pages_and_triton_serves(registry, target):
    def resolve(pages):
        return registry.resolve("paged_mqa_logits", target, Problem(heads=64, dim=128, next_n=1, fp8=FP8[target],
                                                                    keys="fp8", pages=pages),
                                environment=WITH_AITER)

    assert resolve(LAST_SAFE_PAGE_COUNT).chosen.impl_id == "paged_mqa_logits.rocm.aiter"
    res = resolve(LAST_SAFE_PAGE_COUNT + 1)
    assert res.chosen.impl_id == "paged_mqa_logits.triton.logits"
    reason = _candidate(res, "paged_mqa_logits.rocm.aiter").reason
    assert reason.startswith("pages=254201: aiter's paged kernel takes at most 254200 cache pages")
    assert "int32" in reason and "Triton kernel serves larger caches" in reason
    assert "pages=254201" in res.explain()


def test_the_paged_ops_problem_carries_the_cache_page_count(registry):
    """From the op's own facts, on meta tensors (a 2 GiB cache described, not allocated): the problem of a call over
    254,201 pages names them, and resolution for it leaves aiter's kernel."""
    meta = dict(device="meta")
    q = torch.empty(2, 1, 64, 128, dtype=torch.float8_e4m3fn, **meta)
    weights = torch.empty(2, 64, dtype=torch.float32, **meta)
    lens = torch.empty(2, 1, dtype=torch.int32, **meta)
    table = torch.empty(2, 4, dtype=torch.int32, **meta)
    for pages, chosen in ((LAST_SAFE_PAGE_COUNT, "paged_mqa_logits.rocm.aiter"),
                          (LAST_SAFE_PAGE_COUNT + 1, "paged_mqa_logits.triton.logits")):
        cache = torch.empty(pages, 64, 1, 132, dtype=torch.uint8, **meta)
        problem = ops.paged_mqa_logits.problem(q, cache, weights, lens, table, 256)
        assert problem.get("pages") == pages
        assert registry.resolve("paged_mqa_logits", GFX950, problem,
                                environment=WITH_AITER).chosen.impl_id == chosen


def test_the_adapter_refuses_a_cache_past_the_limit_before_launching():
    """Called directly (not through resolution), the adapter raises naming kv_cache and the limit, before any
    allocation or launch (meta tensors: nothing to allocate)."""
    kernel = PlainPagedKernelDouble()
    fn = paged.make_paged_mqa_logits("kernel", fn=kernel)
    meta = dict(device="meta")
    q = torch.empty(2, 1, 16, 128, dtype=torch.float8_e4m3fn, **meta)
    cache = torch.empty(LAST_SAFE_PAGE_COUNT + 1, 64, 1, 132, dtype=torch.uint8, **meta)
    with pytest.raises(ValueError, match=r"kv_cache has 254201 pages: .*int32.* past 254200 pages.*Triton"):
        fn(q, cache, torch.empty(2, 16, **meta), torch.empty(2, 1, dtype=torch.int32, **meta),
           torch.empty(2, 4, dtype=torch.int32, **meta), 256)
    assert kernel.launches == []


# --- 16: a prebuilt module counts as built only where aiter's own arch check would load it ----------------------
TOPK = dict(k=2048, slots=False, starts=False)




@pytest.mark.parametrize("running, built_for, jit_dir_env, usable", [
    ("gfx950", ("gfx942",), False, False),  # v0.1.17+: a gfx942 build on a gfx950 host is rebuilt in the first call
    ("gfx950", ("gfx942",), True, False),  # the same under $AITER_JIT_DIR
    ("gfx950", ("gfx942", "gfx950"), False, True),  # a fat build that holds this arch loads as is
    ("gfx942", ("gfx942",), False, True),
    ("gfx950", (), False, True),  # no code-object ids found: aiter's check keeps the module (so do we)
    (None, ("gfx942",), False, True),  # an aiter before v0.1.17 has no arch check and loads it as is
])
def test_prebuilt_modules_follow_aiters_own_arch_check(monkeypatch, tmp_path, registry, running, built_for,
                                                       jit_dir_env, usable):
    modules = ("module_top_k_per_row", "module_gemm_a8w8_blockscale")
    fp8 = torch.float8_e4m3fnuz if running == "gfx942" else torch.float8_e4m3fn  # aiter.dtypes.fp8 of that GPU
    fake = install_fake_aiter(monkeypatch, fp8=fp8, with_stable=True,
                              jit=dict(tmp_path=tmp_path, prebuilt=() if jit_dir_env else modules,
                                       running_arch=running, built_for={md: built_for for md in modules}))
    fake.gemm_a8w8_blockscale = lambda *a, **k: pytest.fail("the probe must not call a CK function")
    if jit_dir_env:
        from doubles.aiter import _offload_bundle

        elsewhere = tmp_path / "user_jit"
        elsewhere.mkdir()
        for md in modules:
            (elsewhere / f"{md}.so").write_bytes(_offload_bundle(built_for))
        monkeypatch.setenv("AITER_JIT_DIR", str(elsewhere))
    else:
        monkeypatch.delenv("AITER_JIT_DIR", raising=False)
    pretend_rocm_gpu(monkeypatch)
    assert aiter_api.probe() is None
    api = aiter_api.detected_api()
    probed = Environment(probes={}, facts={"gpu": None, "triton": None, "aiter": None},
                         name=f"probed-arch-{running}-{'-'.join(built_for)}-{jit_dir_env}")
    target = Target("rocm", running or "gfx950")
    topk = registry.resolve("topk_indices", target, Problem(**TOPK), environment=probed)
    gemm = registry.resolve("gemm_fp8_blockscale", target, Problem(), environment=probed)
    if usable:
        assert api.unbuilt == {} and api.module_notes == {}
        assert topk.chosen.impl_id == "topk_indices.rocm.aiter_stable"
        assert gemm.chosen.impl_id == "gemm_fp8_blockscale.rocm.aiter"
    else:
        assert api.unbuilt == {"topk_decode": ("module_top_k_per_row",), "topk_stable": ("module_top_k_per_row",),
                               "gemm_blockscale": ("module_gemm_a8w8_blockscale",)}
        words = "module_top_k_per_row is built for gfx942, not this GPU's gfx950 (aiter.jit.core._needs_arch_rebuild)"
        assert api.module_notes["module_top_k_per_row"] == words[len("module_top_k_per_row "):]
        reason = _candidate(topk, "topk_indices.rocm.aiter_stable").reason
        assert words in reason and "hipcc" in reason and "GPU_ARCHS=" in reason
        assert topk.chosen.impl_id == "topk_indices.triton.topk"
        assert "module_gemm_a8w8_blockscale is built for gfx942" in _candidate(
            gemm, "gemm_fp8_blockscale.rocm.aiter").reason
        assert gemm.chosen.impl_id == "gemm_fp8_blockscale.triton.gemm"
        assert "module_top_k_per_row is built for gfx942" in api.describe()
    assert not [c for c in fake.calls if c[0] == "top_k_per_row_decode"]  # the probe never calls a HIP function


# --- 17: the CK block-scale GEMM is not enabled on gfx1250 -----------------------------------------------------------
def test_ck_gemm_is_refused_on_gfx1250_and_triton_serves(registry):
    res = registry.resolve("gemm_fp8_blockscale", GFX1250, Problem(fp8="fn"), environment=WITH_AITER)
    assert res.chosen.impl_id == "gemm_fp8_blockscale.triton.gemm"
    reason = _candidate(res, "gemm_fp8_blockscale.rocm.aiter").reason
    assert reason.startswith("gfx1250: aiter's CK gemm_a8w8_blockscale is not verified there")
    assert "no tuned gfx1250 shapes" in reason and "SIGSEGV" in reason and "Triton GEMM serves it" in reason
    for target in (GFX942, GFX950):  # where it was registered for, unchanged
        res = registry.resolve("gemm_fp8_blockscale", target, Problem(fp8=FP8[target]), environment=WITH_AITER)
        assert res.chosen.impl_id == "gemm_fp8_blockscale.rocm.aiter"
    # The fused quant (a Triton kernel of aiter) stays the gfx1250 producer; its consumer is now the Triton GEMM.
    res = registry.resolve("rmsnorm_quant_fp8", GFX1250, Problem(group_size=128, ue8m0=False, fp8="fn"),
                           environment=WITH_AITER)
    assert res.chosen.impl_id == "rmsnorm_quant_fp8.rocm.aiter"


# --- 18: what the reasons and the docs say about aiter's releases and about CI -----------------------------------
def test_reasons_say_no_aiter_release_has_the_paged_kernel_and_which_has_stable_topk(monkeypatch, registry):
    """An aiter without the block-level paged kernel and without stable= (0.1.7's paths, as every tag up to
    v0.1.20.post1 for the paged kernel and up to v0.1.19.post2 for stable=, read from ROCm/aiter's git tags): the
    reasons `explain` prints say what to install."""
    monkeypatch.setattr(aiter_api.LIBRARY, "detected", (None, aiter_api.AiterApi(
        version="0.1.7-fake", fp8_dtype=torch.float8_e4m3fn, topk_decode="aiter.ops.topk.top_k_per_row_decode")))
    probed = Environment(probes={}, facts={"gpu": None, "triton": None, "aiter": None}, name="probed-releases")
    res = registry.resolve("paged_mqa_logits", GFX950, Problem(heads=64, dim=128, next_n=1, fp8="fn"),
                           environment=probed)
    reason = _candidate(res, "paged_mqa_logits.rocm.aiter").reason
    assert "no release has it" in reason and "v0.1.20.post1" in reason and "04907edc" in reason
    res = registry.resolve("topk_indices", GFX950, Problem(**TOPK), environment=probed)
    assert "stable=True) (ROCm/aiter v0.1.20 on" in _candidate(res, "topk_indices.rocm.aiter_stable").reason


def test_the_tests_over_aiters_real_kernels_are_not_counted_as_ci():
    """`.deps/` (aiter's Python files for the real-kernel tests) is git-ignored and CI runs `.ci/run` on a clean clone,
    so no row of the run table may credit those tests to CPU CI."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    assert "/.deps/" in (root / ".gitignore").read_text().split()
    assert ".deps" not in (root / ".ci" / "run").read_text()
    rows = [line for line in (root / "docs" / "backends-amd-npu.md").read_text().splitlines()
            if line.startswith("|") and ".deps/" in line]
    assert rows and all("CPU CI" not in row and "CI skips it" in row for row in rows), rows
