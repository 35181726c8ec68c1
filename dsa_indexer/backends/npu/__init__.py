"""The Ascend backend: torch_npu's fused lightning indexers over the plain cache layouts.

torch_npu's indexer kernels take bf16 (or int8 + scale) keys in a plain paged tensor ``[blocks, 64, 1, 128]``, not
the fp8 132-byte pages the other backends read, so this backend serves the ops of the plain layouts
(``contract/cache.py``: ``paged64_bf16`` for V3.2, ``paged64_int8``), which `Indexer` uses when its cache has such a
layout (`Indexer.allocate_cache` picks it on target ``npu``):

* ``lightning_indexer_ragged.npu.torch_npu`` (200): ``npu_lightning_indexer`` (bf16) / ``npu_quant_lightning_indexer``
  (int8), for decode, speculative decode and prefill alike (`lightning.py`). Uncompressed keys only: no released
  torch_npu indexer takes a compression ratio, so V4's C4 indexer (compress_ratio 4) is refused with that reason.
* ``q_prologue_plain.npu.torch_npu`` and ``k_prologue_store_plain.npu.torch_npu`` (200): RoPE by ``npu_rotary_mul``,
  int8 by ``npu_dynamic_quant``, the store by ``npu_scatter_nd_update_`` (`prologue.py`).
* ``indexer_pipeline.npu.two_stream`` (100): the k path on a side NPU stream (`pipeline.py`).

* ``lightning_indexer.npu.torch_npu_fp8`` (200): the fp8 132-byte pages read in place by
  ``npu_quant_lightning_indexer``'s fp8 path, on Ascend 950PR / 950DT only (op-plugin 26.1.0 on; checked once on the
  device when first resolved, since 26.0.0 has the same schema without that path).

The other fp8 ops are not registered (``UNREGISTERED`` says why), so an fp8-layout cache on npu runs its prologues
and store on the reference, which strict mode refuses; so does V4's compressor pooling (``c4_compress_pool``), which
has no torch_npu kernel.
Nothing here has run on Ascend hardware: the CPU tests run the adapters through operators registered with
torch.library under torch_npu's published schemas (tests/data/torch_npu_schemas.json) and through a plain-Python
double (tests/doubles/torch_npu.py); docs/backends-amd-npu.md says what each registration was checked against.

The probe: torch_npu must import (inside a try: it needs the CANN toolkit) and ``torch.npu.is_available()`` must hold;
feature detection (`api.detect`) reads each kernel's operator schema.
"""

from __future__ import annotations

import torch

from ...dispatch.capabilities import Capabilities, Rule
from ...dispatch.plugins import hookimpl
from ...dispatch.problem import Problem
from ...dispatch.registry import Registry
from ...dispatch.target import Target
from ...dispatch.verification import Level, Verified
from ...dispatch.vendor import VendorLibrary
from ...contract.specs import PIPELINE_OP
from . import api as npu_api

__all__ = ["LIBRARY", "MAX_K", "NPU_PRIORITY", "UNREGISTERED", "torch_npu_probe"]

INSTALL_HINT = "pip install 'dsa-indexer[npu]' (torch-npu) with the CANN toolkit"
NPU_PRIORITY = 200
PIPELINE_PRIORITY = 100
HEADS, HEAD_DIM, MAX_K = 64, 128, 2048  # what torch_npu's indexer kernels take (query heads, dim, sparse_count)

UNREGISTERED = {
    "paged_mqa_logits": "no torch_npu kernel returns the logits themselves (its indexers fuse the top-k)",
    "ragged_mqa_logits": "as paged_mqa_logits",
    "ragged_mqa_topk": "reads the fp8 keys; torch_npu's indexers read the plain layouts (lightning_indexer_ragged)",
    "q_prologue_fp4": "V4's FP4 q has no torch_npu kernel (and the NPU backend refuses V4's C4 indexer)",
    "topk_indices": "torch.topk runs on NPU tensors already: the reference implementation is the NPU path",
    "quant_fp8_groups": "torch_npu has no e4m3 fp8 quant matching this recipe (its dynamic quant is int8)",
    "rmsnorm_quant_fp8": "as quant_fp8_groups",
    "q_prologue": "fp8 output; see quant_fp8_groups (q_prologue_plain.npu.torch_npu serves the plain layouts)",
    "k_prologue_store": "writes the fp8 cache; k_prologue_store_plain.npu.torch_npu writes the plain layouts",
    "gemm_fp8_blockscale": "no e4m3 block-scaled GEMM in torch_npu; the plain layouts' q path runs wq_b in bf16",
    "c4_compress_pool": "the reference pooling runs on NPU tensors; no torch_npu kernel matches V4's compressor",
    "x_projections": "torch's two GEMMs (x_projections.generic.torch) run on NPU tensors; no torch_npu kernel fuses them",
    "decode_metadata": "the reference's torch ops run on NPU tensors; DecodeGraph, its caller, captures CUDA / HIP graphs only",
}


def _npu_visible(module) -> str | None:
    npu = getattr(torch, "npu", None)
    try:
        available = bool(npu is not None and npu.is_available())
    except Exception as exc:  # noqa: BLE001
        return f"torch_npu imported but torch.npu.is_available() failed ({type(exc).__name__}: {exc})"
    return None if available else "torch_npu imported but torch.npu.is_available() is False (no NPU visible)"


def _usable(api: npu_api.NpuApi) -> str | None:
    if api.indexer is None and api.quant_indexer is None:
        unfit = [api.missing[op] for op in (npu_api.INDEXER, npu_api.QUANT_INDEXER)
                 if not api.missing[op].startswith("has no ")]
        detail = f" ({'; '.join(unfit)})" if unfit else ""
        return f"{api.describe()} has neither {npu_api.INDEXER} nor {npu_api.QUANT_INDEXER}{detail}"
    return None


# The shared vendor-library probe (dispatch/vendor.py); no self-test: it would need an NPU to compare on.
LIBRARY = VendorLibrary(module="torch_npu", install_hint=INSTALL_HINT, after_import=_npu_visible,
                        detect=lambda module: npu_api.detect(module), usable=lambda api: _usable(api),
                        describe=lambda api: api.describe(),
                        catch_base_exceptions=True)  # a missing CANN toolkit must not take the host down


def torch_npu_probe() -> str | None:
    """None when torch_npu imports, an NPU is visible and it has an indexer kernel; else the reason. Never raises."""
    return LIBRARY.probe()


def detected_api() -> npu_api.NpuApi:
    """The probed API; raises if the probe did not find one (the registry calls these only after it passed)."""
    api = LIBRARY.detected_api()
    if api is None:
        raise RuntimeError("torch_npu was not probed in this process (or the probe failed): run "
                           "`dsa-indexer explain --target npu` to see why")
    return api


# What torch_npu's kernels take that is a fact of the problem, declared (dispatch/capabilities.py): the registry
# reports every failing fact at once, before the `supports` checks below, which keep what the problem cannot say (the
# probed release's operators, the Ascend product).
_SPARSE_COUNT = Rule(lambda k: 1 <= k <= MAX_K, f"1..{MAX_K} (its sparse_count)")
# What was checked: op-plugin's published schemas (master 517f2e7d, branches 7.3.0, 26.0.0, 26.1.0) of both indexers
# have no compression-ratio argument (and there is no metadata op); the C4 indexers of the Ascend serving stacks are
# separate custom-op packages with their own schemas, none of which this adapter binds.
C4_REFUSED = ("1 (uncompressed keys: no released torch_npu indexer takes a compression ratio, op-plugin master "
              "517f2e7d, 7.3.0, 26.0.0 and 26.1.0, so V4's C4 indexer, compress_ratio 4, is served by the reference)")
INDEXER_CAPS = Capabilities("torch_npu's lightning indexer", heads=(HEADS,), dim=(HEAD_DIM,), k=_SPARSE_COUNT,
                            ratio=Rule(lambda ratio: ratio == 1, C4_REFUSED))
# npu_quant_lightning_indexer's fp8 path, on Ascend 950 (op-plugin 26.1.0 09024aa9 / master 517f2e7d docs).
FP8_HEADS = (8, 16, 24, 32, 64)
FP8_PAGES_CAPS = Capabilities("Ascend 950's fp8 indexer", heads=FP8_HEADS, dim=(HEAD_DIM,), k=_SPARSE_COUNT,
                              keys=Rule(lambda keys: keys == "fp8", "fp8 (V4's FP4 pages, 68 bytes: no torch_npu "
                                                                    "indexer reads e2m1 keys)"),
                              fp8=Rule(lambda fp8: fp8 == "fn", "fn (float8_e4m3fn)"))
_PLAIN_DIM = Rule(lambda dim: dim == HEAD_DIM, f"{HEAD_DIM} (what the plain layouts hold)")
K_PROLOGUE_CAPS = Capabilities("torch_npu's k prologue", dim=_PLAIN_DIM)
Q_PROLOGUE_CAPS = Capabilities("torch_npu's q prologue", dim=_PLAIN_DIM)


def _indexer_api_supports(problem: Problem, target: Target) -> list[str]:
    """What the probed torch_npu lacks for this problem's keys (not problem data: the installed release decides),
    every reason at once; the shape facts and the compression ratio are `INDEXER_CAPS`."""
    api = LIBRARY.detected_api()
    if api is None:  # not probed (a simulated environment): assume the published current API
        return []
    reasons = []
    fmt = problem.get("format")
    if fmt == "bf16" and api.indexer is None:
        reasons.append(f"{api.why_not(npu_api.INDEXER)} (bf16 keys)")
    if fmt == "int8" and api.quant_indexer is None:
        reasons.append(f"{api.why_not(npu_api.QUANT_INDEXER)} (int8 keys)")
    return reasons


def _prologue_supports(store: bool):
    def check(problem: Problem, target: Target) -> list[str]:
        """What the probed torch_npu lacks (its release decides), every reason at once; the head dim is
        `K_PROLOGUE_CAPS` / `Q_PROLOGUE_CAPS`."""
        api = LIBRARY.detected_api()
        if api is None:  # not probed (a simulated environment): assume the documented current API
            return []
        reasons = []
        needed = [(api.rotary, npu_api.ROTARY)]
        if store:
            needed.append((api.scatter, npu_api.SCATTER))
        if problem.get("format") == "int8":
            needed.append((api.dynamic_quant, npu_api.DYNAMIC_QUANT))
        missing = [api.missing.get(name, f"has no {name}") for fn, name in needed if fn is None]
        if missing:
            reasons.append(f"{api.describe()}: {'; '.join(missing)}")
        if problem.get("interleaved") and not api.rotary_interleave:
            reasons.append(f"{api.describe()}'s {npu_api.ROTARY} takes no rotary_mode (interleaved pairs: V4's RoPE)")
        return reasons

    return check


def _fp8_pages_supports(problem: Problem, target: Target) -> list[str]:
    """The Ascend product and the probed release (not problem data); the shape facts are `FP8_PAGES_CAPS`."""
    from .lightning import fp8_supports

    return fp8_supports(LIBRARY.detected_api())


# The layouts its steps write: the plain ones torch_npu's indexers read.
TWO_STREAM_CAPS = Capabilities("the NPU two-stream strategy", cache=("paged64_bf16", "paged64_int8"))


# Never run on Ascend hardware or with a real torch_npu: CPU CI calls these through operators registered with
# torch.library under op-plugin's published schemas (tests/data/torch_npu_schemas.json, four releases).
SCHEMA_VERIFIED = (Verified(Level.VENDOR_SCHEMA, ("npu",), "tests/backends/test_npu_schemas.py, test_npu_backend.py "
                                                           "(tests/data/torch_npu_schemas.json)"),)
# The fp8 pages path: the schemas above plus a double that follows each release's and product's documented dtypes.
FP8_PAGES_VERIFIED = (Verified(Level.VENDOR_SCHEMA, ("npu",), "tests/backends/test_npu_fp8_pages_and_weights.py "
                                                              "(tests/data/torch_npu_schemas.json, "
                                                              "tests/doubles/torch_npu.py)"),)


@hookimpl
def dsa_indexer_register(registry: Registry) -> None:
    registry.add_probe("torch_npu", torch_npu_probe)  # a simulated environment keeps its fixed facts
    requires = ("torch_npu",)

    def indexer_factory():
        from .lightning import make_lightning_indexer_ragged

        return make_lightning_indexer_ragged(detected_api)

    def store_factory():
        from .prologue import make_k_prologue_store_plain

        return make_k_prologue_store_plain(detected_api)

    def q_factory():
        from .prologue import make_q_prologue_plain

        return make_q_prologue_plain(detected_api)

    def fp8_factory():
        from .lightning import check_fp8_adapter, make_lightning_indexer_fp8

        fn = make_lightning_indexer_fp8(detected_api)
        api = detected_api()
        try:  # op-plugin 26.0.0 has the same schema but no fp8 path: one call on the device tells
            check_fp8_adapter(fn, api.device)
        except Exception as exc:  # noqa: BLE001 - the registry marks it broken with this reason and falls back
            raise RuntimeError(f"{api.describe()}: npu_quant_lightning_indexer's fp8 check failed "
                               f"({type(exc).__name__}: {exc})") from exc
        return fn

    def pipeline_factory():
        from .pipeline import make_two_stream

        return make_two_stream()

    # Neither registration declares writes_out: torch_npu's lightning indexers return new (indices, values)
    # tensors and take no output argument (tests/data/torch_npu_schemas.json), so a caller's out= buffer is filled
    # by the dispatch layer with one copy of the result (dsa_indexer.ops).
    registry.implementation("lightning_indexer_ragged", impl_id="lightning_indexer_ragged.npu.torch_npu",
                            targets=("npu",), priority=NPU_PRIORITY, requires=requires,
                            capabilities=INDEXER_CAPS, supports=_indexer_api_supports,
                            description="torch_npu npu_lightning_indexer (bf16) / npu_quant_lightning_indexer (int8)",
                            verified=SCHEMA_VERIFIED)(indexer_factory)
    registry.implementation("lightning_indexer", impl_id="lightning_indexer.npu.torch_npu_fp8", targets=("npu",),
                            priority=NPU_PRIORITY, requires=requires, capabilities=FP8_PAGES_CAPS,
                            supports=_fp8_pages_supports,
                            description="torch_npu npu_quant_lightning_indexer, fp8 query and keys (Ascend 950PR / "
                                        "950DT): the fp8 132-byte pages read in place",
                            info={"vendor_function": "torch_npu.npu_quant_lightning_indexer (float8_e4m3fn, "
                                                     "op-plugin 26.1.0 09024aa9 / master 517f2e7d docs)",
                                  "weights": "sign(w) as bf16 weights, |w| as the fp32 query_dequant_scale: exact",
                                  "ties": "the kernel's (undocumented) order among equal scores"},
                            verified=FP8_PAGES_VERIFIED)(fp8_factory)
    registry.implementation("k_prologue_store_plain", impl_id="k_prologue_store_plain.npu.torch_npu",
                            targets=("npu",), priority=NPU_PRIORITY, requires=requires,
                            capabilities=K_PROLOGUE_CAPS, supports=_prologue_supports(store=True),
                            description="RoPE by npu_rotary_mul (+ int8 by npu_dynamic_quant), npu_scatter_nd_update_",
                            verified=SCHEMA_VERIFIED)(store_factory)
    registry.implementation("q_prologue_plain", impl_id="q_prologue_plain.npu.torch_npu", targets=("npu",),
                            priority=NPU_PRIORITY, requires=requires, capabilities=Q_PROLOGUE_CAPS,
                            supports=_prologue_supports(store=False),
                            description="RoPE by npu_rotary_mul (+ Hadamard, int8 by npu_dynamic_quant)",
                            verified=SCHEMA_VERIFIED)(q_factory)
    registry.implementation(PIPELINE_OP, impl_id=f"{PIPELINE_OP}.npu.two_stream", targets=("npu",),
                            priority=PIPELINE_PRIORITY, requires=requires, capabilities=TWO_STREAM_CAPS,
                            description="k path on a side NPU stream, q path on the current one",
                            verified=SCHEMA_VERIFIED)(pipeline_factory)
