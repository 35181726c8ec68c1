"""The CUDA top-k: its launch plans, the adapter with the reference's signature, the self-test.

Four kernels, chosen by a plan that is a pure function of the shapes and the device (so a call can be captured
in a CUDA graph, and the plan is computed once per shape: `plan_for` is cached, so every layer of a decode step
shares one plan and pays a dictionary look-up for it). The launch's width is only a bound: engines pad decode logits
to max_model_len. So inside the register and streaming kernels each row is routed on the device by its own window
(read from ``ends`` / ``starts`` at every call, graph replays included): a row that one 512-thread CTA holds in
registers (up to 16K columns) is selected by one CTA alone, whatever the launch's cluster; only longer rows pay the
cluster's barriers or the streaming passes (`registers_grid_rows` packs several rows per cluster for that):

- ``csrc/topk_registers.cu`` for rows up to 16 x 16K columns: 512-thread CTAs, each holding a chunk of
  4K / 8K / 16K columns in registers (8 / 16 / 32 keys per thread); a row longer than one chunk is split over a
  thread-block cluster of up to 16 CTAs (`register_plan`);
- the streaming kernel in ``csrc/topk_registers.cu`` for many long rows (more than 32K columns, up to 256K), where
  the register kernel would need more than two waves of CTAs (128 x 128K): one 512-thread CTA per row
  reads the row once, keeps the keys above a threshold estimated from a sample, and selects among those (the
  whole row when the sample misled it: exact either way); launched with a cluster of 2 / 4 / 8 CTAs per row (the
  split pass, `stream_cluster`), the cluster's CTAs share a long row's pass and CTA 0 selects;
- the prefill kernel in ``csrc/topk_registers.cu`` for a prefill chunk's rows (thousands of rows of 4K to 16M
  columns): the streaming kernel's sample, pass and select in 256-thread CTAs, three per SM, each looping over rows,
  so one row's select (a chain of block barriers) overlaps other rows' passes over their columns; its output order
  is fixed by block scans, not a bitmap, so any width fits;
- ``csrc/topk.cu`` for wider rows: 1024-thread CTAs holding up to 44K columns each in shared memory, a cluster of
  up to 8 per row (`plan`). Rows too wide for that too (over about 360K columns) go to the Triton top-k, which
  takes any width.
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch

from ..triton.pdl import pdl_options
from . import jit

SOURCE = "topk.cu"
REGISTERS_SOURCE = "topk_registers.cu"
THREADS = 1024
MAX_CLUSTER = 8
CHUNK_TARGET = 32768  # columns per CTA before the row is split over more CTAs
MAX_CHUNK = 44 * 1024  # columns per CTA that fit the 227 KB opt-in shared memory beside the histograms
MIN_CHUNK = 16384  # a CTA gets at least this many columns when C grows (cluster barriers cost more below)
MAX_GRID_ROWS = 65535
SMEM_OPTIN_FALLBACK = 227 * 1024  # sm90 / sm100 opt-in shared memory per block
REGISTERS_THREADS = 512
REGISTERS_KEYS = (8, 16, 32)  # keys per thread the register kernel is built for
REGISTERS_CTAS_PER_SM = 2  # 512 threads x 64 registers: two CTAs share an SM
REGISTERS_MAX_CLUSTER = 16  # the register kernel's clusters may be non-portable (16 CTAs: sm90 / sm100)
STREAM_MIN_COLS = 32768  # the streaming kernel serves longer rows only (shorter ones fit the register kernel's wave)
STREAM_MAX_COLS = 1 << 18  # its shared bitmap of selected columns holds this many
STREAM_AFTER_WAVES = 2  # the streaming kernel takes rows whose register launch needs more waves than this
# Decode rows of at most 16K columns, one CTA per row: the streaming kernel selects each in registers with the fewest
# keys per thread that hold it, which beat the register kernel's 2-CTA clusters (H200, benchmarks/results/
# topk_routing_h200.json, us: 32 / 64 / 128 x 8K 12.1 / 12.5 / 13.1 vs 12.7 / 12.9 / 13.7; V4's k = 512 at 1 / 32 x 2K
# 7.2 / 7.2 vs 7.6 / 8.1); since its rows' first columns are prefetched to L2 before their lengths arrive, one row of
# 8K too (9.4 vs 10.3; topk_stream_pass_h200.json).
SHORT_ROWS_MAX_COLS = 16384
# From 32 rows of more than 64K columns the streaming kernel (one CTA reading each row once) beats the register
# kernel's clusters since its pass is no longer instruction-bound (topk_stream_pass_h200.json, us: 32 / 64 x 128K
# 32.7 / 35.4 vs 36.6 / 58.2); at one row of 128K the 16-CTA cluster wins (14.7 vs 29.4: one SM reads a row at
# ~40 GB/s), at 32 x 32K 4-CTA clusters (17.9 vs 22.1).
LONG_ROWS_STREAM_MIN_COLS = 65536
LONG_ROWS_STREAM_MIN_ROWS = 32
# V4's k = 512 on compressed-key rows: from 64 rows of 32K columns or more the streaming kernel beats the 2-CTA
# register clusters (its candidates are fewer at k = 512; topk_engines_s10_h200.json, us: 64 / 128 x 32K 19.1 / 21.6
# vs 20.4 / 24.6; at k = 2048 the clusters stay ahead or even: 20.4 / 25.2 vs 22.9 / 25.3).
SMALL_K_STREAM_MAX_K = 512
SMALL_K_STREAM_MIN_ROWS = 64
# At any k, from 128 rows of 32K columns or more: since the sample reads whole lines, the streaming kernel beats the
# register kernel's 2-CTA clusters there (H100, one process, topk_engines_sample_runs_s18_h100.json, us: 128 x 32K
# 25.6 vs 28.3; at 64 x 32K they are even, 23.7 vs 23.1).
MANY_ROWS_STREAM_MIN_ROWS = 128
# The streaming kernel's split pass: a cluster of C CTAs per row shares a long row's pass (each streams 1/C of it
# into CTA 0's candidates; CTA 0 selects), so the longest row of a launch with SMs to spare is read C times
# faster (one SM reads ~40 GB/s: a 128K row's pass alone is ~12 us). Rows one CTA holds go to the cluster's CTAs
# in turn. Measured against the one-CTA launch (H100, topk_engines_split_s18_h100.json, us, 1 CTA vs 2 per row):
# 32 x 8K / 32K in a 163840 width 12.1 / 22.9 vs 11.7 / 20.6; 32 rows log-uniform in [2K, 128K] 31.8 vs 27.3;
# 32 x 128K 33.8 vs 29.2. At launch the clusters narrow until the rows' clusters all run at once
# (`fit_split_cluster`: 32 rows do not fit the H100's 30 clusters of 4).
SPLIT_STREAM = True
STREAM_CLUSTERS = (1, 2, 4, 8)
# The prefill kernel (same file): a prefill chunk's thousands of rows. Decode grids (B x next_n rows, a few hundred
# at most) never reach PREFILL_MIN_ROWS, so their plans are unchanged.
PREFILL_MIN_ROWS = 1024
# Up to 8K columns one register-kernel CTA holds a row and was faster (H200, 8192 x 8192 causal: 0.27 vs 0.37 ms;
# prefill_scoring_h200.json); from 16K columns on the prefill kernel is (32K-token chunks: 3.1 vs 4.4 ms).
PREFILL_MIN_COLS = 8192
PREFILL_MAX_COLS = 1 << 24  # its column tie-break key holds 24 bits
PREFILL_THREADS = 256  # 256-thread CTAs, three per SM (512: two per SM; kept for measurements)


class Plan(NamedTuple):
    """One launch: ``kernel`` "registers" or "routed" (``per_cta`` = keys per thread), "shared" (``per_cta`` = key
    capacity per CTA in shared memory), "stream" or "prefill"; ``cluster`` CTAs per row."""

    kernel: str
    cluster: int
    per_cta: int


@functools.lru_cache(maxsize=None)
def _device_facts(index: int) -> tuple[int, int, tuple[int, int]]:
    props = torch.cuda.get_device_properties(index)
    optin = getattr(props, "shared_memory_per_block_optin", 0) or SMEM_OPTIN_FALLBACK
    return props.multi_processor_count, int(optin), (props.major, props.minor)


# The arguments every launch entry point starts with, in the kernels' Params order: x, x_stride, rows, cols, k,
# starts, ends, block_table, bt_stride, row_request, out.
ROW_ARGTYPES = (ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_void_p)


# The builds for programmatic dependent launch (csrc/cluster_launch.cuh): used when the step's kernels launch with PDL
# (``DSA_INDEXER_PDL=1``; one decision per device, shared with the Triton kernels, `backends/triton/pdl.py`).
PDL_DEFINES = ("DSA_PDL=1",)


@functools.lru_cache(maxsize=None)
def _library(capability: tuple[int, int], pdl: bool = False) -> ctypes.CDLL:
    lib = jit.load(SOURCE, capability, PDL_DEFINES if pdl else ())
    lib.dsa_topk_launch.restype = ctypes.c_int
    lib.dsa_topk_launch.argtypes = [*ROW_ARGTYPES, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                    ctypes.c_void_p]
    lib.dsa_topk_smem_bytes.restype = ctypes.c_longlong
    lib.dsa_topk_smem_bytes.argtypes = [ctypes.c_int]
    lib.dsa_topk_error_string.restype = ctypes.c_char_p
    lib.dsa_topk_error_string.argtypes = [ctypes.c_int]
    return lib


# The register kernels' compile-time variant: ``NAME=VALUE`` macros of csrc/topk_registers.cu (none: the shipped
# build). Benchmarks set it through `use_register_variant` to time two builds side by side in one process.
REGISTER_DEFINES: tuple[str, ...] = ()


def use_register_variant(defines: tuple[str, ...] = ()) -> None:
    """Launch the register kernels from the build with ``defines`` from now on (built on first use, cached like the
    shipped one); ``()`` goes back to the shipped build."""
    global REGISTER_DEFINES
    REGISTER_DEFINES = tuple(defines)
    _registers_library.cache_clear()
    _prefill_blocks_per_sm.cache_clear()
    _stream_active_clusters.cache_clear()


@functools.lru_cache(maxsize=None)
def _registers_library(capability: tuple[int, int], pdl: bool = False) -> ctypes.CDLL:
    lib = jit.load(REGISTERS_SOURCE, capability, REGISTER_DEFINES + (PDL_DEFINES if pdl else ()))
    lib.dsa_topk_registers_launch.restype = ctypes.c_int
    lib.dsa_topk_registers_launch.argtypes = [*ROW_ARGTYPES, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                              ctypes.c_void_p]
    lib.dsa_topk_registers_chunk.restype = ctypes.c_int
    lib.dsa_topk_registers_chunk.argtypes = [ctypes.c_int]
    lib.dsa_topk_routed_launch.restype = ctypes.c_int
    lib.dsa_topk_routed_launch.argtypes = [*ROW_ARGTYPES, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                           ctypes.c_int, ctypes.c_void_p]
    lib.dsa_topk_stream_launch.restype = ctypes.c_int
    lib.dsa_topk_stream_launch.argtypes = [*ROW_ARGTYPES, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.dsa_topk_stream_max_cols.restype = ctypes.c_int
    lib.dsa_topk_stream_active_clusters.restype = ctypes.c_int
    lib.dsa_topk_stream_active_clusters.argtypes = [ctypes.c_int]
    lib.dsa_topk_stream_smem_bytes.restype = ctypes.c_longlong
    lib.dsa_topk_prefill_launch.restype = ctypes.c_int
    lib.dsa_topk_prefill_launch.argtypes = [*ROW_ARGTYPES, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.dsa_topk_prefill_blocks_per_sm.restype = ctypes.c_int
    lib.dsa_topk_prefill_blocks_per_sm.argtypes = [ctypes.c_int]
    lib.dsa_topk_prefill_max_cols.restype = ctypes.c_int
    lib.dsa_topk_registers_error_string.restype = ctypes.c_char_p
    lib.dsa_topk_registers_error_string.argtypes = [ctypes.c_int]
    return lib


def register_plan(rows: int, cols: int, sms: int) -> tuple[int, int] | None:
    """(CTAs per row, keys per thread) of the register kernel for rows of ``cols`` columns; None when 16 CTAs of
    16K columns cannot hold a row. The smallest chunk (4K, 8K, 16K columns per CTA) whose grid still fits one
    CTA per SM; when none fits, the fewest CTAs (16K-column chunks, two CTAs sharing an SM), with the fewest
    keys per thread that still give that count. Measured on the H200 (benchmarks/results/topk_*.json): per CTA
    the select costs a fixed chain of barriers that does not shrink with the chunk, so smaller chunks help only
    while the CTAs run side by side, not in waves."""
    for keys in REGISTERS_KEYS:
        cluster = -(-cols // (keys * REGISTERS_THREADS))
        if cluster <= REGISTERS_MAX_CLUSTER and rows * cluster <= sms:
            return cluster, keys
    fewest = -(-cols // (REGISTERS_KEYS[-1] * REGISTERS_THREADS))
    if fewest > REGISTERS_MAX_CLUSTER:
        return None
    keys = next(n for n in REGISTERS_KEYS if -(-cols // (n * REGISTERS_THREADS)) == fewest)
    return fewest, keys


def registers_grid_rows(rows: int, cluster: int, sms: int) -> int:
    """Clusters the register kernel launches for ``rows`` rows: one per row (PACK_ROWS False, the default), or
    (PACK_ROWS True) at most one wave of clusters, each looping over its rows. The kernel routes each row by its
    own window: a row that one CTA holds runs on one CTA of its cluster alone, the cluster's next such row on the
    next CTA, so a packed wave runs up to ``cluster`` short rows per cluster side by side. Measured on the H200
    (benchmarks/results/topk_routing_h200.json) packing lost where long rows meet in one cluster (64 x 128K:
    68.1 vs 59.0 us; 32 mixed rows in a 163840 width: 39.1 vs 30.7) and gained under 0.5 us on short padded rows,
    so it is off; the GPU tests run both grids."""
    if not PACK_ROWS or cluster == 1:
        return min(rows, MAX_GRID_ROWS)
    return min(rows, MAX_GRID_ROWS, max(1, (REGISTERS_CTAS_PER_SM * sms) // cluster))


PACK_ROWS = False  # see registers_grid_rows; benchmarks and tests flip it to compare the two grids

# Rows wider than one CTA holds (16K columns), in up to two waves of register clusters: a routed launch. The
# launch's width is only a bound (engines pad decode logits to max_model_len), so the rows are routed on the device
# by their own lengths: the register kernel's clusters on a second stream take the rows longer than 16K columns,
# the streaming kernel on the caller's stream the shorter ones (one CTA each, in registers), side by side. Rows
# longer than LONG_ROWS_STREAM_MIN_COLS stream instead when LONG_ROWS_STREAM_MIN_ROWS or more of them are that long
# (counted on the device), the rule the plan applied to the width before.
# Measured (H100, benchmarks/results/topk_routed_window_s12_h100.json): it lost to the best single launch in every
# cell it took (padded 1 x 8K in 163840: 15.2 us vs 9.9 streaming; mixed 32 rows: 27.0 vs 26.7 clusters), so off;
# benchmarks/bench_topk_engines.py --plans times it as "routed", the GPU tests keep it right.
ROUTE_ROWS = False


@functools.lru_cache(maxsize=4096)
def plan_for(rows: int, cols: int, sms: int, vec: int, k: int = 2048) -> Plan | None:
    """The launch for a [rows, cols] problem (cached: computed once per shape and device, shared by every layer
    of a step); None: no CUDA kernel holds such rows (the Triton top-k serves them). ``k``: at V4's k = 512, 64+
    rows of 32K-256K columns stream (SMALL_K_STREAM_*); at any k, 128+ such rows (MANY_ROWS_STREAM_MIN_ROWS).
    Rows longer than 32K whose register launch needs more than two waves (two CTAs per SM each) take the streaming
    kernel: each wave pays the register kernel's barrier chain again, while the streaming kernel reads each row
    once in one wave (H200, topk_engines_stream_h200.json: 128 x 128K 72 us streaming vs 104 us registers; at
    64 x 128K, two waves, 66 vs 64 us, then; since the streaming pass was made cheaper, from 32 rows of > 64K
    columns). Up to a wave of short rows (<= 16K columns) take the streaming kernel too, which selects each row
    in registers on one CTA. Prefill chunks (at least PREFILL_MIN_ROWS rows of at least PREFILL_MIN_COLS columns,
    any width below 2^24) take the prefill kernel: small CTAs, three per SM, that overlap one row's select with
    other rows' streaming passes; so do rows too wide for the other CUDA kernels when there are at least as many
    as SMs (else the Triton top-k serves them, as before)."""
    if rows >= PREFILL_MIN_ROWS and PREFILL_MIN_COLS < cols < PREFILL_MAX_COLS:
        return Plan("prefill", 1, PREFILL_THREADS)
    if cols <= SHORT_ROWS_MAX_COLS and rows <= sms:
        return Plan("stream", stream_cluster(rows, cols, sms), 0)
    if (LONG_ROWS_STREAM_MIN_COLS < cols <= STREAM_MAX_COLS and rows >= LONG_ROWS_STREAM_MIN_ROWS
            and not ROUTE_ROWS):
        return Plan("stream", stream_cluster(rows, cols, sms), 0)
    if STREAM_MIN_COLS <= cols <= STREAM_MAX_COLS and (
            rows >= MANY_ROWS_STREAM_MIN_ROWS or (k <= SMALL_K_STREAM_MAX_K and rows >= SMALL_K_STREAM_MIN_ROWS)):
        return Plan("stream", stream_cluster(rows, cols, sms), 0)
    reg = register_plan(rows, cols, sms)
    if (ROUTE_ROWS and reg is not None and SHORT_ROWS_MAX_COLS < cols <= STREAM_MAX_COLS
            and rows * reg[0] <= STREAM_AFTER_WAVES * REGISTERS_CTAS_PER_SM * sms):
        return Plan("routed", *reg)
    if (reg is not None and STREAM_MIN_COLS < cols <= STREAM_MAX_COLS
            and rows * reg[0] > STREAM_AFTER_WAVES * REGISTERS_CTAS_PER_SM * sms):
        return Plan("stream", stream_cluster(rows, cols, sms), 0)
    if reg is not None:
        return Plan("registers", *reg)
    shared = plan(rows, cols, sms, vec)
    if shared is not None:
        return Plan("shared", *shared)
    if rows >= sms and cols < PREFILL_MAX_COLS:  # a 1M-token prefill's last chunks (~500 rows of 1M columns)
        return Plan("prefill", 1, PREFILL_THREADS)
    return None


def stream_cluster(rows: int, cols: int, sms: int) -> int:
    """CTAs per row of a streaming launch: 1 when rows of ``cols`` columns fit one CTA's registers (nothing to
    split) or SPLIT_STREAM is off; else the most of 2 / 4 / 8 that keep rows x CTAs within one CTA per SM."""
    cluster = 1
    if not SPLIT_STREAM or cols <= SHORT_ROWS_MAX_COLS:
        return cluster
    while cluster < STREAM_CLUSTERS[-1] and rows * cluster * 2 <= sms:
        cluster *= 2
    return cluster


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


@functools.lru_cache(maxsize=None)
def _prefill_blocks_per_sm(capability: tuple[int, int], threads: int) -> int:
    """CTAs of the prefill kernel that share one SM (its occupancy; 0: it cannot launch), queried once."""
    return int(_registers_library(capability).dsa_topk_prefill_blocks_per_sm(threads))


@functools.lru_cache(maxsize=None)
def _stream_active_clusters(capability: tuple[int, int], cluster: int) -> int:
    """Clusters of ``cluster`` CTAs of the split pass this GPU runs at once (0: none fits), queried once per size."""
    return int(_registers_library(capability).dsa_topk_stream_active_clusters(cluster))


def stream_active_clusters(device: torch.device, cluster: int) -> int:
    """Clusters of ``cluster`` CTAs (2, 4 or 8) of the streaming kernel's split pass that ``device`` runs at once: a
    GPC holds a cluster, so this is below SMs / cluster where GPCs' SM counts are not multiples of it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _stream_active_clusters(_device_facts(index)[2], cluster)


def launched_plan(plan: Plan | None, rows: int, capability: tuple[int, int]) -> Plan | None:
    """``plan`` as `run_plan` launches it for ``rows`` rows on a GPU of ``capability``: a split pass's clusters
    narrowed to what the GPU runs in one wave (`fit_split_cluster`; one CTA per row needs no query)."""
    if plan is None or plan.kernel != "stream" or plan.cluster == 1:
        return plan
    active = functools.partial(_stream_active_clusters, capability)
    return plan._replace(cluster=fit_split_cluster(min(rows, MAX_GRID_ROWS), plan.cluster, active))


def fit_split_cluster(rows: int, cluster: int, active_clusters) -> int:
    """The split pass's CTAs per row for ``rows`` rows: ``cluster`` halved while the rows' clusters would not all
    run at once (``active_clusters(c)``: clusters of c CTAs the GPU co-schedules), since a second wave of clusters
    costs a whole pass again (H100, 32 rows: 30 clusters of 4 fit, and 4 CTAs per row ran 30.2 us at 32 x 32K in a
    163840 width against 20.6 for 2; topk_engines_split_s18_h100.json)."""
    while cluster > 1 and rows > active_clusters(cluster):
        cluster //= 2
    return cluster


def _fits(lib: ctypes.CDLL, chunk_cols: int, optin: int) -> bool:
    return lib.dsa_topk_smem_bytes(chunk_cols) <= optin


def topk_indices(logits: torch.Tensor, k: int, ends: torch.Tensor, starts: torch.Tensor | None = None,
                 block_table: torch.Tensor | None = None, row_request: torch.Tensor | None = None, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [R, k]: the k largest of each row within [starts, ends), ties to the lower column, a NaN ranked as
    -inf; -1 padded when the window holds <= k columns. Same signature as the reference; ``out``: the caller's
    contiguous int32 [R, k] buffer the kernel writes (every element), returned."""
    return run_plan(logits, k, ends, starts, block_table, row_request, None, out=out)


def run_plan(logits: torch.Tensor, k: int, ends: torch.Tensor, starts: torch.Tensor | None,
             block_table: torch.Tensor | None, row_request: torch.Tensor | None, forced: Plan | None, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """`topk_indices` with the launch ``forced`` (tests and benchmarks compare plans) or, when None, planned.
    ``out``: the caller's buffer (contiguous int32 [rows, k], checked by the op): its pointer goes to the kernel,
    which writes row r at ``out + r * k``, so no result is allocated or copied."""
    rows, cols = logits.shape
    device = logits.device
    if out is None:
        out = torch.empty((rows, k), dtype=torch.int32, device=device)
    if rows == 0:
        return out
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    x = x if x.dtype == torch.float32 else x.float()
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms, optin, capability = _device_facts(index)
    vec = 4 if x.data_ptr() % 16 == 0 and x.stride(0) % 4 == 0 else 1
    launch = forced if forced is not None else plan_for(rows, max(cols, 1), sms, vec, k)
    if launch is not None and launch.kernel == "shared" and not _fits(_library(capability), launch.per_cta, optin):
        launch = None
    if launch is not None and launch.kernel in ("stream", "routed"):
        reg_lib = _registers_library(capability)
        if cols > reg_lib.dsa_topk_stream_max_cols() or reg_lib.dsa_topk_stream_smem_bytes() > optin:
            launch = None
    if launch is not None and launch.kernel == "prefill":
        reg_lib = _registers_library(capability)
        if cols >= reg_lib.dsa_topk_prefill_max_cols() or _prefill_blocks_per_sm(capability, launch.per_cta) < 1:
            launch = None
    if launch is None:
        from ..triton.topk import topk_indices as wide_rows  # any width; the op's contract is the same

        return wide_rows(logits, k, ends, starts, block_table, row_request, out=out)
    ends = ends.contiguous()
    starts = starts.contiguous() if starts is not None else None
    bt = None
    if block_table is not None:
        bt = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    req = row_request.contiguous() if row_request is not None else None
    stream = torch.cuda.current_stream(device).cuda_stream
    pdl = bool(pdl_options(device))  # the kernels below launch from the PDL build when the step's do
    args = (x.data_ptr(), x.stride(0), rows, cols, k, starts.data_ptr() if starts is not None else None,
            ends.data_ptr(), bt.data_ptr() if bt is not None else None, bt.stride(0) if bt is not None else 0,
            req.data_ptr() if req is not None else None, out.data_ptr())
    if launch.kernel == "prefill":
        lib = _registers_library(capability, pdl)
        grid = min(rows, sms * _prefill_blocks_per_sm(capability, launch.per_cta))
        err = lib.dsa_topk_prefill_launch(*args, launch.per_cta, grid, int(vec == 4), stream)
        message = lib.dsa_topk_registers_error_string
    elif launch.kernel == "stream":
        lib = _registers_library(capability, pdl)
        if launch.cluster not in STREAM_CLUSTERS:
            raise ValueError(f"plan {launch}: the streaming kernel runs on 1, 2, 4 or 8 CTAs per row")
        cluster = launched_plan(launch, rows, capability).cluster  # narrowed to one wave (exact either way)
        err = lib.dsa_topk_stream_launch(*args, min(rows, MAX_GRID_ROWS), cluster, int(vec == 4), stream)
        message = lib.dsa_topk_registers_error_string
    elif launch.kernel == "routed":
        lib = _registers_library(capability, pdl)
        if launch.cluster * lib.dsa_topk_registers_chunk(launch.per_cta) < cols or rows > MAX_GRID_ROWS:
            raise ValueError(f"plan {launch} does not cover {rows} rows of {cols} columns")
        err = lib.dsa_topk_routed_launch(*args, launch.cluster, launch.per_cta, int(vec == 4),
                                         LONG_ROWS_STREAM_MIN_COLS, LONG_ROWS_STREAM_MIN_ROWS, stream)
        message = lib.dsa_topk_registers_error_string
    elif launch.kernel == "registers":
        lib = _registers_library(capability, pdl)
        if launch.cluster * lib.dsa_topk_registers_chunk(launch.per_cta) < cols:
            raise ValueError(f"plan {launch} does not cover {cols} columns")
        err = lib.dsa_topk_registers_launch(*args, launch.cluster, launch.per_cta, int(vec == 4),
                                            registers_grid_rows(rows, launch.cluster, sms), stream)
        message = lib.dsa_topk_registers_error_string
    else:
        lib = _library(capability, pdl)
        err = lib.dsa_topk_launch(*args, launch.cluster, vec, launch.per_cta, MAX_GRID_ROWS, stream)
        message = lib.dsa_topk_error_string
    if err != 0:
        raise RuntimeError(f"dsa_indexer CUDA top-k launch failed: {message(err).decode()} "
                           f"(rows={rows}, cols={cols}, k={k}, plan={launch})")
    return out


def _self_test_cases(device: torch.device):
    """Small rows that exercise every branch of both kernels: random, heavy ties at the k-th value, NaN / -inf,
    windows with starts, short rows, rows split over a cluster, the slot transform, a row for the shared-memory
    kernel."""
    gen = torch.Generator().manual_seed(4321)
    k = 64
    rows = torch.randn(7, 3000, generator=gen)
    rows[1] = torch.randint(0, 4, (3000,), generator=gen).float()  # massive ties
    rows[2, ::7] = float("nan")
    rows[3, ::5] = float("-inf")
    rows[4] = 1.0  # all equal
    rows[6, 100:] = float("nan")  # fewer than k values above NaN: NaN is selected as -inf would be
    ends = torch.tensor([3000, 2999, 2500, 3000, 3000, 40, 3000], dtype=torch.int32)
    starts = torch.tensor([0, 3, 17, 1000, 0, 0, 50], dtype=torch.int32)
    yield rows.to(device), k, ends.to(device), starts.to(device), None, None
    long_row = torch.randn(2, 70000, generator=gen)  # a cluster of CTAs per row
    long_row[1, ::3] = float("nan")
    yield long_row.to(device), 2048, torch.tensor([70000, 65001], dtype=torch.int32, device=device), None, None, None
    table = torch.randperm(64, generator=gen).to(torch.int32).view(2, 32)
    yield (torch.randn(2, 2048, generator=gen).to(device), 100, torch.tensor([2048, 90], dtype=torch.int32,
                                                                             device=device), None, table.to(device),
           None)
    wide = torch.randint(0, 50, (1, 270000), generator=gen).float()  # wider than 16 x 16K: the shared kernel
    yield wide.to(device), 2048, torch.tensor([270000], dtype=torch.int32, device=device), None, None, None


def nan_as_neg_inf(logits: torch.Tensor) -> torch.Tensor:
    """The library's NaN rule: a NaN score ranks exactly as -inf (what every top-k must equal the reference on)."""
    return torch.where(torch.isnan(logits), torch.full_like(logits, float("-inf")), logits)


def self_test(device: torch.device, topk=None) -> None:
    """Compare ``topk`` (default this module's `topk_indices`) with the reference on `_self_test_cases` (the
    reference sees the rows with NaN replaced by -inf); raise RuntimeError naming the first difference."""
    from ..reference import kernels as ref

    candidates = {"planned": topk or topk_indices}
    if topk is None:  # the streaming and prefill kernels serve few shapes by plan: force them on every case
        candidates["stream"] = lambda *a: run_plan(*a, Plan("stream", 1, 0)) if a[0].shape[1] <= STREAM_MAX_COLS \
            else topk_indices(*a)
        candidates["prefill"] = lambda *a: run_plan(*a, Plan("prefill", 1, PREFILL_THREADS))
    for name, fn in candidates.items():
        for n, (logits, k, ends, starts, table, req) in enumerate(_self_test_cases(device)):
            got = fn(logits, k, ends, starts, table, req)
            want = ref.topk_indices(nan_as_neg_inf(logits), k, ends, starts, table, req)
            got_sets = torch.sort(got, dim=1).values
            want_sets = torch.sort(want, dim=1).values
            if not torch.equal(got_sets, want_sets):
                bad = int((got_sets != want_sets).any(dim=1).nonzero()[0, 0])
                raise RuntimeError(f"CUDA top-k self-test case {n} ({name}): row {bad} differs from the reference")


def _load_libraries(capability: tuple[int, int]) -> tuple[ctypes.CDLL, ctypes.CDLL]:
    return _library(capability), _registers_library(capability)


LIBRARY = jit.kernel_library("the CUDA top-k", _load_libraries, lambda device: self_test(device),
                             needs="thread-block clusters tuned for")


def probe() -> str | None:
    """None when the kernels build (or are cached) for this GPU and pass their self-test, else the reason."""
    return LIBRARY.probe()
