"""DeepGEMM's Python API, detected by feature (names and signatures, never version strings): which generation
is installed, which functions the adapters call, whether paged context lengths are 1-D or 2-D (`deepgemm.py` has the
generations' facts)."""

from __future__ import annotations

import dataclasses
import inspect
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch

# Names per API generation, newest first.
PAGED_NEW, PAGED_LEGACY = "fp8_fp4_paged_mqa_logits", "fp8_paged_mqa_logits"
RAGGED_NEW, RAGGED_LEGACY = "fp8_fp4_mqa_logits", "fp8_mqa_logits"
GEMM_NAMES = ("fp8_fp4_gemm_nt", "fp8_gemm_nt", "gemm_fp8_fp8_bf16_nt")
METADATA = "get_paged_mqa_logits_metadata"
SM90_RECIPE = (1, 128, 128)  # per-token groups of 128 for a, 128x128 blocks for b
SM100_RECIPE = (1, 1, 128)  # sm100 with packed ue8m0 scales: per-row groups of 128 for a AND b (b broadcast)
FP4_LOGITS_BLOCK = 32  # DeepGEMM's FP4 logits read e2m1 with one ue8m0 scale per 32 (4 per int32 at D=128)
INSTALL_HINT = ("pip install sgl-deep-gemm (a build made against this torch version), or install DeepGEMM by its "
                "own instructions: https://github.com/deepseek-ai/DeepGEMM (README, installation)")
JIT_CACHE_ENV = "DG_JIT_CACHE_DIR"  # DeepGEMM's own knob: where its JIT keeps the kernels it compiled


def jit_cache_dir() -> str:
    """The folder DeepGEMM's JIT compiles into on first use of each kernel shape (``$DG_JIT_CACHE_DIR``, default
    ``~/.deep_gemm``)."""
    return os.environ.get(JIT_CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".deep_gemm")


# ----------------------------------------------------------------------------------------------------------------
# API detection
def param_names(fn: Callable) -> tuple[str, ...] | None:
    """The parameter names of ``fn``: from `inspect.signature`, else from a pybind11 docstring
    (``name(q: tuple[...], kv_cache: torch.Tensor, clean_logits: bool = False) -> torch.Tensor``); None if unknown."""
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        pass
    doc = getattr(fn, "__doc__", None) or ""
    name = getattr(fn, "__name__", "")
    start = doc.find(f"{name}(") if name else -1
    if start < 0:
        return None
    start += len(name) + 1
    names, depth, part = [], 0, []
    for ch in doc[start:]:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                break
            depth -= 1
        if ch == "," and depth == 0:
            names.append("".join(part))
            part = []
        else:
            part.append(ch)
    names.append("".join(part))
    out = tuple(p.split(":")[0].split("=")[0].strip() for p in names)
    return tuple(n for n in out if n and n not in ("*", "/"))


@dataclass(frozen=True)
class DeepGemmApi:
    """What the installed deep_gemm offers, found by feature. ``None`` names mean "absent"."""

    version: str
    paged_fn: str | None = None
    paged_params: tuple[str, ...] = ()
    context_lens_2d: bool | None = None  # None: not known before the self-test (legacy paged API)
    ragged_fn: str | None = None
    ragged_params: tuple[str, ...] = ()
    gemm_fn: str | None = None
    gemm_params: tuple[str, ...] = ()
    self_tested: bool = False

    @property
    def paged_tuple_q(self) -> bool:
        return self.paged_fn == PAGED_NEW

    @property
    def ragged_tuple_q(self) -> bool:
        return self.ragged_fn == RAGGED_NEW

    @property
    def generation(self) -> str:
        if self.paged_fn == PAGED_NEW or self.ragged_fn == RAGGED_NEW:
            return "fp8_fp4"
        if self.paged_fn or self.ragged_fn:
            return "legacy"
        return "gemm only" if self.gemm_fn else "none"

    def function_for(self, op: str) -> str | None:
        return {"paged_mqa_logits": self.paged_fn, "ragged_mqa_logits": self.ragged_fn,
                "gemm_fp8_blockscale": self.gemm_fn}.get(op)

    def describe(self) -> str:
        lens = {None: "context lens 1-D or 2-D (untested)", True: "2-D context lens", False: "1-D context lens"}
        return (f"deep_gemm {self.version} ({self.generation} API: paged={self.paged_fn} "
                f"[{lens[self.context_lens_2d] if self.paged_fn else '-'}], ragged={self.ragged_fn}, "
                f"gemm={self.gemm_fn})")


def _version(module: ModuleType) -> str:
    version = getattr(module, "__version__", None)
    if version:
        return str(version)
    try:
        from importlib import metadata

        for dist in ("deep_gemm", "deep-gemm", "sgl-deep-gemm"):
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
    except Exception:
        pass
    return "(unknown version)"


def detect_api(module: ModuleType) -> DeepGemmApi:
    """Which generation of the API ``module`` exposes: names first, then parameter lists.

    Paged logits need the metadata function too. Context lengths are 2-D for the fp8_fp4 names; for the legacy
    name it stays unknown (None) until `self_test` tries a call.
    """

    def fn(name: str) -> Callable | None:
        value = getattr(module, name, None)
        return value if callable(value) else None

    api = DeepGemmApi(version=_version(module))
    paged = next((n for n in (PAGED_NEW, PAGED_LEGACY) if fn(n)), None)
    if paged is not None and fn(METADATA):
        api = dataclasses.replace(api, paged_fn=paged, paged_params=param_names(fn(paged)) or (),
                                  context_lens_2d=True if paged == PAGED_NEW else None)
    ragged = next((n for n in (RAGGED_NEW, RAGGED_LEGACY) if fn(n)), None)
    if ragged is not None:
        api = dataclasses.replace(api, ragged_fn=ragged, ragged_params=param_names(fn(ragged)) or ())
    gemm = next((n for n in GEMM_NAMES if fn(n)), None)
    if gemm is not None:
        api = dataclasses.replace(api, gemm_fn=gemm, gemm_params=param_names(fn(gemm)) or ())
    return api


