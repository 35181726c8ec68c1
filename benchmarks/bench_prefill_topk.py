"""The top-k at prefill row shapes (issue 27): every CUDA top-k launch that holds a prefill chunk's rows, on the
logits of the chunks the Indexer plans, against the ragged logits kernel alone, on a GPU.

    python benchmarks/bench_prefill_topk.py [--tokens 8192,32768,131072] [--last-chunk-of 1048576] [--json PATH]

One V3.2 request of T tokens, no prefix (row t sees keys [0, t + 1)); the chunks are the Indexer's plan at its
default 2 GiB budget for the composed scoring (fp32 logits, 4 B per key, plus the q path's bytes per row). Random
fp8 q and k (randn cast to e4m3fn), positive k scales, randn head weights; the logits are the registry's
``ragged_mqa_logits`` (DeepGEMM where it is installed, else the Triton kernel) of each chunk.

Per chunk: the logits kernel's time, then each top-k launch on those logits (CUDA events, one timed call after a
warm-up on the first chunk): the planned one (`topk.plan_for`), the prefill kernel at 256 and 512 threads, the
streaming kernel (rows <= 256K), the register kernel's plan, the shared-memory radix kernel's plan where one holds
the rows, and the Triton top-k. Checks: every launch's index sets equal the prefill kernel's on every row; 32 rows
per chunk equal the pure-torch reference (`reference.topk_indices`, NaN-free logits); the prefill kernel's output is
bitwise equal over two calls. ``--last-chunk-of T`` measures only the last planned chunk of a T-token prefill (the
widest rows: 1M tokens -> ~500 rows of 1M keys). Sums over the chunks are what one layer's scoring pays.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dsa_indexer import Indexer, IndexerConfig, PrefillBatch, ops  # noqa: E402
from dsa_indexer.backends.cuda import topk as cuda_topk  # noqa: E402
from dsa_indexer.backends.reference import kernels as ref  # noqa: E402
from dsa_indexer.backends.triton import topk as triton_topk  # noqa: E402
from dsa_indexer.dispatch.plugins import default_registry  # noqa: E402

HEADS, DIM, TOPK = 64, 128, 2048
REF_ROWS = 32


def _event_ms(fn) -> tuple[float, object]:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    result = fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop), result


def _launches(rows: int, cols: int, sms: int) -> dict:
    """name -> callable(logits, k, ends, starts) for every launch that holds [rows, cols]."""
    out = {"planned": lambda *a: cuda_topk.run_plan(*a, None, None, None)}
    for threads in (256, 512):
        out[f"prefill{threads}"] = (lambda t: lambda *a: cuda_topk.run_plan(*a, None, None,
                                                                            cuda_topk.Plan("prefill", 1, t)))(threads)
    if cols <= cuda_topk.STREAM_MAX_COLS:
        out["stream"] = lambda *a: cuda_topk.run_plan(*a, None, None, cuda_topk.Plan("stream", 1, 0))
    reg = cuda_topk.register_plan(rows, cols, sms)
    if reg is not None:
        out[f"registers{reg[0]}x{reg[1]}"] = lambda *a: cuda_topk.run_plan(*a, None, None,
                                                                          cuda_topk.Plan("registers", *reg))
    shared = cuda_topk.plan(rows, cols, sms, 4)
    if shared is not None:
        out["shared_radix"] = lambda *a: cuda_topk.run_plan(*a, None, None, cuda_topk.Plan("shared", *shared))
    out["triton"] = lambda *a: triton_topk.topk_indices(*a)
    return out


def bench(tokens: int, last_chunk_only: bool) -> dict:
    cfg = IndexerConfig.deepseek_v32(max_position=max(163840, tokens + 64))
    indexer = Indexer(cfg, device="cuda")  # its planning numbers and target only
    pages = tokens // 64 + 2
    batch = PrefillBatch.build([0], [tokens], torch.arange(pages, dtype=torch.int32).view(1, pages), device="cuda")
    plan = batch.plan_chunks(indexer.logits_budget_bytes, indexer.q_path_bytes_per_row())
    chunks = plan[-1:] if last_chunk_only else plan
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    fp8 = torch.float8_e4m3fn
    k = torch.randn(tokens, DIM, device="cuda", generator=gen).to(fp8)
    k_scales = torch.rand(tokens, device="cuda", generator=gen) + 0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    logits_impl = default_registry().resolve("ragged_mqa_logits", indexer.target,
                                             ops.problem("ragged_mqa_logits", heads=HEADS, dim=DIM, fp8="fn")
                                             ).chosen.impl_id
    report = {"tokens": tokens, "chunks": len(plan), "measured_chunks": len(chunks), "logits_impl": logits_impl,
              "logits_ms": 0.0, "topk_ms": {}, "plans": [], "set_mismatch_rows": {}, "reference_mismatch_rows": 0,
              "prefill_repeatable": True}
    warmed = set()
    for start, stop, lo, hi in chunks:
        rows = stop - start
        q = torch.randn(rows, HEADS, DIM, device="cuda", generator=gen).to(fp8)
        w = torch.randn(rows, HEADS, device="cuda", generator=gen)
        ks = (batch.ks[start:stop] - lo).contiguous()
        ke = (batch.ke[start:stop] - lo).contiguous()
        kk, ksc = k[lo:hi], k_scales[lo:hi]
        ms, logits = _event_ms(lambda: ops.ragged_mqa_logits(q, kk, ksc, w, ks, ke))
        report["logits_ms"] += ms
        cols = logits.shape[1]
        report["plans"].append([rows, cols, str(cuda_topk.plan_for(rows, cols, sms, 4))])
        base = None
        for name, fn in _launches(rows, cols, sms).items():
            if name not in warmed:
                fn(logits, TOPK, ke, ks)
                warmed.add(name)
            torch.cuda.synchronize()
            ms, got = _event_ms(lambda: fn(logits, TOPK, ke, ks))
            report["topk_ms"][name] = report["topk_ms"].get(name, 0.0) + ms
            got_sets = got.sort(dim=1).values
            if base is None:
                base = got_sets
            else:
                bad = int((got_sets != base).any(dim=1).sum())
                report["set_mismatch_rows"][name] = report["set_mismatch_rows"].get(name, 0) + bad
            if name == "prefill256":
                again = fn(logits, TOPK, ke, ks)
                report["prefill_repeatable"] &= bool(torch.equal(again, got))
        pick = torch.linspace(0, rows - 1, REF_ROWS, device="cuda").long().unique()
        want = ref.topk_indices(logits[pick], TOPK, ke[pick], ks[pick]).sort(dim=1).values
        report["reference_mismatch_rows"] += int((want != base[pick]).any(dim=1).sum())
        del logits, base, q, w
    topk = report["topk_ms"]
    report["scoring_over_logits"] = {name: (report["logits_ms"] + t) / report["logits_ms"] for name, t in topk.items()}
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="8192,32768,131072")
    parser.add_argument("--last-chunk-of", default="", help="comma-separated T: measure only their last chunk")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_prefill_topk needs a CUDA GPU")
        return 0
    results = {"command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]),
               "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "prefill_blocks_per_sm": {t: cuda_topk._prefill_blocks_per_sm(torch.cuda.get_device_capability(), t)
                                         for t in (256, 512)}, "runs": []}
    sizes = [(int(t), False) for t in args.tokens.split(",") if t]
    sizes += [(int(t), True) for t in args.last_chunk_of.split(",") if t]
    for tokens, last in sizes:
        started = time.perf_counter()
        run = bench(tokens, last)
        run["wall_s"] = time.perf_counter() - started
        results["runs"].append(run)
        torch.cuda.empty_cache()
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}))
    for run in results["runs"]:
        tag = f"T={run['tokens']}" + (" (last chunk)" if run["measured_chunks"] < run["chunks"] else "")
        print(f"{tag}: chunks {run['measured_chunks']}/{run['chunks']} logits {run['logits_impl']} "
              f"{run['logits_ms']:.2f} ms; ref mismatches {run['reference_mismatch_rows']}; repeatable "
              f"{run['prefill_repeatable']}; plans {run['plans'][:2]}...{run['plans'][-1:]}")
        for name, ms in sorted(run["topk_ms"].items(), key=lambda kv: kv[1]):
            print(f"   {name:18s} {ms:9.2f} ms  scoring/logits {run['scoring_over_logits'][name]:.3f}  "
                  f"set mismatches {run['set_mismatch_rows'].get(name, 0)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
