"""Programmatic dependent launch (PDL) of the step's Triton kernels on NVIDIA Hopper and later: opt-in.

In a decode step at small batch each kernel is latency bound (3-7 us for under 1 us of traffic in issue 38's
profile), and part of that is the gap between one kernel's last program and the next kernel's first. With PDL
(CUDA's programmatic stream serialization, Triton's ``launch_pdl``) the next kernel of a stream is launched while
its predecessor drains. Each kernel taking part starts with `wait_for_predecessor`: PTX ``griddepcontrol.wait``,
which returns once every grid it depends on has completed and its writes are visible, then
``griddepcontrol.launch_dependents``, which lets the next kernel launch in turn. The wait is the first statement,
before any load or store, so no kernel reads its predecessor's output early or overwrites what the predecessor
still reads: results are bit-identical with PDL on or off. The CUDA top-k reads the same decision
(`backends/cuda/topk.py` then launches its ``DSA_PDL=1`` builds, `csrc/cluster_launch.cuh`). A kernel launched
without PDL (torch's, cuBLAS's) waits for its predecessor in full, as always. DeepGEMM's kernels wait for their
predecessor themselves; the DeepGEMM adapters launch them with PDL on through DeepGEMM's own ``set_pdl``
(`backends/cuda/deepgemm_kernels.launching_with_pdl`).

``DSA_INDEXER_PDL=1`` turns it on. It is off by default because it has not yet been timed (issue 38). The choice
is made once per device, at that device's first launch: PDL is used only on a CUDA device (not ROCm) of compute
capability 9.0 or later, and never in the Triton interpreter.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ...envflags import env_flag

PDL_ENV = "DSA_INDEXER_PDL"
_LAUNCH_WITH_PDL = {"PDL": True, "launch_pdl": True}
_decided: dict[torch.device, dict] = {}


def pdl_options(device: torch.device) -> dict:
    """The launch keywords for a kernel on ``device``: ``{}`` (its ``PDL`` constexpr keeps its default, False: the
    same compiled kernel and launch as without this module) or the PDL constexpr and Triton's ``launch_pdl``."""
    options = _decided.get(device)
    if options is None:
        options = _decided[device] = _LAUNCH_WITH_PDL if uses_pdl(device) else {}
    return options


def uses_pdl(device: torch.device) -> bool:
    """Whether launches on ``device`` use PDL (see the module docstring; reads ``DSA_INDEXER_PDL`` now)."""
    if device.type != "cuda" or torch.version.hip or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if not env_flag(PDL_ENV):
        return False
    if not triton_has_pdl():
        raise RuntimeError(f"{PDL_ENV}=1 needs a Triton with programmatic dependent launch (the launch option "
                           f"launch_pdl and triton.language.extra.cuda.gdc_wait); this is Triton "
                           f"{triton.__version__}: upgrade Triton or unset {PDL_ENV}")
    return torch.cuda.get_device_capability(device)[0] >= 9


def triton_has_pdl() -> bool:
    """Whether this Triton can launch with PDL: its NVIDIA options know ``launch_pdl`` and its language has the
    grid dependency control."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # a Triton without its NVIDIA backend
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {}) and hasattr(tl.extra.cuda, "gdc_wait")


def forget_decisions() -> None:
    """Decide again at each device's next launch (tests that set ``DSA_INDEXER_PDL``)."""
    _decided.clear()


@triton.jit
def wait_for_predecessor(PDL: tl.constexpr):
    """A PDL kernel's first statement: wait for the grids this one depends on, then let dependents launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
