"""The reference backend: every op in pure torch, on any device. The oracle for tests and the last-resort fallback."""

from __future__ import annotations

from ...contract.specs import WRITES_OUT_INFO
from ...dispatch.plugins import hookimpl
from ...dispatch.registry import Registry
from ...dispatch.verification import CPU_SUITE, ran_on

REFERENCE_PRIORITY = 0
# The reference on CUDA tensors, on the H200: the V3.2 step with every op forced to it, and the bench's side-by-side
# rows. Other ops (and other accelerators) ran it on CPU tensors only.
_FORCED_STEP = ran_on("sm90", "9b06952", "2026-12-01", "tests/gpu/test_indexer_gpu.py (the V3.2 step, every op forced "
                                                       "to the reference)")
_BENCH_ROWS = ran_on("sm90", "540b599", "2026-12-01", "benchmarks/results/bench_h200.json")
H200_RUNS = {"q_prologue": _FORCED_STEP, "k_prologue_store": _FORCED_STEP, "x_projections": _FORCED_STEP,
             "ragged_mqa_topk": _FORCED_STEP, "gemm_fp8_blockscale": _FORCED_STEP, "quant_fp8_groups": _FORCED_STEP,
             "lightning_indexer": _FORCED_STEP, "ragged_mqa_logits": _BENCH_ROWS, "topk_indices": _BENCH_ROWS}


def _factory(name: str):
    def factory():
        from . import kernels

        return getattr(kernels, name)

    return factory


@hookimpl
def dsa_indexer_register(registry: Registry) -> None:
    from ...contract.declarations import OPS
    from ...contract.specs import DECLARED
    from ...contract.quant import GEMM_INPUT_LAYOUT

    for op in OPS:  # every op has its pure-torch oracle
        # The GEMM states the activation layout it takes: what a reusable q_lora_quant must match.
        info = {"input_layout": GEMM_INPUT_LAYOUT} if op == "gemm_fp8_blockscale" else {}
        if DECLARED[op].out is not None:  # the top-k ops write a caller's buffer (out=) in place
            info[WRITES_OUT_INFO] = True
        registry.implementation(op, impl_id=f"{op}.reference.torch", targets=("*",), priority=REFERENCE_PRIORITY,
                                description="pure torch, any device", info=info,
                                verified=(CPU_SUITE, *((H200_RUNS[op],) if op in H200_RUNS else ()))
                                )(_factory(op))
