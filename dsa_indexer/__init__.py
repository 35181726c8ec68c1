"""dsa_indexer: the DeepSeek sparse-attention lightning indexer (V3.2, V4 C4) behind one interface.

    from dsa_indexer import Indexer, IndexerConfig, IndexKCache, DecodeBatch, ops
    indexer = Indexer(IndexerConfig.deepseek_v32(), device="cuda").init_random(0)
    topk = indexer(x, q_lora, positions, batch, cache)          # int32 [T, 2048], -1 padded

This file is the stable public API: it never changes when a backend is added.
"""

from . import ops
from .batch import DecodeBatch, PrefillBatch
from .contract.cache import IndexKCache
from .compressor import Compressor, CompressorState
from .config import IndexerConfig
from .dispatch import (Environment, Implementation, NoImplementationError, Problem, Registry, Resolution, Target,
                       default_registry, detect_target, hookimpl, parse_target)
from .graphs import DecodeGraph
from .indexer import Indexer
from .contract.quant import Fp8GroupLayout, QuantizedActivation
from .contract.step import StepContext
from .contract.validate import IndexerInputError

__version__ = "0.1.0"

# Platforms are plain data (no vendor library is imported): load them now, so the first op call, which may be traced
# by torch.compile, finds them loaded (and the CPU detected) instead of taking a lock.
from .dispatch.platform import platforms as _platforms
from .dispatch.target import warm_detection as _warm_detection

_platforms()
_warm_detection()


def explain(op: str, target: str | Target | None = None, **problem) -> str:
    """The resolution trace of ``op`` on ``target`` (default: the detected one) for a problem class."""
    tgt = detect_target(override=target) if target is not None else detect_target()
    return default_registry().resolve(op, tgt, Problem(**problem)).explain()


__all__ = ["Compressor", "CompressorState", "DecodeBatch", "DecodeGraph", "Environment", "Fp8GroupLayout",
           "Implementation", "IndexKCache", "Indexer", "IndexerConfig", "IndexerInputError",
           "NoImplementationError", "PrefillBatch", "Problem", "QuantizedActivation", "Registry",
           "Resolution", "StepContext", "Target", "default_registry", "detect_target", "explain", "hookimpl", "ops",
           "parse_target"]
