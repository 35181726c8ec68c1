"""The suites: each accepted implementation forced in turn on its inputs, and `run_bench`, which runs the suites."""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from typing import Callable, Sequence

import torch

from .. import ops
from ..testing import decode_step, random_cache, real_decode_logits
from ..contract.step import StepContext
from ..dispatch.plugins import default_registry
from ..dispatch.target import Target, detect_target
from .progress import progress_factory
from .report import (
    BenchReport, CPU_BATCHES, CPU_CONTEXTS, CPU_NOTE, CPU_PREFILL, DIM, GPU_BATCHES, GPU_CONTEXTS, GPU_PREFILL,
    HEADS, PIPELINE, REFERENCE_MAX_PAIRS, REFERENCE_MAX_TOKENS, REUSE, Row, SINGLE_STREAM, SUITES, TOPK,
    TORCH_TOPK)
from .timing import Timer, measure_ceilings


# --- resolution ----------------------------------------------------------------------------------------------------
class _Forced:
    """``with _Forced(op, impl_id):`` resolves ``op`` to that implementation for the block (timing included), then
    restores the override that was there before (a user's `Registry.force` survives a bench row)."""

    def __init__(self, op: str, impl_id: str) -> None:
        self.op, self.impl_id = op, impl_id

    def __enter__(self):
        self.registry = default_registry()
        self.previous = self.registry.force(self.op, self.impl_id)

    def __exit__(self, *exc):
        self.registry.force(self.op, self.previous)


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


# --- inputs --------------------------------------------------------------------------------------------------------
def _decode_inputs(batch: int, context: int, device: torch.device, fp8_dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    pages = -(-context // 64)
    cache = random_cache(batch * pages, device, fp8_dtype, seed=seed)
    table = torch.randperm(batch * pages, generator=gen).to(torch.int32).view(batch, pages).to(device)
    q = (torch.randn(batch, 1, HEADS, DIM, generator=gen) * 20).to(fp8_dtype).to(device)
    weights = torch.randn(batch, HEADS, generator=gen).to(device)
    lens = torch.full((batch, 1), context, dtype=torch.int32, device=device)
    return q, cache.data, weights, lens, table, context


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
            from ..config import IndexerConfig
            from ..indexer import Indexer

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
    problem = ops.problem("lightning_indexer", heads=HEADS, dim=DIM, next_n=1, k=TOPK, fp8=ops.fp8_name(run.fp8),
                          slots=False)
    bytes_moved = batch * context * (132 + 4)  # keys + scales read, fp32 logits written (an upper bound)
    shape = {"batch": batch, "context": context}
    keys_bytes = batch * context * 132  # the floor: every key and scale read once
    kernel_us = _deepgemm_kernel_alone(run, args, shape, keys_bytes)
    for impl in run.accepted("lightning_indexer", problem, shape, work=batch * context):
        us = run.timed("lightning_indexer", impl, lambda: ops.lightning_indexer(*args, TOPK), shape)
        if us is not None:
            extra = {"keys_floor_us": keys_bytes / run.report.ceilings["copy_GBps"] / 1e3}
            if kernel_us:
                extra["time_vs_deepgemm_logits_kernel"] = us / kernel_us
            run.add("decode", "lightning_indexer", impl, shape, us, bytes_moved, "GB/s",
                    run.report.ceilings["copy_GBps"], bytes=bytes_moved, **extra)


DEEPGEMM_PAGED = "paged_mqa_logits.cuda.deepgemm"
DEEPGEMM_KERNEL_ROW = "deepgemm_paged_logits_kernel_alone"


def _deepgemm_kernel_alone(run: _Run, args, shape: dict, keys_bytes: int) -> float | None:
    """DeepGEMM's paged logits kernel alone (no tail mask, its schedule metadata made once per step, as every
    layer after the first sees it), where the registry accepts it: the yardstick of issue 23 (lightning_indexer
    <= 1.15x this). None where DeepGEMM is not accepted here."""
    problem = ops.problem("paged_mqa_logits", heads=HEADS, dim=DIM, next_n=1, fp8=ops.fp8_name(run.fp8))
    res = default_registry().resolve("paged_mqa_logits", run.target, problem)
    if not any(c.accepted and c.impl.impl_id == DEEPGEMM_PAGED for c in res.candidates):
        return None
    with _Forced("paged_mqa_logits", DEEPGEMM_PAGED):
        unmasked = getattr(default_registry().function("paged_mqa_logits", run.target, problem), "unmasked", None)
    if unmasked is None:
        return None
    # One step context for every timed call: the schedule is made once, as a step's later layers see it (a call
    # without a context, a public op alone, makes its own every time).
    step = StepContext()
    us = run.timed("paged_mqa_logits", DEEPGEMM_PAGED, lambda: unmasked(*args, context=step), shape)
    if us is not None:
        run.add("decode", "paged_mqa_logits", DEEPGEMM_KERNEL_ROW, shape, us, keys_bytes, "GB/s",
                run.report.ceilings["copy_GBps"], bytes=keys_bytes)
    return us


def step_floor_bytes(indexer, batch: int, context: int) -> int:
    """The least a decode step must move: its weights, every context key + scale once (132 B), x and q_lora in,
    the int32 top-k out."""
    cfg = indexer.config
    weights = sum(p.numel() * p.element_size() for p in indexer.parameters())
    return weights + batch * context * 132 + batch * (cfg.hidden_size + cfg.q_lora_rank) * 2 + batch * cfg.topk * 4


def bench_decode_step(run: _Run, batch: int, context: int) -> None:
    """One V3.2 indexer decode step per accepted pipeline strategy, without and with q_lora reuse."""
    indexer = run.indexer()
    x, q_lora, quant, db, cache, _ = decode_step(indexer.config, indexer, batch, context, run.device,
                                                 seed=batch * 7 + context)
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
    """Top-k on real decode logits (keys through the V3.2 indexer's k path, queries through its q path, the
    registry's paged logits: `testing.real_decode_logits`), the distribution the engines' kernels are compared on;
    randn rows select differently (no long tail of near-zero ReLU sums). Every row ``context`` long."""
    bench_topk_engine_call(run, "grid", [context] * batch, context, TOPK)


V4_TOPK = 512  # DeepSeek-V4's C4 indexer selects 512 compressed keys
PADDED_WIDTH = 163840  # vLLM pads V3.2 decode logits to max_model_len
PADDED_CELLS = ((1, 8192), (32, 8192), (128, 8192), (32, 32768))
MIXED_ROWS, MIXED_RANGE = (32, 128), (2048, 131072)
V4_CONTEXTS = (2048, 8192, 32768)


def engine_call_cells(on_gpu: bool, batches: Sequence[int], contexts: Sequence[int]) -> list[tuple]:
    """``(family, lengths, width, k)`` of the top-k cells in the ways serving engines call it (issue 35): rows of
    one length in logits padded to max_model_len ("padded"), rows of mixed lengths in that width ("mixed", seeded
    log-uniform), and V4's k = 512 ("v4"). On a GPU the issue's cells; on a CPU the same kinds at this run's sizes."""
    gen = torch.Generator().manual_seed(35)
    if on_gpu:
        padded = [(b, c, PADDED_WIDTH) for b, c in PADDED_CELLS]
        mixed = [(b, *MIXED_RANGE, PADDED_WIDTH) for b in MIXED_ROWS]
        v4 = [(b, c) for c in V4_CONTEXTS for b in batches]
    else:
        width = 4 * max(contexts)
        padded = [(b, min(contexts), width) for b in batches]
        mixed = [(max(batches) * 2, min(contexts) // 2, max(contexts), width)]
        v4 = [(b, c) for c in contexts[:1] for b in batches]
    cells = [("padded", [c] * b, width, TOPK) for b, c, width in padded]
    for b, lo, hi, width in mixed:
        low, high = torch.tensor(float(lo)).log(), torch.tensor(float(hi)).log()
        lengths = (low + (high - low) * torch.rand(b, generator=gen)).exp().round().clamp(lo, hi).long().tolist()
        cells.append(("mixed", lengths, width, TOPK))
    return cells + [("v4", [c] * b, c, V4_TOPK) for b, c in v4]


def bench_topk_engine_call(run: _Run, family: str, lengths: list[int], width: int, k: int) -> None:
    """Top-k on real decode logits laid out as an engine passes them: per-row lengths (``ends``) inside a
    ``width``-wide row whose columns past a row's end hold a value above every real logit (read, they would be
    selected: the differing-rows check catches it). torch.topk, the baseline, runs on the valid prefix of the
    longest row. ``family`` "grid": every row fills the width (the rows keep the B x context shape)."""
    batch, longest = len(lengths), max(lengths)
    real = real_decode_logits(batch, longest, run.device, seed=1, indexer=run.indexer())[0]
    logits = torch.full((batch, width), float(real.max()) * 2 + 1.0, device=run.device)
    for r, n in enumerate(lengths):
        logits[r, :n] = real[r, :n]
    ends = torch.tensor(lengths, dtype=torch.int32, device=run.device)
    shape = {"batch": batch, "context": longest}
    if family != "grid":
        shape.update(width=width, k=k, family=family)
    bytes_moved = sum(lengths) * 4
    prefix = logits[:, :longest]
    base_us = run.timer(lambda: torch.topk(prefix, min(k, longest), dim=1))
    base_mode = run.timer.mode
    problem = ops.problem("topk_indices", k=k, slots=False, starts=False)
    for impl in run.accepted("topk_indices", problem, shape, work=batch * width):
        us = run.timed("topk_indices", impl, lambda: ops.topk_indices(logits, k, ends), shape)
        if us is None:
            continue
        with _Forced("topk_indices", impl):
            got = ops.topk_indices(logits, k, ends)
        differ = 0
        for n in sorted(set(lengths)):
            rows = (ends == n).nonzero().flatten()
            want = torch.topk(logits[rows, :n], min(k, n), dim=1).indices
            differ += _differing_rows(got[rows], want)
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
    problem = ops.problem("ragged_mqa_logits", heads=HEADS, dim=DIM, fp8=ops.fp8_name(run.fp8))
    shape = {"queries": queries, "keys": keys}
    for impl in run.accepted("ragged_mqa_logits", problem, shape, work=queries * keys, limit=REFERENCE_MAX_PAIRS):
        us = run.timed("ragged_mqa_logits", impl, lambda: ops.ragged_mqa_logits(q, k, scales, weights, ks, ke), shape)
        if us is not None:
            run.add("prefill", "ragged_mqa_logits", impl, shape, us, flops, "TFLOP/s", ceiling, flops=flops)


# --- the run -------------------------------------------------------------------------------------------------------
def run_bench(suites: Sequence[str], device: torch.device | None = None, repeats: int | None = None,
              progress: Callable[[int], object] | None = None, batches: Sequence[int] | None = None,
              contexts: Sequence[int] | None = None, prefill: Sequence[tuple[int, int]] | None = None,
              budget_s: float | None = None, inference_mode: bool = False) -> BenchReport:
    """Run ``suites`` (see the module docstring). ``batches`` x ``contexts``: the decode / top-k sweep, ``prefill``:
    (queries, keys) pairs (defaults: GPU or CPU sizes). ``budget_s``: start no new item after that many seconds
    (the skipped ones are listed in ``skipped_for_time``). ``progress``: a `progress_factory` result.
    ``inference_mode``: run every item (inputs, warm-up, capture, timing) under ``torch.inference_mode()``, as vLLM
    and SGLang run their models; the ceilings are measured outside it either way."""
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
        from ..config import IndexerConfig

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
                       "inference_mode": inference_mode,
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
    if "topk" in suites:  # the engines' ways of calling it: only when the top-k suite is asked for by name
        items += [(f"topk {family} B={len(lengths)} len={max(lengths)}{'' if len(set(lengths)) == 1 else ' (mixed)'} "
                   f"width={width} k={k}",
                   lambda f=family, n=lengths, w=width, kk=k: bench_topk_engine_call(run, f, n, w, kk))
                  for family, lengths, width, k in engine_call_cells(on_gpu, batches, contexts)]
    if "prefill" in want:
        items += [(f"prefill {q}x{k}", lambda q=q, k=k: bench_prefill(run, q, k))
                  for q, k in sizes("prefill", prefill)]
    bar = progress(len(items))
    try:
        for label, work in items:
            if budget_s is not None and time.perf_counter() - started > budget_s:
                report.skipped_for_time.append(label)
            else:
                with torch.inference_mode() if inference_mode else contextlib.nullcontext():
                    work()
                if on_gpu:
                    torch.cuda.empty_cache()  # this shape's cache and graphs go before the next is allocated
            bar.advance(label)
    finally:
        bar.close()
    report.settings["elapsed_s"] = time.perf_counter() - started
    return report
