"""One DeepSeek-V3.2 indexer layer's causal prefill of T tokens through `Indexer.forward` (issue 13), on a GPU.

    python benchmarks/bench_prefill_layer.py [--tokens 8192,32768,131072] [--once 1048576] [--repeats 3]
        [--json PATH] [--model v32|v4] [--only PARTS] [--once-only PARTS]

One request of T new tokens, no prefix, random weights (`init_random`), the default prefill budget (2 GiB);
``--model v4``: V4-Flash's C4 indexer (its compressor stores T / 4 keys first, then top-512 scoring). For each T:

* host planning: `PrefillBatch.build` and the first (and the cached) `plan_chunks` call, in ms;
* the whole layer, `Indexer.forward` (keys stored first, then per planned chunk: q path + scoring), once per
  `ragged_mqa_topk` implementation the registry accepts (forced in turn): the fused Triton kernel and the
  composition of the best ragged logits and top-k (DeepGEMM + the CUDA radix top-k where built);
* the scoring alone over the same chunks and the same q: `ragged_mqa_topk` per implementation, and the ragged
  logits kernel alone (`ragged_mqa_logits`, the resolved best), so scoring / logits is the fused top-k's overhead;
* peak memory: the rise of `torch.cuda.max_memory_allocated` over what was allocated before the call, with the
  budget and the int32 [T, 2048] output for comparison.

Times are CUDA events around the call, median of --repeats after one warm-up (--once sizes: one timed run, no
warm-up beyond the compile of the smaller sizes). The outputs of the implementations are compared (sets per row).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dsa_indexer import CompressorState, IndexerConfig, Indexer, IndexKCache, PrefillBatch, ops  # noqa: E402
from dsa_indexer.bench.timing import topk_set_agreement  # noqa: E402
from dsa_indexer.dispatch.plugins import default_registry  # noqa: E402

OP = "ragged_mqa_topk"
SCORING_ALONE_MAX_TOKENS = 262144


ALLOCATOR_COUNTS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def _allocator_counts() -> dict[str, int]:
    stats = torch.cuda.memory_stats()
    return {name: int(stats.get(name, -1)) for name in ALLOCATOR_COUNTS}


def _timed(fn, repeats: int, warmup: bool, extra: dict | None = None) -> tuple[float, float, object]:
    """(median ms, peak GiB above what was allocated before the first call, the last call's result). ``extra``
    (when given) receives the warm-up call's ms and the caching allocator's cudaMalloc / cudaFree / retry counts
    during the timed calls (a first call that grows the allocator pays for it)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    if warmup:
        started, counts = time.perf_counter(), _allocator_counts()
        fn()
        torch.cuda.synchronize()
        if extra is not None:
            extra["warmup_ms"] = (time.perf_counter() - started) * 1e3
            after = _allocator_counts()
            extra["allocator_during_warmup"] = {name: after[name] - counts[name] for name in ALLOCATOR_COUNTS}
    before = _allocator_counts()
    times, result = [], None
    for _ in range(repeats):
        result = None  # free the previous output: it is not part of the next call's peak
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    if extra is not None:
        after = _allocator_counts()
        extra["allocator_during_timed_calls"] = {name: after[name] - before[name] for name in ALLOCATOR_COUNTS}
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**30, result


def bench(tokens: int, repeats: int, warmup: bool, model: str = "v32", only: tuple[str, ...] = ()) -> dict:
    if model == "v4":  # V4-Flash's C4 indexer: one compressed key per 4 tokens, top-512, its compressor's state
        cfg = IndexerConfig.deepseek_v4_flash()
        ratio = 4
    else:
        cfg = IndexerConfig.deepseek_v32(max_position=max(163840, tokens + 64))
        ratio = 1
    indexer = Indexer(cfg, device="cuda").init_random(0)
    pages = tokens // ratio // 64 + 2
    table = torch.randperm(pages).to(torch.int32).view(1, pages)
    state = CompressorState.allocate(1, cfg, "cuda") if ratio == 4 else None  # a request from position 0 never
    # reads it, so every timed call may reuse it
    t0 = time.perf_counter()
    batch = PrefillBatch.build([0], [tokens], table, num_cache_pages=pages, device="cuda", compress_ratio=ratio)
    build_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    plan = batch.plan_chunks(indexer.logits_budget_bytes, indexer.q_path_bytes_per_row())
    plan_ms = (time.perf_counter() - t0) * 1e3
    fresh = []  # the host's noise: four more first-time plans (budgets 1-4 bytes larger, so none is the cached one)
    for extra in range(1, 5):
        t0 = time.perf_counter()
        batch.plan_chunks(indexer.logits_budget_bytes + extra, indexer.q_path_bytes_per_row())
        fresh.append((time.perf_counter() - t0) * 1e3)
    plan_ms_median = statistics.median([plan_ms, *fresh])
    t0 = time.perf_counter()
    batch.plan_chunks(indexer.logits_budget_bytes, indexer.q_path_bytes_per_row())
    plan_cached_ms = (time.perf_counter() - t0) * 1e3
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, cfg.hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
    q_lora = torch.randn(tokens, cfg.q_lora_rank, device="cuda", generator=gen).to(torch.bfloat16)
    registry = default_registry()
    res = registry.resolve(OP, indexer.target, ops.problem(OP, heads=64, dim=128, fp8="fn", k=cfg.topk))
    logits_impl = registry.resolve("ragged_mqa_logits", indexer.target,
                                   ops.problem("ragged_mqa_logits", heads=64, dim=128, fp8="fn")).chosen.impl_id
    impls = [c.impl.impl_id for c in res.candidates if c.accepted and c.impl.vendor != "reference"]
    if only:
        impls = [impl for impl in impls if any(part in impl for part in only)]
    report = {"model": cfg.name, "tokens": tokens, "keys": tokens // ratio, "topk": cfg.topk, "chunks": len(plan),
              "budget_GiB": indexer.logits_budget_bytes / 2**30,
              "output_GiB": tokens * cfg.topk * 4 / 2**30, "build_ms": build_ms, "plan_ms": plan_ms,
              "plan_ms_median_of_5": plan_ms_median,
              "plan_cached_ms": plan_cached_ms, "implementations": impls, "logits_impl": logits_impl,
              "layer_ms": {}, "layer_peak_GiB": {},
              "scoring_ms": {}, "scoring_peak_GiB": {}}
    cache = IndexKCache.allocate(pages, "cuda", indexer.fp8_dtype)
    report["keys_GiB"] = batch.gather_slots.numel() * 132 / 2**30
    report["layer_chunks"] = {}
    outputs = {}
    for impl in impls:
        registry.force(OP, impl)
        try:
            report["layer_chunks"][impl] = len(batch.plan_chunks(indexer.logits_budget_bytes,
                                                                 *indexer.scoring_plan_bytes()))
            report.setdefault("layer_timing", {})[impl] = timing = {}
            report["layer_ms"][impl], report["layer_peak_GiB"][impl], outputs[impl] = _timed(
                lambda: indexer(x, q_lora, batch.positions, batch, cache, compressor_state=state), repeats, warmup,
                timing)
        finally:
            registry.force(OP, None)
    if len(outputs) > 1:
        first, *rest = list(outputs)
        report["set_agreement_vs_" + first] = {impl: topk_set_agreement(outputs[impl], outputs[first]) for impl in rest}
    outputs.clear()
    if tokens > SCORING_ALONE_MAX_TOKENS or not impls:  # q for every row at once would hold ~57 KiB per token
        report["scoring_ms"] = f"not measured above {SCORING_ALONE_MAX_TOKENS} tokens (q of every row at once)"
        return report
    # Scoring alone over the same chunks: q for every row once, keys gathered once (as _score_planned does).
    q_fp8, weights = (step := indexer.step_plan(tokens, False)).steps.q_path(step, x, q_lora, batch.positions, None)
    keys, scales = cache.gather(batch.gather_slots)

    def scoring(score):
        out = torch.empty(tokens, cfg.topk, dtype=torch.int32, device="cuda")
        for start, stop, lo, hi in plan:
            score(start, stop, lo, hi, out)
        return out

    # The logits kernel alone: the resolved implementation's function, and where it has one (DeepGEMM) its padded
    # form, so the copy to a contiguous [rows, keys] is not counted as the kernel's time.
    logits_fn = registry.function("ragged_mqa_logits", indexer.target,
                                  ops.problem("ragged_mqa_logits", heads=64, dim=128, fp8="fn"))
    logits_fn = getattr(logits_fn, "padded", logits_fn)

    def logits_only(start, stop, lo, hi, out):
        logits_fn(q_fp8[start:stop], keys[lo:hi], scales[lo:hi], weights[start:stop], batch.ks[start:stop] - lo,
                  batch.ke[start:stop] - lo)

    report["scoring_ms"]["ragged_mqa_logits alone"], _, _ = _timed(lambda: scoring(logits_only), repeats, warmup)
    for impl in impls:
        registry.force(OP, impl)
        try:
            def topk_chunk(start, stop, lo, hi, out):
                out[start:stop] = ops.ragged_mqa_topk(q_fp8[start:stop], keys[lo:hi], scales[lo:hi],
                                                      weights[start:stop], batch.ks[start:stop] - lo,
                                                      batch.ke[start:stop] - lo, cfg.topk)

            report["scoring_ms"][impl], report["scoring_peak_GiB"][impl], _ = _timed(lambda: scoring(topk_chunk),
                                                                                     repeats, warmup)
        finally:
            registry.force(OP, None)
    logits = report["scoring_ms"]["ragged_mqa_logits alone"]
    report["scoring_over_logits"] = {impl: report["scoring_ms"][impl] / logits for impl in impls}
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="8192,32768,131072", help="comma-separated T (timed --repeats times)")
    parser.add_argument("--once", default="", help="comma-separated T timed once (e.g. 1048576)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--model", choices=("v32", "v4"), default="v32",
                        help="v32: DeepSeek-V3.2 (top-2048); v4: V4-Flash's C4 indexer (top-512, keys = tokens / 4)")
    parser.add_argument("--only", default="", help="comma-separated parts of implementation ids to run (all: '')")
    parser.add_argument("--once-warm", action="store_true",
                        help="give the --once sizes one untimed warm-up call first (its time is reported)")
    parser.add_argument("--once-only", default="composed",
                        help="like --only, for the --once sizes (default: the composition alone)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_prefill_layer needs a CUDA GPU; `dsa-indexer bench --suite prefill` runs on a CPU")
        return 0
    results = {"command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]),
               "device": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": []}
    only = tuple(part for part in args.only.split(",") if part)
    once_only = tuple(part for part in args.once_only.split(",") if part)
    sizes = [(int(t), args.repeats, True, only) for t in args.tokens.split(",") if t]
    sizes += [(int(t), 1, args.once_warm, once_only) for t in args.once.split(",") if t]
    for tokens, repeats, warmup, parts in sizes:
        started = time.perf_counter()
        run = bench(tokens, repeats, warmup, args.model, parts)
        torch.cuda.empty_cache()
        run["wall_s"] = time.perf_counter() - started
        results["runs"].append(run)
        short = {key: run[key] for key in ("model", "tokens", "chunks", "layer_chunks", "plan_ms", "plan_ms_median_of_5",
                                           "layer_ms", "layer_timing", "layer_peak_GiB", "scoring_ms", "scoring_over_logits",
                                           "wall_s")
                 if key in run}
        print(json.dumps(short, separators=(",", ":")), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
