"""Compile this backend's CUDA C++ kernels at first use and cache the shared libraries on disk.

The kernels in ``csrc/`` are plain CUDA (no torch headers, no pybind): nvcc builds each into a small shared
library in a few seconds, which is loaded with ctypes and called with raw device pointers and the current
stream (`dsa_indexer.backends.cuda.topk`). So the build needs nvcc and a host compiler only, not torch's
extension toolchain or ninja, and the library does not depend on torch's C++ ABI.

Cache: ``$DSA_INDEXER_CACHE_DIR`` (default ``~/.cache/dsa_indexer``) ``/cuda/<name>-sm<arch>-<hash>.so``; the hash
covers the source text, csrc/'s headers (``*.cuh``), the flags and nvcc's version, so an edited kernel or header or
another toolkit rebuilds. A build writes to a temporary file and renames it into place, so concurrent processes never
load a half-written file.

Knobs: ``CUDA_HOME`` / ``CUDA_PATH`` (where nvcc lives; else ``nvcc`` on PATH, else /usr/local/cuda),
``DSA_INDEXER_CCBIN`` (nvcc's host compiler, ``-ccbin``), ``DSA_INDEXER_CACHE_DIR``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from ...dispatch.vendor import VendorLibrary

CACHE_ENV = "DSA_INDEXER_CACHE_DIR"
CCBIN_ENV = "DSA_INDEXER_CCBIN"
CSRC = Path(__file__).resolve().parent / "csrc"
NVCC_FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-cudart", "shared", "--expt-relaxed-constexpr")
BUILD_TIMEOUT_S = 600

_lock = threading.Lock()
_loaded: dict[tuple[str, str], ctypes.CDLL] = {}
# What this process compiled ({"source", "seconds", "path"}), in order: `dsa-indexer run` names first-use builds.
BUILDS: list[dict] = []


class CudaBuildError(RuntimeError):
    """nvcc is missing or failed; the message says which and holds the compiler's last lines."""


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "dsa_indexer")
    return Path(root) / "cuda"


def find_nvcc() -> str | None:
    """The nvcc to build with: CUDA_HOME / CUDA_PATH first, then PATH, then /usr/local/cuda; None if none."""
    for env in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(env)
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = "/usr/local/cuda/bin/nvcc"
    return default if os.access(default, os.X_OK) else None


def nvcc_version(nvcc: str) -> str:
    try:
        text = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise CudaBuildError(f"{nvcc} --version failed: {exc}") from exc
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if not lines:
        raise CudaBuildError(f"{nvcc} --version printed nothing")
    return lines[-1]


def arch_flags(capability: tuple[int, int]) -> list[str]:
    major, minor = capability
    return [f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"]


def build(source: str, capability: tuple[int, int], defines: tuple[str, ...] = ()) -> Path:
    """Compile ``csrc/<source>`` for ``capability`` unless the cache has it; returns the library's path.
    ``defines``: ``NAME=VALUE`` macros of a compile-time variant (a benchmark compares builds in one process); each
    variant is its own cached library."""
    src = CSRC / source
    for define in defines:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(=[A-Za-z0-9_.+-]*)?", define):
            raise ValueError(f"defines: {define!r} is not NAME or NAME=VALUE")
    nvcc = find_nvcc()
    if nvcc is None:
        raise CudaBuildError("no nvcc found (set CUDA_HOME or put the CUDA toolkit's nvcc on PATH)")
    version = nvcc_version(nvcc)
    flags = list(NVCC_FLAGS) + arch_flags(capability) + [f"-D{define}" for define in defines]
    ccbin = os.environ.get(CCBIN_ENV)
    if ccbin:
        flags += ["-ccbin", ccbin]
    headers = b"".join(h.name.encode() + b"\0" + h.read_bytes() for h in sorted(CSRC.glob("*.cuh")))
    digest = hashlib.sha256(src.read_bytes() + headers + "\0".join(flags + [version]).encode()).hexdigest()[:16]
    major, minor = capability
    out = cache_dir() / f"{src.stem}-sm{major}{minor}-{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.stem}.{os.getpid()}.{threading.get_ident()}.tmp.so")
    cmd = [nvcc, *flags, "-o", str(tmp), str(src)]
    started = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        raise CudaBuildError(f"running nvcc failed: {exc}") from exc
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-12:])
        raise CudaBuildError(f"nvcc failed (exit {done.returncode}) building {source}:\n{tail}")
    os.replace(tmp, out)
    BUILDS.append({"source": source, "seconds": time.perf_counter() - started, "path": str(out)})
    return out


def load(source: str, capability: tuple[int, int], defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The loaded library of ``csrc/<source>`` for ``capability`` (and ``defines``, see `build`), built on first
    use, once per process."""
    key = (source, f"{capability[0]}{capability[1]}", tuple(defines))
    lib = _loaded.get(key)
    if lib is None:
        with _lock:
            lib = _loaded.get(key)
            if lib is None:
                lib = ctypes.CDLL(str(build(source, capability, tuple(defines))))
                _loaded[key] = lib
    return lib


def kernel_library(name: str, load: Callable[[tuple[int, int]], object], self_test: Callable[[torch.device], None],
                   needs: str) -> VendorLibrary:
    """The probe of one of this backend's nvcc-built kernels, on the one vendor-library path (`VendorLibrary`):
    an NVIDIA sm90 / sm100 GPU -> ``load(capability)`` (builds at first use, else the cached library) -> the
    kernel's ``self_test(device)`` against the reference -> a cached verdict. ``needs`` says why those archs."""

    def device_check() -> str | None:
        if torch.version.hip:
            return f"{name} is NVIDIA-only and this torch is a ROCm build"
        if not torch.cuda.is_available():
            return "torch sees no CUDA device"
        major, _ = torch.cuda.get_device_capability()
        if major not in (9, 10):
            return f"{name} uses {needs} (sm90 / sm100); this GPU is sm{major}x"
        return None

    def run_self_test(library, api, device: torch.device):
        self_test(device)
        return api

    return VendorLibrary(module=name, install_hint="built from this package's csrc/ with nvcc at first use",
                         device_check=device_check, load=lambda: load(torch.cuda.get_device_capability()),
                         self_test=run_self_test, describe=lambda api: f"{name} (nvcc-built, cached in {cache_dir()})")
