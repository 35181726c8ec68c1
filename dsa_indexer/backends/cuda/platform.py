"""The NVIDIA platform: sm archs, CUDA devices (not ROCm's HIP devices, which torch also calls "cuda")."""

from __future__ import annotations

import re

import torch

from ...dispatch.environment import module_probe
from ...dispatch.platform import Platform
from ...dispatch.target import Target

ARCHS = ("sm90", "sm100", "sm120")  # what the backends here know; any sm number parses
_NAME = re.compile(r"^sm_?(\d{2,3})[af]?$")


def _parse(name: str) -> Target | None:
    match = _NAME.match(name.lower())
    return Target("cuda", f"sm{match.group(1)}") if match else None


def _visible() -> bool:
    return torch.cuda.is_available() and not torch.version.hip


def _detect(device: torch.device) -> Target | None:
    if device.type != "cuda" or torch.version.hip:
        return None
    props = torch.cuda.get_device_properties(device)
    return Target("cuda", f"sm{props.major}{props.minor}")


def _compile_caches() -> list:
    """This package's nvcc-built kernels and DeepGEMM's JIT: where their first-use compiles land."""
    from . import jit
    from .deepgemm_api import jit_cache_dir

    return [{"name": "dsa_indexer CUDA JIT (nvcc top-k)", "path": str(jit.cache_dir()), "env": jit.CACHE_ENV},
            {"name": "DeepGEMM JIT", "path": jit_cache_dir(), "env": "DG_JIT_CACHE_DIR"}]


def _compile_builds() -> list:
    from . import jit

    return [dict(build) for build in jit.BUILDS]


PLATFORM = Platform(
    vendor="cuda", archs=ARCHS, parse=_parse, detect=_detect, device_visible=_visible, default_device="cuda",
    probes={"deep_gemm": module_probe("deep_gemm", "pip install 'dsa-indexer[cuda]' or build upstream DeepGEMM")},
    libraries={"deep_gemm": "deep_gemm", "flashinfer": "flashinfer"},
    distributions=("deep_gemm", "sgl-deep-gemm", "flashinfer-python"),
    names="a CUDA arch (sm90, sm100, sm120)", compile_caches=_compile_caches, compile_builds=_compile_builds)
