"""Ragged (prefill) MQA logits through aiter's Triton kernel, with a workaround for its start-alignment bug.

aiter 0.1.7's ``fp8_mqa_logits(Q, KV, kv_scales, weights, cu_starts, cu_ends)`` returns fp32 ``[S, N]`` filled
with -inf outside each row's window, and computes ``kv_scale[n] * sum_h w[s, h] * relu(q[s, h] . k[n])`` inside:
the reference's contract. Its kernel walks a row in 128-column blocks starting at ``cu_starts[s]`` and finishes
with one masked block whose mask is computed from ``cu_ends[s] // 128 * 128`` while its pointers continue from
where the unmasked loop stopped. When ``cu_starts[s]`` is a multiple of 128 the two agree. When it is not:

* the unmasked loop runs past ``cu_ends[s]`` (it stops at the first block start >= the aligned end), storing
  logits beyond the window and reading keys past ``N`` on the last rows (out-of-bounds reads and writes);
* the masked block's window test uses the aligned offsets, so it stores a shifted range: columns after the
  start stay -inf while columns past the end get values.

The adapter avoids the bug without touching the cache or the keys: it passes starts rounded DOWN to a multiple
of 128 (``ks & ~127``), which the kernel handles correctly, and then writes -inf over the at most 127 extra
columns ``[ks & ~127, ks)`` of each row (one small Triton kernel on the GPU; a torch mask on the CPU). The extra
work is at most one 128-column block per row. ``check_ragged_adapter`` (the probe's self-test) and the tests use
starts that are not multiples of 128 so that a regression shows.

Two ways to launch aiter's kernel:

* ``launch="wrapper"`` (the registered path on ROCm): aiter's public ``fp8_mqa_logits``, which adds the AMD
  launch options ``waves_per_eu`` and ``matrix_instr_nonkdim``;
* ``launch="kernel"``: `kernel_launcher` launches aiter's ``_fp8_mqa_logits_kernel`` itself without those
  options, so the same kernel code also runs under Triton for NVIDIA (the H200 test) and in Triton's CPU
  interpreter (CI). It allocates and -inf-fills the output as the wrapper does.

This module never imports ``aiter`` at import time; `find_wrapper` / `find_kernel` import it when called.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from .lookup import find_function

try:  # triton is a dependency of the package; the head mask falls back to torch ops without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None

BLOCK_KV = 128  # aiter's kernel walks keys in blocks of this many columns; starts are aligned to it
# Where each aiter generation keeps the ragged logits wrapper and its kernel (newest layouts moved under attention/).
WRAPPER_MODULES = ("aiter.ops.triton.fp8_mqa_logits", "aiter.ops.triton.attention.fp8_mqa_logits")
WRAPPER_NAME = "fp8_mqa_logits"
KERNEL_MODULES = ("aiter.ops.triton._triton_kernels.fp8_mqa_logits",
                  "aiter.ops.triton._triton_kernels.attention.fp8_mqa_logits")
KERNEL_NAME = "_fp8_mqa_logits_kernel"

RaggedFn = Callable[..., torch.Tensor]


def find_wrapper() -> tuple[str, RaggedFn] | None:
    """aiter's public ragged logits function (imports aiter)."""
    return find_function(WRAPPER_MODULES, WRAPPER_NAME)


def find_kernel() -> tuple[str, Any] | None:
    """aiter's Triton kernel behind the public function (imports aiter's kernel module only)."""
    return find_function(KERNEL_MODULES, KERNEL_NAME)


# ----------------------------------------------------------------------------------------------------------------
# Launching aiter's kernel without the AMD-only options
def kernel_launcher(kernel: Any, num_warps: int = 4, num_stages: int = 2) -> RaggedFn:
    """A function with the signature and output of aiter's ``fp8_mqa_logits`` that launches ``kernel`` (aiter's
    ``_fp8_mqa_logits_kernel``) with portable launch options only. Arguments are passed by the kernel's own
    parameter names, so a renamed parameter fails loudly instead of binding to the wrong slot."""

    def fp8_mqa_logits(q: torch.Tensor, kv: torch.Tensor, kv_scales: torch.Tensor, weights: torch.Tensor,
                       cu_starts: torch.Tensor, cu_ends: torch.Tensor) -> torch.Tensor:
        rows, heads, dim = q.shape
        keys = kv.shape[0]
        logits = torch.full((rows, keys), float("-inf"), dtype=torch.float32, device=q.device)
        if rows == 0 or keys == 0:
            return logits
        kernel[(rows,)](
            Q_ptr=q, KV_ptr=kv, kv_scales_ptr=kv_scales, weights_ptr=weights, cu_start_ptr=cu_starts,
            cu_end_ptr=cu_ends, logits_ptr=logits, seq_len=rows, seq_len_kv=keys, NUM_HEADS=heads, HEAD_SIZE=dim,
            stride_q_s=q.stride(0), stride_q_h=q.stride(1), stride_q_d=q.stride(2),
            stride_kv_s=kv.stride(0), stride_kv_d=kv.stride(1), stride_w_s=weights.stride(0),
            stride_w_h=weights.stride(1), stride_logits_s=logits.stride(0), stride_logits_k=logits.stride(1),
            BLOCK_KV=BLOCK_KV, num_warps=num_warps, num_stages=num_stages)
        return logits

    return fp8_mqa_logits


# ----------------------------------------------------------------------------------------------------------------
# The -inf head mask: columns [lo, hi) of each row, hi - lo < 128
def mask_head_(logits: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, *, use_triton: bool | None = None
               ) -> torch.Tensor:
    """In place: ``logits[r, c] = -inf`` for ``lo[r] <= c < hi[r]``, where ``0 <= hi - lo < 128`` (the shared
    column mask with a narrow span). ``use_triton`` None: the kernel for GPU tensors, a torch mask otherwise."""
    from ..triton.masks import mask_columns_

    if use_triton is None:
        use_triton = logits.device.type != "cpu" and triton is not None
    return mask_columns_(logits, lo, hi, span=BLOCK_KV, use_triton=use_triton)


# ----------------------------------------------------------------------------------------------------------------
# The adapter
def make_ragged_mqa_logits(fp8_mqa_logits: RaggedFn | None = None, *, launch: str = "wrapper") -> RaggedFn:
    """``ragged_mqa_logits`` with the reference's signature and contract, computed by aiter's kernel.

    ``fp8_mqa_logits``: a function with aiter's public signature (default: found in the installed aiter by
    ``launch``: "wrapper" = aiter's own function, "kernel" = `kernel_launcher` over aiter's kernel)."""
    if fp8_mqa_logits is None:
        if launch == "wrapper":
            found = find_wrapper()
            what = f"{WRAPPER_NAME} in {' / '.join(WRAPPER_MODULES)}"
        elif launch == "kernel":
            found = find_kernel()
            found = (found[0], kernel_launcher(found[1])) if found is not None else None
            what = f"{KERNEL_NAME} in {' / '.join(KERNEL_MODULES)}"
        else:
            raise ValueError(f"launch must be 'wrapper' or 'kernel', got {launch!r}")
        if found is None:
            raise RuntimeError(f"aiter has no {what}; the aiter probe should have rejected this implementation")
        fp8_mqa_logits = found[1]
    extra: dict[str, Any] = {}
    try:
        if "clean_logits" in inspect.signature(fp8_mqa_logits).parameters:
            extra["clean_logits"] = True  # newer aiter: -inf outside the window only when asked
    except (TypeError, ValueError):
        pass

    def ragged_mqa_logits(q: torch.Tensor, k: torch.Tensor, k_scales: torch.Tensor, weights: torch.Tensor,
                          ks: torch.Tensor, ke: torch.Tensor) -> torch.Tensor:
        rows, keys = q.shape[0], k.shape[0]
        if rows == 0 or keys == 0:
            return torch.full((rows, keys), float("-inf"), dtype=torch.float32, device=q.device)
        ks = ks.to(torch.int32).contiguous()
        aligned = torch.bitwise_and(ks, -BLOCK_KV)  # ks rounded down to a multiple of 128 (ks >= 0)
        # The kernel indexes scales, starts and ends with unit stride.
        logits = fp8_mqa_logits(q, k, k_scales.contiguous(), weights, aligned, ke.to(torch.int32).contiguous(),
                                **extra)
        return mask_head_(logits, aligned, ks)

    return ragged_mqa_logits


# ----------------------------------------------------------------------------------------------------------------
# Self-test (run by the aiter probe on the real device; also used by the tests)
def check_ragged_adapter(fn: RaggedFn, device: torch.device | str, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                         heads: int = 64, seed: int = 11) -> None:
    """Compare ``fn`` with the reference on small random inputs whose starts are mostly not multiples of 128
    (the shapes that trigger aiter's alignment bug without the workaround). Raises AssertionError naming the
    first difference. Tolerance: 2e-3 x the row's largest |logit| (fp8 MMA accumulation order and precision)."""
    from ..reference import kernels as ref

    gen = torch.Generator().manual_seed(seed)
    rows, keys, dim = 24, 520, 128
    fmax = ref.fp8_max(fp8_dtype)
    q = (torch.randn(rows, heads, dim, generator=gen) * fmax / 8).to(fp8_dtype)
    k = (torch.randn(keys, dim, generator=gen) * fmax / 8).to(fp8_dtype)
    scales = torch.rand(keys, generator=gen) * 1e-3 + 1e-4
    weights = torch.randn(rows, heads, generator=gen)
    ks = torch.randint(0, keys, (rows,), generator=gen, dtype=torch.int32)
    ks[:4] = torch.tensor([0, 128, 256, 384], dtype=torch.int32)  # aligned rows stay right too
    ke = torch.minimum(ks + torch.randint(0, 300, (rows,), generator=gen, dtype=torch.int32),
                       torch.tensor(keys, dtype=torch.int32))
    args = [t.to(device) for t in (q, k, scales, weights, ks, ke)]
    want = ref.ragged_mqa_logits(*[a.cpu() for a in args])
    got = fn(*args).cpu()
    assert got.shape == want.shape and got.dtype == torch.float32, f"shape/dtype {tuple(got.shape)} {got.dtype}"
    visible = torch.isfinite(want)
    bad_mask = torch.isneginf(got) != ~visible
    if bool(bad_mask.any()):
        row = int(bad_mask.any(dim=1).nonzero()[0])
        raise AssertionError(f"row {row} (ks={int(ks[row])}, ke={int(ke[row])}): -inf pattern differs from the "
                             f"window at columns {bad_mask[row].nonzero().flatten()[:8].tolist()}")
    row_max = torch.where(visible, want.abs(), torch.zeros_like(want)).amax(dim=1, keepdim=True)
    err = torch.where(visible, (got - want).abs(), torch.zeros_like(want))
    if not bool((err <= 2e-3 * row_max + 1e-30).all()):
        raise AssertionError(f"max logit error {float(err.max()):.3g} (row max {float(row_max.max()):.3g})")
