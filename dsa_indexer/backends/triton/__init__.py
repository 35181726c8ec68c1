"""The portable Triton backend: one kernel per op, for NVIDIA (sm90, sm100, sm120) and AMD (gfx942/950/1250).

It ranks below the vendor libraries (DeepGEMM, aiter) and above the reference. Kernels take the target's fp8
type (e4m3fnuz on gfx942, checked by the public op layer). With ``TRITON_INTERPRET=1`` the kernels also run on CPU
tensors (slowly), which is how CI exercises them on small shapes.
"""

from __future__ import annotations

import importlib

from ...contract.specs import WRITES_OUT_INFO
from ...dispatch.capabilities import Capabilities, Rule
from ...dispatch.plugins import hookimpl
from ...dispatch.registry import Registry
from ...dispatch.verification import Level, Verified, ran_on

TRITON_PRIORITY = 100
# The fused prefill scoring (`fused_topk.py`) ranks BELOW the composition of the best logits and top-k kernels
# (generic, 2): on the H200 the composition (DeepGEMM logits + the CUDA radix top-k) scored a 128K-token V3.2
# prefill in 241 ms vs 256 ms fused, and 1M tokens in 20 s vs 49 s (benchmarks/results/prefill_layer_h200.json);
# the fused kernel holds about half the memory. Opt in with
# DSA_INDEXER_FORCE=ragged_mqa_topk=ragged_mqa_topk.triton.fused_topk.
FUSED_TOPK_PRIORITY = 1
# The x projections in one launch (`xproj.x_projections_one_launch`: the last split program of a tile reduces it)
# rank below the two-launch kernel and above torch's GEMMs (generic, 1): not timed yet (issue 38). Opt in with
# DSA_INDEXER_FORCE=x_projections=x_projections.triton.one_launch.
ONE_LAUNCH_XPROJ_PRIORITY = 2
TRITON_TARGETS = ("sm90", "sm100", "sm120", "gfx942", "gfx950", "gfx1250")
# Measured on NVIDIA only (the H200): these register for the sm archs; AMD keeps torch's GEMMs (generic).
NVIDIA_ONLY = {"x_projections": ("sm90", "sm100", "sm120")}

# op -> (module in this package, function name)
KERNELS = {
    "quant_fp8_groups": ("quant", "quant_fp8_groups"),
    "rmsnorm_quant_fp8": ("quant", "rmsnorm_quant_fp8"),
    "q_prologue": ("prologue", "q_prologue"),
    "q_prologue_fp4": ("prologue", "q_prologue_fp4"),  # V4's FP4 q: bit-identical to the butterfly-Hadamard recipe
    "k_prologue_store": ("prologue", "k_prologue_store"),
    "gemm_fp8_blockscale": ("gemm", "gemm_fp8_blockscale"),
    "x_projections": ("xproj", "x_projections"),  # V3.2's fp32 weights_proj + bf16 wk: one read of x, 2 launches
    "ragged_mqa_logits": ("logits", "ragged_mqa_logits"),
    "paged_mqa_logits": ("logits", "paged_mqa_logits"),
    "topk_indices": ("topk", "topk_indices"),
    "c4_compress_pool": ("compressor", "c4_compress_pool"),
    "decode_metadata": ("metadata", "decode_metadata"),  # a graph decode step's positions, lengths, slots: 1 launch
}


# What ran where. sm90: the H200 (the commit that recorded the run). Every other Triton arch: the same kernel source
# in Triton's CPU interpreter (CI); no sm100, sm120 or AMD device was available.
INTERPRETED_ON = tuple(arch for arch in TRITON_TARGETS if arch != "sm90")
_V32_RUN = "benchmarks/results/run_v32.json (dsa-indexer run on the H200, verified against the reference)"
H200_RUNS = {
    "quant_fp8_groups": ran_on("sm90", "b199e8b", "2026-12-01", "benchmarks/results/q_lora_reuse.json; "
                                                                "tests/gpu/test_triton_quant_prologue_gpu.py"),
    "rmsnorm_quant_fp8": ran_on("sm90", "540b599", "2026-12-01", _V32_RUN),
    "q_prologue": ran_on("sm90", "540b599", "2026-12-01", _V32_RUN),
    "k_prologue_store": ran_on("sm90", "540b599", "2026-12-01", _V32_RUN),
    "q_prologue_fp4": ran_on("sm90", "3980ee1", "2026-12-01", "tests/gpu/test_fp4_gpu.py (bit-identical to the "
                                                               "recipe; docs/v4.md)"),
    "gemm_fp8_blockscale": ran_on("sm90", "a6aa63f", "2026-12-01", "benchmarks/results/decode_no_deepgemm_h200.json"),
    "x_projections": ran_on("sm90", "0eee8a5", "2026-12-01", "benchmarks/results/decode_glue_h200.json; "
                                                             "tests/gpu/test_x_projections_gpu.py"),
    "ragged_mqa_logits": ran_on("sm90", "fbd03b3", "2026-12-01", "tests/gpu/test_triton_logits_topk_gpu.py, "
                                                                 "test_fused_topk_gpu.py"),
    "paged_mqa_logits": ran_on("sm90", "fbd03b3", "2026-12-01", "tests/gpu/test_triton_logits_topk_gpu.py"),
    "topk_indices": ran_on("sm90", "540b599", "2026-12-01", "benchmarks/results/bench_h200.json; "
                                                            "tests/gpu/test_triton_logits_topk_gpu.py"),
    "c4_compress_pool": ran_on("sm90", "b199e8b", "2026-12-01", "benchmarks/results/run_v4.json, v4_compressor.json; "
                                                                "tests/gpu/test_v4_c4_gpu.py"),
    "decode_metadata": ran_on("sm90", "90cca2e", "2026-12-02", "benchmarks/results/decode_metadata_h200.json; the "
                                                               "graph decode tests in tests/gpu"),
}
H200_FP4_RUNS = {
    "paged_mqa_logits": ran_on("sm90", "905a84d", "2026-12-01", "tests/gpu/test_fp4_gpu.py (vs the CPU reference)"),
    "ragged_mqa_logits": ran_on("sm90", "a609a71", "2026-12-02", "tests/gpu/test_fp4_gpu.py (packed vs folded "
                                                                 "prefill); benchmarks/results/fp4_prefill_h200.json"),
}
H200_FUSED_TOPK_RUN = ran_on("sm90", "dd525a6", "2026-12-01", "tests/gpu/test_prefill_scoring_gpu.py; "
                                                               "benchmarks/results/prefill_scoring_h200.json")
_QUANT_INTERP = "test_triton_quant_prologue_interp.py"
INTERPRETER_TESTS = {
    "quant_fp8_groups": _QUANT_INTERP, "rmsnorm_quant_fp8": _QUANT_INTERP, "q_prologue": _QUANT_INTERP,
    "k_prologue_store": _QUANT_INTERP, "gemm_fp8_blockscale": _QUANT_INTERP,
    "q_prologue_fp4": "test_triton_fp4_prologue_interp.py",
    "x_projections": "test_triton_xproj_interp.py", "ragged_mqa_logits": "test_triton_logits_topk_interp.py",
    "paged_mqa_logits": "test_triton_logits_topk_interp.py", "topk_indices": "test_triton_logits_topk_interp.py",
    "c4_compress_pool": "test_triton_c4_compress_interp.py", "decode_metadata": "test_triton_decode_metadata_interp.py",
    "ragged_mqa_topk": "test_fused_topk_interp.py",
}


def _verified(hardware: Verified, interpreter_test: str, targets: tuple[str, ...]) -> tuple[Verified, ...]:
    interpreted = tuple(arch for arch in targets if arch in INTERPRETED_ON)
    return (hardware, Verified(Level.INTERPRETER, interpreted, f"tests/backends/triton/{interpreter_test}"))


def _factory(module: str, name: str):
    def factory():
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)

    return factory


# What the Triton kernels take, declared (dispatch/capabilities.py): head dim 128, quant groups of 32-128, a row
# within one program, and for the logits kernels 32, 64 or 128 heads.
_KERNEL_FACTS = dict(dim=(128,), group_size=(32, 64, 128),
                     width=Rule(lambda width: width <= 16384, "at most 16384 (one row per Triton program)"))
LOGITS_OPS = ("ragged_mqa_logits", "paged_mqa_logits", "ragged_mqa_topk")


def _capabilities(op: str) -> Capabilities:
    if op in LOGITS_OPS:
        # keys: the fp8 kernels read the 132-byte pages; V4's FP4 pages (68 bytes) have their own kernel.
        return Capabilities("the Triton logits kernel", heads=(32, 64, 128), keys=("fp8",), **_KERNEL_FACTS)
    return Capabilities("the Triton kernel", **_KERNEL_FACTS)


# The logits over V4's FP4 keys as stored (the paged64_fp4_e2m1 pages, or rows gathered from them): nibbles and
# block scales unpacked in the kernel.
FP4_LOGITS_CAPS = Capabilities("the Triton FP4 logits kernel", heads=(32, 64, 128), dim=(128,), keys=("fp4",))
FP4_KERNELS = {
    "paged_mqa_logits": ("paged_mqa_logits_fp4", "FP4 pages (68 B/token)"),
    "ragged_mqa_logits": ("ragged_mqa_logits_fp4", "FP4 rows as stored (uint8 [N, 64] + ue8m0 [N, 4])"),
}


class _FusedRowBytes:
    """The fused top-k's device bytes per row for a given topk (`fused_topk.scratch_bytes_per_row`), as registry
    info the Indexer plans prefill chunks by; its repr is what `dsa-indexer explain` prints."""

    def __call__(self, topk: int) -> int:
        from .fused_topk import scratch_bytes_per_row  # imports triton: only when the Indexer plans with it

        return scratch_bytes_per_row(topk)

    def __repr__(self) -> str:
        return "8 * (candidates 4k + pow2(k)) + 516 bytes per row (k = topk; 80 KiB at 2048), no logits"


_fused_row_bytes = _FusedRowBytes()


@hookimpl
def dsa_indexer_register(registry: Registry) -> None:
    from ...contract.quant import GEMM_INPUT_LAYOUT

    for op, (module, name) in KERNELS.items():
        # The GEMM states the activation layout it takes (per-token groups of 128, fp32 row-major scales, the
        # target's fp8 flavour): what a reusable q_lora_quant must match, on NVIDIA and AMD alike.
        info = {"input_layout": GEMM_INPUT_LAYOUT} if op == "gemm_fp8_blockscale" else None
        if op == "topk_indices":
            info = {WRITES_OUT_INFO: True}  # its kernels store into the caller's buffer
        targets = NVIDIA_ONLY.get(op, TRITON_TARGETS)
        registry.implementation(op, impl_id=f"{op}.triton.{module}", targets=targets,
                                priority=TRITON_PRIORITY,
                                requires=("gpu", "triton"), capabilities=_capabilities(op),
                                description=f"Triton kernel {module}.{name}", info=info,
                                verified=_verified(H200_RUNS[op], INTERPRETER_TESTS[op], targets)
                                )(_factory(module, name))
    for op, (name, reads) in FP4_KERNELS.items():
        registry.implementation(op, impl_id=f"{op}.triton.logits_fp4", targets=TRITON_TARGETS,
                                # - 1: below the fp8 kernel (no tie), so a problem that does not say its keys (the
                                # CLI's, a coarse plan) gets the fp8 kernel; fp4 keys are refused by that one.
                                priority=TRITON_PRIORITY - 1, requires=("gpu", "triton"), capabilities=FP4_LOGITS_CAPS,
                                description=f"Triton kernel logits_fp4.{name}: {reads}, e2m1 + ue8m0 unpacked in "
                                            "the kernel, fp8 dot per block of 32, fp32 sums",
                                verified=_verified(H200_FP4_RUNS[op], "test_triton_fp4_logits_interp.py",
                                                   TRITON_TARGETS)
                                )(_factory("logits_fp4", name))
    xproj_targets = NVIDIA_ONLY["x_projections"]
    registry.implementation("x_projections", impl_id="x_projections.triton.one_launch", targets=xproj_targets,
                            priority=ONE_LAUNCH_XPROJ_PRIORITY, requires=("gpu", "triton"),
                            capabilities=_capabilities("x_projections"),
                            description="Triton kernel xproj.x_projections_one_launch: the split partials and, in "
                                        "the last program of each tile to arrive, their reduce (one launch)",
                            verified=(Verified(Level.INTERPRETER, xproj_targets,
                                               f"tests/backends/triton/{INTERPRETER_TESTS['x_projections']} "
                                               "(bit-identical to the two launches)"),)
                            )(_factory("xproj", "x_projections_one_launch"))
    registry.implementation("ragged_mqa_topk", impl_id="ragged_mqa_topk.triton.fused_topk", targets=TRITON_TARGETS,
                            priority=FUSED_TOPK_PRIORITY, requires=("gpu", "triton"),
                            capabilities=_capabilities("ragged_mqa_topk"),
                            description="Triton: sampled threshold, candidate pass, exact select; no [S, N] logits",
                            info={"plan_key_bytes": 0, "plan_row_bytes": _fused_row_bytes, WRITES_OUT_INFO: True},
                            verified=_verified(H200_FUSED_TOPK_RUN, INTERPRETER_TESTS["ragged_mqa_topk"],
                                               TRITON_TARGETS)
                            )(_factory("fused_topk", "ragged_mqa_topk"))
