"""One DeepSeek-V3.2 indexer layer's causal prefill of T tokens: ragged logits alone, unfused logits + top-k, and the
fused ragged logits + top-k (`dsa_indexer.backends.triton.fused_topk`), on a GPU.

    python benchmarks/bench_fused_prefill.py [--tokens 8192,32768,131072] [--json PATH] [--budget-gib 2]
        [--fused-budget-gib 1] [--repeats 5] [--check-chunks 3] [--sort kernel|torch] [--capacity C]

One request of T tokens, no prefix: row t sees keys [0, t + 1). H = 64 heads, D = 128, topk = 2048. Random fp8 q and k
(randn cast to e4m3fn), positive random k scales, randn head weights.

* (a) ``logits``: ``ops.ragged_mqa_logits`` (the Triton implementation, forced) over all rows, in row chunks of
  ``budget // (4 T)`` rows (default 2 GiB of fp32 logits per chunk);
* (b) ``unfused``: (a) then ``ops.topk_indices`` (the Triton implementation, forced) on each chunk;
* (c) ``fused``: ``fused_ragged_topk`` over all rows (it chunks its own candidate scratch under --fused-budget-gib),
  in the reference's order (--sort); ``fused_set``: the same with ``sort="none"`` (the top-k set in no documented
  order, like (b)'s ``ops.topk_indices``): the like-for-like comparison with (b).

Times: CUDA events around the whole layer, median of --repeats runs after one warm-up run. Peak memory: the rise of
``torch.cuda.max_memory_allocated`` over what was allocated before the run (inputs excluded). The fused result is
checked against the unfused one on --check-chunks chunks (first, last, evenly spaced between): the index sets equal
the Triton top-k's, and on up to 512 rows of each checked chunk the full result (order included) equals the
pure-torch ``topk_indices`` applied to the same logits. Writes JSON with --json (the exact command line included).
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

from dsa_indexer import ops  # noqa: E402
from dsa_indexer.backends.reference import kernels as ref  # noqa: E402
from dsa_indexer.backends.triton.fused_topk import fused_ragged_topk  # noqa: E402
from dsa_indexer.bench.timing import eager_event_times  # noqa: E402
from dsa_indexer.dispatch.plugins import default_registry  # noqa: E402

HEADS, DIM, TOPK = 64, 128, 2048
FORCED = {"ragged_mqa_logits": "ragged_mqa_logits.triton.logits", "topk_indices": "topk_indices.triton.topk"}


def _peak(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _inputs(t: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(t, HEADS, DIM, generator=gen, device="cuda").to(torch.float8_e4m3fn)
    k = torch.randn(t, DIM, generator=gen, device="cuda").to(torch.float8_e4m3fn)
    k_scales = torch.rand(t, generator=gen, device="cuda") + 0.5
    weights = torch.randn(t, HEADS, generator=gen, device="cuda")
    ks = torch.zeros(t, dtype=torch.int32, device="cuda")
    ke = torch.arange(1, t + 1, dtype=torch.int32, device="cuda")
    return q, k, k_scales, weights, ks, ke


def _check_chunk(fused_rows: torch.Tensor, logits: torch.Tensor, unfused: torch.Tensor, ks, ke) -> dict:
    same_sets = torch.equal(fused_rows.sort(dim=1).values, unfused.sort(dim=1).values)
    pick = torch.linspace(0, logits.shape[0] - 1, min(512, logits.shape[0]), device=logits.device).long().unique()
    exact = ref.topk_indices(logits[pick], TOPK, ke[pick], ks[pick])
    return {"same_sets_as_unfused": bool(same_sets), "rows_checked_exactly": int(pick.numel()),
            "exact_order_equal": bool(torch.equal(fused_rows[pick], exact))}


def bench_tokens(t: int, args) -> dict:
    q, k, k_scales, weights, ks, ke = _inputs(t, seed=t)
    chunk_rows = max(128, min(t, int(args.budget_gib * (1 << 30)) // (4 * t)) // 128 * 128)
    chunks = [(r0, min(t, r0 + chunk_rows)) for r0 in range(0, t, chunk_rows)]
    fused_budget = int(args.fused_budget_gib * (1 << 30))
    fused_kw = dict(budget_bytes=fused_budget, sort=args.sort, capacity=args.capacity,
                    sample_stride=args.sample_stride)

    def logits_of(r0, r1):
        return ops.ragged_mqa_logits(q[r0:r1], k, k_scales, weights[r0:r1], ks[r0:r1], ke[r0:r1], target="sm90")

    def run_logits():
        for r0, r1 in chunks:
            logits = logits_of(r0, r1)
            del logits

    def run_unfused():
        for r0, r1 in chunks:
            logits = logits_of(r0, r1)
            idx = ops.topk_indices(logits, TOPK, ke[r0:r1], ks[r0:r1], target="sm90")
            del logits, idx

    def run_fused(stats=None):
        return fused_ragged_topk(q, k, k_scales, weights, ks, ke, TOPK, stats=stats, **fused_kw)

    def run_fused_set():
        return fused_ragged_topk(q, k, k_scales, weights, ks, ke, TOPK, **{**fused_kw, "sort": "none"})

    result = {"tokens": t, "rows": t, "keys": t, "chunk_rows": chunk_rows, "chunks": len(chunks),
              "fused_budget_bytes": fused_budget, "times_ms": {}, "peak_bytes": {}}
    for name, fn in (("logits", run_logits), ("unfused", run_unfused), ("fused", run_fused),
                     ("fused_set", run_fused_set)):
        times = eager_event_times(fn, args.repeats)
        result["times_ms"][name] = {"median": statistics.median(times), "all": times}
        print(f"T={t} {name}: {statistics.median(times):.2f} ms (median of {len(times)})", flush=True)
    result["peak_bytes"]["unfused"] = _peak(run_unfused)
    result["peak_bytes"]["fused"] = _peak(run_fused)

    stats: dict = {}
    fused = run_fused(stats)
    result["fused_stats"] = stats
    n_check = min(args.check_chunks, len(chunks))
    which = sorted({round(i * (len(chunks) - 1) / max(1, n_check - 1)) for i in range(n_check)}) if n_check else []
    checks = []
    for i in which:  # one chunk at a time: bounded memory
        r0, r1 = chunks[i]
        logits = logits_of(r0, r1)
        idx = ops.topk_indices(logits, TOPK, ke[r0:r1], ks[r0:r1], target="sm90")
        check = _check_chunk(fused[r0:r1], logits, idx, ks[r0:r1], ke[r0:r1])
        check.update(chunk=i, rows=[r0, r1])
        checks.append(check)
        del logits, idx
    result["checks"] = checks
    result["all_checks_pass"] = all(c["same_sets_as_unfused"] and c["exact_order_equal"] for c in checks)
    tm = result["times_ms"]
    print(f"T={t}: peak unfused {result['peak_bytes']['unfused'] / 2**30:.2f} GiB, fused "
          f"{result['peak_bytes']['fused'] / 2**30:.2f} GiB; fallback rows {stats['fallback_rows']} of "
          f"{stats['long_rows']} long; fused/unfused {tm['fused']['median'] / tm['unfused']['median']:.3f}, "
          f"fused_set/unfused {tm['fused_set']['median'] / tm['unfused']['median']:.3f}; "
          f"checks {'pass' if result['all_checks_pass'] else 'FAIL'}", flush=True)
    del q, k, k_scales, weights, ks, ke, fused
    torch.cuda.empty_cache()
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="8192,32768,131072", help="comma-separated prefill lengths T")
    parser.add_argument("--budget-gib", type=float, default=2.0, help="fp32 logits per chunk of the unfused path")
    parser.add_argument("--fused-budget-gib", type=float, default=1.0, help="candidate scratch per fused chunk")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--check-chunks", type=int, default=3)
    parser.add_argument("--sort", choices=("kernel", "torch"), default="kernel")
    parser.add_argument("--capacity", type=int, default=None, help="fused candidates per row (default 4 * topk)")
    parser.add_argument("--sample-stride", type=int, default=None, help="fused sampling stride R (default 32)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    registry = default_registry()
    for op, impl in FORCED.items():
        registry.force(op, impl)
    tokens = [int(x) for x in args.tokens.split(",") if x.strip()]
    out = {"command": shlex.join([sys.executable] + sys.argv),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "heads": HEADS, "dim": DIM, "topk": TOPK, "forced": FORCED, "args": vars(args),
           "started": time.strftime("%Y-%m-%d %H:%M:%S"), "results": []}
    try:
        for t in tokens:
            out["results"].append(bench_tokens(t, args))
    finally:
        for op in FORCED:
            registry.force(op, None)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(out, indent=2))
    return 0 if all(r["all_checks_pass"] for r in out["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
