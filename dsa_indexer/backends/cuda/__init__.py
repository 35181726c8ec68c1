"""The NVIDIA backend: DeepGEMM's logits and block-fp8 GEMM kernels (sm90, sm100) and the dual-stream pipeline.

Registrations (all through the one plugin hook):
- the probe of the environment fact ``deep_gemm``: import, API detection by feature and a small self-test on the
  GPU against the reference kernels (`deepgemm.probe`), run once at the first resolution that needs it;
- ``paged_mqa_logits.cuda.deepgemm``, ``ragged_mqa_logits.cuda.deepgemm``, ``gemm_fp8_blockscale.cuda.deepgemm``
  at priority 200 (above Triton's 100) for sm90 and sm100, each with a ``supports`` check that names the limit
  a problem hits (head counts, next_n, head dim, fp8 flavour; the GEMM on sm100 declares ``scale_fmt="ue8m0"``);
- ``paged_mqa_logits.cuda.deepgemm_fp4``, ``ragged_mqa_logits.cuda.deepgemm_fp4`` (`deepgemm_fp4.py`, priority 199,
  sm100 only, ``keys="fp4"``): DeepGEMM's FP4 logits, each self-tested against the reference by its factory;
- ``indexer_pipeline.cuda.dual_stream`` (`dual_stream.py`);
- the probe of the fact ``cuda_jit``: this backend's own CUDA C++ kernels (``csrc/``) compile with nvcc (cached
  on disk, `jit.py`) and pass a self-test against the reference (`topk.probe`);
- ``topk_indices.cuda.radix`` (`topk.py`, priority 200): the exact cluster radix top-k;
- ``topk_indices.cuda.flashinfer`` (`flashinfer_topk.py`, priority 60, fact ``flashinfer``): FlashInfer's top-k;
- ``lightning_indexer.cuda.deepgemm_radix`` (`lightning.py`, priority 200): DeepGEMM's paged logits consumed
  unmasked by the CUDA top-k, schedule metadata once per step;
- ``lightning_indexer.cuda.fused`` (`lightning_fused.py`, priority -1: opt-in, see `FUSED_LIGHTNING_PRIORITY`,
  fact ``cuda_jit``): logits and top-k in one CUDA kernel, the logits in shared memory; its factory builds the
  kernel and self-tests it against the reference (a failure rejects it with the reason, and resolution moves on).

``deep_gemm`` is imported only by the probe and the factories, so importing dsa_indexer never needs it; nvcc is
run only by the ``cuda_jit`` probe, at the first resolution that needs it.
"""

from __future__ import annotations

import torch

from ...dispatch.capabilities import Capabilities, Rule
from ...dispatch.environment import Environment
from ...dispatch.plugins import hookimpl
from ...dispatch.problem import Problem
from ...dispatch.registry import Registry
from ...dispatch.target import Target
from ...dispatch.verification import Level, Verified, ran_on
from ...contract.quant import Fp8GroupLayout
from ...contract.specs import WRITES_OUT_INFO
from ...contract.step import STEP_CONTEXT_INFO
from .flashinfer_topk import CAPABILITIES as FLASHINFER_CAPS  # imports no flashinfer (its probe and factory do)

DEEPGEMM_PRIORITY = 200
DEEPGEMM_TARGETS = ("sm90", "sm100")
# Head counts DeepGEMM 2.6.1 takes for fp8 logits: {32, 64} on sm90, {8, 16, 32, 64} on sm100. Kept to the
# shapes the self-test and the GPU tests cover; V3.2 and V4 use 64.
LOGITS_HEADS = {"sm90": (32, 64), "sm100": (32, 64)}
PAGED_NEXT_N = {"sm90": (1, 2), "sm100": None}  # None: any next_n >= 1
HEAD_DIM = 128

# What the DeepGEMM GEMM accepts from our quant op: per-token groups of 128 along K, plain fp32 scales,
# row-major [M, K/128] (DeepGEMM makes its MN-major TMA-aligned copy inside the call), e4m3fn.
GEMM_INPUT_LAYOUT = Fp8GroupLayout(group_size=128, ue8m0=False, scale_major="row", packed_scales=False,
                                   fp8_dtype=torch.float8_e4m3fn)

OPS = ("paged_mqa_logits", "ragged_mqa_logits", "gemm_fp8_blockscale")
JIT_PRIORITY = 200
JIT_TARGETS = ("sm90", "sm100")
DESCRIPTIONS = {
    "paged_mqa_logits": "DeepGEMM paged MQA logits (schedule metadata + kernel, tail masked to -inf)",
    "ragged_mqa_logits": "DeepGEMM ragged MQA logits (clean_logits=True, contiguous copy)",
    "gemm_fp8_blockscale": "DeepGEMM block-fp8 GEMM, recipe (1, 128, 128), bf16 output",
}


def _deep_gemm_probe() -> str | None:
    from . import deepgemm

    return deepgemm.probe()


# What the DeepGEMM adapters take, declared (dispatch/capabilities.py); the registry reports every failing fact.
# keys: these read fp8 keys: the 132-byte pages (paged), fp8 [N, 128] rows with fp32 scales (ragged); FP4 keys go to
# the FP4 adapters below.
LOGITS_CAPS = Capabilities("DeepGEMM logits", fp8=("fn",), dim=(HEAD_DIM,), heads=LOGITS_HEADS, keys=("fp8",))
PAGED_CAPS = Capabilities("DeepGEMM paged logits", fp8=("fn",), dim=(HEAD_DIM,), heads=LOGITS_HEADS,
                          next_n=PAGED_NEXT_N, keys=("fp8",))
# scale_fmt: sm100's DeepGEMM reads packed ue8m0 scales (the adapter packs power-of-two fp32 scales; fp32 ones would
# be rounded down silently), sm90's reads fp32 scales of either format.
GEMM_SCALE_FMTS = {"sm90": None, "sm100": ("ue8m0",)}
GEMM_CAPS = Capabilities("the DeepGEMM GEMM adapter", fp8=("fn",), scale_fmt=GEMM_SCALE_FMTS,
                         out=Rule(lambda out: out == str(torch.bfloat16), "bf16 output (what the adapter writes)"),
                         k=Rule(lambda k: k % 128 == 0, "a multiple of 128 (the (1, 128, 128) recipe)"),
                         n=Rule(lambda n: n % 64 == 0, "a multiple of 64 (DeepGEMM's TMA store alignment for bf16)"))
# V4's FP4 keys (the paged64_fp4_e2m1 pages, or their bytes gathered for the ragged op) through
# fp8_fp4_paged_mqa_logits / fp8_fp4_mqa_logits with q's scales: DeepGEMM asserts sm100 for FP4 (arch_major == 10;
# sm90 takes fp8 only) and heads 8/16/32/64, head dim 64 or 128 (the library's is 128).
FP4_TARGETS = ("sm100",)
FP4_HEADS = (8, 16, 32, 64)
FP4_CAPABILITIES = {
    "paged_mqa_logits": Capabilities("DeepGEMM FP4 paged logits", fp8=("fn",), dim=(HEAD_DIM,), heads=FP4_HEADS,
                                     keys=("fp4",)),
    "ragged_mqa_logits": Capabilities("DeepGEMM FP4 ragged logits", fp8=("fn",), dim=(HEAD_DIM,), heads=FP4_HEADS,
                                      keys=("fp4",)),
}
FP4_DESCRIPTIONS = {
    "paged_mqa_logits": "DeepGEMM fp8_fp4_paged_mqa_logits over the 68-byte FP4 pages (q unfolded to packed e2m1 + "
                        "ue8m0 scales; sm100 only; self-tested at build, never run here)",
    "ragged_mqa_logits": "DeepGEMM fp8_fp4_mqa_logits over FP4 keys as stored (packed e2m1 + ue8m0 bytes; q unfolded; "
                         "sm100 only; self-tested at build, never run here)",
}
CAPABILITIES = {"paged_mqa_logits": PAGED_CAPS, "ragged_mqa_logits": LOGITS_CAPS, "gemm_fp8_blockscale": GEMM_CAPS}


def _gemm_supports(problem: Problem, target: Target) -> str | None:
    """What the declared capabilities cannot say: a declared fact the problem does not carry is not checked, but on
    sm100 a GEMM problem without ``scale_fmt`` (a coarse one, e.g. the CLI's defaults) must not get DeepGEMM, which
    would round fp32 scales down to powers of two silently there."""
    if target.arch == "sm100" and problem.get("scale_fmt") is None:
        return ("sm100: DeepGEMM reads packed ue8m0 scales there and this problem does not say its scale_fmt "
                "(ask with scale_fmt='ue8m0' for power-of-two scales)")
    return None


def _available(op: str):
    def check(target: Target, env: Environment) -> str | None:
        # Runs only once the deep_gemm fact holds. In a simulated environment nothing was detected: assume
        # the full API. After a real probe, the detected API decides.
        from .deepgemm import detected_api

        api = detected_api()
        if api is not None and api.function_for(op) is None:
            return f"{api.describe()} has no {op} function"
        return None

    return check


def _fp4_available(op: str):
    """The detected API must have the FP4-capable function of ``op`` (feature detection, as `_available`)."""
    def check(target: Target, env: Environment) -> str | None:
        from .deepgemm import PAGED_NEW, RAGGED_NEW, detected_api

        name, what = {"paged_mqa_logits": (PAGED_NEW, "paged"), "ragged_mqa_logits": (RAGGED_NEW, "ragged")}[op]
        api = detected_api()
        if api is not None and api.function_for(op) != name:
            return f"{api.describe()} has no {name} (DeepGEMM's FP4 {what} logits)"
        return None

    return check


def _fp4_supports(problem: Problem, target: Target) -> str | None:
    """A declared fact the problem does not carry is not checked: a problem that does not say its keys (a coarse
    one) must not get an adapter that reads FP4 keys only, whatever its head count."""
    if problem.get("keys") is None:
        return "the problem does not say its keys (this adapter reads FP4 keys only: ask with keys='fp4')"
    return None


def _fp4_factory(op: str):
    def factory():
        """The adapter, self-tested once against the reference on the GPU (it has never run on a real sm100 here): a
        failure rejects it with the reason and resolution moves on (to the Triton FP4 kernel or the reference)."""
        import deep_gemm

        from . import deepgemm
        from .deepgemm_fp4 import FP4_ADAPTERS

        make, check = FP4_ADAPTERS[op]
        adapter = make(deep_gemm, deepgemm.api_for(deep_gemm))
        if torch.cuda.is_available():
            check(adapter, torch.device("cuda", torch.cuda.current_device()))
        return adapter

    return factory


def _cuda_jit_probe() -> str | None:
    from . import topk

    return topk.probe()


def _lightning_available(target: Target, env: Environment) -> str | None:
    return _available("paged_mqa_logits")(target, env)


# Opt-in only (below the composition and the reference): measured on the H200 (issue 23,
# benchmarks/results/decode_step_h200.json) it is 2.3-10x slower than DeepGEMM + the CUDA top-k, and slower
# than the composition without DeepGEMM, at every decode cell. Its fp8 mma.sync is emulated on sm90 (convert + HMMA) and
# compute-bound, and its cluster select costs ~20 us. Force it with
# DSA_INDEXER_FORCE=lightning_indexer=lightning_indexer.cuda.fused.
FUSED_LIGHTNING_PRIORITY = -1
FUSED_LIGHTNING_HEADS = 64


FUSED_LIGHTNING_CAPS = Capabilities("the fused CUDA lightning kernel", heads=(FUSED_LIGHTNING_HEADS,),
                                    dim=(HEAD_DIM,), fp8=("fn",), keys=("fp8",))


def _fused_lightning_factory():
    from . import lightning_fused

    reason = lightning_fused.probe()
    if reason is not None:
        raise RuntimeError(reason)
    return lightning_fused.lightning_indexer


def _flashinfer_probe() -> str | None:
    from . import flashinfer_topk

    return flashinfer_topk.probe()


def _flashinfer_factory():
    import flashinfer

    from .flashinfer_topk import make_topk_indices

    return make_topk_indices(flashinfer)


def _topk_factory():
    from .topk import topk_indices

    return topk_indices


def _ragged_topk_factory():
    import deep_gemm

    from . import deepgemm
    from .lightning import make_ragged_mqa_topk

    return make_ragged_mqa_topk(deep_gemm, deepgemm.api_for(deep_gemm))


def _lightning_factory():
    import deep_gemm

    from . import deepgemm
    from .lightning import make_lightning_indexer

    return make_lightning_indexer(deep_gemm, deepgemm.api_for(deep_gemm))


def _factory(op: str):
    def factory():
        import deep_gemm

        from . import deepgemm

        return deepgemm.launching_with_pdl(deepgemm.MAKERS[op](deep_gemm, deepgemm.api_for(deep_gemm)), deep_gemm)

    return factory


# What ran where: sm90 on the H200 (upstream DeepGEMM 2.6.1 built from source there; the commit that recorded the
# run); sm100 never ran on a GPU: the adapters are tested against doubles of DeepGEMM's API (tests/doubles), the
# JIT kernels only resolved.
_SM100_ADAPTERS = Verified(Level.DOUBLE, ("sm100",), "tests/backends/test_cuda_backend_cpu.py (fake deep_gemm API "
                                                     "generations), test_gemm_scale_fmt.py (tests/doubles/"
                                                     "deep_gemm_sm100.py)")
VERIFIED = {
    "paged_mqa_logits": (ran_on("sm90", "a6aa63f", "2026-12-01", "benchmarks/results/decode_step_h200.json; "
                                                                 "tests/gpu/test_cuda_backend_gpu.py"),
                         _SM100_ADAPTERS),
    "ragged_mqa_logits": (ran_on("sm90", "540b599", "2026-12-01", "benchmarks/results/bench_h200.json"),
                          _SM100_ADAPTERS),
    "gemm_fp8_blockscale": (ran_on("sm90", "540b599", "2026-12-01", "benchmarks/results/run_v32.json"),
                            _SM100_ADAPTERS),
}
FP4_VERIFIED = (Verified(Level.DOUBLE, ("sm100",), "tests/backends/test_deepgemm_fp4_paged_cpu.py, test_deepgemm_fp4_"
                                                   "ragged_cpu.py (tests/doubles/deep_gemm_sm100.py)"),)
RADIX_VERIFIED = (ran_on("sm90", "6846d27", "2026-12-02", "tests/gpu/test_cuda_topk_gpu.py; "
                                                          "benchmarks/results/topk_short_rows_h200.json"),)
# flashinfer did not import on the H200 (docs/performance.md): only its documented call, as a double.
FLASHINFER_VERIFIED = (Verified(Level.DOUBLE, JIT_TARGETS, "tests/ops/test_no_silent_wrong_results.py "
                                                           "(tests/doubles/flashinfer.py)"),)
LIGHTNING_VERIFIED = (ran_on("sm90", "90cca2e", "2026-12-02", "benchmarks/results/decode_s6_h200.json"),)
RAGGED_TOPK_VERIFIED = (ran_on("sm90", "dd525a6", "2026-12-01", "tests/gpu/test_prefill_scoring_gpu.py; "
                                                                "benchmarks/results/prefill_scoring_h200.json"),)
FUSED_LIGHTNING_VERIFIED = (ran_on("sm90", "6e8b140", "2026-12-01", "tests/gpu/test_decode_fused_gpu.py"),)


@hookimpl
def dsa_indexer_register(registry: Registry) -> None:
    registry.add_probe("deep_gemm", _deep_gemm_probe)  # a simulated environment keeps its fixed facts
    for op in OPS:
        supports = _gemm_supports if op == "gemm_fp8_blockscale" else None
        info = {"input_layout": GEMM_INPUT_LAYOUT} if op == "gemm_fp8_blockscale" else {}
        if op == "paged_mqa_logits":
            info = {STEP_CONTEXT_INFO: True}  # its schedule is the step's (contract/step.py)
        registry.implementation(op, impl_id=f"{op}.cuda.deepgemm", targets=DEEPGEMM_TARGETS,
                                priority=DEEPGEMM_PRIORITY, requires=("gpu", "deep_gemm"), available=_available(op),
                                supports=supports, capabilities=CAPABILITIES[op], description=DESCRIPTIONS[op],
                                info=info, verified=VERIFIED[op])(_factory(op))
    # DEEPGEMM_PRIORITY - 1: no tie with the fp8 adapter on sm100 (the keys fact keeps the two apart).
    # native_fp4: sm100's FP4 MMAs take the packed operands (no nibble decode): `Indexer.fp4_prefill_keys="auto"`
    # reads the FP4 pages as stored for prefill where the FP4 ragged logits resolve to such an implementation.
    for op in FP4_CAPABILITIES:
        registry.implementation(op, impl_id=f"{op}.cuda.deepgemm_fp4", targets=FP4_TARGETS,
                                priority=DEEPGEMM_PRIORITY - 1, requires=("gpu", "deep_gemm"),
                                available=_fp4_available(op), supports=_fp4_supports,
                                capabilities=FP4_CAPABILITIES[op], description=FP4_DESCRIPTIONS[op],
                                info={"native_fp4": True, STEP_CONTEXT_INFO: op == "paged_mqa_logits"},
                                verified=FP4_VERIFIED)(_fp4_factory(op))
    registry.add_probe("cuda_jit", _cuda_jit_probe)
    registry.implementation("topk_indices", impl_id="topk_indices.cuda.radix", targets=JIT_TARGETS,
                            priority=JIT_PRIORITY, requires=("gpu", "cuda_jit"),
                            description="CUDA C++ cluster radix select, rows in shared memory (JIT-built)",
                            info={WRITES_OUT_INFO: True},  # the kernel stores into the caller's buffer
                            verified=RADIX_VERIFIED)(_topk_factory)
    registry.add_probe("flashinfer", _flashinfer_probe)
    # No writes_out: FlashInfer's top_k_ragged_transform returns a tensor of its own (its documented call takes no
    # output buffer), so a caller's out= is filled by the dispatch layer with one copy (dsa_indexer.ops).
    registry.implementation("topk_indices", impl_id="topk_indices.cuda.flashinfer", targets=JIT_TARGETS,
                            priority=60, requires=("gpu", "flashinfer"), capabilities=FLASHINFER_CAPS,
                            description="FlashInfer top_k_ragged_transform, deterministic lower-index ties",
                            verified=FLASHINFER_VERIFIED)(_flashinfer_factory)
    registry.implementation("lightning_indexer", impl_id="lightning_indexer.cuda.deepgemm_radix",
                            targets=DEEPGEMM_TARGETS, priority=JIT_PRIORITY, requires=("gpu", "deep_gemm", "cuda_jit"),
                            available=_lightning_available, capabilities=PAGED_CAPS,  # its logits half
                            description="DeepGEMM paged logits (unmasked, per-step schedule) + the CUDA top-k",
                            info={STEP_CONTEXT_INFO: True, WRITES_OUT_INFO: True},
                            verified=LIGHTNING_VERIFIED)(_lightning_factory)
    registry.implementation("ragged_mqa_topk", impl_id="ragged_mqa_topk.cuda.deepgemm_radix",
                            targets=DEEPGEMM_TARGETS, priority=JIT_PRIORITY, requires=("gpu", "deep_gemm", "cuda_jit"),
                            available=_available("ragged_mqa_logits"), capabilities=LOGITS_CAPS,
                            description="DeepGEMM ragged logits read in their padded rows by the CUDA top-k (no "
                                        "contiguous copy of the logits)",
                            info={WRITES_OUT_INFO: True},
                            verified=RAGGED_TOPK_VERIFIED)(_ragged_topk_factory)
    registry.implementation("lightning_indexer", impl_id="lightning_indexer.cuda.fused", targets=JIT_TARGETS,
                            priority=FUSED_LIGHTNING_PRIORITY, requires=("gpu", "cuda_jit"),
                            capabilities=FUSED_LIGHTNING_CAPS,
                            description="one CUDA kernel: fp8 mma.sync paged logits in shared memory + cluster radix "
                                        "top-k (JIT-built; opt-in: slower than DeepGEMM + radix on the H200)",
                            info={WRITES_OUT_INFO: True},
                            verified=FUSED_LIGHTNING_VERIFIED)(_fused_lightning_factory)
    from .dual_stream import register_dual_stream

    register_dual_stream(registry)
