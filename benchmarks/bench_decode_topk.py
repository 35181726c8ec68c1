"""The decode step and its top-k on the GPU (issue 8): every top-k that resolves here beside torch.topk on REAL
indexer logits and on randn logits, the whole V3.2 decode step single vs dual stream beside a naive step, and the
in-step paged logits beside DeepGEMM's kernel alone.

    python benchmarks/bench_decode_topk.py --out DIR [--quick] [--budget-s 420]

Real logits: a cache of 1M random tokens whose keys the project's own k path stored (random bf16 activations,
seeded random V3.2 weights), queries from its q path over random activations, paged logits through the
registry (DeepGEMM where it runs); each request's block table draws random pages of that cache. randn logits:
``torch.randn`` of the same shape. Top-k: k = 2048 over each row's full context, B in {1, 8, 32, 64, 128} x ctx
in {8K, 32K, 128K}; every ``topk_indices`` implementation that resolves here (forced in turn), FlashInfer's
``top_k`` when ``flashinfer`` imports, and ``torch.topk`` (on the same logits). Each is timed under CUDA-graph
replay and eagerly, L2 flushed before every call (a 256 MiB write), medians. Their index sets are compared
with torch.topk's (ties aside: the count of rows whose sets differ is recorded).

Decode step (V3.2, one layer, B x ctx for B in {1, 8, 32, 64, 128}, ctx in {8K, 32K}): `DecodeGraph` replay with
the pipeline forced to single and to dual stream; the library step with four layers in one graph sharing one
batch (per-layer time: the schedule metadata is computed once per step); and a naive step written here the way
an engine without this library would: torch ops for the quant, RoPE, Hadamard and cache store, DeepGEMM's
GEMM, metadata and paged logits, a -inf mask and torch.topk, single and dual stream. Same timer, same process.

Also the Triton rows-path diagnosis: the Triton top-k on real logits, on the same logits with columns shuffled,
on randn, and on randn moved to the real rows' mean and spread.

Writes DIR/decode_topk.json (with the command) and prints a table last. Without CUDA: "needs CUDA", exit 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pipeline import _versions, capture  # noqa: E402

TOPK = 2048
BASE_TOKENS = 1 << 20
TOPK_IMPLS = ("topk_indices.cuda.radix", "topk_indices.triton.topk")


class Timer:
    """Medians of CUDA-event-timed calls, L2 flushed before each (the flush is queued, never timed)."""

    def __init__(self, calls: int) -> None:
        self.calls = calls
        self.scratch = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def __call__(self, fn) -> dict:
        fn()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.calls)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.calls)]
        for start, end in zip(starts, ends):
            self.scratch.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        samples = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
        return {"median_us": statistics.median(samples), "p10_us": samples[len(samples) // 10],
                "p90_us": samples[(len(samples) * 9) // 10], "calls": len(samples)}

    def graph(self, fn) -> dict:
        graph, _ = capture(fn)
        out = self(graph.replay)
        del graph
        return out


def copy_bandwidth(timer: Timer) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src))
    return 2 * src.numel() / t["median_us"] / 1e3  # GB/s


class RealKeys:
    """One cache of BASE_TOKENS real keys (the k path over random activations), shared by every shape."""

    def __init__(self, indexer, seed: int = 0) -> None:
        from dsa_indexer import IndexKCache
        from dsa_indexer.contract.cache import PAGE_SIZE
        from dsa_indexer.pipeline import k_path

        cfg = indexer.config
        self.indexer = indexer
        self.pages = BASE_TOKENS // PAGE_SIZE
        self.cache = IndexKCache.allocate(self.pages, device="cuda")
        gen = torch.Generator(device="cuda").manual_seed(seed)
        step = 1 << 16
        for start in range(0, BASE_TOKENS, step):
            x = torch.randn(step, cfg.hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
            pos = torch.arange(start, start + step, device="cuda") % cfg.max_position
            k_path(indexer, x, pos, torch.arange(start, start + step, device="cuda"), self.cache.data)
        torch.cuda.synchronize()

    def step(self, batch: int, ctx: int, seed: int):
        """(q [B,1,H,D] fp8, weights, context_lens [B,1], block_table, x, q_lora) of a decode step over ctx."""
        from dsa_indexer.pipeline import q_path

        cfg = self.indexer.config
        gen = torch.Generator(device="cuda").manual_seed(seed)
        pages = -(-ctx // 64)
        table = torch.randint(0, self.pages, (batch, pages), device="cuda", generator=gen, dtype=torch.int32)
        x = torch.randn(batch, cfg.hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
        q_lora = torch.randn(batch, cfg.q_lora_rank, device="cuda", generator=gen).to(torch.bfloat16)
        pos = torch.full((batch,), ctx - 1, device="cuda", dtype=torch.int64)
        q_fp8, weights = q_path(self.indexer, x, q_lora, pos, None)
        lens = torch.full((batch, 1), ctx, dtype=torch.int32, device="cuda")
        return q_fp8.view(batch, 1, cfg.n_heads, cfg.head_dim), weights, lens, table, x, q_lora

    def logits(self, batch: int, ctx: int, seed: int) -> torch.Tensor:
        from dsa_indexer import ops

        q, weights, lens, table, _, _ = self.step(batch, ctx, seed)
        return ops.paged_mqa_logits(q, self.cache.data, weights, lens, table, ctx)


def flashinfer_topk():
    """FlashInfer's top-k as a callable (logits, k) -> indices, or the reason it is not usable here."""
    try:
        from dsa_indexer.backends.cuda.flashinfer_topk import load_flashinfer_top_k
    except ImportError as exc:
        return None, f"adapter missing: {exc}"
    try:
        return load_flashinfer_top_k(), None
    except Exception as exc:  # noqa: BLE001
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


class Bench:
    def __init__(self, args) -> None:
        from dsa_indexer import Indexer, IndexerConfig, default_registry
        from dsa_indexer.dispatch.target import detect_target

        self.args = args
        self.registry = default_registry()
        self.target = detect_target("cuda")
        self.indexer = Indexer(IndexerConfig.deepseek_v32(), device="cuda").init_random(0)
        self.timer = Timer(args.calls)
        self.start = time.perf_counter()
        self.skipped: list[str] = []
        self.results: dict = {"topk": [], "triton_diagnosis": [], "decode_step": [], "logits_in_step": []}
        self.copy_gbps = copy_bandwidth(self.timer)
        self.keys = RealKeys(self.indexer)
        self.fi, self.fi_reason = flashinfer_topk()

    def over_budget(self, what: str) -> bool:
        if time.perf_counter() - self.start > self.args.budget_s:
            self.skipped.append(what)
            return True
        return False

    def topk_impl(self, impl: str):
        """The callable of one topk_indices implementation, or the reason it does not resolve here."""
        from dsa_indexer.dispatch.problem import Problem

        res = self.registry.resolve("topk_indices", self.target, Problem(k=TOPK, slots=False, starts=False),
                                    force=impl)
        if res.chosen is None:
            return None, next((c.reason for c in res.candidates if c.impl.impl_id == impl), "not registered")
        return self.registry._factory_result(res.chosen), None

    # --- top-k -------------------------------------------------------------------------------------------------
    def topk(self, batch: int, ctx: int) -> None:
        real = self.keys.logits(batch, ctx, seed=batch * 1000 + ctx)
        ends = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        for kind, logits in (("real", real), ("randn", torch.randn_like(real))):
            row = {"B": batch, "ctx": ctx, "logits": kind, "impls": {}}
            want = torch.topk(logits, TOPK, dim=1).indices.sort(dim=1).values
            row["torch.topk"] = {"graph": self.timer.graph(lambda: torch.topk(logits, TOPK, dim=1)),
                                 "eager": self.timer(lambda: torch.topk(logits, TOPK, dim=1))}
            impls = [(impl, *self.topk_impl(impl)) for impl in TOPK_IMPLS]
            impls.append(("flashinfer.top_k", self.fi, self.fi_reason))
            for impl, fn, reason in impls:
                if fn is None:
                    row["impls"][impl] = {"skipped": reason}
                    continue
                call = (lambda: fn(logits, TOPK)) if impl == "flashinfer.top_k" else (lambda: fn(logits, TOPK, ends))
                try:
                    got = call()
                    entry = {"graph": self.timer.graph(call), "eager": self.timer(call),
                             "rows_differing_from_torch_topk": int((got.long().sort(dim=1).values != want)
                                                                   .any(dim=1).sum())}
                except Exception as exc:  # noqa: BLE001 - record it, measure the rest
                    torch.cuda.synchronize()
                    entry = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
                for mode in ("graph", "eager"):
                    if mode in entry:
                        entry[f"speedup_vs_torch_{mode}"] = (row["torch.topk"][mode]["median_us"]
                                                             / entry[mode]["median_us"])
                row["impls"][impl] = entry
            self.results["topk"].append(row)
            if kind == "real" and (batch, ctx) in ((32, 8192), (64, 32768), (8, 131072)):
                self.triton_diagnosis(batch, ctx, logits, ends)
        del real
        gc.collect()
        torch.cuda.empty_cache()

    def triton_diagnosis(self, batch, ctx, real, ends) -> None:
        fn, reason = self.topk_impl("topk_indices.triton.topk")
        if fn is None:
            return
        perm = torch.randperm(ctx, device="cuda")
        mean, std = real.mean(dim=1, keepdim=True), real.std(dim=1, keepdim=True)
        variants = {"real": real, "real, columns shuffled": real[:, perm].contiguous(),
                    "randn": torch.randn_like(real), "randn at real mean/std": torch.randn_like(real) * std + mean}
        entry = {"B": batch, "ctx": ctx,
                 "real_rows_std_over_abs_mean": float((std / mean.abs().clamp_min(1e-30)).median()),
                 "real_rows_mean": float(mean.median()), "real_rows_std": float(std.median())}
        for name, logits in variants.items():
            entry[name] = self.timer.graph(lambda: fn(logits, TOPK, ends))["median_us"]
        self.results["triton_diagnosis"].append(entry)

    # --- the decode step ---------------------------------------------------------------------------------------
    def step_cache(self, batch: int, ctx: int):
        """A cache holding this shape's requests: real keys copied from the base cache (one page table each)."""
        from dsa_indexer import IndexKCache

        pages = -(-ctx // 64)
        cache = IndexKCache.allocate(batch * pages + 1, device="cuda")
        src = torch.randint(0, self.keys.pages, (batch * pages,), device="cuda")
        cache.data[: batch * pages].copy_(self.keys.cache.data[src])
        table = torch.arange(batch * pages, device="cuda", dtype=torch.int32).view(batch, pages)
        return cache, table

    def decode(self, batch: int, ctx: int) -> None:
        from dsa_indexer.graphs import DecodeGraph

        indexer, cfg = self.indexer, self.indexer.config
        cache, table = self.step_cache(batch, ctx)
        gen = torch.Generator(device="cuda").manual_seed(batch + ctx)
        x = torch.randn(batch, cfg.hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
        q_lora = torch.randn(batch, cfg.q_lora_rank, device="cuda", generator=gen).to(torch.bfloat16)
        seq = torch.full((batch,), ctx, dtype=torch.int32)
        row = {"B": batch, "ctx": ctx}
        variants = [("single", "indexer_pipeline.generic.single_stream", True),
                    ("dual", "indexer_pipeline.cuda.dual_stream", True),
                    ("dual_unfused_projections", "indexer_pipeline.cuda.dual_stream", False)]
        for name, impl, fused in variants:
            self.registry.force("indexer_pipeline", impl)
            indexer.fuse_x_projections = fused
            try:
                self.registry.used.clear()
                self.registry.clear_cache()
                graph = DecodeGraph.capture(indexer, cache, batch, ctx)
                graph.replay(x, q_lora, seq, table)
                row[name] = {**self.timer(graph.graph.replay),
                             "impls": {k[0]: r.chosen.impl_id for k, r in self.registry.used.items()}}
                if name == "dual" and (batch, ctx) == (32, 8192):
                    self.results["profile_dual_32x8K"] = profile(graph.graph.replay)
                del graph
            except Exception as exc:  # noqa: BLE001
                torch.cuda.synchronize()
                row[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
            finally:
                self.registry.force("indexer_pipeline", None)
                indexer.fuse_x_projections = True
        if (batch, ctx) in ((1, 8192), (32, 8192), (128, 8192), (32, 32768)):
            row["dual_4_layers_per_layer"] = self.multi_layer(cache, table, x, q_lora, seq, batch, ctx, layers=4)
        for name, dual in (("naive_single", False), ("naive_dual", True)):
            row[name] = self.naive(cache, table, x, q_lora, batch, ctx, dual)
        for a, b in (("single", "dual"), ("naive_dual", "dual")):
            if "median_us" in row.get(a, {}) and "median_us" in row.get(b, {}):
                row[f"{b}_vs_{a}"] = row[b]["median_us"] / row[a]["median_us"]
        self.results["decode_step"].append(row)
        self.logits_in_step(cache, table, batch, ctx)
        del cache
        gc.collect()
        torch.cuda.empty_cache()

    def multi_layer(self, cache, table, x, q_lora, seq, batch, ctx, layers: int) -> dict:
        """``layers`` indexer layers (own weights, own caches with the same keys) in one graph, one batch: the
        per-layer time when the step's metadata is shared."""
        from dsa_indexer import IndexKCache, Indexer
        from dsa_indexer.graphs import DecodeBuffers

        stack = [self.indexer] + [Indexer(self.indexer.config, device="cuda").init_random(i + 1)
                                  for i in range(layers - 1)]
        caches = [cache] + [IndexKCache(cache.data.clone(), cache.fp8_dtype) for _ in range(layers - 1)]
        buffers = DecodeBuffers.allocate(self.indexer, batch, ctx, 1, torch.device("cuda"))
        buffers.load(x, q_lora, seq, table)

        def step():
            db = buffers.derive()
            return [layer(buffers.x, buffers.q_lora, db.positions, db, c) for layer, c in zip(stack, caches)]

        try:
            timing = self.timer.graph(step)
        except Exception as exc:  # noqa: BLE001
            torch.cuda.synchronize()
            return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
        return {"median_us": timing["median_us"] / layers, "layers": layers, "whole_graph_us": timing["median_us"]}

    def naive(self, cache, table, x, q_lora, batch, ctx, dual: bool) -> dict:
        """The step as an engine without this library writes it (see the module docstring)."""
        try:
            import deep_gemm
        except Exception as exc:  # noqa: BLE001
            return {"skipped": f"deep_gemm does not import ({type(exc).__name__})"}
        from dsa_indexer.backends.reference.kernels import apply_rope, hadamard_matrix, quant_fp8_groups
        from dsa_indexer.contract.cache import page_views

        ind, cfg = self.indexer, self.indexer.config
        had = hadamard_matrix(cfg.head_dim, torch.device("cuda"))
        keys, scales = page_views(cache.data)
        pos = torch.full((batch,), ctx - 1, device="cuda", dtype=torch.int64)
        slot = table[:, -1].long() * 64 + (ctx - 1) % 64
        lens = torch.full((batch, 1), ctx, dtype=torch.int32, device="cuda")
        num_sms = deep_gemm.get_num_sms()
        cols = torch.arange(ctx, device="cuda")
        alt = torch.cuda.Stream()

        def k_side():
            k = torch.nn.functional.layer_norm(torch.nn.functional.linear(x, ind.wk.weight).float(), (cfg.head_dim,),
                                               ind.k_norm.weight.float(), ind.k_norm.bias.float(), cfg.norm_eps)
            k = apply_rope(k, pos, ind.cos_sin, 0, False) @ had
            k8, ks = quant_fp8_groups(k, 128, cfg.ue8m0)
            keys[slot // 64, slot % 64] = k8
            scales[slot // 64, slot % 64] = ks.squeeze(-1)

        def q_side():
            hw = torch.nn.functional.linear(x, ind.weights_proj.weight).float()
            a8, sa = quant_fp8_groups(q_lora, 128)
            q = torch.empty(batch, cfg.n_heads * cfg.head_dim, dtype=torch.bfloat16, device="cuda")
            deep_gemm.fp8_gemm_nt((a8, sa), (ind.wq_b.weight, ind.wq_b.weight_scale_inv), q)
            q = apply_rope(q.view(batch, cfg.n_heads, cfg.head_dim).float(), pos, ind.cos_sin, 0, False) @ had
            q8, qs = quant_fp8_groups(q, 128, cfg.ue8m0)
            return q8, hw * cfg.weight_scale * qs.squeeze(-1)

        def step():
            if dual:
                main = torch.cuda.current_stream()
                alt.wait_stream(main)
                with torch.cuda.stream(alt):
                    k_side()
                q8, w = q_side()
                main.wait_stream(alt)
            else:
                k_side()
                q8, w = q_side()
            meta = deep_gemm.get_paged_mqa_logits_metadata(lens, 64, num_sms)
            logits = deep_gemm.fp8_paged_mqa_logits(q8.view(batch, 1, cfg.n_heads, cfg.head_dim), cache.data, w,
                                                    lens, table, meta, ctx, False)
            logits = logits.masked_fill(cols[None, :] >= lens, float("-inf"))
            return torch.topk(logits, cfg.topk, dim=1).indices

        try:
            return self.timer.graph(step)
        except Exception as exc:  # noqa: BLE001
            torch.cuda.synchronize()
            return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}

    def logits_in_step(self, cache, table, batch, ctx) -> None:
        """Paged logits as the step runs them (the lightning indexer's logits half, metadata included) vs
        DeepGEMM's kernel alone with its metadata precomputed."""
        try:
            import deep_gemm
        except Exception:  # noqa: BLE001
            return
        from dsa_indexer import ops

        q, weights, lens, _, _, _ = self.keys.step(batch, ctx, seed=7)
        num_sms = deep_gemm.get_num_sms()
        meta = deep_gemm.get_paged_mqa_logits_metadata(lens, 64, num_sms)
        kernel_alone = self.timer.graph(lambda: deep_gemm.fp8_paged_mqa_logits(q, cache.data, weights, lens, table,
                                                                                meta, ctx, False))
        with_meta = self.timer.graph(lambda: deep_gemm.fp8_paged_mqa_logits(
            q, cache.data, weights, lens, table, deep_gemm.get_paged_mqa_logits_metadata(lens, 64, num_sms), ctx,
            False))
        lightning = self.timer.graph(lambda: ops.lightning_indexer(q, cache.data, weights, lens, table, ctx, TOPK))
        topk_alone = self.timer.graph(lambda: ops.topk_indices(
            deep_gemm.fp8_paged_mqa_logits(q, cache.data, weights, lens, table, meta, ctx, False), TOPK,
            lens.reshape(-1)))
        self.results["logits_in_step"].append({
            "B": batch, "ctx": ctx, "deepgemm_kernel_alone_us": kernel_alone["median_us"],
            "deepgemm_with_metadata_us": with_meta["median_us"], "lightning_indexer_us": lightning["median_us"],
            "deepgemm_kernel_then_topk_op_us": topk_alone["median_us"],
            "GBps_kernel_alone": batch * ctx * 136 / kernel_alone["median_us"] / 1e3})


def profile(fn, replays: int = 10) -> dict:
    """Kernels of ``fn`` (a graph replay) by the torch profiler: name -> mean us per replay, and their sum."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            fn()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if us:
            kernels[event.key[:90]] = us / replays
    top = dict(sorted(kernels.items(), key=lambda kv: -kv[1]))
    return {"kernels_us_per_replay": top, "kernel_count": len(top), "sum_us": sum(top.values())}


def print_table(report: dict) -> None:
    print(f"\n{report['gpu']}  copy {report['copy_GBps']:.0f} GB/s; medians us, L2 flushed; graph / eager")
    print(f"{'B':>4} {'ctx':>7} {'logits':>6} | {'torch.topk':>13} | {'cuda.radix':>13} {'x':>9} | "
          f"{'triton':>13} {'x':>9} | flashinfer")
    for row in report["topk"]:
        t = row["torch.topk"]
        cells = []
        for impl in TOPK_IMPLS:
            e = row["impls"].get(impl, {})
            if "graph" in e:
                cells.append(f"{e['graph']['median_us']:6.1f}/{e['eager']['median_us']:6.1f} "
                             f"{e['speedup_vs_torch_graph']:4.1f}/{e['speedup_vs_torch_eager']:4.1f}")
            else:
                cells.append(f"{'-':>13} {'':>9}")
        fi = row["impls"].get("flashinfer.top_k", {})
        fic = f"{fi['graph']['median_us']:.1f}" if "graph" in fi else (fi.get("skipped") or fi.get("error", "-"))[:40]
        print(f"{row['B']:>4} {row['ctx']:>7} {row['logits']:>6} | {t['graph']['median_us']:6.1f}/"
              f"{t['eager']['median_us']:6.1f} | {cells[0]} | {cells[1]} | {fic}")
    for d in report["triton_diagnosis"]:
        print("triton rows diagnosis", {k: (round(v, 1) if isinstance(v, float) else v) for k, v in d.items()})
    print(f"\n{'B':>4} {'ctx':>6} {'single':>8} {'dual':>8} {'d/s':>5} {'4L/layer':>9} {'naive1':>8} {'naive2':>8} "
          f"{'d/naive2':>8}")
    for row in report["decode_step"]:
        def f(key):
            e = row.get(key, {})
            return f"{e['median_us']:.1f}" if "median_us" in e else "-"
        ratio = f"{row['dual_vs_naive_dual']:.2f}" if "dual_vs_naive_dual" in row else "-"
        ds = f"{row['dual_vs_single']:.2f}" if "dual_vs_single" in row else "-"
        print(f"{row['B']:>4} {row['ctx']:>6} {f('single'):>8} {f('dual'):>8} {ds:>5} "
              f"{f('dual_4_layers_per_layer'):>9} {f('naive_single'):>8} {f('naive_dual'):>8} {ratio:>8} "
              f"unfused-dual {f('dual_unfused_projections')}")
    for e in report["logits_in_step"]:
        print("logits", {k: (round(v, 1) if isinstance(v, float) else v) for k, v in e.items()})
    prof = report.get("profile_dual_32x8K")
    if prof:
        print(f"profile dual 32x8K: {prof['kernel_count']} kernels, sum {prof['sum_us']:.1f} us")
        for name, us in list(prof["kernels_us_per_replay"].items())[:16]:
            print(f"  {us:6.1f}  {name}")
    if report["skipped_for_time"]:
        print("skipped for time:", ", ".join(report["skipped_for_time"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="a few shapes, fewer calls")
    parser.add_argument("--calls", type=int, default=None, help="timed calls per measurement (default 60)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no new shape after this many seconds")
    parser.add_argument("--only", choices=("topk", "decode", "all"), default="all")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 0
    args.calls = args.calls or (20 if args.quick else 60)
    bench = Bench(args)
    topk_shapes = [(b, c) for c in (8192, 32768, 131072) for b in (1, 8, 32, 64, 128)]
    step_shapes = [(b, c) for c in (8192, 32768) for b in (1, 8, 32, 64, 128)]
    if args.quick:
        topk_shapes = [(1, 8192), (32, 8192), (64, 32768), (8, 131072)]
        step_shapes = [(1, 8192), (32, 8192)]
    if args.only in ("topk", "all"):
        for b, c in topk_shapes:
            if not bench.over_budget(f"topk {b}x{c}"):
                bench.topk(b, c)
                print(f"topk {b}x{c} done at {time.perf_counter() - bench.start:.0f} s", flush=True)
    if args.only in ("decode", "all"):
        for b, c in step_shapes:
            if not bench.over_budget(f"decode {b}x{c}"):
                bench.decode(b, c)
                print(f"decode {b}x{c} done at {time.perf_counter() - bench.start:.0f} s", flush=True)
    report = {"gpu": torch.cuda.get_device_name(0), "target": str(bench.target), "versions": _versions(),
              "command": [sys.executable, *sys.argv], "copy_GBps": bench.copy_gbps,
              "settings": {"calls": args.calls, "quick": args.quick, "budget_s": args.budget_s, "l2_flushed": True},
              "facts": {f: bench.registry.environment.missing(f) or "present" for f in ("deep_gemm", "cuda_jit")},
              **bench.results, "skipped_for_time": bench.skipped, "elapsed_s": time.perf_counter() - bench.start}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_topk.json").write_text(json.dumps(report, indent=2, default=str))
    print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
