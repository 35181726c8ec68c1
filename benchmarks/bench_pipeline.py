"""Per-layer decode time of the indexer under CUDA-graph replay (CUDA): single vs dual stream, each phase on its
own, and DeepGEMM vs Triton kernels side by side.

    python benchmarks/bench_pipeline.py --out DIR [--quick] [--warm-l2] [--budget-s 240]

DeepSeek-V3.2 shapes (hidden 7168, q_lora_rank 1536, 64 index heads x 128, top-2048, block-fp8 wq_b), random
weights. For decode batches B x context ctx (every request at ctx tokens, next_n = 1):
- the whole step (`DecodeGraph`, one layer) with ``indexer_pipeline`` forced to single stream, then dual stream;
- each phase captured alone into its own graph: q path (weights_proj, wq_b, q prologue), k path (wk, k prologue +
  store), logits (paged MQA logits incl. DeepGEMM's metadata kernel), top-k;
- paged logits with each available implementation (DeepGEMM, Triton) forced in turn.
Then ragged (prefill) causal logits 4096 x 4096 and the wq_b GEMM (1536 -> 8192) for M in {1, 32, 128, 1024}, per
implementation. Implementations are forced with ``default_registry().force(op, impl_id)``.

Timing: CUDA events around each graph replay, L2 flushed (a 256 MiB memset, not timed) before each one, medians
over replays x repeats (``--warm-l2``: back-to-back replays, no flush, mean per repeat, median over repeats).
Writes ``DIR/pipeline.json`` (all numbers, GPU, versions, the implementation that ran each op, the command line)
and prints a compact table last. ``--budget-s`` stops starting new measurements past that many seconds (the GPU
session runs each benchmark under a 300 s timeout); what was skipped is listed in the JSON.
Without CUDA it prints "needs CUDA" and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PIPELINE = "indexer_pipeline"
SINGLE = "indexer_pipeline.generic.single_stream"
DUAL = "indexer_pipeline.cuda.dual_stream"
PAGED_IMPLS = ("paged_mqa_logits.cuda.deepgemm", "paged_mqa_logits.triton.logits")
RAGGED_IMPLS = ("ragged_mqa_logits.cuda.deepgemm", "ragged_mqa_logits.triton.logits")
GEMM_IMPLS = ("gemm_fp8_blockscale.cuda.deepgemm", "gemm_fp8_blockscale.triton.gemm")


class Timer:
    """Times CUDA-graph replays with CUDA events."""

    def __init__(self, replays: int, repeats: int, flush_l2: bool) -> None:
        self.replays, self.repeats, self.flush_l2 = replays, repeats, flush_l2
        self.scratch = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if flush_l2 else None

    def __call__(self, graph: torch.cuda.CUDAGraph) -> dict:
        graph.replay()
        torch.cuda.synchronize()
        samples: list[float] = []
        for _ in range(self.repeats):
            if self.flush_l2:
                starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.replays)]
                ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.replays)]
                for start, end in zip(starts, ends):
                    self.scratch.zero_()  # evict L2; queued ahead, so the host is never the bottleneck
                    start.record()
                    graph.replay()
                    end.record()
                torch.cuda.synchronize()
                samples += [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
            else:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(self.replays):
                    graph.replay()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) * 1e3 / self.replays)
        samples.sort()
        return {"median_us": statistics.median(samples), "p10_us": samples[len(samples) // 10],
                "p90_us": samples[(len(samples) * 9) // 10], "samples": len(samples)}


def capture(fn, warmup: int = 2):
    """Capture ``fn()`` into a graph after eager warm-up on a side stream; returns (graph, its output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def random_cache(pages: int, seed: int):
    """An index-K cache with random fp8 keys and positive scales (filled in chunks to bound temporaries)."""
    from dsa_indexer import IndexKCache
    from dsa_indexer.contract.cache import page_views

    cache = IndexKCache.allocate(pages, device="cuda")
    keys, scales = page_views(cache.data)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    step = 2048
    for start in range(0, pages, step):
        stop = min(pages, start + step)
        keys[start:stop] = (torch.randn(stop - start, 64, 128, device="cuda", generator=gen) * 64).clamp(
            -448, 448).to(torch.float8_e4m3fn)
        scales[start:stop] = torch.rand(stop - start, 64, device="cuda", generator=gen) * 1e-2 + 1e-3
    return cache


class Bench:
    def __init__(self, args) -> None:
        from dsa_indexer import Indexer, IndexerConfig, default_registry
        from dsa_indexer.dispatch.target import detect_target

        self.args = args
        self.registry = default_registry()
        self.target = detect_target("cuda")
        self.indexer = Indexer(IndexerConfig.deepseek_v32(), device="cuda").init_random(0)
        self.timer = Timer(args.replays, args.repeats, not args.warm_l2)
        self.start = time.perf_counter()
        self.skipped: list[str] = []
        self.results: dict = {"decode": [], "paged_logits": [], "ragged_logits": [], "gemm": []}

    # --- helpers ------------------------------------------------------------------------------------------------
    def over_budget(self, what: str) -> bool:
        if time.perf_counter() - self.start > self.args.budget_s:
            self.skipped.append(what)
            return True
        return False

    def usable(self, op: str, impl_id: str, problem) -> str | None:
        """None when ``impl_id`` can run ``op`` here, else the reason (from the resolution trace)."""
        res = self.registry.resolve(op, self.target, problem, force=impl_id)
        if res.chosen is not None:
            return None
        return next((c.reason for c in res.candidates if c.impl.impl_id == impl_id), "not registered")

    def used_impls(self) -> dict:
        return {key[0]: res.chosen.impl_id for key, res in self.registry.used.items()}

    def timed(self, fn, forces: dict | None = None) -> dict:
        """Capture ``fn`` with ``forces`` applied and time its replays: timing + {op: impl that ran}, or the error
        (a failing measurement is recorded, the others still run)."""
        forces = forces or {}
        for op, impl in forces.items():
            self.registry.force(op, impl)
        try:
            self.registry.used.clear()
            self.registry.clear_cache()  # re-resolve on first use, so `used` records what runs
            graph, _ = capture(fn)
            impls = self.used_impls()
            return {**self.timer(graph), "impls": impls}
        except Exception as exc:  # noqa: BLE001
            torch.cuda.synchronize()
            return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
        finally:
            for op in forces:
                self.registry.force(op, None)

    # --- decode grid --------------------------------------------------------------------------------------------
    def decode(self, batch: int, ctx: int) -> None:
        from dsa_indexer import DecodeBatch, ops
        from dsa_indexer.dispatch.problem import Problem, token_bucket
        from dsa_indexer.graphs import DecodeGraph
        from dsa_indexer.pipeline import k_path, q_path

        indexer, cfg = self.indexer, self.indexer.config
        pages_per_req = ctx // 64
        cache = random_cache(batch * pages_per_req, seed=batch * 7 + ctx)
        gen = torch.Generator().manual_seed(batch)
        seq = torch.full((batch,), ctx)
        table = torch.randperm(batch * pages_per_req, generator=gen).to(torch.int32).view(batch, pages_per_req)
        x = torch.randn(batch, cfg.hidden_size, generator=gen).to(torch.bfloat16).cuda()
        q_lora = torch.randn(batch, cfg.q_lora_rank, generator=gen).to(torch.bfloat16).cuda()
        row = {"batch": batch, "ctx": ctx}

        for name, impl in (("single", SINGLE), ("dual", DUAL)):
            reason = self.usable(PIPELINE, impl, Problem(tokens=token_bucket(batch), decode=True, q_lora_quant=False))
            if reason is not None:
                row[name] = {"skipped": reason}
                continue
            self.registry.force(PIPELINE, impl)
            try:
                self.registry.used.clear()
                self.registry.clear_cache()  # re-resolve on first use, so `used` records what runs
                graph = DecodeGraph.capture(indexer, cache, batch, ctx)
                graph.replay(x, q_lora, seq, table)
                row[name] = {**self.timer(graph.graph), "impls": self.used_impls(),
                             "pipeline": indexer.last_pipeline.chosen.impl_id}
                del graph
            except Exception as exc:  # noqa: BLE001 - record it, keep measuring the rest
                torch.cuda.synchronize()
                row[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
            finally:
                self.registry.force(PIPELINE, None)
        if "median_us" in row.get("single", {}) and "median_us" in row.get("dual", {}):
            row["dual_speedup"] = row["single"]["median_us"] / row["dual"]["median_us"]

        # Phases, each alone in its own graph, with the default implementations.
        db = DecodeBatch.build(seq, table, next_n=1, max_context_len=ctx, device="cuda")
        q_fp8, weights = q_path(indexer, x, q_lora, db.positions, None)
        q4 = q_fp8.view(batch, 1, cfg.n_heads, cfg.head_dim)
        logits = ops.paged_mqa_logits(q4, cache.data, weights, db.context_lens, db.block_table, ctx)
        ends = db.context_lens.reshape(-1)
        phases = {
            "q_path": lambda: q_path(indexer, x, q_lora, db.positions, None),
            "k_path": lambda: k_path(indexer, x, db.positions, db.slot_mapping, cache.data),
            "logits": lambda: ops.paged_mqa_logits(q4, cache.data, weights, db.context_lens, db.block_table, ctx),
            "topk": lambda: ops.topk_indices(logits, cfg.topk, ends),
        }
        row["phases"] = {}
        for name, fn in phases.items():
            row["phases"][name] = self.timed(fn)
        self.results["decode"].append(row)

        # Paged logits per implementation.
        problem = Problem(heads=cfg.n_heads, dim=cfg.head_dim, next_n=1, fp8="fn")
        nbytes = batch * ctx * (132 + 4)  # keys + scales read once, fp32 logits written once
        for impl in PAGED_IMPLS:
            reason = self.usable("paged_mqa_logits", impl, problem)
            entry = {"batch": batch, "ctx": ctx, "impl": impl}
            if reason is not None:
                entry["skipped"] = reason
            else:
                timing = self.timed(phases["logits"], {"paged_mqa_logits": impl})
                entry.update(timing)
                if "median_us" in timing:
                    entry["GBps"] = nbytes / timing["median_us"] / 1e3
            self.results["paged_logits"].append(entry)

    # --- prefill logits and the wq_b GEMM -----------------------------------------------------------------------
    def ragged(self, s: int = 4096, n: int = 4096) -> None:
        from dsa_indexer import ops
        from dsa_indexer.backends.reference import kernels as ref
        from dsa_indexer.dispatch.problem import Problem

        q, _ = ref.quant_fp8_groups(torch.randn(s, 64, 128, device="cuda"), 128)
        k, k_scale = ref.quant_fp8_groups(torch.randn(n, 128, device="cuda"), 128)
        k_scale = k_scale.squeeze(-1)
        weights = torch.randn(s, 64, device="cuda")
        ks = torch.zeros(s, dtype=torch.int32, device="cuda")
        ke = (torch.arange(s, device="cuda") + n - s + 1).to(torch.int32)
        flops = 2 * 64 * 128 * int((ke - ks).sum())
        for impl in RAGGED_IMPLS:
            entry = {"s": s, "n": n, "impl": impl}
            reason = self.usable("ragged_mqa_logits", impl, Problem(heads=64, dim=128, fp8="fn"))
            if reason is not None:
                entry["skipped"] = reason
            elif not self.over_budget(f"ragged {impl}"):
                timing = self.timed(lambda: ops.ragged_mqa_logits(q, k, k_scale, weights, ks, ke),
                                    {"ragged_mqa_logits": impl})
                entry.update(timing)
                if "median_us" in timing:
                    entry["TFLOPs"] = flops / timing["median_us"] / 1e6
            else:
                entry["skipped"] = "time budget"
            self.results["ragged_logits"].append(entry)

    def gemm(self, ms: tuple[int, ...]) -> None:
        from dsa_indexer import ops
        from dsa_indexer.backends.reference import kernels as ref
        from dsa_indexer.dispatch.problem import Problem

        w, w_scale = self.indexer.wq_b.weight, self.indexer.wq_b.weight_scale_inv
        n, kdim = w.shape
        problem = Problem(n=n, k=kdim, out=str(torch.bfloat16), fp8="fn")
        for m in ms:
            a, sa = ref.quant_fp8_groups(torch.randn(m, kdim, device="cuda").to(torch.bfloat16), 128)
            for impl in GEMM_IMPLS:
                entry = {"m": m, "n": n, "k": kdim, "impl": impl}
                reason = self.usable("gemm_fp8_blockscale", impl, problem)
                if reason is not None:
                    entry["skipped"] = reason
                elif not self.over_budget(f"gemm M={m} {impl}"):
                    timing = self.timed(lambda: ops.gemm_fp8_blockscale(a, sa, w, w_scale, torch.bfloat16),
                                        {"gemm_fp8_blockscale": impl})
                    entry.update(timing)
                    if "median_us" in timing:
                        entry["TFLOPs"] = 2 * m * n * kdim / timing["median_us"] / 1e6
                else:
                    entry["skipped"] = "time budget"
                self.results["gemm"].append(entry)


def _versions() -> dict:
    import importlib.metadata as md

    import dsa_indexer

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "dsa_indexer": dsa_indexer.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        out["triton"] = None
    try:
        import deep_gemm

        out["deep_gemm"] = getattr(deep_gemm, "__version__", None) or md.version("deep_gemm")
    except Exception as exc:  # noqa: BLE001
        out["deep_gemm"] = f"not importable ({type(exc).__name__})"
    return out


def _fmt(entry: dict, key: str = "median_us") -> str:
    return f"{entry[key]:.1f}" if key in entry else "-"


def print_table(report: dict) -> None:
    print(f"\n{report['gpu']}  ({'L2 flushed' if report['settings']['flush_l2'] else 'warm L2'}; medians, us)")
    print(f"{'B':>4} {'ctx':>6} {'single':>8} {'dual':>8} {'x':>5} | {'q_path':>7} {'k_path':>7} {'logits':>7} "
          f"{'topk':>7}  logits impl")
    for row in report["decode"]:
        ph = row.get("phases", {})
        impl = ph.get("logits", {}).get("impls", {}).get("paged_mqa_logits", "?").split(".", 1)[-1]
        speed = f"{row['dual_speedup']:.2f}" if "dual_speedup" in row else "-"
        print(f"{row['batch']:>4} {row['ctx']:>6} {_fmt(row.get('single', {})):>8} {_fmt(row.get('dual', {})):>8} "
              f"{speed:>5} | {_fmt(ph.get('q_path', {})):>7} {_fmt(ph.get('k_path', {})):>7} "
              f"{_fmt(ph.get('logits', {})):>7} {_fmt(ph.get('topk', {})):>7}  {impl}")
    by_shape: dict = {}
    for e in report["paged_logits"]:
        by_shape.setdefault((e["batch"], e["ctx"]), {})[e["impl"].split(".")[1]] = e
    if by_shape:
        print(f"\npaged logits {'B x ctx':>12} {'deepgemm us':>12} {'GB/s':>6} {'triton us':>10} {'GB/s':>6}")
        for (b, c), impls in by_shape.items():
            dg, tr = impls.get("cuda", {}), impls.get("triton", {})
            print(f"{'':12} {f'{b}x{c}':>12} {_fmt(dg):>12} {_fmt(dg, 'GBps'):>6} {_fmt(tr):>10} {_fmt(tr, 'GBps'):>6}")
    for name, key, label in (("ragged_logits", "TFLOPs", "ragged 4096x4096 causal"), ("gemm", "TFLOPs", "wq_b GEMM")):
        for e in report[name]:
            shape = f"M={e['m']}" if "m" in e else f"{e['s']}x{e['n']}"
            what = e.get("skipped") or e.get("error") or f"{_fmt(e)} us, {_fmt(e, key)} TFLOP/s"
            print(f"{label:<24} {shape:>7} {e['impl']:<36} {what}")
    if report["skipped_for_time"]:
        print(f"skipped for time: {', '.join(report['skipped_for_time'])}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for pipeline.json")
    parser.add_argument("--quick", action="store_true", help="B in {1, 32}, ctx 8192, fewer replays")
    parser.add_argument("--warm-l2", action="store_true", help="do not flush L2 between replays")
    parser.add_argument("--replays", type=int, default=None, help="replays per repeat (default 50, quick 20)")
    parser.add_argument("--repeats", type=int, default=None, help="repeats (default 5, quick 3)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="start no new measurement after this")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 0
    args.replays = args.replays or (20 if args.quick else 50)
    args.repeats = args.repeats or (3 if args.quick else 5)
    batches = (1, 32) if args.quick else (1, 8, 32, 64, 128, 256)
    contexts = (8192,) if args.quick else (8192, 32768)
    gemm_ms = (1, 128) if args.quick else (1, 32, 128, 1024)

    bench = Bench(args)
    for ctx in contexts:
        for batch in batches:
            if not bench.over_budget(f"decode B={batch} ctx={ctx}"):
                bench.decode(batch, ctx)
                gc.collect()  # this shape's cache and graphs go before the next one is allocated
                torch.cuda.empty_cache()
                print(f"decode B={batch} ctx={ctx} done at {time.perf_counter() - bench.start:.0f} s", flush=True)
    bench.ragged()
    bench.gemm(gemm_ms)

    props = torch.cuda.get_device_properties(0)
    report = {
        "gpu": torch.cuda.get_device_name(0), "sm_count": props.multi_processor_count,
        "target": str(bench.target), "versions": _versions(), "command": [sys.executable, *sys.argv],
        "settings": {"replays": args.replays, "repeats": args.repeats, "flush_l2": not args.warm_l2,
                     "quick": args.quick, "budget_s": args.budget_s},
        "deep_gemm_fact": bench.registry.environment.missing("deep_gemm") or "present (self-test passed)",
        **bench.results, "skipped_for_time": bench.skipped,
        "elapsed_s": time.perf_counter() - bench.start,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline.json").write_text(json.dumps(report, indent=2, default=str))
    print_table(report)
    print(f"\nwrote {out / 'pipeline.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
