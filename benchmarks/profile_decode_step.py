"""Kernel list of one indexer decode step (and of ``lightning_indexer`` alone) on a GPU, from torch.profiler.

The step is the bench's (`dsa_indexer.bench.suites`: random weights, every request at ``--context`` tokens, the
batch built before the timed region), run eagerly ``--iters`` times after a warm-up; each kernel's total device
time is divided by ``--iters`` (us per step). Eager launches add host gaps that a CUDA-graph replay does not
have, so the sum of the kernels, not the wall time, is the number to compare with the bench.

``--model v4``: DeepSeek-V4-Flash's C4 indexer instead of V3.2's (its compressor state fresh, rolled by each step;
``lightning_indexer`` alone over context / 4 keys at top-512).

``--force OP=IMPL`` adds a variant of the step with that implementation forced (repeatable, each its own
variant, profiled in the same process after the default one): e.g. the unchanged path of issue 23's x
projections, ``--force x_projections=x_projections.reference.torch``. Several ``--batch`` values profile each.

    python3 benchmarks/profile_decode_step.py --batch 32 --context 8192 [--model v4] [--force OP=IMPL] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from dsa_indexer import default_registry, ops
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


def print_table(title: str, rows: list[dict]) -> None:
    print(f"{title}: {sum(r['us_per_step'] for r in rows):.1f} us of kernels, "
          f"{sum(r['launches_per_step'] for r in rows):.0f} launches")
    for r in rows:
        print(f"  {r['us_per_step']:7.2f} us  x{r['launches_per_step']:.0f}  {r['kernel'][:110]}")


def profile_batch(indexer: Indexer, batch: int, context: int, iters: int, variants: dict[str, str | None]) -> dict:
    """The step's kernel table per variant (default, then each forced implementation) and lightning_indexer's."""
    device = torch.device("cuda")
    registry = default_registry()
    cfg = indexer.config
    x, q_lora, _quant, db, cache, state = decode_step(cfg, indexer, batch, context, device, seed=1)
    report: dict = {"model": cfg.name, "batch": batch, "context": context, "iters": iters, "variants": {}}
    for name, forced in variants.items():
        op, impl = forced.split("=", 1) if forced else (None, None)
        if op is not None:
            registry.force(op, impl)
        try:
            rows = kernel_table(lambda: indexer(x, q_lora, db.positions, db, cache, compressor_state=state), iters)
            pipeline = getattr(indexer.last_pipeline, "chosen", None) and indexer.last_pipeline.chosen.impl_id
        finally:
            if op is not None:
                registry.force(op, None)
        report["variants"][name] = {"forced": forced, "pipeline": pipeline, "step_kernels": rows,
                                    "step_us": sum(r["us_per_step"] for r in rows),
                                    "launches": sum(r["launches_per_step"] for r in rows)}
        print_table(f"step [{name}] B={batch} ctx={context}", rows)
    li_args = _decode_inputs(batch, context // cfg.compress_ratio, device, indexer.fp8_dtype)
    report["lightning_indexer_kernels"] = kernel_table(lambda: ops.lightning_indexer(*li_args, min(TOPK, cfg.topk)),
                                                       iters)
    print_table(f"lightning_indexer B={batch} ctx={context}", report["lightning_indexer_kernels"])
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[32])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--force", action="append", default=[], metavar="OP=IMPL",
                        help="also profile the step with this implementation forced (repeatable)")
    parser.add_argument("--model", choices=("v32", "v4"), default="v32",
                        help="DeepSeek-V3.2's indexer (default) or V4-Flash's C4 indexer")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    for forced in args.force:
        if "=" not in forced:
            parser.error(f"--force takes OP=IMPL, got {forced!r}")
    cfg = IndexerConfig.deepseek_v32() if args.model == "v32" else IndexerConfig.deepseek_v4_flash()
    indexer = Indexer(cfg, device=torch.device("cuda")).init_random(0)
    variants: dict[str, str | None] = {"default": None}
    variants.update({f"forced {forced}": forced for forced in args.force})
    reports = [profile_batch(indexer, batch, args.context, args.iters, variants) for batch in args.batch]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"profiles": reports}, fh, indent=1)


if __name__ == "__main__":
    main()
