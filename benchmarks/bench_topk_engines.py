"""Top-k (k = 2048) on real decode logits: this library's CUDA kernel (its planned launch and, with --plans, every
other launch that holds the rows), torch.topk, optionally the Triton top-k and engine kernels, side by side in one
run.

    python3 benchmarks/bench_topk_engines.py --out DIR [--batches 1 32 64 128] [--contexts 8192 32768 131072]
        [--repeats 50] [--plans] [--triton] [--engines PATH.py] [--budget-s 300]

Logits: keys stored by the project's own k path (random bf16 activations drawn on the GPU, seeded random V3.2
weights), queries from its q path, paged logits through the registry: one cache of 128 requests x the longest
context; a shorter context is the first tokens of the same requests. Timing (`dsa_indexer.bench.Timer`): CUDA-graph
replays timed by CUDA events, a 256 MiB L2 flush before each, the median of --repeats. Every result is checked
exactly: the multiset of the logits it selects (NaN-free here) must equal torch.topk's values, and the indices
must be distinct and in range.

--engines PATH.py: a file (kept outside the repository: engine code and bindings are never committed) defining
``engines() -> dict[name, callable(logits, k, ends) -> int indices [B, >= k]]``; each is timed like ours. The file
may define ``VERSIONS`` (what was built, from which release), recorded in the JSON, and ``engines.path_seen``
(``{(B, width): the kernel an engine's own dispatch took}``), recorded per cell.
Writes DIR/topk_engines.json with the command, versions and the grid.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

K = 2048


def real_logits(batch: int, context: int, device: torch.device, seed: int = 0):
    """``logits_for(ctx) -> [batch, ctx]`` fp32 real decode logits: the k path stores ``batch * context``
    keys, the q path makes one decode query per request; logits for a shorter context read its first tokens."""
    from dsa_indexer import ops
    from dsa_indexer.config import IndexerConfig
    from dsa_indexer.contract.cache import PAGE_SIZE, IndexKCache
    from dsa_indexer.indexer import Indexer
    from dsa_indexer.pipeline import k_path, q_path

    cfg = IndexerConfig.deepseek_v32()
    indexer = Indexer(cfg, device=device).init_random(seed)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    pages = -(-context // PAGE_SIZE)
    cache = IndexKCache.allocate(batch * pages, device, indexer.fp8_dtype)
    table = torch.randperm(batch * pages, generator=gen, device=device).to(torch.int32).view(batch, pages)
    step = 32768
    with torch.no_grad():
        for b in range(batch):
            for start in range(0, context, step):
                n = min(step, context - start)
                x = torch.randn(n, cfg.hidden_size, generator=gen, device=device).to(torch.bfloat16)
                pos = torch.arange(start, start + n, device=device)
                slots = table[b].long()[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
                k_path(indexer.step_plan(n, False), x, pos, slots, cache.data)
        x = torch.randn(batch, cfg.hidden_size, generator=gen, device=device).to(torch.bfloat16)
        q_lora = torch.randn(batch, cfg.q_lora_rank, generator=gen, device=device).to(torch.bfloat16)
        positions = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
        q_fp8, weights = q_path(indexer.step_plan(batch, True), x, q_lora, positions, None)
    q = q_fp8.view(batch, 1, cfg.n_heads, cfg.head_dim)

    def logits_for(ctx: int) -> torch.Tensor:
        lens = torch.full((batch, 1), ctx, dtype=torch.int32, device=device)
        with torch.no_grad():
            return ops.paged_mqa_logits(q, cache.data, weights, lens, table[:, : -(-ctx // PAGE_SIZE)], ctx)

    return logits_for


def check(logits: torch.Tensor, got: torch.Tensor, want_values: torch.Tensor) -> int:
    """Rows whose selection is wrong: the selected values' multiset differs from torch.topk's, or indices repeat
    or leave the row."""
    got = got[:, :K].long()
    bad = (got < 0) | (got >= logits.shape[1])
    vals = logits.gather(1, got.clamp(0, logits.shape[1] - 1)).sort(dim=1, descending=True).values
    wrong = bad.any(dim=1) | (vals != want_values).any(dim=1)
    wrong |= (got.sort(dim=1).values.diff(dim=1) == 0).any(dim=1)
    return int(wrong.sum())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 64, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--plans", action="store_true", help="also time every other launch plan that holds the rows")
    parser.add_argument("--triton", action="store_true", help="also time the Triton top-k")
    parser.add_argument("--engines", default=None, help="a .py file defining engines() (kept out of the repo)")
    parser.add_argument("--budget-s", type=float, default=400.0, help="stop starting new cells after this long")
    args = parser.parse_args(argv)

    from dsa_indexer.backends.cuda import topk as cuda_topk
    from dsa_indexer.bench import Timer

    device = torch.device("cuda")
    began = time.perf_counter()
    assert cuda_topk.probe() is None, cuda_topk.probe()
    engines, engine_module = {}, None
    if args.engines:
        spec = importlib.util.spec_from_file_location("topk_engines_binding", args.engines)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        engines = module.engines()
        engine_module = module
    timer = Timer(device, args.repeats)
    logits_for = real_logits(max(args.batches), max(args.contexts), device)
    print(f"logits ready in {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = []
    for ctx in args.contexts:
        full = logits_for(ctx)
        for batch in args.batches:
            if time.perf_counter() - began > args.budget_s:
                rows.append({"batch": batch, "context": ctx, "skipped": "time budget"})
                continue
            logits = full[:batch].contiguous()
            ends = torch.full((batch,), ctx, dtype=torch.int32, device=device)
            want = torch.topk(logits, K, dim=1).values
            cell = {"batch": batch, "context": ctx, "times_us": {}, "wrong_rows": {}}
            planned = cuda_topk.plan_for(batch, ctx, sms, 4)
            cell["plan"] = list(planned) if planned else None
            impls = {"torch.topk": lambda: torch.topk(logits, K, dim=1).indices,
                     "cuda.radix": lambda: cuda_topk.topk_indices(logits, K, ends)}
            if args.plans:
                for keys in cuda_topk.REGISTERS_KEYS:
                    cluster = -(-ctx // (keys * cuda_topk.REGISTERS_THREADS))
                    alt = cuda_topk.Plan("registers", cluster, keys)
                    if cluster <= cuda_topk.REGISTERS_MAX_CLUSTER and alt != planned:
                        impls[f"cuda.radix {alt.kernel} x{alt.cluster} keys{alt.per_cta}"] = (
                            lambda alt=alt: cuda_topk.run_plan(logits, K, ends, None, None, None, alt))
                if planned != cuda_topk.Plan("stream", 1, 0) and ctx <= cuda_topk.STREAM_MAX_COLS:
                    impls["cuda.radix stream"] = lambda: cuda_topk.run_plan(
                        logits, K, ends, None, None, None, cuda_topk.Plan("stream", 1, 0))
                shared = cuda_topk.plan(batch, ctx, sms, 4)
                if shared is not None:
                    alt = cuda_topk.Plan("shared", *shared)
                    impls["cuda.radix shared (previous kernel)"] = (
                        lambda alt=alt: cuda_topk.run_plan(logits, K, ends, None, None, None, alt))
            if args.triton:
                from dsa_indexer.backends.triton import topk as triton_topk

                impls["triton.topk"] = lambda: triton_topk.topk_indices(logits, K, ends)
            for name, fn in engines.items():
                impls[name] = lambda fn=fn: fn(logits, K, ends)
            for name, fn in impls.items():
                try:
                    cell["wrong_rows"][name] = check(logits, fn(), want)
                    cell["times_us"][name] = round(timer(fn), 2)
                    cell.setdefault("timing", {})[name] = timer.mode
                except Exception as exc:  # noqa: BLE001 - recorded, the rest still runs
                    cell.setdefault("errors", {})[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            seen = getattr(getattr(engine_module, "engines", None), "path_seen", {})
            if (batch, ctx) in seen:
                cell["engine_dispatch"] = seen[(batch, ctx)]
            rows.append(cell)
            times = cell["times_us"]
            print(f"B={batch:4d} ctx={ctx:7d} " + "  ".join(f"{n}={t:.1f}" for n, t in times.items())
                  + f"  wrong={sum(cell['wrong_rows'].values())}", flush=True)
            del logits
        del full
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"command": "python3 benchmarks/bench_topk_engines.py " + " ".join(argv or sys.argv[1:]),
              "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "cuda": torch.version.cuda, "k": K,
              "timing": "CUDA-graph replay, CUDA events, 256 MiB L2 flush before each, median of --repeats",
              "logits": "real V3.2 decode logits (k path keys, q path query, registry paged logits)",
              "rows": rows}
    if engine_module is not None:
        report["engine_versions"] = getattr(engine_module, "VERSIONS", None)
    (out / "topk_engines.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
