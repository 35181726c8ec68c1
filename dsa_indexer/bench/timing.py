"""Timing: CUDA-graph replays timed by CUDA events with L2 flushed (eager on a CPU), medians with their spread, and
the device's own ceilings (copy bandwidth, matmul rate) measured in the same run."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch


# --- timing --------------------------------------------------------------------------------------------------------
UNSTABLE_RATIO = 10.0  # a ceiling whose fastest sample is this many times its slowest is flagged


def percentile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of sorted ``ordered``, interpolating linearly between the nearest samples."""
    if not ordered:
        raise ValueError("percentile of no samples")
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def spread_of(samples: Sequence[float]) -> dict:
    """min, p10, median, p90, max and count of ``samples``."""
    ordered = sorted(samples)
    return {"min": ordered[0], "p10": percentile(ordered, 0.1), "median": statistics.median(ordered),
            "p90": percentile(ordered, 0.9), "max": ordered[-1], "count": len(ordered)}


class Timing(float):
    """The median of timed samples in microseconds (a float), carrying the samples and their `spread_of`: a row
    built from it records how much its samples varied, not only their median."""

    samples: tuple[float, ...]
    spread: dict

    def __new__(cls, samples_us: Sequence[float]) -> "Timing":
        samples = tuple(float(s) for s in samples_us)
        if not samples:
            raise ValueError("a Timing needs at least one sample")
        value = super().__new__(cls, statistics.median(samples))
        value.samples, value.spread = samples, spread_of(samples)
        return value


def rate_spread(timing: Timing, amount: float) -> dict:
    """The spread of ``amount / sample`` over ``timing``'s samples (a rate: the slowest sample is its min), and
    ``max_over_min`` with ``unstable`` (the fastest sample at least UNSTABLE_RATIO times the slowest)."""
    rates = sorted(amount / s for s in timing.samples if s > 0)
    if not rates:
        return {"count": 0, "unstable": False}
    spread = spread_of(rates)
    spread["max_over_min"] = rates[-1] / rates[0]
    spread["unstable"] = spread["max_over_min"] >= UNSTABLE_RATIO
    return spread


def eager_event_times(fn: Callable[[], object], repeats: int) -> list[float]:
    """Milliseconds of ``repeats`` eager calls of ``fn`` on the current CUDA device, each between two CUDA events,
    after one untimed call (compilation, allocator growth): for work too large or too host-driven to capture."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return times


def topk_set_agreement(got: torch.Tensor, want: torch.Tensor, rows: int = 2048) -> float:
    """The share of ``want``'s selected indices (-1 padding left out) that ``got`` selects too, over about ``rows``
    evenly spaced rows; rows that select nothing count for nothing (1.0 when no row selects anything)."""
    step = max(1, got.shape[0] // rows)
    agree = total = 0
    for row_got, row_want in zip(got[::step].cpu().tolist(), want[::step].cpu().tolist()):
        chosen = set(row_want) - {-1}
        agree += len((set(row_got) - {-1}) & chosen)
        total += len(chosen)
    return agree / total if total else 1.0


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return
    backend = getattr(torch, device.type, None)  # torch_npu's torch.npu, and the like
    if device.type != "cpu" and backend is not None and callable(getattr(backend, "synchronize", None)):
        backend.synchronize()


def capture(fn: Callable[[], object], warmup: int = 2):
    """``(graph, output)`` of ``fn`` captured after ``warmup`` side-stream calls (`graphs.capture_graph`)."""
    from ..graphs import capture_graph

    return capture_graph(fn, warmup)


class Timer:
    """Medians of ``repeats`` samples of ``fn`` (a `Timing`: the samples and their spread come with it):
    CUDA-graph replays timed by events (L2 flushed before each) on a GPU when ``fn`` can be captured, CUDA events
    on eager calls when it cannot, the wall clock on a CPU. ``mode`` says how the last call was timed."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.device, self.repeats = device, repeats
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None
        self.mode = ""

    def __call__(self, fn: Callable[[], object]) -> Timing:
        if self.device.type != "cuda":
            fn()  # warm-up: first resolutions, allocator growth
            _synchronize(self.device)
            samples = []
            for _ in range(self.repeats):
                start = time.perf_counter()
                fn()
                _synchronize(self.device)
                samples.append((time.perf_counter() - start) * 1e6)
            self.mode = "wall clock, eager"
            return Timing(samples)
        fn()  # warm-up: JIT compiles, first resolutions, allocator growth
        torch.cuda.synchronize()
        run, graph = fn, None
        try:
            graph, _ = capture(fn, warmup=1)
            run, self.mode = graph.replay, "cuda graph replay, cuda events, L2 flushed"
        except Exception:  # noqa: BLE001 - not capturable (a host sync): time eager calls
            torch.cuda.synchronize()
            self.mode = "eager, cuda events, L2 flushed (not capturable)"
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.repeats)]
        stops = [torch.cuda.Event(enable_timing=True) for _ in range(self.repeats)]
        for start, stop in zip(starts, stops):
            self.flush.zero_()  # queued ahead of the sample, never timed
            start.record()
            run()
            stop.record()
        torch.cuda.synchronize()
        del graph
        return Timing([s.elapsed_time(e) * 1e3 for s, e in zip(starts, stops)])


def measure_ceilings(device: torch.device, timer: Timer, fp8_dtype: torch.dtype = torch.float8_e4m3fn
                     ) -> tuple[dict, dict]:
    """``(ceilings, spread)``: copy bandwidth (bytes read + written per second) and the matmul rate, measured here
    and now (the rate of the median sample), and per ceiling the `rate_spread` of its samples."""
    n = (256 << 20) if device.type == "cuda" else (32 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_us = timer(lambda: dst.copy_(src))
    ceilings = {"copy_GBps": 2 * n / copy_us / 1e3}
    spread = {"copy_GBps": rate_spread(copy_us, 2 * n / 1e3)}
    m = 8192 if device.type == "cuda" else 512
    a = torch.randn(m, m, device=device)
    if device.type == "cuda":
        a8 = a.to(fp8_dtype)
        b8 = a8.t()  # column-major B, as cuBLASLt's fp8 path wants
        one = torch.ones((), device=device)
        try:
            us = timer(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
            ceilings["fp8_matmul_TFLOPs"] = 2 * m ** 3 / us / 1e6
            spread["fp8_matmul_TFLOPs"] = rate_spread(us, 2 * m ** 3 / 1e6)
        except Exception as exc:  # noqa: BLE001
            ceilings["fp8_matmul_TFLOPs"] = None
            ceilings["fp8_matmul_error"] = f"{type(exc).__name__}: {exc}"
    else:
        us = timer(lambda: a @ a)
        ceilings["fp32_matmul_TFLOPs"] = 2 * m ** 3 / us / 1e6
        spread["fp32_matmul_TFLOPs"] = rate_spread(us, 2 * m ** 3 / 1e6)
    return ceilings, spread
