"""The environment fact ``aiter``: is a usable aiter here, which of its functions exist, do they pass a self-test.

``import aiter`` needs a ROCm install (it reads the GPU arch at import) and may fail in many ways on other
machines, so the probe checks cheap facts first (installed, ROCm build of torch, a visible GPU, not inside
graph capture), then imports aiter inside a try, finds the functions the adapters use by feature (module
paths moved between releases), and runs the ragged-logits adapter once against the reference on the GPU.
Every failure becomes a reason string; the probe never raises. It runs once per process, at the first
resolution that needs the fact.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
from dataclasses import dataclass
from typing import Any

import torch

from ...dispatch.vendor import VendorLibrary

log = logging.getLogger("dsa_indexer")

INSTALL_HINT = "pip install 'dsa-indexer[rocm]' (amd-aiter) on a ROCm machine"


@dataclass(frozen=True)
class AiterApi:
    """What the installed aiter offers to the adapters (dotted paths of the functions found, None = absent)."""

    version: str
    fp8_dtype: torch.dtype | None = None  # aiter.dtypes.fp8: e4m3fnuz on gfx942, e4m3fn on gfx950
    ragged_wrapper: str | None = None
    ragged_kernel: str | None = None
    topk_decode: str | None = None
    topk_stable: str | None = None  # the decode top-k takes stable=True (lower-index ties, deterministic)
    fused_rms_quant: str | None = None
    gemm_blockscale: str | None = None
    paged_logits: str | None = None  # the block-level deepgemm_fp8_paged_mqa_logits (a KVBlockSize parameter)
    ragged_self_test: str | None = None  # None: passed (or not run); else why it failed

    def describe(self) -> str:
        fp8 = str(self.fp8_dtype).replace("torch.", "") if self.fp8_dtype is not None else "?"
        return (f"aiter {self.version} (fp8 {fp8}; ragged logits: {self.ragged_wrapper or '-'}; "
                f"top-k decode: {self.topk_decode or '-'}; fused rms quant: {self.fused_rms_quant or '-'}; "
                f"block-scale GEMM: {self.gemm_blockscale or '-'}; paged logits: {self.paged_logits or '-'})")


def find_function(modules: tuple[str, ...], name: str, *, callable_only: bool = False) -> tuple[str, Any] | None:
    """The first ``module.name`` that imports, as (dotted path, object); None when none does. aiter's module paths
    moved between releases (``aiter.ops.triton.X`` -> ``aiter.ops.triton.<family>.X``), so every adapter lists the
    places it knows and takes the first that exists."""
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        obj = getattr(module, name, None)
        if obj is not None and (callable(obj) or not callable_only):
            return f"{module_name}.{name}", obj
    return None


def _version() -> str:
    try:
        from importlib import metadata

        return metadata.version("amd-aiter")
    except Exception:  # noqa: BLE001 - a source install has no distribution metadata
        module = sys.modules.get("aiter")
        return str(getattr(module, "__version__", "(unknown version)"))


def detect_api() -> AiterApi:
    """Find, in the importable aiter, the functions the adapters call (imports aiter and its submodules)."""
    import aiter

    from . import gemm, logits, paged, quant, topk

    dtypes = getattr(aiter, "dtypes", None)
    api = AiterApi(version=_version(), fp8_dtype=getattr(dtypes, "fp8", None))
    wrapper, kernel = logits.find_wrapper(), logits.find_kernel()
    decode, fused, blockscale = topk.find_decode(), quant.find_fused_rms_quant(), gemm.find_gemm()
    paged_fn = paged.find_wrapper()
    stable = decode if decode and topk.takes_stable(decode[1]) else None
    return dataclasses.replace(api, ragged_wrapper=wrapper[0] if wrapper else None,
                               ragged_kernel=kernel[0] if kernel else None, topk_decode=decode[0] if decode else None,
                               fused_rms_quant=fused[0] if fused else None,
                               gemm_blockscale=blockscale[0] if blockscale else None,
                               paged_logits=paged_fn[0] if paged_fn else None,
                               topk_stable=stable[0] if stable else None)


def self_test(api: AiterApi, device: torch.device) -> AiterApi:
    """Run the ragged-logits adapter (aiter's wrapper + the alignment workaround) once against the reference;
    the outcome is recorded in the returned api (only that implementation is turned off when it fails)."""
    if api.ragged_wrapper is None or api.fp8_dtype is None:
        return api
    from . import logits

    try:
        logits.check_ragged_adapter(logits.make_ragged_mqa_logits(launch="wrapper"), device, api.fp8_dtype)
    except Exception as exc:  # noqa: BLE001 - every failure becomes the reason
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return dataclasses.replace(api, ragged_self_test=f"{type(exc).__name__}: {text}")
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
                f"deepgemm_fp8_paged_mqa_logits)")
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
    reason. Never raises. A failed ragged self-test turns off only that implementation (recorded in the api)."""
    reason = LIBRARY.probe()
    api = LIBRARY.detected_api()
    if reason is None and api is not None and api.ragged_self_test:
        log.info("dsa_indexer: aiter's ragged logits self-test failed: %s", api.ragged_self_test)
    return reason
