"""`dsa-indexer bench`: every implementation that resolution accepts on this device, side by side, with the device's
own ceilings measured in the same run.

Suites (``--suite``): ``decode`` (the fused paged logits + top-k, B x context sweep), ``topk`` (top-k alone on logits
of that sweep, with ``torch.topk`` as the baseline), ``prefill`` (ragged logits, query x key lengths) and ``ops``
(``decode`` + ``topk`` + ``prefill`` at one size each). For each op the registry's accepted candidates are forced in
turn; each is timed by CUDA events around CUDA-graph replays (warm-up excluded, L2 flushed between samples, the
median of ``--repeats``), or by the wall clock on a CPU, where the sizes are small and the numbers are CPU numbers,
not GPU numbers. Throughput is reported with the fraction of the measured ceiling: copy bandwidth for the memory
bound ops (bytes read + written), and the fp8 (GPU) or fp32 (CPU) matmul rate for prefill.
Output: a table, ``--json FILE`` (``-`` for stdout), and PNG plots with ``--plots DIR`` (needs matplotlib: the
``bench`` extra).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from . import ops
from .dispatch.plugins import default_registry
from .dispatch.target import Target, detect_target

SUITES = ("decode", "topk", "prefill", "ops")
GPU_DECODE = ((1, 4096), (32, 8192), (64, 32768), (128, 8192))
CPU_DECODE = ((2, 1024), (4, 4096))
GPU_PREFILL = ((4096, 4096), (2048, 32768))
CPU_PREFILL = ((128, 1024),)
HEADS, DIM = 64, 128


@dataclass
class Row:
    suite: str
    op: str
    implementation: str
    shape: dict
    time_us: float
    throughput: float
    unit: str
    fraction_of_ceiling: float | None


@dataclass
class BenchReport:
    device: str
    target: str
    note: str
    ceilings: dict
    rows: list[Row] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"device": self.device, "target": self.target, "note": self.note, "ceilings": self.ceilings,
                "rows": [asdict(r) for r in self.rows]}


class Timer:
    """Medians of ``repeats`` samples of ``fn``: CUDA-graph replays timed by events (L2 flushed before each) on a
    GPU when ``fn`` can be captured, CUDA events on eager calls when it cannot, the wall clock on a CPU."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.device, self.repeats = device, repeats
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def __call__(self, fn: Callable[[], object]) -> float:
        fn()  # warm-up: JIT compiles, first resolutions, allocator growth
        if self.device.type != "cuda":
            samples = []
            for _ in range(self.repeats):
                start = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - start) * 1e6)
            return statistics.median(samples)
        torch.cuda.synchronize()
        run = fn
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            run = graph.replay
        except Exception:  # noqa: BLE001 - not capturable (host syncs): time eager calls
            torch.cuda.synchronize()
        samples = []
        for _ in range(self.repeats):
            self.flush.zero_()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            stop.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(stop) * 1e3)
        return statistics.median(samples)


def measure_ceilings(device: torch.device, timer: Timer) -> dict:
    """Copy bandwidth (bytes read + written per second) and the matmul rate, measured here and now."""
    n = (256 << 20) if device.type == "cuda" else (32 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_us = timer(lambda: dst.copy_(src))
    ceilings = {"copy_GBps": 2 * n / copy_us / 1e3}
    m = 8192 if device.type == "cuda" else 512
    a = torch.randn(m, m, device=device)
    if device.type == "cuda":
        a8 = a.to(torch.float8_e4m3fn)
        b8 = a8.t()
        one = torch.ones((), device=device)
        try:
            us = timer(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
            ceilings["fp8_matmul_TFLOPs"] = 2 * m ** 3 / us / 1e6
        except Exception as exc:  # noqa: BLE001
            ceilings["fp8_matmul_TFLOPs"] = None
            ceilings["fp8_matmul_error"] = f"{type(exc).__name__}: {exc}"
    else:
        us = timer(lambda: a @ a)
        ceilings["fp32_matmul_TFLOPs"] = 2 * m ** 3 / us / 1e6
    return ceilings


def _accepted(op: str, target: Target, problem) -> list[str]:
    res = default_registry().resolve(op, target, problem)
    return [c.impl.impl_id for c in res.candidates if c.accepted]


class _Forced:
    """``with _Forced(op, impl_id):`` resolves ``op`` to that implementation for the block (timing included)."""

    def __init__(self, op: str, impl_id: str) -> None:
        self.op, self.impl_id = op, impl_id

    def __enter__(self):
        default_registry().force(self.op, self.impl_id)

    def __exit__(self, *exc):
        default_registry().force(self.op, None)


def _time_forced(timer: "Timer", op: str, impl_id: str, fn: Callable[[], object]) -> float:
    with _Forced(op, impl_id):
        return timer(fn)


def _decode_inputs(batch: int, context: int, device: torch.device, seed: int = 0):
    from .testing import random_cache

    gen = torch.Generator().manual_seed(seed)
    pages = -(-context // 64)
    cache = random_cache(batch * pages, device, seed=seed)
    table = torch.randperm(batch * pages, generator=gen).to(torch.int32).view(batch, pages).to(device)
    q = (torch.randn(batch, 1, HEADS, DIM, generator=gen) * 20).to(torch.float8_e4m3fn).to(device)
    weights = torch.randn(batch, HEADS, generator=gen).to(device)
    lens = torch.full((batch, 1), context, dtype=torch.int32, device=device)
    return q, cache.data, weights, lens, table, context


def bench_decode(report: BenchReport, target: Target, device: torch.device, timer: Timer, sizes, progress) -> None:
    for batch, context in progress(sizes, "decode"):
        args = _decode_inputs(batch, context, device)
        problem = ops.problem("lightning_indexer", heads=HEADS, dim=DIM, next_n=1, k=2048, fp8="fn", slots=False)
        bytes_moved = batch * context * (132 + 4)  # keys + scales read, fp32 logits written (an upper bound)
        for impl in _accepted("lightning_indexer", target, problem):
            us = _time_forced(timer, "lightning_indexer", impl, lambda: ops.lightning_indexer(*args, 2048))
            gbps = bytes_moved / us / 1e3
            report.rows.append(Row("decode", "lightning_indexer", impl, {"batch": batch, "context": context}, us,
                                   gbps, "GB/s", gbps / report.ceilings["copy_GBps"]))


def bench_topk(report: BenchReport, target: Target, device: torch.device, timer: Timer, sizes, progress) -> None:
    for batch, context in progress(sizes, "topk"):
        gen = torch.Generator().manual_seed(1)
        logits = torch.randn(batch, context, generator=gen).to(device)
        ends = torch.full((batch,), context, dtype=torch.int32, device=device)
        bytes_moved = batch * context * 4
        problem = ops.problem("topk_indices", k=2048, slots=False, starts=False)
        timings = [(impl, _time_forced(timer, "topk_indices", impl, lambda: ops.topk_indices(logits, 2048, ends)))
                   for impl in _accepted("topk_indices", target, problem)]
        timings.append(("torch.topk (baseline)", timer(lambda: torch.topk(logits, min(2048, context), dim=1))))
        for impl, us in timings:
            gbps = bytes_moved / us / 1e3
            report.rows.append(Row("topk", "topk_indices", impl, {"batch": batch, "context": context}, us, gbps,
                                   "GB/s", gbps / report.ceilings["copy_GBps"]))


def bench_prefill(report: BenchReport, target: Target, device: torch.device, timer: Timer, sizes, progress) -> None:
    ceiling = report.ceilings.get("fp8_matmul_TFLOPs") or report.ceilings.get("fp32_matmul_TFLOPs")
    for queries, keys in progress(sizes, "prefill"):
        gen = torch.Generator().manual_seed(2)
        q = (torch.randn(queries, HEADS, DIM, generator=gen) * 20).to(torch.float8_e4m3fn).to(device)
        k = (torch.randn(keys, DIM, generator=gen) * 20).to(torch.float8_e4m3fn).to(device)
        scales = torch.rand(keys, generator=gen).to(device)
        weights = torch.randn(queries, HEADS, generator=gen).to(device)
        ke = torch.arange(keys - queries + 1, keys + 1, dtype=torch.int32, device=device)  # causal rows
        ks = torch.zeros_like(ke)
        flops = 2 * HEADS * DIM * float(ke.double().sum())  # the visible (causal) part
        problem = ops.problem("ragged_mqa_logits", heads=HEADS, dim=DIM, fp8="fn")
        for impl in _accepted("ragged_mqa_logits", target, problem):
            us = _time_forced(timer, "ragged_mqa_logits", impl,
                              lambda: ops.ragged_mqa_logits(q, k, scales, weights, ks, ke))
            tflops = flops / us / 1e6
            report.rows.append(Row("prefill", "ragged_mqa_logits", impl, {"queries": queries, "keys": keys}, us,
                                   tflops, "TFLOP/s", tflops / ceiling if ceiling else None))


def run_bench(suites: list[str], device: torch.device | None = None, repeats: int | None = None,
              progress: Callable | None = None) -> BenchReport:
    device = device or (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    on_gpu = device.type == "cuda"
    target = detect_target(device)
    timer = Timer(device, repeats or (25 if on_gpu else 5))
    progress = progress or (lambda items, label: items)
    note = ("" if on_gpu else "CPU run at small sizes with the implementations the CPU target accepts: these are "
            "CPU numbers, not GPU numbers")
    report = BenchReport(str(device), str(target), note, measure_ceilings(device, timer))
    want = set(suites)
    if "ops" in want:
        want |= {"decode", "topk", "prefill"}
    decode = list(GPU_DECODE if on_gpu else CPU_DECODE)
    prefill = list(GPU_PREFILL if on_gpu else CPU_PREFILL)
    if "ops" in suites:
        decode, prefill = decode[:1], prefill[:1]
    if "decode" in want:
        bench_decode(report, target, device, timer, decode, progress)
    if "topk" in want:
        bench_topk(report, target, device, timer, decode, progress)
    if "prefill" in want:
        bench_prefill(report, target, device, timer, prefill, progress)
    return report


def format_table(report: BenchReport) -> str:
    lines = [f"dsa-indexer bench on {report.device} (target {report.target})" +
             (f"\nnote: {report.note}" if report.note else ""),
             "ceilings: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in report.ceilings.items()),
             f"{'suite':<8} {'implementation':<44} {'shape':<26} {'time us':>10} {'throughput':>16} {'of ceiling':>10}"]
    for r in report.rows:
        shape = " ".join(f"{k}={v}" for k, v in r.shape.items())
        frac = f"{r.fraction_of_ceiling:.1%}" if r.fraction_of_ceiling is not None else "-"
        lines.append(f"{r.suite:<8} {r.implementation:<44} {shape:<26} {r.time_us:>10.1f} "
                     f"{r.throughput:>10.2f} {r.unit:<5} {frac:>10}")
    return "\n".join(lines)


def write_plots(report: BenchReport, folder) -> list[str]:
    """Latency per implementation over the sweep, one PNG per suite (matplotlib: the ``bench`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install 'dsa-indexer[bench]'") from None
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for suite in sorted({r.suite for r in report.rows}):
        rows = [r for r in report.rows if r.suite == suite]
        fig, ax = plt.subplots(figsize=(7, 4))
        for impl in sorted({r.implementation for r in rows}):
            mine = [r for r in rows if r.implementation == impl]
            ax.plot([" ".join(f"{v}" for v in r.shape.values()) for r in mine], [r.time_us for r in mine],
                    marker="o", label=impl)
        ax.set_ylabel("time (us, median)")
        ax.set_xlabel(" x ".join(rows[0].shape))
        ax.set_yscale("log")
        ax.set_title(f"{suite} on {report.device} ({report.target})")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = folder / f"bench_{suite}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(str(path))
    return written


def write_json(report: BenchReport, where: str) -> None:
    text = json.dumps({"command": " ".join(["dsa-indexer"] + sys.argv[1:]), **report.as_dict()}, indent=2)
    if where == "-":
        print(text)
    else:
        with open(where, "w") as handle:
            handle.write(text)
