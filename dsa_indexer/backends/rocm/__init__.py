"""The AMD backend: aiter's kernels for the ops whose contract they can meet (gfx942, gfx950; gfx1250 the fused quant).

Registrations (all through the one plugin hook; docs/backends-amd-npu.md has the per-arch table, versions and what
was run where):

- the probe of the environment fact ``aiter`` (`aiter_api.probe`, the shared vendor-library probe): import inside a
  try, API detection by feature, the compiled HIP / CK modules checked prebuilt (never built in a call), a
  self-test of the ragged- and paged-logits adapters on the GPU; without ROCm, a reason;
- ``rmsnorm_quant_fp8.rocm.aiter`` (200): aiter's fused RMSNorm + fp8 quant, attention's q_lora producer in the seed
  integration, declared ``PRODUCER_UNROUNDED`` (`quant.py`); the ROCm platform reuses its copy by default;
- ``gemm_fp8_blockscale.rocm.aiter`` (200): the CK block-scale GEMM, the reuse consumer (`gemm.py`);
- ``paged_mqa_logits.rocm.aiter`` (200, next_n 1): aiter's plain Triton block-level paged kernel, launched by the
  adapter on this cache (aiter's public wrapper routes to a page-size-1 Gluon kernel: not called; `paged.py`);
- ``ragged_mqa_logits.rocm.aiter`` (200): aiter's Triton ``fp8_mqa_logits`` with the start-alignment workaround;
- ``topk_indices.rocm.aiter_stable`` (200) when the decode top-k takes ``stable=`` (lower-index ties), and
  ``topk_indices.rocm.aiter`` (50, below Triton: non-deterministic ties) otherwise (`topk.py`).

Not registered, with the reason (``UNREGISTERED``): the K store (aiter's cache ops have no Hadamard and another
fnuz range), the plain quant and the q prologue (no aiter function with this recipe / fusion).

Targets: gfx942 takes e4m3fnuz, gfx950 and gfx1250 e4m3fn; problems of the other flavour are rejected with a
reason. On gfx1250 only the Triton-level producer is enabled (nothing was run there; the CK GEMM is refused,
`GEMM_GFX1250` says why).

``aiter`` is imported only by the probe and the factories, so importing dsa_indexer never needs it.
"""

from __future__ import annotations

import torch

from ...contract.specs import WRITES_OUT_INFO, fp8_name
from ...dispatch.capabilities import Capabilities, Rule
from ...dispatch.environment import Environment
from ...dispatch.plugins import hookimpl
from ...dispatch.problem import Problem
from ...dispatch.registry import Registry
from ...dispatch.target import Target
from ...dispatch.verification import Level, Verified
from ...contract.quant import GEMM_INPUT_LAYOUT, PRODUCER_UNROUNDED
from .paged import MAX_INT32_PAGES
from .platform import FP8_DTYPES
from .quant import aiter_fused_rms_fp8_group_quant

__all__ = ["AITER_PRIORITY", "AITER_TARGETS", "TOPK_PRIORITY", "UNREGISTERED", "aiter_fused_rms_fp8_group_quant"]

AITER_PRIORITY = 200
TOPK_PRIORITY = 50  # below Triton's deterministic top-k (100): see topk.py on ties
AITER_TARGETS = ("gfx942", "gfx950", "gfx1250")


def _fp8_flavour(target: Target) -> str:
    """The target's fp8 flavour as problems name it ("fn" / "fnuz"), from its platform (one arch table)."""
    return fp8_name(target.fp8_dtype)


HEAD_DIM = 128
TOPK = 2048

UNREGISTERED = {
    "k_prologue_store": "aiter's indexer_k_quant_and_cache is quant + store only and its bytes differ from the "
                        "reference: scale max is 240 for e4m3fnuz (library: 224), ue8m0 uses exp2f(ceilf(log2f(s))) "
                        "(can round down), and it multiplies by 1/scale (1 fp8 ulp); the Triton kernel already fuses "
                        "norm + RoPE + Hadamard + quant + store",
    "quant_fp8_groups": "no aiter function quantizes with this contract's recipe (amax clamp 1e-4, 224 on fnuz)",
    "q_prologue": "aiter main's rope_rotate_activation (HIP module_dsv4_rotate_quant; fp8 out: interleaved RoPE on "
                  "the trailing rope_dim, Hadamard, group-128 quant) is not this recipe: scale = amax / finfo max, "
                  "240 on e4m3fnuz (library: 224), amax floored at 1e-10 (library: 1e-4), x * (1 / scale) (library: "
                  "x / scale, 1 fp8 ulp apart), cos / sin in the input's dtype (library: fp32 cos_sin), RoPE only "
                  "on the trailing dims (library: rope_offset), and no head-weight fold; the Triton kernel fuses "
                  "all of it",
    "q_prologue_fp4": "aiter main's rope_rotate_activation (fp4x2 out: e2m1 with e8m0 scales per 32) keeps the "
                      "RoPE'd and the rotated rows in fp32, where V4's recipe rounds both to bf16 (so its codes "
                      "differ near rounding edges), writes packed e2m1 + e8m0 (this op returns the rows folded "
                      "into fp8 with the scale in the head weights) and has no weight fold; the Triton kernel "
                      "does the recipe bit for bit",
    "lightning_indexer": "no aiter fused paged logits + top-k for this cache layout (the generic composition of "
                         "the resolved paged logits and top-k serves it)",
}


def _aiter_probe() -> str | None:
    from . import aiter_api

    return aiter_api.probe()


def _arch_checks(problem: Problem, target: Target, what: str) -> str | None:
    if target.arch == "gfx1250":
        return (f"gfx1250: no public integration runs aiter's {what} there and it has not been run there; "
                "not enabled")
    fp8 = problem.get("fp8")
    want = _fp8_flavour(target)
    if fp8 is not None and want is not None and fp8 != want:
        return (f"fp8={fp8} on {target.arch}: aiter there takes float8_e4m3{want} (aiter.dtypes.fp8); "
                "fn and fnuz operands are never mixed")
    return None


def _ragged_supports(problem: Problem, target: Target) -> str | None:
    return _arch_checks(problem, target, "fp8_mqa_logits")


# aiter main's V4 logits kernels (e4048607, aiter/ops/flydsl/kernels/mqa_logits/) are FlyDSL programs (MLIR lowered
# to AMD GPUs only): neither Triton's interpreter nor the H200 runs them, so nothing here could check one.
# * flydsl_pa_mqa_logits_fp4 (+ _prefill / _varqlen; gfx950) reads a preshuffled FP4 cache, kvcache [num_blocks,
#   k_tiles, 4, kv_block_size, 16] and scales [num_blocks, k_tiles, 4, kv_block_size] in an interleaved order,
#   written by aiter's rmsnorm_rope_rotate_activation_fp4quant_kvcache; this library's FP4 pages are DeepGEMM's
#   68-byte token-major layout, which the CUDA, Triton and reference kernels read. The cache layout stays the
#   library's: taking the vendor's would need a second FP4 layout and its store, for a kernel not run here.
# * flydsl_fp8_mqa_logits (gfx942): the same math as fp8_mqa_logits (it converts e4m3fn bytes to fnuz itself).
FLYDSL_FP4 = ("V4's FP4 pages: aiter's flydsl_pa_mqa_logits_fp4 (gfx950, FlyDSL) reads a preshuffled FP4 cache "
              "([blocks, k_tiles, 4, block, 16] + interleaved e8m0 scales), not the library's 68-byte DeepGEMM "
              "layout, and FlyDSL kernels cannot run here to be checked; the Triton kernel serves FP4 pages")
FLYDSL_FP8 = ("aiter's flydsl_fp8_mqa_logits (gfx942) has the same contract as fp8_mqa_logits but is a FlyDSL "
              "program: not registered until it is run on a gfx942 (nothing here can run FlyDSL)")


# The shape facts aiter's logits kernels take, declared (dispatch/capabilities.py): every failing one at once.
_TL_DOT_HEADS = Rule(lambda heads: 16 <= heads <= 128 and not heads & (heads - 1),
                     "a power of two in 16..128 (all heads tile one tl.dot)")
_FP8_KEYS = Rule(lambda keys: keys == "fp8", f"fp8 ({FLYDSL_FP4})")
RAGGED_CAPS = Capabilities("aiter's fp8_mqa_logits", dim=(HEAD_DIM,), heads=_TL_DOT_HEADS,
                           keys=_FP8_KEYS)  # fp8 key rows, not V4's FP4 ones as the 68-byte pages store them
PAGED_CAPS = Capabilities("aiter's paged kernel",
                          next_n=Rule(lambda n: n == 1, "1 (it derives the rows' lengths from one length per "
                                                        "request, not the per-row lengths of this op)"),
                          dim=(HEAD_DIM,), heads=_TL_DOT_HEADS,
                          keys=_FP8_KEYS,  # it reads the 132-byte pages, not V4's FP4 ones (68 bytes)
                          pages=Rule(lambda pages: isinstance(pages, int) and pages <= MAX_INT32_PAGES,
                                     f"at most {MAX_INT32_PAGES} cache pages (its key addresses are int32 and wrap "
                                     f"past 2**31 - 1 bytes: paged.MAX_INT32_PAGES, ROCm/aiter e4048607); the "
                                     f"Triton kernel serves larger caches"))


TOPK_CAPS = Capabilities("aiter's top_k_per_row",
                         k=Rule(lambda k: k == TOPK, f"{TOPK} only (k is fixed in the kernels)"),
                         starts=Rule(lambda starts: not starts,
                                     "false (ragged row starts: aiter's decode top-k reads rows from column 0, and "
                                     "its prefill top-k ignores rowStarts for rows longer than 2048, aiter 0.1.7)"))


def _topk_supports(problem: Problem, target: Target) -> str | None:
    """What data cannot say: gfx1250 is held back (not run there), whatever the problem."""
    return _arch_checks(problem, target, "top_k_per_row_decode")  # top-k problems carry no fp8 fact


def _available(field: str, op: str):
    def check(target: Target, env: Environment) -> str | None:
        # A simulated environment detected nothing: assume the full API. After a real probe, the detected API
        # decides: function present (with the version that has it), compiled module already built, self-test
        # passed, fp8 flavour of this aiter build = the target's.
        if env.simulated:
            return None
        from .aiter_api import NEEDS, detected_api, prebuild_hint

        api = detected_api()
        if api is None:
            return None
        if getattr(api, field) is None:
            return f"aiter {api.version} has no function for {op}: it needs {NEEDS[field]}"
        if api.unbuilt.get(field):
            return "; ".join(prebuild_hint(md, api.module_notes.get(md)) for md in api.unbuilt[field])
        if field == "ragged_wrapper" and api.ragged_self_test:
            return f"aiter {api.version} ragged logits self-test failed: {api.ragged_self_test}"
        if field == "paged_logits" and api.paged_self_test:
            return f"aiter {api.version} paged logits self-test (64-token pages) failed: {api.paged_self_test}"
        if api.fp8_dtype is not None and not api.fp8_dtype.is_floating_point:
            return (f"aiter {api.version}'s aiter.dtypes has no fp8 type for this GPU "
                    f"({str(api.fp8_dtype).replace('torch.', '')} fallback; amd-aiter 0.1.7.post2.dev18 knows "
                    f"gfx942 / gfx950 only, ROCm/aiter main e4048607 adds gfx1250)")
        if api.fp8_dtype is not None and api.fp8_dtype != target.fp8_dtype:
            return (f"this aiter build uses {str(api.fp8_dtype).replace('torch.', '')}, target {target} takes "
                    f"{str(target.fp8_dtype).replace('torch.', '')}")
        return None

    return check


def _ragged_factory():
    from .logits import make_ragged_mqa_logits

    return make_ragged_mqa_logits(launch="wrapper")


RMS_QUANT_CAPS = Capabilities(
    "aiter's fused_rms_fp8_group_quant",
    fp8=Rule(lambda fp8: fp8 != "fnuz", "e4m3fn (on e4m3fnuz, gfx942, it scales to +-240, torch.finfo max, the "
                                        "library's and the AMD integrations' fnuz recipe to +-224; the Triton "
                                        "producer serves gfx942)"),
    group_size=(128,),  # what it is registered for
    ue8m0=Rule(lambda ue8m0: not ue8m0, "false (it writes plain fp32 scales, amax / fp8 max)"))


def _paged_supports(problem: Problem, target: Target) -> str | None:
    if target.arch == "gfx1250":
        return ("gfx1250: not enabled (aiter's own gfx1250 paged path takes KVBlockSize 1 without preshuffle, and "
                "its plain Triton kernel has not been run there); the library's Triton kernel serves it")
    return _arch_checks(problem, target, "deepgemm_fp8_paged_mqa_logits")


def _paged_factory():
    from .paged import make_paged_mqa_logits

    return make_paged_mqa_logits(launch="kernel")


# Why the CK GEMM is off on gfx1250 (ROCm/aiter e4048607, aiter/ops/gemm_op_a8w8.py): aiter routes
# gemm_a8w8_blockscale to its prebuilt CK module only for the archs of _BLOCKSCALE_HIP_PREBUILT_ARCHES, because a
# code object for another arch "SIGSEGVs uncatchably at kernel launch" (its comment), and gfx1250 joined that set in
# the commit that added the FlyDSL preshuffled GEMM (242fee05, #4210), not a CK change; the module's instance list
# (csrc/ck_gemm_a8w8_blockscale/gemm_a8w8_blockscale_instance.py) is written in CK's XDL (xdlops) tile parameters,
# and no a8w8_blockscale tuned-GEMM csv under aiter/configs has a gfx1250 row. A crash of that kind
# cannot be caught by an in-process self-test, and nothing here ran on gfx1250: refused until it is run there.
GEMM_GFX1250 = ("gfx1250: aiter's CK gemm_a8w8_blockscale is not verified there (aiter enables it for gfx1250 by one "
                "allowlist entry, _BLOCKSCALE_HIP_PREBUILT_ARCHES, with no tuned gfx1250 shapes, and says a code object "
                "of the wrong arch SIGSEGVs at launch; not run on gfx1250); the Triton GEMM serves it")


# fp8: each arch's flavour (aiter.dtypes.fp8 there; fn and fnuz operands are never mixed).
GEMM_CAPS = Capabilities("aiter's gemm_a8w8_blockscale", out=("torch.bfloat16", "torch.float16"),
                         fp8={arch: (fp8_name(FP8_DTYPES.get(arch, torch.float8_e4m3fn)),) for arch in AITER_TARGETS})


def _gemm_supports(problem: Problem, target: Target) -> str | None:
    """What data cannot say: gfx1250 is held back (`GEMM_GFX1250`), whatever the problem."""
    return GEMM_GFX1250 if target.arch == "gfx1250" else None


def _gemm_factory():
    from .gemm import make_gemm_fp8_blockscale

    return make_gemm_fp8_blockscale()


def _rms_quant_factory():
    from .quant import make_rmsnorm_quant_fp8

    return make_rmsnorm_quant_fp8()


def _topk_factory():
    from .topk import make_topk_indices

    return make_topk_indices()


# What ran where (docs/backends-amd-npu.md, "What was run where"): nothing on AMD hardware. Each adapter is tested
# in CPU CI against a double of aiter's function (tests/doubles/aiter.py); aiter's Triton kernels also ran on the
# H200 behind a test-only shim, which says nothing about an AMD device.
_H200_SHIM = ("; aiter's real kernel also ran on the H200 behind a test-only shim "
              "(tests/gpu/test_rocm_aiter_kernels_on_h200.py)")
# gfx1250 is refused by these adapters' supports checks (below), so nothing is claimed there.
_SERVED = ("gfx942", "gfx950")
RAGGED_VERIFIED = (Verified(Level.DOUBLE, _SERVED, "tests/backends/test_rocm_npu_backends_cpu.py (a double "
                                                         "with aiter's start-alignment bug)" + _H200_SHIM),)
PAGED_VERIFIED = (Verified(Level.DOUBLE, _SERVED, "tests/backends/test_rocm_npu_backends_cpu.py (a double "
                                                        "keeping aiter main's routing rules)" + _H200_SHIM),)
GEMM_VERIFIED = (Verified(Level.DOUBLE, _SERVED, "tests/backends/test_rocm_npu_backends_cpu.py, "
                                                              "test_rocm_audit_round2.py (a double of its signature)"),)
RMS_QUANT_VERIFIED = (Verified(Level.DOUBLE, ("gfx950", "gfx1250"), "tests/backends/test_amd_q_lora_reuse.py (a "
                                                                    "double of its recipe)" + _H200_SHIM),)
TOPK_VERIFIED = (Verified(Level.DOUBLE, _SERVED, "tests/backends/test_rocm_npu_backends_cpu.py (a double of "
                                                       "the decode top-k's semantics and bit order, NaN included)"),)


@hookimpl
def dsa_indexer_register(registry: Registry) -> None:
    registry.add_probe("aiter", _aiter_probe)  # a simulated environment keeps its fixed facts
    registry.implementation(
        "ragged_mqa_logits", impl_id="ragged_mqa_logits.rocm.aiter", targets=AITER_TARGETS, priority=AITER_PRIORITY,
        requires=("gpu", "aiter"), available=_available("ragged_wrapper", "ragged_mqa_logits"),
        supports=_ragged_supports, capabilities=RAGGED_CAPS,
        description="aiter Triton fp8_mqa_logits, starts aligned down to 128 then the head re-masked",
        info={"vendor_function": "aiter.ops.triton.fp8_mqa_logits.fp8_mqa_logits",
              "workaround": "aiter misplaces the masked block when a row start is not a multiple of 128: starts "
                            "are passed rounded down and columns [ks & ~127, ks) are set to -inf after",
              "not_used": FLYDSL_FP8},
        verified=RAGGED_VERIFIED,
    )(_ragged_factory)
    registry.implementation(
        "paged_mqa_logits", impl_id="paged_mqa_logits.rocm.aiter", targets=AITER_TARGETS, priority=AITER_PRIORITY,
        requires=("gpu", "aiter"), available=_available("paged_logits", "paged_mqa_logits"), supports=_paged_supports,
        capabilities=PAGED_CAPS,
        description="aiter's plain Triton _deepgemm_fp8_paged_mqa_logits launched here, KVBlockSize 64 (reads "
                    "paged64_fp8_e4m3 directly)",
        info={"vendor_function": "aiter.ops.triton._triton_kernels.attention.pa_mqa_logits."
                                 "_deepgemm_fp8_paged_mqa_logits (ROCm/aiter main e4048607)",
              "layout": "KVBlockSize=64: per block 64 x 128 fp8 then 64 fp32 scales (this library's cache)",
              "not_the_wrapper": "aiter's deepgemm_fp8_paged_mqa_logits routes Preshuffle=False to a Gluon kernel "
                                 "that reads page size 1 (Triton >= 3.5 on gfx942/950/1250): not called",
              "fp4_pages": FLYDSL_FP4,
              "split_kv": "per power-of-two row bucket; every bucket compiled by the probe (paged.split_kv)"},
        verified=PAGED_VERIFIED,
    )(_paged_factory)
    registry.implementation(
        "gemm_fp8_blockscale", impl_id="gemm_fp8_blockscale.rocm.aiter", targets=AITER_TARGETS,
        priority=AITER_PRIORITY, requires=("gpu", "aiter"),
        available=_available("gemm_blockscale", "gemm_fp8_blockscale"),
        supports=_gemm_supports, capabilities=GEMM_CAPS,
        description="aiter's CK gemm_a8w8_blockscale (x_scale [M, K/128] fp32 row-major, w_scale [N/128, K/128])",
        info={"vendor_function": "aiter.gemm_a8w8_blockscale", "input_layout": GEMM_INPUT_LAYOUT},
        verified=GEMM_VERIFIED,
    )(_gemm_factory)
    registry.implementation(
        "rmsnorm_quant_fp8", impl_id="rmsnorm_quant_fp8.rocm.aiter", targets=AITER_TARGETS, priority=AITER_PRIORITY,
        requires=("gpu", "aiter"), available=_available("fused_rms_quant", "rmsnorm_quant_fp8"),
        capabilities=RMS_QUANT_CAPS,
        description="aiter's Triton fused_rms_fp8_group_quant (attention's q_lora producer in the seed integration); "
                    "quantizes before bf16 rounding",
        info={"vendor_function": "aiter.ops.triton.fused_fp8_quant.fused_rms_fp8_group_quant",
              "producer": PRODUCER_UNROUNDED},
        verified=RMS_QUANT_VERIFIED,
    )(_rms_quant_factory)
    registry.implementation(
        "topk_indices", impl_id="topk_indices.rocm.aiter_stable", targets=AITER_TARGETS, priority=AITER_PRIORITY,
        requires=("gpu", "aiter"), available=_available("topk_stable", "topk_indices (stable)"),
        supports=_topk_supports, capabilities=TOPK_CAPS,
        description="aiter HIP top_k_per_row_decode(stable=True) (k=2048): ties to the lower index, deterministic",
        info={"vendor_function": "aiter.ops.topk.top_k_per_row_decode(stable=True)",
              "ties": "stable=True: the smallest indices among values equal to the k-th (this op's contract)",
              WRITES_OUT_INFO: True},  # aiter writes its indices argument in place: the caller's buffer
        verified=TOPK_VERIFIED,
    )(_topk_factory)
    registry.implementation(
        "topk_indices", impl_id="topk_indices.rocm.aiter", targets=AITER_TARGETS, priority=TOPK_PRIORITY,
        requires=("gpu", "aiter"), available=_available("topk_decode", "topk_indices"), supports=_topk_supports,
        capabilities=TOPK_CAPS,
        description="aiter HIP top_k_per_row_decode (k=2048); ties NOT lower-index (atomics): opt-in, below Triton",
        info={"vendor_function": "aiter.ops.topk.top_k_per_row_decode",
              "ties": "which of several equal logits at the k-th value are kept is not deterministic",
              WRITES_OUT_INFO: True},
        verified=TOPK_VERIFIED,
    )(_topk_factory)
