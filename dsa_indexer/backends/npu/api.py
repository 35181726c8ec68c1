"""What this torch_npu offers, found by feature detection (names and parameter names, never version strings).

torch_npu's indexer kernels changed their keywords over releases: early builds of ``npu_lightning_indexer`` name
the top-k count ``selected_count``, later ones ``sparse_count``; ``cmp_ratio`` (DeepSeek-V4's compressed keys) and
the quant indexer's ``metadata`` argument (from ``npu_quant_lightning_indexer_metadata``) came later still. The
adapters pass exactly the keywords the detected functions take.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch

INDEXER = "npu_lightning_indexer"
QUANT_INDEXER = "npu_quant_lightning_indexer"
QUANT_METADATA = "npu_quant_lightning_indexer_metadata"
SCATTER = "npu_scatter_nd_update_"
ROTARY = "npu_rotary_mul"
DYNAMIC_QUANT = "npu_dynamic_quant"


def param_names(fn: Callable | None, op_name: str) -> tuple[str, ...] | None:
    """The parameter names of ``fn``: its Python signature, else the schema of ``torch.ops.npu.<op_name>`` (torch_npu
    binds its kernels as torch ops, whose Python wrappers may have no inspectable signature); None if neither."""
    if fn is None:
        return None
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        pass
    try:
        schema = getattr(torch.ops.npu, op_name).default._schema
        return tuple(arg.name for arg in schema.arguments)
    except (AttributeError, RuntimeError):
        return None


@dataclass(frozen=True)
class NpuApi:
    version: str
    indexer: Callable | None  # npu_lightning_indexer (bf16 / fp16 keys)
    indexer_count: str | None  # its top-k keyword: "sparse_count" or "selected_count" (None: no indexer)
    indexer_cmp_ratio: bool  # takes cmp_ratio (compressed keys)
    quant_indexer: Callable | None  # npu_quant_lightning_indexer (int8 keys)
    quant_cmp_ratio: bool
    quant_metadata: Callable | None  # npu_quant_lightning_indexer_metadata, when the quant indexer takes metadata
    scatter: Callable | None  # npu_scatter_nd_update_
    rotary: Callable | None  # npu_rotary_mul
    rotary_interleave: bool  # it takes rotary_mode (its "interleave" mode: V4's RoPE pairs)
    dynamic_quant: Callable | None  # npu_dynamic_quant (symmetric per-row int8)

    def describe(self) -> str:
        return f"torch_npu {self.version}"


def detect(module: ModuleType) -> NpuApi:
    indexer = getattr(module, INDEXER, None)
    names = param_names(indexer, INDEXER)
    if indexer is None:
        count = None
    elif names is None or "sparse_count" in names:
        count = "sparse_count"  # the documented keyword of current releases (also when the signature is hidden)
    elif "selected_count" in names:
        count = "selected_count"
    else:
        indexer, count = None, None  # a signature this adapter does not know: not used
    quant = getattr(module, QUANT_INDEXER, None)
    quant_names = param_names(quant, QUANT_INDEXER) or ()
    metadata = getattr(module, QUANT_METADATA, None) if "metadata" in quant_names else None
    return NpuApi(version=str(getattr(module, "__version__", "?")), indexer=indexer, indexer_count=count,
                  indexer_cmp_ratio="cmp_ratio" in (names or ()), quant_indexer=quant,
                  quant_cmp_ratio="cmp_ratio" in quant_names, quant_metadata=metadata,
                  scatter=getattr(module, SCATTER, None), rotary=getattr(module, ROTARY, None),
                  rotary_interleave="rotary_mode" in (param_names(getattr(module, ROTARY, None), ROTARY) or ()),
                  dynamic_quant=getattr(module, DYNAMIC_QUANT, None))
