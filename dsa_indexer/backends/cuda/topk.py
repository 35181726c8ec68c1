"""The CUDA top-k (``csrc/topk.cu``): its launch plan, the adapter with the reference's signature, the self-test.

Launch plan (a pure function of the shapes and the device, so a call can be captured in a CUDA graph):
one cluster of ``C`` CTAs per row, 1024 threads each, the row's keys held in shared memory (at most
`CHUNK_TARGET` columns per CTA, so rows up to 32K columns take one CTA). When rows are few and long, ``C`` grows
(up to 8) while every CTA keeps >= 16K columns, so one 128K-column row still spreads over 8 SMs. Rows too wide
for 8 CTAs (over about 360K columns) are handed to the Triton top-k, which takes any width.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import jit

SOURCE = "topk.cu"
THREADS = 1024
MAX_CLUSTER = 8
CHUNK_TARGET = 32768  # columns per CTA before the row is split over more CTAs
MAX_CHUNK = 44 * 1024  # columns per CTA that fit the 227 KB opt-in shared memory beside the histograms
MIN_CHUNK = 16384  # a CTA gets at least this many columns when C grows (cluster barriers cost more below)
MAX_GRID_ROWS = 65535
SMEM_OPTIN_FALLBACK = 227 * 1024  # sm90 / sm100 opt-in shared memory per block


@functools.lru_cache(maxsize=None)
def _device_facts(index: int) -> tuple[int, int, tuple[int, int]]:
    props = torch.cuda.get_device_properties(index)
    optin = getattr(props, "shared_memory_per_block_optin", 0) or SMEM_OPTIN_FALLBACK
    return props.multi_processor_count, int(optin), (props.major, props.minor)


@functools.lru_cache(maxsize=None)
def _library(capability: tuple[int, int]) -> ctypes.CDLL:
    lib = jit.load(SOURCE, capability)
    lib.dsa_topk_launch.restype = ctypes.c_int
    lib.dsa_topk_launch.argtypes = [
        ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.dsa_topk_smem_bytes.restype = ctypes.c_longlong
    lib.dsa_topk_smem_bytes.argtypes = [ctypes.c_int]
    lib.dsa_topk_error_string.restype = ctypes.c_char_p
    lib.dsa_topk_error_string.argtypes = [ctypes.c_int]
    return lib


def plan(rows: int, cols: int, sms: int, vec: int) -> tuple[int, int] | None:
    """(CTAs per row, key capacity per CTA) for rows of ``cols`` columns; None when 8 CTAs cannot hold a row."""
    step = 32 * vec
    steps = -(-(cols + vec - 1) // step)  # the window may start mid-vector: up to vec - 1 extra columns
    # Sized from the columns, not the rounded steps: a CTA may hold one step more than CHUNK_TARGET (its
    # shared memory still fits), which keeps 32K-column rows on one CTA and 128K on four.
    cluster = max(1, -(-cols // CHUNK_TARGET))
    while cluster * 2 <= MAX_CLUSTER and rows * cluster * 2 <= sms and cols // (cluster * 2) >= MIN_CHUNK:
        cluster *= 2
    cluster = min(cluster, MAX_CLUSTER)  # past 8 x 32K columns, CTAs hold more (up to MAX_CHUNK each)
    chunk = -(-steps // cluster) * step
    return None if chunk > MAX_CHUNK else (cluster, chunk)


def _fits(lib: ctypes.CDLL, chunk_cols: int, optin: int) -> bool:
    return lib.dsa_topk_smem_bytes(chunk_cols) <= optin


def topk_indices(logits: torch.Tensor, k: int, ends: torch.Tensor, starts: torch.Tensor | None = None,
                 block_table: torch.Tensor | None = None, row_request: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [R, k]: the k largest of each row within [starts, ends), ties to the lower column; the keys above
    the k-th value in column order, then the lowest columns equal to it. Same signature as the reference."""
    rows, cols = logits.shape
    device = logits.device
    out = torch.empty((rows, k), dtype=torch.int32, device=device)
    if rows == 0:
        return out
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    x = x if x.dtype == torch.float32 else x.float()
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms, optin, capability = _device_facts(index)
    vec = 4 if x.data_ptr() % 16 == 0 and x.stride(0) % 4 == 0 else 1
    lib = _library(capability)
    launch = plan(rows, max(cols, 1), sms, vec)
    if launch is None or not _fits(lib, launch[1], optin):
        from ..triton.topk import topk_indices as wide_rows  # any width; the op's contract is the same

        return wide_rows(logits, k, ends, starts, block_table, row_request)
    cluster, chunk_cols = launch
    ends = ends.contiguous()
    starts = starts.contiguous() if starts is not None else None
    bt = None
    if block_table is not None:
        bt = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    req = row_request.contiguous() if row_request is not None else None
    stream = torch.cuda.current_stream(device).cuda_stream
    err = lib.dsa_topk_launch(
        x.data_ptr(), x.stride(0), rows, cols, k, starts.data_ptr() if starts is not None else None,
        ends.data_ptr(), bt.data_ptr() if bt is not None else None, bt.stride(0) if bt is not None else 0,
        req.data_ptr() if req is not None else None, out.data_ptr(), cluster, vec, chunk_cols, MAX_GRID_ROWS,
        stream)
    if err != 0:
        raise RuntimeError(f"dsa_indexer CUDA top-k launch failed: {lib.dsa_topk_error_string(err).decode()} "
                           f"(rows={rows}, cols={cols}, k={k}, cluster={cluster}, chunk={chunk_cols})")
    return out


def _self_test_cases(device: torch.device):
    """Small rows that exercise every branch: random, heavy ties at the k-th value, NaN / -inf, windows with
    starts, short rows, a row split over a cluster, the slot transform."""
    gen = torch.Generator().manual_seed(4321)
    k = 64
    rows = torch.randn(6, 3000, generator=gen)
    rows[1] = torch.randint(0, 4, (3000,), generator=gen).float()  # massive ties
    rows[2, ::7] = float("nan")
    rows[3, ::5] = float("-inf")
    rows[4] = 1.0  # all equal
    ends = torch.tensor([3000, 2999, 2500, 3000, 3000, 40], dtype=torch.int32)
    starts = torch.tensor([0, 3, 17, 1000, 0, 0], dtype=torch.int32)
    yield rows.to(device), k, ends.to(device), starts.to(device), None, None
    long_row = torch.randn(2, 70000, generator=gen)  # 3 CTAs per row
    yield long_row.to(device), 2048, torch.tensor([70000, 65001], dtype=torch.int32, device=device), None, None, None
    table = torch.randperm(64, generator=gen).to(torch.int32).view(2, 32)
    yield (torch.randn(2, 2048, generator=gen).to(device), 100, torch.tensor([2048, 90], dtype=torch.int32,
                                                                             device=device), None, table.to(device),
           None)


def self_test(device: torch.device) -> None:
    """Compare with the reference on `_self_test_cases`; raise RuntimeError naming the first difference."""
    from ..reference import kernels as ref

    for n, (logits, k, ends, starts, table, req) in enumerate(_self_test_cases(device)):
        got = topk_indices(logits, k, ends, starts, table, req)
        want = ref.topk_indices(logits, k, ends, starts, table, req)
        got_sets = torch.sort(got, dim=1).values
        want_sets = torch.sort(want, dim=1).values
        if not torch.equal(got_sets, want_sets):
            bad = int((got_sets != want_sets).any(dim=1).nonzero()[0, 0])
            raise RuntimeError(f"CUDA top-k self-test case {n}: row {bad} differs from the reference")


def probe() -> str | None:
    """None when the kernel builds (or is cached) for this GPU and passes its self-test, else the reason."""
    if torch.version.hip:
        return "the CUDA C++ top-k is NVIDIA-only and this torch is a ROCm build"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    if torch.cuda.is_current_stream_capturing():
        return ("the CUDA top-k was first resolved inside CUDA-graph capture, where it cannot be built and "
                "self-tested; run the step once eagerly before capturing")
    major, _ = torch.cuda.get_device_capability()
    if major not in (9, 10):
        return f"the CUDA top-k uses thread-block clusters tuned for sm90 / sm100; this GPU is sm{major}x"
    try:
        _library(torch.cuda.get_device_capability())
    except jit.CudaBuildError as exc:
        return f"CUDA top-k kernel not built: {exc}"
    except OSError as exc:
        return f"CUDA top-k kernel built but failed to load: {exc}"
    try:
        self_test(torch.device("cuda", torch.cuda.current_device()))
    except Exception as exc:  # noqa: BLE001 - every failure becomes the reason
        return f"CUDA top-k self-test failed: {type(exc).__name__}: {exc}"
    return None
