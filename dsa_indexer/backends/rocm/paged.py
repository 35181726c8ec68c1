"""aiter's paged MQA logits as ``paged_mqa_logits`` on AMD, reading this library's 64-token page layout directly.

Read from ROCm/aiter's source (HEAD e4048607, 2026-08; `aiter/ops/triton/attention/pa_mqa_logits.py` and its Triton
kernel `_triton_kernels/attention/pa_mqa_logits.py`): ``deepgemm_fp8_paged_mqa_logits(q_fp8 [B, N, H, D], kv_cache
[blocks, KVBlockSize, 1, D + 4], weights [B*N, H] f32, out_logits [B*N, max_model_len] f32, context_lens [B] i32,
kv_indices [B, max_blocks] i32, max_model_len, Preshuffle=False, KVBlockSize=1, ChunkK=256, ...)`` writes the logits
in place. With ``KVBlockSize=64`` each block is 64 x 128 fp8 values followed by 64 fp32 scales: exactly
``paged64_fp8_e4m3``, so no second cache layout is needed (aiter 0.1.7 read a page-size-1 cache instead; the feature
check below tells them apart by the ``KVBlockSize`` parameter). Its semantics, matched here:

- one length per request: row j of request b sees keys ``t <= context_lens[b] - N + j`` (causal next_n). The
  library's per-row lengths have that form for V3.2 decode, not for C4 entries, so the registration takes next_n 1
  only (speculative rows go to the Triton kernel, with the reason);
- columns past a row's last chunk are not written: the adapter pre-fills the output with -inf (as aiter's tests do).

Two launches, as for the ragged logits: ``"wrapper"`` (aiter's public function: its Gluon kernel on gfx942 / gfx950,
AMD only) and ``"kernel"`` (aiter's plain Triton kernel launched here, with the split over keys computed from this
device's multiprocessor count, which also runs on NVIDIA: the H200 test, behind a test-only shim).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from ...contract.cache import PAGE_SIZE
from .aiter_api import find_function

WRAPPER_MODULES = ("aiter.ops.triton.attention.pa_mqa_logits", "aiter.ops.triton.pa_mqa_logits")
WRAPPER_NAME = "deepgemm_fp8_paged_mqa_logits"
KERNEL_MODULES = ("aiter.ops.triton._triton_kernels.attention.pa_mqa_logits",)
KERNEL_NAME = "_deepgemm_fp8_paged_mqa_logits"
CHUNK_K = 256  # keys per inner step (aiter's default); a multiple of the 64-token page


def _takes_block_size(fn: Any) -> bool:
    """True for the block-level API (a ``KVBlockSize`` parameter): aiter 0.1.7's page-size-1 version has none."""
    names = getattr(fn, "arg_names", None)
    if names is None:
        try:
            names = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            return False
    return "KVBlockSize" in names


def find_wrapper() -> tuple[str, Callable] | None:
    found = find_function(WRAPPER_MODULES, WRAPPER_NAME)
    return found if found is not None and _takes_block_size(found[1]) else None


def find_kernel() -> tuple[str, Any] | None:
    found = find_function(KERNEL_MODULES, KERNEL_NAME)
    return found if found is not None and _takes_block_size(found[1]) else None


def _split_kv(device: torch.device, rows: int) -> int:
    """Programs per query row over the keys, from this device's compute-unit count (aiter's formula, with the
    count read from the device, never one chip's number)."""
    units = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return (max(1, units // max(1, rows)) + 4) // 5 * 5


def make_paged_mqa_logits(launch: str = "wrapper", fn: Any = None) -> Callable[..., torch.Tensor]:
    """``paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len)`` (the reference's
    signature) over aiter's block-level paged kernel."""
    if launch not in ("wrapper", "kernel"):
        raise ValueError(f"launch must be 'wrapper' or 'kernel', got {launch!r}")
    if fn is None:
        found = find_wrapper() if launch == "wrapper" else find_kernel()
        if found is None:
            raise RuntimeError(f"aiter has no block-level {WRAPPER_NAME if launch == 'wrapper' else KERNEL_NAME} "
                               f"(a KVBlockSize parameter) in {', '.join(WRAPPER_MODULES + KERNEL_MODULES)}")
        fn = found[1]

    def paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor,
                         block_table: torch.Tensor, max_context_len: int) -> torch.Tensor:
        b, n, heads, dim = q.shape
        if n != 1:
            raise ValueError("aiter's paged logits derive each row's length from one length per request; this "
                             "adapter takes next_n 1 (the registration routes next_n > 1 elsewhere)")
        out = torch.full((b * n, max_context_len), float("-inf"), dtype=torch.float32, device=q.device)
        lens = context_lens.reshape(b, n)[:, -1].to(torch.int32).contiguous()
        table = block_table.to(torch.int32).contiguous()
        weights_ = weights.float().contiguous()
        if launch == "wrapper":
            fn(q, kv_cache, weights_, out, lens, table, max_context_len, Preshuffle=False, KVBlockSize=PAGE_SIZE,
               ChunkK=CHUNK_K)
            return out
        blocks = kv_cache.view(kv_cache.shape[0], -1)
        values = blocks[:, : PAGE_SIZE * dim].view(q.dtype).view(-1, PAGE_SIZE, dim)
        scales = blocks[:, PAGE_SIZE * dim:].view(torch.float32).view(-1, PAGE_SIZE)
        split = _split_kv(q.device, b * n)
        fn[(b * n * split,)](b, n, heads, q, q.stride(0), q.stride(1), q.stride(2), values, values.stride(0),
                             values.stride(1), scales, scales.stride(0), scales.stride(1), lens, table, weights_,
                             weights_.stride(0), out, out.stride(0), max_context_len, table.shape[1],
                             ChunkQ=heads, ChunkK=CHUNK_K, HiddenDim=dim, KVBlockSize=PAGE_SIZE, SplitKV=split)
        return out

    return paged_mqa_logits
