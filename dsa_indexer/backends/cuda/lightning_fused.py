"""``lightning_indexer`` in one CUDA kernel (``csrc/lightning_decode.cu``): paged fp8 logits and the exact top-k
per row, the logits kept in shared memory (no [B * next_n, context] logits in global memory, one launch, no
schedule metadata).

A row is split over a thread-block cluster of up to 8 CTAs (`plan`): enough CTAs to fill the GPU when rows are
few, at most 32K columns per CTA (its shared memory holds the chunk's keys). The plan depends on the row count,
``max_context_len`` and the device only, so a call can be captured in a CUDA graph. Limits (clear errors, not
silent fallbacks): 64 heads, head dim 128, float8_e4m3fn, ``max_context_len`` <= 8 x 32K columns.

The kernel is built by `jit.py` (nvcc, cached on disk) and self-tested against the reference when its factory
runs (`probe`).

Status (H200, issue 23, benchmarks/results/decode_step_h200.json): correct, but 2.3-10x slower than DeepGEMM's
paged logits + the CUDA top-k, so it is registered opt-in (priority -1). Why: sm90 has no fp8 ``mma.sync``
(ptxas emulates it: F2FP conversions + f16 HMMA, about 240 TFLOP/s), so the logits are compute-bound (128 x 8K:
~120 us vs DeepGEMM's wgmma kernel 47 us); the three-level cluster select costs ~20 us (1 x 8K: 40 us in all,
logits 19). A competitive single kernel needs wgmma logits (DeepGEMM's structure) with the select in its epilogue.
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch

from ...contract.cache import PAGE_SIZE
from ...contract.validate import IndexerInputError
from . import jit

SOURCE = "lightning_decode.cu"
HEADS = 64
HEAD_DIM = 128
MAX_CLUSTER = 8
CHUNK_TARGET = 32768  # columns per CTA before a row takes more CTAs
MAX_CHUNK = 32 * 1024  # columns per CTA that fit the opt-in shared memory beside the histograms and stages
MIN_CHUNK = 512  # a CTA keeps at least this many columns when CTAs are added to fill the GPU
MAX_CONTEXT = MAX_CLUSTER * MAX_CHUNK


class Plan(NamedTuple):
    cluster: int  # CTAs per row
    chunk: int  # columns per CTA (a multiple of the 64-token page)


@functools.lru_cache(maxsize=4096)
def plan(rows: int, max_context_len: int, sms: int) -> Plan:
    """The fewest CTAs per row that hold ``max_context_len`` columns at <= 32K each, doubled while the grid still
    fits one CTA per SM and each CTA keeps >= 512 columns."""
    width = max(int(max_context_len), 1)
    if width > MAX_CONTEXT:
        raise IndexerInputError(f"max_context_len={width}: lightning_indexer.cuda.fused holds at most {MAX_CONTEXT} "
                                "columns per row (8 CTAs x 32K); use lightning_indexer.cuda.deepgemm_radix")
    cluster = 1
    while cluster * CHUNK_TARGET < width and cluster < MAX_CLUSTER:
        cluster *= 2
    while cluster * 2 <= MAX_CLUSTER and rows * cluster * 2 <= sms and width // (cluster * 2) >= MIN_CHUNK:
        cluster *= 2
    pages = -(-width // PAGE_SIZE)
    chunk = -(-pages // cluster) * PAGE_SIZE
    return Plan(cluster, chunk)


@functools.lru_cache(maxsize=None)
def _device_facts(index: int) -> tuple[int, tuple[int, int]]:
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, (props.major, props.minor)


@functools.lru_cache(maxsize=None)
def _library(capability: tuple[int, int]) -> ctypes.CDLL:
    lib = jit.load(SOURCE, capability)
    lib.dsa_lightning_decode_launch.restype = ctypes.c_int
    lib.dsa_lightning_decode_launch.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong,
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p]
    lib.dsa_lightning_decode_smem_bytes.restype = ctypes.c_longlong
    lib.dsa_lightning_decode_smem_bytes.argtypes = [ctypes.c_int]
    lib.dsa_lightning_decode_error_string.restype = ctypes.c_char_p
    lib.dsa_lightning_decode_error_string.argtypes = [ctypes.c_int]
    return lib


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous with a 16-byte aligned base (the kernel loads 16-byte vectors)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def run(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor,
        block_table: torch.Tensor, max_context_len: int, k: int, return_slots: bool = False,
        out: torch.Tensor | None = None, logits_out: torch.Tensor | None = None,
        forced: Plan | None = None) -> torch.Tensor:
    """The kernel with the reference's arguments; ``out`` (int32 [B * next_n, k]) to write into, ``logits_out``
    (fp32 [B * next_n, >= max_context_len]) to receive the kernel's own logits of the visible columns (tests: the
    reference top-k over them must equal the kernel's), ``forced`` a launch plan (tests)."""
    batch, next_n, heads, dim = q.shape
    if heads != HEADS or dim != HEAD_DIM:
        raise IndexerInputError(f"q has {heads} heads x {dim}: lightning_indexer.cuda.fused takes {HEADS} x "
                                f"{HEAD_DIM}; use lightning_indexer.cuda.deepgemm_radix or the reference")
    if q.dtype != torch.float8_e4m3fn:
        raise IndexerInputError(f"q dtype {q.dtype}: lightning_indexer.cuda.fused takes float8_e4m3fn")
    rows = batch * next_n
    if out is None:
        out = torch.empty((rows, k), dtype=torch.int32, device=q.device)
    if rows == 0:
        return out
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    sms, capability = _device_facts(index)
    launch = forced or plan(rows, int(max_context_len), sms)
    lib = _library(capability)
    qc = _aligned(q)
    w = weights.reshape(rows, heads)
    w = w if w.dtype == torch.float32 and w.is_contiguous() else w.float().contiguous()
    lens = context_lens.reshape(rows)
    lens = lens if lens.dtype == torch.int32 and lens.is_contiguous() else lens.to(torch.int32).contiguous()
    table = block_table if block_table.dtype == torch.int32 and block_table.stride(-1) == 1 else \
        block_table.to(torch.int32).contiguous()
    stream = torch.cuda.current_stream(q.device).cuda_stream
    err = lib.dsa_lightning_decode_launch(
        qc.data_ptr(), kv_cache.data_ptr(), w.data_ptr(), lens.data_ptr(), table.data_ptr(), table.stride(0), rows,
        next_n, int(max_context_len), int(k), launch.chunk, launch.cluster, int(bool(return_slots)), out.data_ptr(),
        logits_out.data_ptr() if logits_out is not None else None,
        logits_out.stride(0) if logits_out is not None else 0, stream)
    if err != 0:
        raise RuntimeError(f"lightning_indexer.cuda.fused launch failed: "
                           f"{lib.dsa_lightning_decode_error_string(err).decode()} (rows={rows}, "
                           f"max_context_len={max_context_len}, k={k}, plan={launch})")
    return out


def lightning_indexer(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor,
                      block_table: torch.Tensor, max_context_len: int, k: int, return_slots: bool = False, *,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [B * next_n, k]: the reference's `lightning_indexer`, in one kernel (writing ``out`` if given)."""
    return run(q, kv_cache, weights, context_lens, block_table, max_context_len, k, return_slots, out=out)


def _self_test_case(device: torch.device, next_n: int, seed: int):
    from ...contract.cache import page_views

    gen = torch.Generator(device="cpu").manual_seed(seed)
    batch, width = 3, 5000
    lens = torch.tensor([[4990], [1500], [0]], dtype=torch.int32)
    if next_n == 2:
        lens = torch.cat([lens - 1, lens], dim=1).clamp_min(0)
    pages = -(-width // PAGE_SIZE)
    cache = torch.zeros(batch * pages + 3, PAGE_SIZE, 1, 132, dtype=torch.uint8)
    keys, scales = page_views(cache)
    keys.copy_((torch.randn(keys.shape, generator=gen) * 4).to(torch.float8_e4m3fn))
    scales.copy_(torch.rand(scales.shape, generator=gen) + 0.5)
    table = torch.randperm(batch * pages + 3, generator=gen)[:batch * pages].to(torch.int32).view(batch, pages)
    q = (torch.randn(batch, next_n, HEADS, HEAD_DIM, generator=gen) * 4).to(torch.float8_e4m3fn)
    weights = torch.randn(batch * next_n, HEADS, generator=gen)
    return [t.to(device) for t in (q, cache, weights, lens, table)] + [width]


def self_test(device: torch.device) -> None:
    """The kernel's top-k equals the reference top-k over the kernel's own logits (exact), its logits are within
    2e-3 of the reference's (fp8 MMA sums), and every output element is written; next_n 1 and 2, a row at 0
    keys, a row with fewer keys than k, slots. Raises RuntimeError naming the first failure."""
    from ..reference import kernels as ref

    for next_n, k in ((1, 2048), (2, 512)):
        q, cache, weights, lens, table, width = _self_test_case(device, next_n, seed=11 + next_n)
        rows = q.shape[0] * next_n
        for slots in (False, True):
            out = torch.full((rows, k), -7, dtype=torch.int32, device=device)
            logits = torch.full((rows, width), float("nan"), dtype=torch.float32, device=device)
            run(q, cache, weights, lens, table, width, k, slots, out=out, logits_out=logits)
            want_logits = ref.paged_mqa_logits(q, cache, weights, lens, table, width)
            visible = torch.isfinite(want_logits)
            scale = float(want_logits[visible].abs().max()) if bool(visible.any()) else 1.0
            diff = float((logits[visible] - want_logits[visible]).abs().max()) if bool(visible.any()) else 0.0
            if not diff <= 2e-3 * scale:
                raise RuntimeError(f"fused lightning self-test (next_n={next_n}): logits differ from the reference "
                                   f"by {diff:.3g} (max |ref| {scale:.3g})")
            own = torch.where(visible, logits, torch.full_like(logits, float("-inf")))
            req = ref.decode_row_requests(q.shape[0], next_n, device) if slots else None
            want = ref.topk_indices(own, k, lens.reshape(-1), None, table if slots else None, req)
            if not torch.equal(out.sort(dim=1).values, want.sort(dim=1).values):
                bad = int((out.sort(dim=1).values != want.sort(dim=1).values).any(dim=1).nonzero()[0, 0])
                raise RuntimeError(f"fused lightning self-test (next_n={next_n}, slots={slots}): row {bad} differs "
                                   "from the reference top-k over the kernel's own logits")


LIBRARY = jit.kernel_library("the fused CUDA lightning indexer", _library, lambda device: self_test(device),
                             needs="fp8 mma.sync and clusters")


def probe() -> str | None:
    """None when the kernel builds (or is cached) for this GPU and passes its self-test, else the reason."""
    return LIBRARY.probe()
