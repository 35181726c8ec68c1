"""Kernel list of one V3.2 indexer decode step (and of ``lightning_indexer`` alone) on a GPU, from torch.profiler.

The step is the bench's (`dsa_indexer.bench.suites`: random weights, every request at ``--context`` tokens, the
batch built before the timed region), run eagerly ``--iters`` times after a warm-up; each kernel's total device
time is divided by ``--iters`` (us per step). Eager launches add host gaps that a CUDA-graph replay does not
have, so the sum of the kernels, not the wall time, is the number to compare with the bench.

    python3 benchmarks/profile_decode_step.py --batch 32 --context 8192 [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from dsa_indexer import ops
from dsa_indexer.bench.report import TOPK
from dsa_indexer.bench.suites import _decode_inputs
from dsa_indexer.testing import decode_step
from dsa_indexer.config import IndexerConfig
from dsa_indexer.indexer import Indexer


def kernel_table(fn, iters: int) -> list[dict]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals[event.name]
            entry[0] += event.device_time if hasattr(event, "device_time") else event.cuda_time
            entry[1] += 1
    rows = [{"kernel": name, "us_per_step": total / iters, "launches_per_step": count / iters}
            for name, (total, count) in totals.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    indexer = Indexer(IndexerConfig.deepseek_v32(), device=device).init_random(0)
    x, q_lora, _quant, db, cache, _ = decode_step(indexer.config, indexer, args.batch, args.context, device, seed=1)
    step = kernel_table(lambda: indexer(x, q_lora, db.positions, db, cache), args.iters)
    li_args = _decode_inputs(args.batch, args.context, device, indexer.fp8_dtype)
    lightning = kernel_table(lambda: ops.lightning_indexer(*li_args, TOPK), args.iters)
    report = {"batch": args.batch, "context": args.context, "iters": args.iters,
              "pipeline": getattr(indexer.last_pipeline, "chosen", None) and indexer.last_pipeline.chosen.impl_id,
              "step_kernels": step, "lightning_indexer_kernels": lightning}
    for title, rows in (("step", step), ("lightning_indexer", lightning)):
        print(f"{title} B={args.batch} ctx={args.context}: {sum(r['us_per_step'] for r in rows):.1f} us of kernels, "
              f"{sum(r['launches_per_step'] for r in rows):.0f} launches")
        for r in rows:
            print(f"  {r['us_per_step']:7.2f} us  x{r['launches_per_step']:.0f}  {r['kernel'][:110]}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
