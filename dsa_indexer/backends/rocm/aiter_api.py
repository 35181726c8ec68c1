"""The environment fact ``aiter``: is a usable aiter here, which of its functions exist, do they pass a self-test.

``import aiter`` needs a ROCm install (it reads the GPU arch at import) and may fail in many ways on other
machines, so the probe checks cheap facts first (installed, ROCm build of torch, a visible GPU, not inside
graph capture), then imports aiter inside a try, finds the functions the adapters use by feature (module
paths moved between releases), checks that the HIP / CK modules behind them are already built, and runs the
ragged-logits and paged-logits adapters once against the reference on the GPU. Every failure becomes a reason
string; the probe never raises. It runs once per process, at the first resolution that needs the fact.

**Compiled modules.** aiter's HIP and CK functions (``top_k_per_row_decode``: ``module_top_k_per_row``;
``gemm_a8w8_blockscale``: ``module_gemm_a8w8_blockscale``, and ``module_gemm_a8w8_blockscale_cktile`` where that
variant exists) are ``aiter.jit.core.compile_ops`` wrappers: when the module's ``.so`` is absent, the FIRST CALL
runs hipcc for minutes. The PyPI wheel ships none of them prebuilt. So the probe never builds anything and never
lets a call build: it checks, with aiter's own loading rules (`module_unready`), whether each module loads as is,
and an implementation whose module does not is turned off with a reason saying how to prebuild it. "As is"
includes aiter's own arch check where aiter has it (v0.1.17 on): a module built for gfx942 only, found on a gfx950,
would be rebuilt inside the first call, so it counts as not built.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from ...dispatch.vendor import VendorLibrary
from . import gemm, logits, paged, quant, topk

log = logging.getLogger("dsa_indexer")

INSTALL_HINT = "pip install 'dsa-indexer[rocm]' (amd-aiter) on a ROCm machine"
CHECKED = "ROCm/aiter main e4048607 and amd-aiter 0.1.7.post2.dev18 (source read)"

# What each adapter needs from aiter, with the versions where it was found by reading the source; reasons and
# `AiterApi.describe` quote it, so `dsa-indexer explain` says what this install lacks and which aiter has it.
NEEDS = {
    "ragged_wrapper": "fp8_mqa_logits (Triton; amd-aiter 0.1.7.post2.dev18 and ROCm/aiter main e4048607)",
    "paged_logits": "the block-level Triton kernel _deepgemm_fp8_paged_mqa_logits (KVBlockSize, block and token "
                    "strides): a source install of ROCm/aiter main (04907edc on, e4048607 read); no release has it "
                    "(amd-aiter 0.1.7.post2.dev18 and every tag up to v0.1.20.post1: page-size-1 kernel only)",
    "topk_decode": "aiter.ops.topk.top_k_per_row_decode (HIP, module_top_k_per_row; 0.1.7.post2.dev18 and main)",
    "topk_stable": "top_k_per_row_decode(..., stable=True) (ROCm/aiter v0.1.20 on, main e4048607; not in "
                   "0.1.7.post2.dev18)",
    "fused_rms_quant": "fused_rms_fp8_group_quant (Triton; 0.1.7.post2.dev18 and main)",
    "gemm_blockscale": "aiter.gemm_a8w8_blockscale (CK, module_gemm_a8w8_blockscale; 0.1.7.post2.dev18 and main)",
}
# field -> (compiled module, the C++ function aiter loads from it): built by hipcc at the first call when absent.
JIT_MODULES = {
    "topk_decode": (("module_top_k_per_row", "top_k_per_row_decode"),),
    "topk_stable": (("module_top_k_per_row", "top_k_per_row_decode"),),
    "gemm_blockscale": (("module_gemm_a8w8_blockscale", "gemm_a8w8_blockscale"),),
}
CKTILE_MODULE = ("module_gemm_a8w8_blockscale_cktile", "gemm_a8w8_blockscale_cktile")  # main: tuned shapes use it


@dataclass(frozen=True)
class AiterApi:
    """What the installed aiter offers to the adapters (dotted paths of the functions found, None = absent)."""

    version: str
    fp8_dtype: torch.dtype | None = None  # aiter.dtypes.fp8: e4m3fnuz on gfx942, e4m3fn on gfx950 (uint8: unknown GPU)
    ragged_wrapper: str | None = None
    ragged_kernel: str | None = None
    topk_decode: str | None = None
    topk_stable: str | None = None  # the decode top-k takes stable=True (lower-index ties, deterministic)
    fused_rms_quant: str | None = None
    gemm_blockscale: str | None = None
    paged_logits: str | None = None  # the plain Triton kernel with KVBlockSize and block / token strides
    paged_wrapper: str | None = None  # aiter's block-level wrapper (informational: not called, see paged.py)
    paged_wrapper_route: str | None = None  # None: the wrapper reaches the plain kernel; else why it must not be used
    ragged_self_test: str | None = None  # None: passed (or not run); else why it failed
    paged_self_test: str | None = None  # None: passed (or not run); else why it failed
    unbuilt: dict[str, tuple[str, ...]] = field(default_factory=dict)  # field -> compiled modules not built yet
    module_notes: dict[str, str] = field(default_factory=dict)  # module -> why it would be rebuilt, if not "absent"

    def describe(self) -> str:
        """What this install provides, per adapter (``-``: absent), with the self-tests' and the modules' state."""
        fp8 = str(self.fp8_dtype).replace("torch.", "") if self.fp8_dtype is not None else "?"

        def item(label: str, name: str) -> str:
            path = getattr(self, name)
            if path is None:
                return f"{label}: - (needs {NEEDS[name]})"
            notes = [f"{module} {self.module_notes.get(module, 'not built')}" for module in self.unbuilt.get(name, ())]
            test = {"ragged_wrapper": self.ragged_self_test, "paged_logits": self.paged_self_test}.get(name)
            if test:
                notes.append(f"self-test failed: {test}")
            return f"{label}: {path}" + (f" [{'; '.join(notes)}]" if notes else "")

        parts = [item("ragged logits", "ragged_wrapper"), item("paged logits", "paged_logits"),
                 item("top-k decode", "topk_decode"), item("stable top-k", "topk_stable"),
                 item("fused rms quant", "fused_rms_quant"), item("block-scale GEMM", "gemm_blockscale")]
        if self.paged_wrapper is not None and self.paged_wrapper_route:
            parts.append(f"paged wrapper {self.paged_wrapper} not used: {self.paged_wrapper_route}")
        return f"aiter {self.version} (fp8 {fp8}; " + "; ".join(parts) + ")"


def _version() -> str:
    try:
        from importlib import metadata

        return metadata.version("amd-aiter")
    except Exception:  # noqa: BLE001 - a source install has no distribution metadata
        module = sys.modules.get("aiter")
        return str(getattr(module, "__version__", "(unknown version)"))


NOT_BUILT = "is not built"
ARCH_CHECK = "_needs_arch_rebuild"  # aiter.jit.core, ROCm/aiter v0.1.17 on (commit 575bed7e, #3849); absent before


def _built_for_another_arch(core: Any, md_name: str) -> str | None:
    """Why aiter would rebuild its prebuilt ``md_name`` for this GPU, by aiter's own check; None when it would not.

    Since v0.1.17 (ROCm/aiter `aiter/jit/core.py`, e4048607 too) ``get_module`` first asks ``_needs_arch_rebuild``:
    a ``<md_name>.so`` under aiter's user JIT dir whose offload bundles name gfx archs, none of them the running GPU's,
    makes aiter raise ModuleNotFoundError and rebuild it with hipcc inside that call. An older aiter has no such
    check and loads the module as it is, so nothing more can be said there (the file-presence rule decides)."""
    needs_rebuild = getattr(core, ARCH_CHECK, None)
    if not callable(needs_rebuild) or not needs_rebuild(md_name):
        return None
    try:  # the archs, for the reason, from aiter's own helpers when it has them (private: best effort)
        built = sorted(core._so_offload_archs(os.path.join(core.get_user_jit_dir(), f"{md_name}.so")))
        running = core.get_gfx_runtime()
        return f"is built for {', '.join(built)}, not this GPU's {running} (aiter.jit.core.{ARCH_CHECK})"
    except Exception:  # noqa: BLE001
        return f"is built for other GPU archs than this one (aiter.jit.core.{ARCH_CHECK})"


def module_unready(md_name: str, function: str) -> str | None:
    """None when aiter would load its compiled module ``md_name`` without building it; else why it would build it
    at the first call ("is not built", or the arch it was built for). aiter.jit.core's loading rules (e4048607 and
    0.1.7): ``AITER_REBUILD`` set rebuilds at the first call; a prebuilt ``aiter_`` extension (0.1.7's
    ``PREBUILD_KERNELS``) serves the functions it has; else the module is imported as ``md_name`` from
    ``$AITER_JIT_DIR`` when set, or as ``aiter.jit.<md_name>``, unless aiter's arch check (v0.1.17 on) finds it built
    for other archs only. Anything unreadable counts as not built."""
    try:
        core = importlib.import_module("aiter.jit.core")
        if int(getattr(core, "AITER_REBUILD", 0) or 0):
            return NOT_BUILT
        if getattr(core, "PREBUILD_KERNELS", False) and hasattr(getattr(core, "aiter_", None), function):
            return None
        jit_dir = os.environ.get("AITER_JIT_DIR")
        if jit_dir:
            found = importlib.machinery.PathFinder.find_spec(md_name, [jit_dir]) is not None
        else:
            found = importlib.util.find_spec(f"aiter.jit.{md_name}") is not None
        return _built_for_another_arch(core, md_name) if found else NOT_BUILT
    except Exception:  # noqa: BLE001 - an aiter whose loader we cannot read might build at the first call
        return NOT_BUILT


def module_prebuilt(md_name: str, function: str) -> bool:
    """Would aiter load its compiled module ``md_name`` as it is, without building it (`module_unready`)?"""
    return module_unready(md_name, function) is None


def prebuild_hint(md_name: str, why: str | None = None) -> str:
    return (f"aiter's {md_name} {why or NOT_BUILT}: its first call would compile it with hipcc (minutes, inside a "
            f"step). Build it for this GPU before serving, then restart: install aiter from source with "
            f"PREBUILD_KERNELS=1 GPU_ARCHS=<your gfx arch> (aiter's CONTRIBUTE.md), or call the function once in a "
            f"warm-up process (aiter then keeps {md_name}.so under aiter/jit or $AITER_JIT_DIR)")


def _unbuilt(api: "AiterApi", has_cktile: bool) -> tuple[dict[str, tuple[str, ...]], dict[str, str]]:
    """field -> its modules that a first call would build, and module -> why where that is not plain absence."""
    missing: dict[str, tuple[str, ...]] = {}
    notes: dict[str, str] = {}
    for name, modules in JIT_MODULES.items():
        if getattr(api, name) is None:
            continue
        if name == "gemm_blockscale" and has_cktile:
            modules = modules + (CKTILE_MODULE,)
        absent = []
        for md, function in modules:
            why = module_unready(md, function)
            if why is not None:
                absent.append(md)
                if why != NOT_BUILT:
                    notes[md] = why
        if absent:
            missing[name] = tuple(absent)
    return missing, notes


def detect_api() -> AiterApi:
    """Find, in the importable aiter, the functions the adapters call (imports aiter and its submodules)."""
    import aiter

    dtypes = getattr(aiter, "dtypes", None)
    api = AiterApi(version=_version(), fp8_dtype=getattr(dtypes, "fp8", None))
    wrapper, kernel = logits.find_wrapper(), logits.find_kernel()
    decode, fused, blockscale = topk.find_decode(), quant.find_fused_rms_quant(), gemm.find_gemm()
    paged_kernel, paged_wrapper = paged.find_kernel(), paged.find_wrapper()
    stable = decode if decode and topk.takes_stable(decode[1]) else None
    api = dataclasses.replace(api, ragged_wrapper=wrapper[0] if wrapper else None,
                              ragged_kernel=kernel[0] if kernel else None, topk_decode=decode[0] if decode else None,
                              fused_rms_quant=fused[0] if fused else None,
                              gemm_blockscale=blockscale[0] if blockscale else None,
                              paged_logits=paged_kernel[0] if paged_kernel else None,
                              paged_wrapper=paged_wrapper[0] if paged_wrapper else None,
                              paged_wrapper_route=paged.wrapper_route(paged_wrapper[1]) if paged_wrapper else None,
                              topk_stable=stable[0] if stable else None)
    unbuilt, notes = _unbuilt(api, gemm.find_cktile() is not None)
    return dataclasses.replace(api, unbuilt=unbuilt, module_notes=notes)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"


def self_test(api: AiterApi, device: torch.device) -> AiterApi:
    """Run the ragged-logits adapter (aiter's wrapper + the alignment workaround) and the paged-logits adapter
    (aiter's plain Triton kernel on 64-token pages) once against the reference; each outcome is recorded in the
    returned api, and a failure turns off only that implementation. Nothing HIP / CK runs here (`module_prebuilt`)."""
    if api.fp8_dtype is None:
        return api

    if api.ragged_wrapper is not None:
        try:
            logits.check_ragged_adapter(logits.make_ragged_mqa_logits(launch="wrapper"), device, api.fp8_dtype)
        except Exception as exc:  # noqa: BLE001 - every failure becomes the reason
            api = dataclasses.replace(api, ragged_self_test=_first_line(exc))
    if api.paged_logits is not None:
        try:
            adapter = paged.make_paged_mqa_logits(launch="kernel")
            paged.check_paged_adapter(adapter, device, api.fp8_dtype)
            paged.warm_split_buckets(adapter, device, api.fp8_dtype)  # every SplitKV compile, before any capture
        except Exception as exc:  # noqa: BLE001
            api = dataclasses.replace(api, paged_self_test=_first_line(exc))
    return api


def _device_check() -> str | None:
    if not torch.version.hip:
        return "aiter needs a ROCm build of torch (torch.version.hip is None)"
    if not torch.cuda.is_available():
        return "aiter is installed but torch sees no ROCm GPU"
    return None


def _usable(api: AiterApi) -> str | None:
    if not (api.ragged_wrapper or api.topk_decode or api.fused_rms_quant or api.gemm_blockscale or api.paged_logits):
        return (f"aiter {api.version} exposes none of the functions this backend adapts "
                f"(fp8_mqa_logits, top_k_per_row_decode, fused_rms_fp8_group_quant, gemm_a8w8_blockscale, "
                f"_deepgemm_fp8_paged_mqa_logits)")
    return None


# The shared vendor-library probe (dispatch/vendor.py); the lambdas look this module's functions up at call time.
LIBRARY = VendorLibrary(module="aiter", install_hint=INSTALL_HINT, device_check=_device_check,
                        detect=lambda module: detect_api(), usable=_usable,
                        self_test=lambda module, api, device: self_test(api, device),
                        describe=lambda api: api.describe() if isinstance(api, AiterApi) else "aiter",
                        catch_base_exceptions=True)  # aiter's import may even call exit() without ROCm tools


def detected_api() -> AiterApi | None:
    """The API the probe found in this process (None before the probe ran or when it failed)."""
    return LIBRARY.detected_api()


def reset_detection() -> None:
    """Forget the probe's result (tests)."""
    LIBRARY.reset()


def probe() -> str | None:
    """None when aiter imports on a ROCm GPU and exposes at least one function the adapters use; else the
    reason. Never raises. A failed self-test or an unbuilt compiled module turns off only the implementations
    concerned (recorded in the api; their ``available`` check gives the reason)."""
    reason = LIBRARY.probe()
    api = LIBRARY.detected_api()
    if reason is None and api is not None:
        if api.ragged_self_test:
            log.info("dsa_indexer: aiter's ragged logits self-test failed: %s", api.ragged_self_test)
        if api.paged_self_test:
            log.info("dsa_indexer: aiter's paged logits self-test failed: %s", api.paged_self_test)
        for modules in sorted(set(api.unbuilt.values())):
            log.info("dsa_indexer: %s", "; ".join(prebuild_hint(md, api.module_notes.get(md)) for md in modules))
    return reason
