"""CPU checks of the CUDA top-k's plumbing (the kernel itself runs in tests/gpu/test_cuda_topk_gpu.py): resolution
with the compiler present / absent, the build's error reasons, the launch plan, and the FlashInfer adapter's
argument handling against a test double of flashinfer's documented API (the double proves marshalling only,
not FlashInfer's numerics)."""

from __future__ import annotations

import subprocess
import types

import pytest
import torch

from dsa_indexer import Environment, Problem, default_registry
from dsa_indexer.backends.cuda import flashinfer_topk, jit
from doubles.flashinfer import flashinfer_double
from dsa_indexer.backends.cuda import topk as cuda_topk
from dsa_indexer.backends.reference import kernels as ref
from dsa_indexer.dispatch import parse_target

TOPK = Problem(k=2048, slots=False, starts=False)


def _resolve(target: str, **facts):
    return default_registry().resolve("topk_indices", parse_target(target), TOPK,
                                      environment=Environment.simulated(**facts))


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_cuda_topk_chosen_when_the_kernel_builds(target):
    assert _resolve(target, gpu=True, triton=True, cuda_jit=True).chosen.impl_id == "topk_indices.cuda.radix"


def test_no_compiler_says_so_and_triton_serves():
    res = _resolve("sm90", gpu=True, triton=True, cuda_jit="CUDA top-k kernel not built: no nvcc found (set CUDA_HOME)")
    assert res.chosen.impl_id == "topk_indices.triton.topk"
    verdict = next(c for c in res.candidates if c.impl.impl_id == "topk_indices.cuda.radix")
    assert not verdict.accepted and "no nvcc found" in verdict.reason


@pytest.mark.parametrize("target", ["sm120", "gfx950", "npu", "cpu"])
def test_cuda_topk_serves_only_sm90_and_sm100(target):
    res = _resolve(target, gpu=True, triton=True, cuda_jit=True)
    assert res.chosen.impl_id != "topk_indices.cuda.radix"


def test_lightning_indexer_needs_deepgemm_and_the_kernel():
    problem = Problem(heads=64, dim=128, next_n=1, k=2048, fp8="fn", slots=False)
    registry = default_registry()

    def chosen(**facts):
        return registry.resolve("lightning_indexer", parse_target("sm90"), problem,
                                environment=Environment.simulated(**facts)).chosen.impl_id

    assert chosen(gpu=True, triton=True, deep_gemm=True, cuda_jit=True) == "lightning_indexer.cuda.deepgemm_radix"
    assert chosen(gpu=True, triton=True, deep_gemm=True) == "lightning_indexer.generic.composed"
    assert chosen(gpu=True, triton=True, cuda_jit=True) == "lightning_indexer.generic.composed"
    res = registry.resolve("lightning_indexer", parse_target("sm90"), Problem(heads=16, dim=128, next_n=1, k=2048,
                                                                              fp8="fn", slots=False),
                           environment=Environment.simulated(gpu=True, deep_gemm=True, cuda_jit=True))
    assert res.chosen.impl_id == "lightning_indexer.generic.composed"
    assert "heads=16" in next(c.reason for c in res.candidates if c.impl.vendor == "cuda")


def test_build_without_nvcc_raises_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(jit.os, "access", lambda path, mode: False)
    with pytest.raises(jit.CudaBuildError, match="no nvcc found"):
        jit.build("topk.cu", (9, 0))


def test_build_failure_carries_the_compiler_output(monkeypatch, tmp_path):
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'release 99.9'; exit 0; fi\n"
                    "echo 'topk.cu(1): error: planted failure' >&2; exit 2\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "none"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv(jit.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(jit.CudaBuildError, match="planted failure"):
        jit.build("topk.cu", (9, 0))
    assert not list((tmp_path / "cache").rglob("*.so")), "a failed build must leave nothing in the cache"


def test_cache_key_follows_source_flags_and_toolkit(monkeypatch, tmp_path):
    calls = []
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo \"release $TOOLKIT\"; exit 0; fi\n"
                    "for a in \"$@\"; do prev=$cur; cur=$a; if [ \"$prev\" = -o ]; then : > \"$a\"; fi; done\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv(jit.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("TOOLKIT", "13.0")
    first = jit.build("topk.cu", (9, 0))
    calls.append(first)
    assert first.exists() and jit.build("topk.cu", (9, 0)) == first  # cached
    assert jit.build("topk.cu", (10, 0)) != first  # another arch
    monkeypatch.setenv("TOOLKIT", "13.1")
    assert jit.build("topk.cu", (9, 0)) != first  # another toolkit
    monkeypatch.setenv("TOOLKIT", "13.0")
    variant = jit.build("topk.cu", (9, 0), ("DSA_TOPK_SOLO_WINDOW=1",))
    assert variant.exists() and variant != first  # a compile-time variant is its own library
    assert jit.build("topk.cu", (9, 0), ("DSA_TOPK_SOLO_WINDOW=1",)) == variant  # cached too
    assert jit.build("topk.cu", (9, 0)) == first
    with pytest.raises(ValueError, match="defines: 'X=1; rm' is not NAME or NAME=VALUE"):
        jit.build("topk.cu", (9, 0), ("X=1; rm",))


def test_a_register_variant_loads_its_own_build_and_goes_back(monkeypatch):
    """`use_register_variant`: the register kernels' library is loaded with the variant's macros from then on, and
    with none after ``use_register_variant()`` (benchmarks compare two builds in one process)."""
    loaded = []
    fake = types.SimpleNamespace(**{name: types.SimpleNamespace() for name in (
        "dsa_topk_registers_launch", "dsa_topk_registers_chunk", "dsa_topk_routed_launch", "dsa_topk_stream_launch",
        "dsa_topk_stream_max_cols", "dsa_topk_stream_active_clusters", "dsa_topk_stream_smem_bytes",
        "dsa_topk_prefill_launch", "dsa_topk_prefill_max_cols", "dsa_topk_prefill_blocks_per_sm",
        "dsa_topk_registers_error_string")})
    monkeypatch.setattr(jit, "load", lambda source, capability, defines=(): loaded.append((source, defines)) or fake)
    try:
        cuda_topk.use_register_variant(("DSA_TOPK_SOLO_WINDOW=1",))
        assert cuda_topk._registers_library((9, 0)) is fake
        cuda_topk.use_register_variant()
        cuda_topk._registers_library((9, 0))
    finally:
        cuda_topk.use_register_variant()
    assert loaded == [(cuda_topk.REGISTERS_SOURCE, ("DSA_TOPK_SOLO_WINDOW=1",)), (cuda_topk.REGISTERS_SOURCE, ())]


def test_pdl_launches_load_the_pdl_builds(monkeypatch):
    """With PDL on for the device (``DSA_INDEXER_PDL=1``), both top-k libraries load their ``DSA_PDL=1`` build, a
    register variant's macros kept; off, the shipped builds."""
    loaded = []
    fake = types.SimpleNamespace(**{name: types.SimpleNamespace() for name in (
        "dsa_topk_launch", "dsa_topk_smem_bytes", "dsa_topk_error_string",
        "dsa_topk_registers_launch", "dsa_topk_registers_chunk", "dsa_topk_routed_launch", "dsa_topk_stream_launch",
        "dsa_topk_stream_max_cols", "dsa_topk_stream_active_clusters", "dsa_topk_stream_smem_bytes",
        "dsa_topk_prefill_launch", "dsa_topk_prefill_max_cols", "dsa_topk_prefill_blocks_per_sm",
        "dsa_topk_registers_error_string")})
    monkeypatch.setattr(jit, "load", lambda source, capability, defines=(): loaded.append((source, defines)) or fake)
    cuda_topk._library.cache_clear()
    try:
        cuda_topk.use_register_variant(("DSA_TOPK_SOLO_WINDOW=1",))
        cuda_topk._registers_library((9, 0), True)
        cuda_topk._library((9, 0), True)
        cuda_topk._library((9, 0))
    finally:
        cuda_topk.use_register_variant()
        cuda_topk._library.cache_clear()
    assert loaded == [(cuda_topk.REGISTERS_SOURCE, ("DSA_TOPK_SOLO_WINDOW=1", "DSA_PDL=1")),
                      (cuda_topk.SOURCE, ("DSA_PDL=1",)), (cuda_topk.SOURCE, ())]


def test_the_pdl_build_waits_before_any_memory_access(tmp_path):
    """csrc/cluster_launch.cuh: in the ``DSA_PDL=1`` build every kernel's first instruction of note is
    ``griddepcontrol.wait`` (before any global load or store, barrier or cluster barrier); the shipped build has
    none. Compiled to PTX for sm90 (skipped where no nvcc is found, as on CI's machine)."""
    nvcc = jit.find_nvcc()
    if nvcc is None:
        pytest.skip("no nvcc: the PDL build is checked where the CUDA kernels can build")
    for defines, expect in (((), False), (("-DDSA_PDL=1",), True)):
        ptx_path = tmp_path / f"topk_{int(expect)}.ptx"
        built = subprocess.run([nvcc, "-ptx", "-O3", "-std=c++17", "--expt-relaxed-constexpr", *defines,
                                *jit.arch_flags((9, 0)), "-o", str(ptx_path), str(jit.CSRC / cuda_topk.SOURCE)],
                               capture_output=True, text=True, timeout=600)
        assert built.returncode == 0, built.stderr[-2000:]
        entries = ptx_path.read_text().split(".entry ")[1:]
        assert entries, "no kernel in the PTX"
        for body in entries:
            ops = [line.split()[0] for line in body.splitlines() if line.strip() and not line.strip().startswith(
                ("//", ".", "{", "}", "$", "(", ")"))]
            if not expect:
                assert not any(op.startswith("griddepcontrol") for op in ops)
                continue
            first_access = next(i for i, op in enumerate(ops)
                                if op.startswith(("ld.global", "st.global", "bar.", "barrier.", "atom.", "red.")))
            assert "griddepcontrol.wait;" in ops[:first_access] or "griddepcontrol.wait" in ops[:first_access], \
                ops[:first_access + 1]


@pytest.mark.parametrize("rows,cols,vec,cluster", [(32, 8192, 4, 1), (1, 8192, 4, 1), (1, 32768, 4, 2),
                                                   (64, 32768, 4, 2), (128, 32768, 4, 1), (8, 131072, 4, 8),
                                                   (32, 131072, 4, 4), (1, 262144, 4, 8), (3, 70000, 1, 3),
                                                   (1, 300000, 4, 8)])
def test_launch_plan(rows, cols, vec, cluster):
    got_cluster, chunk = cuda_topk.plan(rows, cols, 132, vec)
    assert got_cluster == cluster
    assert chunk % (32 * vec) == 0 and chunk * got_cluster >= cols  # every column has a slot
    assert chunk * 4 + 56 * 1024 <= 227 * 1024  # fits the opt-in shared memory with the histograms


def test_rows_too_wide_for_eight_ctas_have_no_plan():
    assert cuda_topk.plan(1, 8 * 48 * 1024, 132, 4) is None
    assert cuda_topk.plan_for(1, 8 * 48 * 1024, 132, 4) is None  # the Triton top-k serves such rows


def _plans_with_routing(monkeypatch, route_rows: bool):
    """plan_for with ROUTE_ROWS set (it is cached per shape: cleared on the way in and out)."""
    monkeypatch.setattr(cuda_topk, "ROUTE_ROWS", route_rows)
    cuda_topk.plan_for.cache_clear()
    yield
    cuda_topk.plan_for.cache_clear()


@pytest.fixture
def width_plans(monkeypatch):
    """The plan with ROUTE_ROWS off: the rules that choose one kernel for every row from the launch's width (what
    the plan does where the routed launch is off, and beside which benchmarks time it)."""
    yield from _plans_with_routing(monkeypatch, False)


@pytest.mark.parametrize("rows,cols,cluster,keys", [
    (300, 4096, 1, 8), (300, 8192, 1, 16), (300, 9000, 1, 32), (1, 16385, 5, 8), (200, 8192, 1, 16),
    (1, 32768, 8, 8), (32, 32768, 4, 16), (64, 32768, 2, 32), (127, 32768, 2, 32),
    (1, 131072, 16, 16), (31, 131072, 8, 32), (2, 70000, 9, 16), (1, 262144, 16, 32)])
def test_register_plan(width_plans, rows, cols, cluster, keys):
    got = cuda_topk.plan_for(rows, cols, 132, 4)
    assert got == cuda_topk.Plan("registers", cluster, keys)
    assert keys in cuda_topk.REGISTERS_KEYS and 1 <= cluster <= cuda_topk.REGISTERS_MAX_CLUSTER
    assert cluster * keys * cuda_topk.REGISTERS_THREADS >= cols  # every column has a register
    if rows * cluster > 132:  # past one CTA per SM: the fewest CTAs
        assert cluster == -(-cols // (32 * cuda_topk.REGISTERS_THREADS))


@pytest.mark.parametrize("rows,cols", [(32, 8192), (128, 8192), (132, 16384), (1, 4096), (1, 100), (64, 2048),
                                       (1, 8192), (5, 4097)])
def test_a_wave_of_short_decode_rows_takes_the_streaming_kernel(width_plans, rows, cols):
    """Up to one CTA per SM of rows <= 16K columns: the streaming kernel, which selects each in registers; more
    rows, or longer rows (fewer than 32 of them or at most 64K columns), keep the register kernel."""
    assert cuda_topk.plan_for(rows, cols, 132, 4) == cuda_topk.Plan("stream", 1, 0)
    for other in ((133, cols), (1, 16385), (rows, 16385)):
        assert cuda_topk.plan_for(*other, 132, 4).kernel == "registers", other


@pytest.mark.parametrize("rows,cols", [(128, 131072), (300, 40000), (128, 262144), (32, 131072), (64, 131072),
                                       (32, 163840), (32, 65537)])
def test_many_long_rows_take_the_streaming_kernel(width_plans, rows, cols):
    split = cuda_topk.stream_cluster(rows, cols, 132)  # the split pass's CTAs per row (1 past 66 rows)
    assert cuda_topk.plan_for(rows, cols, 132, 4) == cuda_topk.Plan("stream", split, 0)


@pytest.mark.parametrize("rows,cols", [(127, 32768), (300, 9000), (31, 131072), (1, 163840), (32, 65536),
                                       (128, 262145), (128, 32767)])
def test_rows_that_fit_one_wave_or_are_short_or_too_wide_do_not_stream(width_plans, rows, cols):
    assert cuda_topk.plan_for(rows, cols, 132, 4).kernel != "stream"


@pytest.mark.parametrize("rows,cols", [(64, 32768), (128, 32768), (64, 65536)])
def test_many_rows_at_v4_k_512_stream_from_32k_columns(width_plans, rows, cols):
    """V4's k = 512: 64+ rows of >= 32K columns stream; the same rows at k = 2048, fewer rows, or shorter ones keep
    the register clusters."""
    split = cuda_topk.stream_cluster(rows, cols, 132)
    assert cuda_topk.plan_for(rows, cols, 132, 4, 512) == cuda_topk.Plan("stream", split, 0)
    at_2048 = "stream" if rows >= cuda_topk.MANY_ROWS_STREAM_MIN_ROWS else "registers"  # (128+ rows: any k)
    assert cuda_topk.plan_for(rows, cols, 132, 4, 2048).kernel == at_2048
    assert cuda_topk.plan_for(63, cols, 132, 4, 512).kernel == "registers"
    assert cuda_topk.plan_for(rows, 32767, 132, 4, 512).kernel == "registers"


@pytest.mark.parametrize("rows,cols", [(128, 32768), (128, 40000), (200, 32768), (128, 262144)])
def test_many_rows_of_32k_columns_or_more_stream_at_any_k(width_plans, rows, cols):
    """From 128 rows of 32K-256K columns the streaming kernel at k = 2048 too; 127 rows keep the register clusters."""
    assert cuda_topk.plan_for(rows, cols, 132, 4, 2048) == cuda_topk.Plan("stream", 1, 0)
    assert cuda_topk.plan_for(127, 32768, 132, 4, 2048).kernel == "registers"


@pytest.mark.parametrize("rows,cols,cluster", [(32, 163840, 4), (64, 131072, 2), (128, 131072, 1), (16, 65537, 8),
                                               (33, 131072, 4), (34, 131072, 2), (66, 131072, 2), (67, 131072, 1),
                                               (32, 16384, 1), (128, 8192, 1)])
def test_split_stream_plan_fills_one_wave(width_plans, monkeypatch, rows, cols, cluster):
    """SPLIT_STREAM on: a streaming launch of rows longer than one CTA holds takes the most CTAs per row (2 / 4 /
    8) that keep rows x CTAs within the SMs; rows one CTA holds (<= 16K columns) keep one CTA each."""
    monkeypatch.setattr(cuda_topk, "SPLIT_STREAM", True)
    assert cuda_topk.stream_cluster(rows, cols, 132) == cluster
    assert rows * cluster <= 132 or cluster == 1
    got = cuda_topk.plan_for(rows, cols, 132, 4)
    if got.kernel == "stream":
        assert got.cluster == cluster
    monkeypatch.setattr(cuda_topk, "SPLIT_STREAM", False)
    assert cuda_topk.stream_cluster(rows, cols, 132) == 1


@pytest.mark.parametrize("rows,planned,runs", [(32, 4, 2), (30, 4, 4), (16, 8, 4), (14, 8, 8), (1, 8, 8), (60, 2, 2),
                                               (70, 2, 1), (5, 4, 4)])
def test_split_clusters_narrow_until_the_rows_run_in_one_wave(rows, planned, runs):
    """At launch a split plan's clusters halve while the rows' clusters would not all run at once (a made-up GPU
    that runs 66 clusters of 2, 30 of 4 and 14 of 8, as GPCs of 16-18 SMs would)."""
    active = {2: 66, 4: 30, 8: 14}
    assert cuda_topk.fit_split_cluster(rows, planned, active.__getitem__) == runs
    assert cuda_topk.fit_split_cluster(rows, planned, lambda c: 0) == 1  # no cluster fits: one CTA per row


def test_rows_past_sixteen_register_chunks_take_the_shared_memory_kernel():
    wide = cuda_topk.plan_for(1, 16 * 16384 + 1, 132, 4)
    assert wide.kernel == "shared" and wide.cluster == 8 and wide.per_cta * 8 >= 16 * 16384 + 1


def test_plan_is_computed_once_per_shape():
    cuda_topk.plan_for.cache_clear()
    for _layer in range(61):  # every layer of a decode step asks for the same shape
        cuda_topk.plan_for(64, 32768, 132, 4)
    info = cuda_topk.plan_for.cache_info()
    assert info.misses == 1 and info.hits == 60


def test_self_test_holds_the_nan_rule():
    """The probe's self-test expects a NaN ranked as -inf: an implementation of that rule passes it on the CPU,
    one that ranks NaN as the largest value (the old rule) or as a plain value fails it."""
    def nan_as_neg_inf(logits, k, ends, starts, table, req):
        return ref.topk_indices(cuda_topk.nan_as_neg_inf(logits), k, ends, starts, table, req)

    def nan_largest(logits, k, ends, starts, table, req):
        big = torch.where(torch.isnan(logits), torch.full_like(logits, float("inf")), logits)
        return ref.topk_indices(big, k, ends, starts, table, req)

    cuda_topk.self_test(torch.device("cpu"), topk=nan_as_neg_inf)
    with pytest.raises(RuntimeError, match="self-test case"):
        cuda_topk.self_test(torch.device("cpu"), topk=nan_largest)
    cases = list(cuda_topk._self_test_cases(torch.device("cpu")))
    assert sum(bool(torch.isnan(c[0]).any()) for c in cases) >= 2  # short and clustered rows hold NaN


def test_nan_as_neg_inf_maps_every_nan_and_nothing_else():
    bits = torch.tensor([0x7FC00000, 0x7F800001, 0xFFFFFFFF - (1 << 32), 0x7F800000, 0x3F800000, 0],
                        dtype=torch.int32)
    x = bits.view(torch.float32)
    got = cuda_topk.nan_as_neg_inf(x)
    assert torch.equal(torch.isneginf(got), torch.tensor([True, True, True, False, False, False]))
    assert torch.equal(got[3:], x[3:])


# --- FlashInfer adapter, against a double of flashinfer 0.7's documented top_k_ragged_transform -------------
def test_flashinfer_adapter_passes_lengths_and_asks_for_deterministic_low_index_ties():
    module, calls = flashinfer_double()
    adapter = flashinfer_topk.make_topk_indices(module)
    logits = torch.randn(5, 300)
    ends = torch.tensor([300, 10, 64, 299, 0], dtype=torch.int32)
    got = adapter(logits, 64, ends)
    assert torch.equal(got, ref.topk_indices(logits, 64, ends))
    assert calls[0]["deterministic"] is True and calls[0]["tie_break"] == 1 and calls[0]["dtype"] == torch.int32
    assert int(calls[0]["offsets"].abs().sum()) == 0
    with pytest.raises(ValueError, match="starts"):
        adapter(logits, 64, ends, torch.zeros(5, dtype=torch.int32))


def test_flashinfer_supports_and_api_checks():
    sm90 = parse_target("sm90")
    caps = flashinfer_topk.CAPABILITIES  # declared: every failing fact at once
    assert caps.reasons(Problem(k=2048, starts=False, slots=False), sm90) == []
    (starts,) = caps.reasons(Problem(k=64, starts=True, slots=False), sm90)
    (slots,) = caps.reasons(Problem(k=64, starts=False, slots=True), sm90)
    assert "starts=True" in starts and "slot transform" in slots
    assert len(caps.reasons(Problem(k=4096, starts=True, slots=True), sm90)) == 3
    assert "k=4096" in caps.reasons(Problem(k=4096, starts=False, slots=False), sm90)[0]
    old = types.SimpleNamespace(__version__="0.2", top_k=lambda *a: None)
    assert "no top_k_ragged_transform" in flashinfer_topk.api_problem(old)
    with pytest.raises(RuntimeError, match="no top_k_ragged_transform"):
        flashinfer_topk.make_topk_indices(old)


def test_the_flashinfer_probe_is_the_shared_vendor_library_probe(monkeypatch):
    """Installed -> import -> feature detection through `dispatch.vendor.VendorLibrary`, as DeepGEMM, aiter and
    torch_npu are probed: an old build is refused with its reason, the double's API passes and is described."""
    import sys

    old = types.ModuleType("flashinfer")
    old.__version__ = "0.2"
    monkeypatch.setitem(sys.modules, "flashinfer", old)
    flashinfer_topk.LIBRARY.reset()
    assert "flashinfer 0.2 has no top_k_ragged_transform" in flashinfer_topk.probe()
    module, _ = flashinfer_double()
    fresh = types.ModuleType("flashinfer")
    fresh.__dict__.update(vars(module))
    monkeypatch.setitem(sys.modules, "flashinfer", fresh)
    assert flashinfer_topk.probe() is None
    assert flashinfer_topk.LIBRARY.description() == "flashinfer 0.7.4-double"
    flashinfer_topk.LIBRARY.reset()


def test_flashinfer_ranks_below_the_cuda_and_triton_top_k():
    res = _resolve("sm90", gpu=True, triton=True, cuda_jit=True, flashinfer=True)
    order = [c.impl.impl_id for c in res.candidates if c.accepted]
    assert order.index("topk_indices.cuda.flashinfer") > order.index("topk_indices.triton.topk")
    res = _resolve("sm90", gpu=True, flashinfer=True)
    assert res.chosen.impl_id == "topk_indices.cuda.flashinfer"


def _pretend_gpu(monkeypatch, capability=(9, 0)):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.mark.parametrize("module", ["topk", "lightning_fused"])
def test_the_jit_kernels_are_probed_on_the_shared_vendor_library_path(module, monkeypatch):
    """The CUDA top-k and the fused lightning kernel go through `VendorLibrary` like every vendor library: no GPU,
    the wrong arch, a failed nvcc build, a failing self-test and a passing one each give their verdict."""
    import importlib

    from dsa_indexer.dispatch.vendor import LIBRARIES, VendorLibrary

    kernels = importlib.import_module(f"dsa_indexer.backends.cuda.{module}")
    library = kernels.LIBRARY
    assert isinstance(library, VendorLibrary) and LIBRARIES[library.module] is library and library.installed()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kernels.probe() == "torch sees no CUDA device"
    _pretend_gpu(monkeypatch, (12, 0))
    assert "sm90 / sm100); this GPU is sm12x" in kernels.probe()
    _pretend_gpu(monkeypatch)
    def build_fails():
        raise jit.CudaBuildError("no nvcc found (set CUDA_HOME)")

    monkeypatch.setattr(library, "load", build_fails)
    assert kernels.probe() == (f"{library.module} failed to build or load (CudaBuildError: no nvcc found "
                               "(set CUDA_HOME))")
    monkeypatch.setattr(library, "load", lambda: "built")
    monkeypatch.setattr(kernels, "self_test", lambda device: (_ for _ in ()).throw(RuntimeError("row 3 differs")))
    assert kernels.probe().endswith("self-test failed: row 3 differs")
    seen = []
    monkeypatch.setattr(kernels, "self_test", lambda device: seen.append(device))
    assert kernels.probe() is None and seen == [torch.device("cuda", 0)]
    assert library.description().startswith(f"{library.module} (nvcc-built")
    library.reset()


@pytest.fixture
def routed_rows(monkeypatch):
    """The plan with ROUTE_ROWS on."""
    yield from _plans_with_routing(monkeypatch, True)


@pytest.mark.parametrize("rows,cols,cluster,keys", [
    (1, 16385, 5, 8), (1, 32768, 8, 8), (32, 32768, 4, 16), (100, 32768, 2, 32), (1, 131072, 16, 16),
    (32, 131072, 8, 32), (64, 131072, 8, 32), (1, 163840, 10, 32), (32, 163840, 10, 32), (1, 262144, 16, 32)])
def test_routed_launch_for_rows_longer_than_one_cta_in_up_to_two_waves(routed_rows, rows, cols, cluster, keys):
    """Rows wider than 16K columns whose register clusters fit two waves: one routed launch (the rows' own lengths
    pick the kernel on the device), with the register kernel's clusters for the width."""
    assert cuda_topk.plan_for(rows, cols, 132, 4) == cuda_topk.Plan("routed", cluster, keys)


@pytest.mark.parametrize("rows,cols,k", [(32, 8192, 2048), (132, 16384, 2048), (128, 131072, 2048),
                                         (300, 40000, 2048), (64, 32768, 512), (1, 262145, 2048),
                                         (2048, 32768, 2048)])
def test_no_routed_launch_for_short_rows_more_waves_v4_streams_wider_rows_or_prefill(routed_rows, rows, cols, k):
    """Short rows (the streaming kernel holds them), more than two waves of clusters (every row streams), V4's
    64+ rows at k = 512, rows wider than the streaming kernel's bitmap, and prefill chunks keep their plans."""
    assert cuda_topk.plan_for(rows, cols, 132, 4, k).kernel != "routed"

