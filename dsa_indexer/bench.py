"""`dsa-indexer bench`: every implementation that resolution accepts on this device, side by side, with the device's
own ceilings measured in the same run.

Suites (``--suite``):

- ``decode``: a B x context sweep of the fused paged logits + top-k (``lightning_indexer``), and the whole indexer
  step: a DeepSeek-V3.2 `Indexer` (``init_random``) decode step per pipeline strategy (the registry op
  ``indexer_pipeline``: single stream, the CUDA dual stream where it is accepted), each without and with q_lora
  reuse (attention's fp8 ``q_lora`` handed in as ``q_lora_quant``: rows named ``<strategy>+q_lora_reuse``);
- ``topk``: top-k alone on logits of that sweep, with ``torch.topk`` as the baseline;
- ``prefill``: ragged causal logits, query x key lengths;
- ``ops``: ``lightning_indexer``, ``topk_indices`` and ``ragged_mqa_logits`` alone, at one size each.

For each op the registry's accepted candidates are forced in turn. Timing: on a GPU each measurement is captured
in a CUDA graph (warm-up first, on a side stream) and its replays are timed by CUDA events, L2 flushed (a 256 MiB
write) before every replay, the median of ``--repeats``; what cannot be captured is timed eagerly by CUDA events
(the row says which). On a CPU the sizes are small and the wall clock times eager calls: those are CPU numbers,
not GPU numbers. Every row keeps the spread of its samples next to the median (min, p10, p90, max, count: the
table's ``min us``, ``p10-p90 us`` and ``n``, the JSON's ``spread``). Throughput is reported with the fraction of
the measured ceiling: copy bandwidth for the memory bound ops (bytes read + written; for the step, the floor is its
weights + every context key once + its inputs and output), and the fp8 (GPU) or fp32 (CPU) matmul rate for
prefill. The ceilings keep their samples' spread too (``ceiling_spread``); one whose fastest sample is 10x its
slowest or more (a busy CPU) is flagged ``UNSTABLE`` in the table and ``unstable`` in the JSON, with a warning.

Output: a table, ``--json FILE`` (``-`` for stdout: then stdout holds the JSON only), and PNG plots with
``--plots DIR`` (matplotlib: the ``bench`` extra): latency vs context per implementation, bandwidth as a
percentage of the measured copy bandwidth, the pipeline strategies accepted here (with and without q_lora reuse),
top-k speedup over torch.topk, and prefill latency. Progress goes to stderr: a rich or tqdm bar on a terminal when
one is installed, else one line per measured item.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from . import ops
from .dispatch.platform import platform_of
from .dispatch.plugins import default_registry
from .dispatch.target import Target, detect_target

SUITES = ("decode", "topk", "prefill", "ops")
GPU_BATCHES, GPU_CONTEXTS = (1, 32, 128), (8192, 32768, 131072)
CPU_BATCHES, CPU_CONTEXTS = (1, 4), (1024, 4096)
GPU_PREFILL = ((4096, 4096), (2048, 32768))
CPU_PREFILL = ((128, 1024),)
HEADS, DIM, TOPK = 64, 128, 2048
PIPELINE = ops.PIPELINE_OP  # one spelling: contract/specs.py
SINGLE_STREAM = "indexer_pipeline.generic.single_stream"
REUSE = "+q_lora_reuse"
TORCH_TOPK = "torch.topk (baseline)"
PROGRESS_STYLES = ("auto", "rich", "tqdm", "plain", "none")
# On an accelerator the pure-torch reference takes seconds per call (and GBs of temporaries) at large sizes: above
# these it is skipped (listed in ``skipped``). Decode / top-k: B * context tokens; prefill: queries * keys.
REFERENCE_MAX_TOKENS, REFERENCE_MAX_PAIRS = 1 << 20, 1 << 24
CPU_NOTE = ("CPU run at small sizes with the implementations the CPU target accepts: these are CPU numbers, not GPU "
            "numbers")


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
    details: dict = field(default_factory=dict)
    # min, p10, median, p90, max (us) and count of the samples behind time_us; None in reports saved before it
    spread: dict | None = None


@dataclass
class BenchReport:
    device: str
    target: str
    note: str
    ceilings: dict
    rows: list[Row] = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    skipped_for_time: list[str] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)  # measurements that raised: recorded, the rest still run
    skipped: list[dict] = field(default_factory=list)  # implementations left out on purpose, with the reason
    # Per ceiling: the spread of its samples (as rates) and ``unstable`` when they vary UNSTABLE_RATIO-fold or more.
    ceiling_spread: dict = field(default_factory=dict)

    def unstable_ceilings(self) -> list[str]:
        return [name for name, spread in self.ceiling_spread.items() if spread.get("unstable")]

    def warnings(self) -> list[str]:
        out = []
        for name in self.unstable_ceilings():
            spread = self.ceiling_spread[name]
            out.append(f"ceiling {name} varied {spread['max_over_min']:.1f}x between its {spread['count']} samples "
                       f"(min {format_number(spread['min'])}, max {format_number(spread['max'])}): the fractions of "
                       "it are unreliable (a busy or throttled machine); re-run on an idle machine or with more "
                       "--repeats")
        return out

    def as_dict(self) -> dict:
        return {"device": self.device, "target": self.target, "note": self.note, "settings": self.settings,
                "ceilings": self.ceilings, "ceiling_spread": self.ceiling_spread, "warnings": self.warnings(),
                "rows": [asdict(r) for r in self.rows],
                "skipped_for_time": self.skipped_for_time, "skipped": self.skipped, "errors": self.errors}


def report_from_json(data: dict) -> BenchReport:
    """A saved report (``--json``) back as a `BenchReport`: its table and plots render again without measuring
    (a GPU machine without matplotlib saves the JSON; the plots are drawn elsewhere). Reports saved before the
    spread was recorded read too: their rows have ``spread`` None (the table prints ``-``)."""
    try:
        rows = [Row(**row) for row in data["rows"]]
        return BenchReport(device=data["device"], target=data["target"], note=data.get("note", ""),
                           ceilings=data.get("ceilings", {}), rows=rows, settings=data.get("settings", {}),
                           skipped_for_time=data.get("skipped_for_time", []), errors=data.get("errors", []),
                           skipped=data.get("skipped", []), ceiling_spread=data.get("ceiling_spread", {}))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a dsa-indexer bench report ({type(exc).__name__}: {exc})") from None


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


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return
    backend = getattr(torch, device.type, None)  # torch_npu's torch.npu, and the like
    if device.type != "cpu" and backend is not None and callable(getattr(backend, "synchronize", None)):
        backend.synchronize()


def capture(fn: Callable[[], object], warmup: int = 2):
    """``(graph, output)`` of ``fn`` captured after ``warmup`` side-stream calls (`graphs.capture_graph`)."""
    from .graphs import capture_graph

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


# --- resolution ----------------------------------------------------------------------------------------------------
class _Forced:
    """``with _Forced(op, impl_id):`` resolves ``op`` to that implementation for the block (timing included)."""

    def __init__(self, op: str, impl_id: str) -> None:
        self.op, self.impl_id = op, impl_id

    def __enter__(self):
        default_registry().force(self.op, self.impl_id)

    def __exit__(self, *exc):
        default_registry().force(self.op, None)


def _time_forced(timer: Timer, op: str, impl_id: str, fn: Callable[[], object]) -> float:
    with _Forced(op, impl_id):
        return timer(fn)


def pipeline_variant(impl_id: str, reuse: bool, registered: Sequence[str] = ()) -> str:
    """The row name of a pipeline strategy: its last id segment (``single_stream``, ``dual_stream``), the id less
    ``indexer_pipeline.`` when two registered strategies share that segment; ``+q_lora_reuse`` when reused."""
    short = impl_id.rsplit(".", 1)[-1]
    if sum(1 for other in registered if other.rsplit(".", 1)[-1] == short) > 1:
        short = impl_id.removeprefix(f"{PIPELINE}.")
    return short + (REUSE if reuse else "")


def _fp8_name(dtype: torch.dtype) -> str:
    return "fnuz" if dtype == torch.float8_e4m3fnuz else "fn"


# --- inputs --------------------------------------------------------------------------------------------------------
def random_cache(num_pages: int, device: torch.device, fp8_dtype: torch.dtype, seed: int = 0,
                 layout: str = "paged64_fp8_e4m3"):
    """An index-K cache of random finite keys with positive scales, generated on ``device`` in chunks (a
    128 x 128K-token cache is 2 GiB: no host copy of it). ``layout``: the fp8 pages, or a plain layout (bf16 keys,
    or int8 keys with fp16 scales) for the targets whose kernels read those."""
    from .contract.cache import IndexKCache, page_views

    cache = IndexKCache.allocate(num_pages, device, fp8_dtype, layout)
    gen = torch.Generator(device=device).manual_seed(seed)
    if cache.is_plain:
        for start in range(0, num_pages, 2048):
            stop = min(num_pages, start + 2048)
            values = torch.randn(stop - start, *cache.data.shape[1:], device=device, generator=gen)
            if cache.scales is None:
                cache.data[start:stop] = values.to(cache.data.dtype)
            else:
                cache.data[start:stop] = (values * 40).clamp(-127, 127).round().to(torch.int8)
                cache.scales[start:stop] = (torch.rand(stop - start, *cache.scales.shape[1:], device=device,
                                                       generator=gen) * 0.01 + 1e-3).to(torch.float16)
        return cache
    keys, scales = page_views(cache.data, fp8_dtype)
    limit = torch.finfo(fp8_dtype).max
    step = 2048
    for start in range(0, num_pages, step):
        stop = min(num_pages, start + step)
        keys[start:stop] = (torch.randn(stop - start, *keys.shape[1:], device=device, generator=gen) * 100).clamp(
            -limit, limit).to(fp8_dtype)
        scales[start:stop] = torch.rand(stop - start, scales.shape[1], device=device, generator=gen) * 0.01 + 1e-3
    return cache


def _decode_inputs(batch: int, context: int, device: torch.device, fp8_dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    pages = -(-context // 64)
    cache = random_cache(batch * pages, device, fp8_dtype, seed=seed)
    table = torch.randperm(batch * pages, generator=gen).to(torch.int32).view(batch, pages).to(device)
    q = (torch.randn(batch, 1, HEADS, DIM, generator=gen) * 20).to(fp8_dtype).to(device)
    weights = torch.randn(batch, HEADS, generator=gen).to(device)
    lens = torch.full((batch, 1), context, dtype=torch.int32, device=device)
    return q, cache.data, weights, lens, table, context


def _step_inputs(indexer, batch: int, context: int, device: torch.device, seed: int):
    """(x, q_lora, q_lora_quant, DecodeBatch, cache) of one decode step: every request at ``context`` tokens."""
    from .batch import DecodeBatch

    cfg = indexer.config
    gen = torch.Generator().manual_seed(seed)
    pages = -(-context // 64)
    layout = platform_of(indexer.target.vendor).cache_layout(cfg.compress_ratio)  # what allocate_cache would pick
    cache = random_cache(batch * pages, device, indexer.fp8_dtype, seed=seed, layout=layout)
    table = torch.randperm(batch * pages, generator=gen).to(torch.int32).view(batch, pages)
    db = DecodeBatch.build([context] * batch, table, num_cache_pages=batch * pages, device=device)
    x = torch.randn(batch, cfg.hidden_size, generator=gen).to(device, torch.bfloat16)
    q_a = (torch.randn(batch, cfg.q_lora_rank, generator=gen) * 2).to(device, torch.bfloat16)
    norm_w = (torch.rand(cfg.q_lora_rank, generator=gen) + 0.5).to(device, torch.bfloat16)
    q_lora, q_lora_quant = ops.rmsnorm_quant_fp8(q_a, norm_w, 1e-6)  # what attention hands over
    return x, q_lora, q_lora_quant, db, cache


# --- the suites ----------------------------------------------------------------------------------------------------
class _Run:
    """What every measurement needs: the report, target, device, timer (and the step's indexer, built once)."""

    def __init__(self, report: BenchReport, target: Target, device: torch.device, timer: Timer) -> None:
        self.report, self.target, self.device, self.timer = report, target, device, timer
        self._indexer = None

    @property
    def fp8(self) -> torch.dtype:
        return self.target.fp8_dtype

    def indexer(self):
        if self._indexer is None:
            from .config import IndexerConfig
            from .indexer import Indexer

            self._indexer = Indexer(IndexerConfig.deepseek_v32(), device=self.device).init_random(0)
        return self._indexer

    def accepted(self, op: str, problem, shape: dict, target: Target | None = None, work: int = 0,
                 limit: int = REFERENCE_MAX_TOKENS) -> list[str]:
        """The implementations resolution accepts for ``op``; none at all is recorded in ``errors``. On an
        accelerator the reference is left out (and listed in ``skipped``) when ``work`` exceeds ``limit``."""
        res = default_registry().resolve(op, target or self.target, problem)
        impls = [c.impl.impl_id for c in res.candidates if c.accepted]
        if not impls:
            self.report.errors.append({"op": op, "implementation": "-", "shape": shape,
                                       "error": "no implementation accepted: " + "; ".join(
                                           f"{c.impl.impl_id}: {c.reason}" for c in res.candidates)})
        if self.device.type != "cpu" and work > limit:
            for impl in [i for i in impls if ".reference." in i]:
                impls.remove(impl)
                self.report.skipped.append({"op": op, "implementation": impl, "shape": shape,
                                            "reason": f"the pure-torch reference on an accelerator above {limit} "
                                                      f"(here {work}): seconds per call"})
        return impls

    def timed(self, op: str, impl: str, fn: Callable[[], object], shape: dict) -> float | None:
        """``fn`` timed with ``op`` forced to ``impl``; None (and an entry in ``errors``) when it raises."""
        try:
            return _time_forced(self.timer, op, impl, fn)
        except Exception as exc:  # noqa: BLE001 - one failing implementation must not lose the others' numbers
            if self.device.type == "cuda":
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize()
            text = str(exc).strip().splitlines()
            self.report.errors.append({"op": op, "implementation": impl, "shape": shape,
                                       "error": f"{type(exc).__name__}: {text[0] if text else ''}"})
            return None

    def add(self, suite: str, op: str, impl: str, shape: dict, us: float, amount: float, unit: str,
            ceiling: float | None, **details) -> Row:
        rate = amount / us / (1e3 if unit == "GB/s" else 1e6)
        row = Row(suite, op, impl, shape, float(us), rate, unit, rate / ceiling if ceiling else None,
                  {"timing": self.timer.mode, **details}, getattr(us, "spread", None))
        self.report.rows.append(row)
        return row


def bench_decode(run: _Run, batch: int, context: int) -> None:
    """``lightning_indexer`` (paged logits + top-k) per accepted implementation at one (B, context)."""
    args = _decode_inputs(batch, context, run.device, run.fp8)
    problem = ops.problem("lightning_indexer", heads=HEADS, dim=DIM, next_n=1, k=TOPK, fp8=_fp8_name(run.fp8),
                          slots=False)
    bytes_moved = batch * context * (132 + 4)  # keys + scales read, fp32 logits written (an upper bound)
    shape = {"batch": batch, "context": context}
    for impl in run.accepted("lightning_indexer", problem, shape, work=batch * context):
        us = run.timed("lightning_indexer", impl, lambda: ops.lightning_indexer(*args, TOPK), shape)
        if us is not None:
            run.add("decode", "lightning_indexer", impl, shape, us, bytes_moved, "GB/s",
                    run.report.ceilings["copy_GBps"], bytes=bytes_moved)


def step_floor_bytes(indexer, batch: int, context: int) -> int:
    """The least a decode step must move: its weights, every context key + scale once (132 B), x and q_lora in,
    the int32 top-k out."""
    cfg = indexer.config
    weights = sum(p.numel() * p.element_size() for p in indexer.parameters())
    return weights + batch * context * 132 + batch * (cfg.hidden_size + cfg.q_lora_rank) * 2 + batch * cfg.topk * 4


def bench_decode_step(run: _Run, batch: int, context: int) -> None:
    """One V3.2 indexer decode step per accepted pipeline strategy, without and with q_lora reuse."""
    indexer = run.indexer()
    x, q_lora, quant, db, cache = _step_inputs(indexer, batch, context, run.device, seed=batch * 7 + context)
    floor = step_floor_bytes(indexer, batch, context)
    registered = [i.impl_id for i in default_registry().implementations(PIPELINE)]
    shape = {"batch": batch, "context": context}
    rows = []
    for reuse in (False, True):
        def step(given=quant if reuse else None):
            return indexer(x, q_lora, db.positions, db, cache, q_lora_quant=given)

        try:  # one unforced step: the resolution forward itself makes, whatever problem facts it uses
            step()
        except Exception as exc:  # noqa: BLE001 - e.g. no strategy accepted: recorded, the rest still runs
            run.report.errors.append({"op": PIPELINE, "implementation": "-", "shape": shape,
                                      "error": f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"})
            continue
        for impl in [c.impl.impl_id for c in indexer.last_pipeline.candidates if c.accepted]:
            before = Counter(indexer.reuse_stats)
            us = run.timed(PIPELINE, impl, step, shape)
            if us is None:
                continue
            decided = Counter(indexer.reuse_stats)
            decided.subtract(before)
            details = {"impl_id": impl, "model": indexer.config.name, "bytes": floor}
            if reuse:  # did the GEMM take attention's fp8 q_lora, or was it dropped (and why)?
                drops = sorted(k for k, n in decided.items() if k.startswith("dropped: ") and n > 0)
                details["q_lora_quant"] = "reused" if decided["reused"] > 0 and not drops else (
                    "; ".join(drops) or "not decided")
            rows.append(run.add("decode", PIPELINE, pipeline_variant(impl, reuse, registered), shape, us, floor,
                                "GB/s", run.report.ceilings["copy_GBps"], **details))
    single = {r.implementation.endswith(REUSE): r.time_us for r in rows if r.details["impl_id"] == SINGLE_STREAM}
    for r in rows:
        base = single.get(r.implementation.endswith(REUSE))
        if base and r.details["impl_id"] != SINGLE_STREAM:
            r.details["time_vs_single_stream"] = r.time_us / base
    plain = {r.details["impl_id"]: r.time_us for r in rows if not r.implementation.endswith(REUSE)}
    for r in rows:
        if r.implementation.endswith(REUSE) and r.details["impl_id"] in plain:
            r.details["saved_us_by_reuse"] = plain[r.details["impl_id"]] - r.time_us


def _differing_rows(got: torch.Tensor, want: torch.Tensor) -> int:
    """Rows whose top-k index set differs from torch.topk's (``got`` may be -1 padded past the context)."""
    kk = want.shape[1]
    mine = got.long().sort(dim=1).values[:, -kk:]
    return int((mine != want.long().sort(dim=1).values).any(dim=1).sum())


def bench_topk(run: _Run, batch: int, context: int) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(batch, context, generator=gen).to(run.device)
    ends = torch.full((batch,), context, dtype=torch.int32, device=run.device)
    kk = min(TOPK, context)
    bytes_moved = batch * context * 4
    shape = {"batch": batch, "context": context}
    want = torch.topk(logits, kk, dim=1).indices
    problem = ops.problem("topk_indices", k=TOPK, slots=False, starts=False)
    base_us = run.timer(lambda: torch.topk(logits, kk, dim=1))
    base_mode = run.timer.mode
    for impl in run.accepted("topk_indices", problem, shape, work=batch * context):
        us = run.timed("topk_indices", impl, lambda: ops.topk_indices(logits, TOPK, ends), shape)
        if us is None:
            continue
        with _Forced("topk_indices", impl):
            differ = _differing_rows(ops.topk_indices(logits, TOPK, ends), want)
        run.add("topk", "topk_indices", impl, shape, us, bytes_moved, "GB/s", run.report.ceilings["copy_GBps"],
                bytes=bytes_moved, speedup_vs_torch_topk=base_us / us, rows_differing_from_torch_topk=differ)
    row = run.add("topk", "topk_indices", TORCH_TOPK, shape, base_us, bytes_moved, "GB/s",
                  run.report.ceilings["copy_GBps"], bytes=bytes_moved)
    row.details["timing"] = base_mode


def bench_prefill(run: _Run, queries: int, keys: int) -> None:
    ceiling = run.report.ceilings.get("fp8_matmul_TFLOPs") or run.report.ceilings.get("fp32_matmul_TFLOPs")
    gen = torch.Generator().manual_seed(2)
    q = (torch.randn(queries, HEADS, DIM, generator=gen) * 20).to(run.fp8).to(run.device)
    k = (torch.randn(keys, DIM, generator=gen) * 20).to(run.fp8).to(run.device)
    scales = torch.rand(keys, generator=gen).to(run.device)
    weights = torch.randn(queries, HEADS, generator=gen).to(run.device)
    ke = torch.arange(keys - queries + 1, keys + 1, dtype=torch.int32, device=run.device)  # causal rows
    ks = torch.zeros_like(ke)
    flops = 2 * HEADS * DIM * float(ke.double().sum().cpu())  # the visible (causal) part
    problem = ops.problem("ragged_mqa_logits", heads=HEADS, dim=DIM, fp8=_fp8_name(run.fp8))
    shape = {"queries": queries, "keys": keys}
    for impl in run.accepted("ragged_mqa_logits", problem, shape, work=queries * keys, limit=REFERENCE_MAX_PAIRS):
        us = run.timed("ragged_mqa_logits", impl, lambda: ops.ragged_mqa_logits(q, k, scales, weights, ks, ke), shape)
        if us is not None:
            run.add("prefill", "ragged_mqa_logits", impl, shape, us, flops, "TFLOP/s", ceiling, flops=flops)


# --- progress ------------------------------------------------------------------------------------------------------
class PlainProgress:
    """One line per finished item on ``stream`` (stderr): what a log file or a pipe can read."""

    def __init__(self, total: int, stream=None) -> None:
        self.total, self.done, self.stream = total, 0, stream or sys.stderr
        self.start = time.perf_counter()

    def advance(self, label: str) -> None:
        self.done += 1
        print(f"bench {self.done}/{self.total}: {label} ({time.perf_counter() - self.start:.1f} s)",
              file=self.stream, flush=True)

    def close(self) -> None:
        pass


class _NoProgress(PlainProgress):
    def advance(self, label: str) -> None:
        self.done += 1


class _TqdmProgress:
    def __init__(self, total: int, stream=None) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="bench", unit="item", file=stream or sys.stderr, dynamic_ncols=True)

    def advance(self, label: str) -> None:
        self.bar.set_postfix_str(label, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class _RichProgress:
    def __init__(self, total: int, stream=None) -> None:
        from rich.console import Console
        from rich.progress import Progress

        self.progress = Progress(console=Console(file=stream or sys.stderr))
        self.progress.start()
        self.task = self.progress.add_task("bench", total=total)

    def advance(self, label: str) -> None:
        self.progress.update(self.task, advance=1, description=f"bench {label}")

    def close(self) -> None:
        self.progress.stop()


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def progress_factory(style: str = "auto", stream=None) -> Callable[[int], object]:
    """``factory(total)`` -> an object with ``advance(label)`` and ``close()``, all output on ``stream`` (stderr).

    ``auto``: a rich bar, else a tqdm bar, when ``stream`` is a terminal and the library imports; otherwise (a
    pipe, a log file, neither installed) one plain line per item. ``rich`` / ``tqdm`` insist (ImportError when
    missing), ``plain`` / ``none`` never use either."""
    if style not in PROGRESS_STYLES:
        raise ValueError(f"progress style must be one of {PROGRESS_STYLES}, got {style!r}")
    stream = stream or sys.stderr
    if style == "auto":
        tty = bool(getattr(stream, "isatty", lambda: False)())
        style = ("rich" if tty and _importable("rich") else "tqdm" if tty and _importable("tqdm") else "plain")
    if style in ("rich", "tqdm") and not _importable(style):
        raise ImportError(f"progress style {style!r} needs {style}: pip install {style} (or use plain)")
    cls = {"rich": _RichProgress, "tqdm": _TqdmProgress, "plain": PlainProgress, "none": _NoProgress}[style]
    return lambda total: cls(total, stream)


# --- the run -------------------------------------------------------------------------------------------------------
def run_bench(suites: Sequence[str], device: torch.device | None = None, repeats: int | None = None,
              progress: Callable[[int], object] | None = None, batches: Sequence[int] | None = None,
              contexts: Sequence[int] | None = None, prefill: Sequence[tuple[int, int]] | None = None,
              budget_s: float | None = None) -> BenchReport:
    """Run ``suites`` (see the module docstring). ``batches`` x ``contexts``: the decode / top-k sweep, ``prefill``:
    (queries, keys) pairs (defaults: GPU or CPU sizes). ``budget_s``: start no new item after that many seconds
    (the skipped ones are listed in ``skipped_for_time``). ``progress``: a `progress_factory` result."""
    unknown = sorted(set(suites) - set(SUITES))
    if unknown or not suites:
        raise ValueError(f"suites must be some of {SUITES}, got {list(suites)}")
    for name, values in (("batches", batches), ("contexts", contexts)):
        if values is not None and (not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                                                     for v in values)):
            raise ValueError(f"{name} must be positive ints, got {list(values)}")
    if prefill is not None and (not prefill or any(not 1 <= q <= k for q, k in prefill)):
        raise ValueError(f"prefill shapes must be (queries, keys) with 1 <= queries <= keys, got {list(prefill)}")
    device = device or (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    on_gpu = device.type == "cuda"
    target = detect_target(device)
    progress = progress or progress_factory("none")
    batches = list(batches or (GPU_BATCHES if on_gpu else CPU_BATCHES))
    contexts = list(contexts or (GPU_CONTEXTS if on_gpu else CPU_CONTEXTS))
    prefill = list(prefill or (GPU_PREFILL if on_gpu else CPU_PREFILL))
    grid = [(b, c) for b in batches for c in contexts]
    want = set(suites) | ({"decode", "topk", "prefill"} if "ops" in suites else set())

    def sizes(suite: str, full: list) -> list:  # a suite named itself sweeps; one only there through `ops`: 1 size
        return full if suite in suites else full[:1]

    step = "decode" in suites  # the whole step is not an op: `ops` alone leaves it out
    if step:
        from .config import IndexerConfig

        longest = IndexerConfig.deepseek_v32().max_position
        if max(contexts) > longest:
            raise ValueError(f"the decode step's context is at most DeepSeek-V3.2's max_position={longest} tokens, "
                             f"got {max(contexts)}")
    timer = Timer(device, repeats or (25 if on_gpu else 5))
    started = time.perf_counter()
    report = BenchReport(str(device), str(target), "" if on_gpu else CPU_NOTE, {})
    report.ceilings, report.ceiling_spread = measure_ceilings(device, timer, target.fp8_dtype)
    report.settings = {"suites": list(suites), "repeats": timer.repeats, "batches": batches, "contexts": contexts,
                       "prefill": [list(p) for p in prefill], "budget_s": budget_s,
                       "plugins_failed": list(default_registry().plugins_failed),
                       "timing": ("CUDA-graph replays timed by CUDA events, L2 flushed (256 MiB write) before each, "
                                  "warm-up excluded, median (rows' spread: min, p10, p90, max, count)" if on_gpu
                                  else "wall clock of eager calls, warm-up excluded, median (rows' spread: min, "
                                  "p10, p90, max, count)")}
    run = _Run(report, target, device, timer)
    items: list[tuple[str, Callable[[], None]]] = []
    if "decode" in want:
        items += [(f"decode lightning_indexer B={b} ctx={c}", lambda b=b, c=c: bench_decode(run, b, c))
                  for b, c in sizes("decode", grid)]
    if step:
        items += [(f"decode indexer step B={b} ctx={c}", lambda b=b, c=c: bench_decode_step(run, b, c))
                  for b, c in grid]
    if "topk" in want:
        items += [(f"topk B={b} ctx={c}", lambda b=b, c=c: bench_topk(run, b, c)) for b, c in sizes("topk", grid)]
    if "prefill" in want:
        items += [(f"prefill {q}x{k}", lambda q=q, k=k: bench_prefill(run, q, k))
                  for q, k in sizes("prefill", prefill)]
    bar = progress(len(items))
    try:
        for label, work in items:
            if budget_s is not None and time.perf_counter() - started > budget_s:
                report.skipped_for_time.append(label)
            else:
                work()
                if on_gpu:
                    torch.cuda.empty_cache()  # this shape's cache and graphs go before the next is allocated
            bar.advance(label)
    finally:
        bar.close()
    report.settings["elapsed_s"] = time.perf_counter() - started
    return report


# --- output --------------------------------------------------------------------------------------------------------
def format_number(value: float | None) -> str:
    """Three significant digits (no more than one decimal place from 100 up): a CPU's 0.004 TFLOP/s prints as
    0.004, never as 0.0."""
    if value is None:
        return "-"
    size = abs(value)
    if size == 0 or size >= 100:
        return f"{value:.0f}"
    if size >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}" if size < 1 else f"{value:.2f}"


def ceiling_of(report: BenchReport, unit: str) -> str | None:
    """The ceiling a row of ``unit`` is judged against: copy bandwidth for GB/s, the matmul rate for TFLOP/s."""
    if unit == "GB/s":
        return "copy_GBps"
    if unit == "TFLOP/s":
        return next((name for name in ("fp8_matmul_TFLOPs", "fp32_matmul_TFLOPs") if report.ceilings.get(name)),
                    None)
    return None


def _ceiling_text(report: BenchReport, name: str, value) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return f"{name} {value}"
    spread = report.ceiling_spread.get(name) or {}
    if not spread.get("count"):
        return f"{name} {format_number(value)}"
    text = (f"{name} {format_number(value)} (min {format_number(spread['min'])}, max {format_number(spread['max'])},"
            f" n={spread['count']})")
    return text + (" UNSTABLE" if spread.get("unstable") else "")


def format_table(report: BenchReport) -> str:
    """The report as text: ceilings with their spread, then one row per measurement with the median time and the
    spread of its samples (min, p10-p90, count; ``-`` for reports saved before the spread was recorded), the
    throughput and the fraction of its ceiling (``*``: that ceiling is flagged unstable)."""
    unstable = set(report.unstable_ceilings())
    lines = [f"dsa-indexer bench on {report.device} (target {report.target})" +
             (f"\nnote: {report.note}" if report.note else ""),
             *([f"plugins failed: {'; '.join(report.settings['plugins_failed'])}"]
               if report.settings.get("plugins_failed") else []),
             "ceilings: " + ", ".join(_ceiling_text(report, k, v) for k, v in report.ceilings.items()),
             *(f"warning: {w}" for w in report.warnings()),
             f"{'suite':<8} {'op':<18} {'implementation':<40} {'shape':<24} {'median us':>10} {'min us':>9} "
             f"{'p10-p90 us':>17} {'n':>3} {'throughput':>16} {'of ceiling':>11}"]
    for r in report.rows:
        shape = " ".join(f"{k}={v}" for k, v in r.shape.items())
        frac = "-"
        if r.fraction_of_ceiling is not None:
            frac = f"{100 * r.fraction_of_ceiling:.3g}%" + ("*" if ceiling_of(report, r.unit) in unstable else "")
        spread = r.spread or {}
        low_high = (f"{format_number(spread['p10'])}-{format_number(spread['p90'])}" if spread else "-")
        lines.append(f"{r.suite:<8} {r.op:<18} {r.implementation:<40} {shape:<24} {format_number(r.time_us):>10} "
                     f"{format_number(spread.get('min')):>9} {low_high:>17} {spread.get('count', '-'):>3} "
                     f"{format_number(r.throughput):>10} {r.unit:<5} {frac:>11}")
    if any(ceiling_of(report, r.unit) in unstable and r.fraction_of_ceiling is not None for r in report.rows):
        lines.append("*: a fraction of an unstable ceiling (see the warning above)")
    if any(r.op == PIPELINE for r in report.rows):
        model = next(r.details.get("model") for r in report.rows if r.op == PIPELINE)
        lines.append(f"{PIPELINE}: one {model} indexer decode step per strategy; its floor is its weights + every "
                     f"context key once + its inputs and output; '{REUSE}': attention's fp8 q_lora handed in "
                     "(details.q_lora_quant in the JSON says whether it was reused)")
    if report.skipped_for_time:
        lines.append("skipped for time: " + ", ".join(report.skipped_for_time))
    for e in report.errors:
        shape = " ".join(f"{k}={v}" for k, v in e["shape"].items())
        lines.append(f"FAILED {e['op']} {e['implementation']} {shape}: {e['error']}")
    return "\n".join(lines)


def require_matplotlib():
    """``matplotlib.pyplot`` on the Agg backend, or a RuntimeError that says how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install 'dsa-indexer[bench]'") from None
    return plt


def _by(rows, key) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault(key(r), []).append(r)
    return out


def streams_title(variants: Sequence[str], annotated: bool) -> str:
    """The pipeline plot's title, naming the strategies drawn (a CPU draws single stream only)."""
    strategies = sorted({v.removesuffix(REUSE) for v in variants})
    reuse = {v.endswith(REUSE) for v in variants}
    title = "indexer decode step: " + " vs ".join(strategies)
    if reuse == {True, False}:
        title += ", each without / with q_lora reuse"
    elif reuse == {True}:
        title += ", with q_lora reuse"
    return title + ("\n(bar labels: time relative to single stream)" if annotated else "")


def topk_k_text(contexts: Sequence[int]) -> str:
    """The k of the top-k rows: TOPK, capped by the context where a context is shorter (torch.topk's k there)."""
    return f"k=min({TOPK}, context)" if any(c < TOPK for c in contexts) else f"k={TOPK}"


def write_plots(report: BenchReport, folder) -> list[str]:
    """PNG plots of ``report`` into ``folder`` (created); returns the paths written, for the rows present:
    ``bench_decode.png`` latency vs context per implementation (median, bars p10-p90 where the spread was
    recorded), ``bench_floor.png`` each bandwidth-bound row's bytes / time as a percentage of the measured copy
    bandwidth (for the whole step those bytes are its floor), ``bench_streams.png`` the pipeline strategies' step
    time (those accepted here, with and without q_lora reuse), ``bench_topk.png`` top-k speedup over torch.topk,
    ``bench_prefill.png`` prefill latency. Needs matplotlib (the ``bench`` extra): RuntimeError otherwise."""
    plt = require_matplotlib()
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    title = f"{report.device} ({report.target})" + (", CPU numbers" if report.note else "")
    unstable = set(report.unstable_ceilings())
    written: list[str] = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = folder / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(str(path))

    decode = [r for r in report.rows if r.suite == "decode"]
    if decode:
        per_op = _by(decode, lambda r: r.op)
        fig, axes = plt.subplots(1, len(per_op), figsize=(7 * len(per_op), 4.5), squeeze=False)
        for ax, (op, rows) in zip(axes[0], per_op.items()):
            impls = sorted({r.implementation for r in rows})
            batches = sorted({r.shape["batch"] for r in rows})
            contexts = sorted({r.shape["context"] for r in rows})
            with_spread = all(r.spread for r in rows)
            for (impl, batch), mine in sorted(_by(rows, lambda r: (r.implementation, r.shape["batch"])).items()):
                mine = sorted(mine, key=lambda r: r.shape["context"])
                style = batches.index(batch)
                # p10-p90 bars around the median when every row has its spread (older reports have none)
                bars = ([[max(0.0, r.time_us - r.spread["p10"]) for r in mine],
                         [max(0.0, r.spread["p90"] - r.time_us) for r in mine]] if with_spread else None)
                ax.errorbar([r.shape["context"] for r in mine], [r.time_us for r in mine], yerr=bars,
                            color=f"C{impls.index(impl)}", marker="os^vD<>"[style % 7],
                            linestyle=("-", "--", ":", "-.")[style % 4], capsize=2 if bars else 0,
                            label=f"{impl} B={batch}")
            ax.set_xscale("log", base=2)
            ax.set_xticks(contexts, [f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in contexts])
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("time (us): median, bars p10-p90" if with_spread else "time (us, median)")
            ax.set_title(f"{op}: latency vs context")
            ax.legend(fontsize=6)
        fig.suptitle(title, fontsize=9)
        save(fig, "bench_decode.png")

    bound = [r for r in report.rows if r.unit == "GB/s" and r.fraction_of_ceiling is not None]
    if bound:
        per_op = _by(bound, lambda r: r.op)
        fig, axes = plt.subplots(1, len(per_op), figsize=(6 * len(per_op), 4.5), squeeze=False)
        for ax, (op, rows) in zip(axes[0], per_op.items()):
            shapes = sorted({tuple(r.shape.values()) for r in rows})
            for impl, mine in _by(rows, lambda r: r.implementation).items():
                at = {tuple(r.shape.values()): r.fraction_of_ceiling for r in mine}
                xs = [i for i, s in enumerate(shapes) if s in at]
                ax.plot(xs, [100 * at[shapes[i]] for i in xs], marker="o", label=impl)
            ax.set_xticks(range(len(shapes)), ["x".join(map(str, s)) for s in shapes], rotation=45, fontsize=7)
            ax.set_xlabel("B x context")
            ax.set_ylabel("bytes / time, % of the measured copy bandwidth")
            ax.set_title(f"{op}: bandwidth vs the copy ceiling" + (" (bytes: the step's floor)" if op == PIPELINE
                                                                    else ""), fontsize=9)
            ax.legend(fontsize=6)
        fig.suptitle(f"{title}; copy {format_number(report.ceilings.get('copy_GBps', 0))} GB/s" +
                     (" (UNSTABLE: its samples varied 10x or more)" if "copy_GBps" in unstable else ""), fontsize=9)
        save(fig, "bench_floor.png")

    steps = [r for r in report.rows if r.op == PIPELINE]  # the V3.2 step per strategy
    if steps:
        shapes = sorted({tuple(r.shape.values()) for r in steps})
        variants = sorted({r.implementation for r in steps}, key=lambda v: (v.endswith(REUSE), v))
        width = 0.8 / len(variants)
        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(shapes)), 4.5))
        annotated = False
        for i, variant in enumerate(variants):
            at = {tuple(r.shape.values()): r for r in steps if r.implementation == variant}
            xs = [j for j, s in enumerate(shapes) if s in at]
            bars = ax.bar([j + (i - (len(variants) - 1) / 2) * width for j in xs],
                          [at[shapes[j]].time_us for j in xs], width, label=variant)
            for bar, j in zip(bars, xs):
                ratio = at[shapes[j]].details.get("time_vs_single_stream")
                if ratio is not None:
                    annotated = True
                    ax.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(shapes)), ["x".join(map(str, s)) for s in shapes], fontsize=7)
        ax.set_xlabel("B x context")
        ax.set_ylabel("step time (us, median)")
        ax.set_title(streams_title(variants, annotated), fontsize=9)
        ax.legend(fontsize=7)
        fig.suptitle(title, fontsize=9)
        save(fig, "bench_streams.png")

    topk = [r for r in report.rows if r.suite == "topk" and "speedup_vs_torch_topk" in r.details]
    if topk:
        shapes = sorted({tuple(r.shape.values()) for r in topk})
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(shapes)), 4.5))
        for impl, mine in _by(topk, lambda r: r.implementation).items():
            at = {tuple(r.shape.values()): r.details["speedup_vs_torch_topk"] for r in mine}
            xs = [i for i, s in enumerate(shapes) if s in at]
            ax.plot(xs, [at[shapes[i]] for i in xs], marker="o", label=impl)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="torch.topk")
        ax.set_xticks(range(len(shapes)), ["x".join(map(str, s)) for s in shapes], rotation=45, fontsize=7)
        ax.set_xlabel("B x context")
        ax.set_ylabel("speedup over torch.topk (x, ratio of medians)")
        ax.set_title(f"top-k ({topk_k_text([r.shape['context'] for r in topk])}) vs torch.topk; {title}",
                     fontsize=9)
        ax.legend(fontsize=7)
        save(fig, "bench_topk.png")

    prefill = [r for r in report.rows if r.suite == "prefill"]
    if prefill:
        shapes = sorted({tuple(r.shape.values()) for r in prefill})
        impls = sorted({r.implementation for r in prefill})
        width = 0.8 / len(impls)
        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(shapes)), 4.5))
        for i, impl in enumerate(impls):
            at = {tuple(r.shape.values()): r.time_us for r in prefill if r.implementation == impl}
            xs = [j for j, s in enumerate(shapes) if s in at]
            ax.bar([j + (i - (len(impls) - 1) / 2) * width for j in xs], [at[shapes[j]] for j in xs], width,
                   label=impl)
        ax.set_xticks(range(len(shapes)), ["x".join(map(str, s)) for s in shapes], fontsize=7)
        ax.set_yscale("log")
        ax.set_xlabel("queries x keys (causal)")
        ax.set_ylabel("time (us, median)")
        ax.set_title(f"ragged_mqa_logits (causal prefill logits); {title}", fontsize=9)
        ax.legend(fontsize=7)
        save(fig, "bench_prefill.png")
    return written


def report_json(report: BenchReport, command: Sequence[str] | None = None) -> str:
    from .versions import package_versions

    command = list(command) if command is not None else ["dsa-indexer", *sys.argv[1:]]
    return json.dumps({"command": " ".join(command), "versions": package_versions(), **report.as_dict()}, indent=2,
                      default=str)


def write_json(report: BenchReport, where: str, stream=None, command: Sequence[str] | None = None) -> None:
    """The report as JSON into the file ``where``, or onto ``stream`` (stdout) when ``where`` is ``-``."""
    text = report_json(report, command)
    if where == "-":
        print(text, file=stream or sys.stdout, flush=True)
    else:
        with open(where, "w") as handle:
            handle.write(text + "\n")
