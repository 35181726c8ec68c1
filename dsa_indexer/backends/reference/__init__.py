"""The reference backend: every op in pure torch, on any device. The oracle for tests and the last-resort fallback."""

from __future__ import annotations

from ...dispatch.plugins import hookimpl
from ...dispatch.registry import Registry

REFERENCE_PRIORITY = 0



def _factory(name: str):
    def factory():
        from . import kernels

        return getattr(kernels, name)

    return factory


@hookimpl
def dsa_indexer_register(registry: Registry) -> None:
    from ...ops import OPS
    from ...contract.quant import GEMM_INPUT_LAYOUT

    for op in OPS:  # every op has its pure-torch oracle
        # The GEMM states the activation layout it takes: what a reusable q_lora_quant must match.
        info = {"input_layout": GEMM_INPUT_LAYOUT} if op == "gemm_fp8_blockscale" else None
        registry.implementation(op, impl_id=f"{op}.reference.torch", targets=("*",), priority=REFERENCE_PRIORITY,
                                description="pure torch, any device", info=info)(_factory(op))
