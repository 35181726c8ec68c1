"""Decode-step timings beside `dsa-indexer bench --suite decode` (issue 23): DeepSeek-V4-Flash's C4 indexer on the
same B x context grid, and what the op layer adds to a `lightning_indexer` call.

Per (B, context), timed like the bench (`dsa_indexer.bench.timing.Timer`: CUDA-graph replay, L2 flushed before
every replay, median of --repeats):
- ``v4_step``: one V4-Flash indexer decode step (random weights, every request at ``context`` tokens, so
  context / 4 compressed keys, top-512), the default pipeline strategy, the batch built before capture
  (`dsa_indexer.testing.decode_step`);
- ``v4_lightning_indexer``: `ops.lightning_indexer` over context / 4 keys with k = 512, per implementation the
  registry accepts (forced in turn), and DeepGEMM's paged logits kernel alone where DeepGEMM is accepted;
- ``op_layer``: V3.2 shapes (context keys, k = 2048): `ops.lightning_indexer` against the resolved
  implementation's function called directly (the op layer's argument checks and dispatch, as captured in a
  graph), for the default implementation.

    python3 benchmarks/bench_decode_v4.py --batch 1 32 128 --context 8192 131072 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from dsa_indexer import ops
from dsa_indexer.bench.suites import DEEPGEMM_PAGED, _decode_inputs, _Forced
from dsa_indexer.bench.timing import Timer, measure_ceilings
from dsa_indexer.config import IndexerConfig
from dsa_indexer.dispatch.plugins import default_registry
from dsa_indexer.dispatch.target import detect_target
from dsa_indexer.indexer import Indexer
from dsa_indexer.testing import decode_step


def _problem(next_n: int, k: int):
    return ops.problem("lightning_indexer", heads=64, dim=128, next_n=next_n, k=k, fp8="fn", slots=False)


def v4_cell(indexer, timer, target, batch: int, context: int, rows: list) -> None:
    cfg = indexer.config
    x, q_lora, _quant, db, cache, state = decode_step(cfg, indexer, batch, context, timer.device, seed=batch + context)
    us = timer(lambda: indexer(x, q_lora, db.positions, db, cache, compressor_state=state))
    rows.append({"what": "v4_step", "batch": batch, "context": context, "us": float(us), "timing": timer.mode,
                 "strategy": indexer.last_pipeline.chosen.impl_id if indexer.last_pipeline else None})
    del x, q_lora, db, cache, state
    keys = context // cfg.compress_ratio
    args = _decode_inputs(batch, keys, timer.device, indexer.fp8_dtype)
    res = default_registry().resolve("lightning_indexer", target, _problem(1, cfg.topk))
    for impl in [c.impl.impl_id for c in res.candidates if c.accepted and ".reference." not in c.impl.impl_id]:
        with _Forced("lightning_indexer", impl):
            us = timer(lambda: ops.lightning_indexer(*args, cfg.topk))
        rows.append({"what": "v4_lightning_indexer", "impl": impl, "batch": batch, "context": context, "keys": keys,
                     "k": cfg.topk, "us": float(us), "default": impl == res.chosen.impl_id})
    paged = ops.problem("paged_mqa_logits", heads=64, dim=128, next_n=1, fp8="fn")
    pres = default_registry().resolve("paged_mqa_logits", target, paged)
    if any(c.accepted and c.impl.impl_id == DEEPGEMM_PAGED for c in pres.candidates):
        with _Forced("paged_mqa_logits", DEEPGEMM_PAGED):
            unmasked = default_registry().function("paged_mqa_logits", target, paged).unmasked
            us = timer(lambda: unmasked(*args))
        rows.append({"what": "v4_deepgemm_paged_logits_kernel_alone", "batch": batch, "context": context,
                     "keys": keys, "us": float(us)})


def op_layer_cell(timer, target, fp8, batch: int, context: int, rows: list) -> None:
    args = _decode_inputs(batch, context, timer.device, fp8)
    problem = _problem(1, 2048)
    impl = default_registry().resolve("lightning_indexer", target, problem).chosen.impl_id
    direct = default_registry().function("lightning_indexer", target, problem)
    via_ops = timer(lambda: ops.lightning_indexer(*args, 2048))
    bare = timer(lambda: direct(*args, 2048))
    rows.append({"what": "op_layer", "impl": impl, "batch": batch, "context": context, "ops_us": float(via_ops),
                 "direct_us": float(bare), "op_layer_us": float(via_ops) - float(bare)})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--context", type=int, nargs="+", default=[8192, 131072])
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--device", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    timer = Timer(device, args.repeats)
    target = detect_target(device)
    ceilings, _ = measure_ceilings(device, timer, target.fp8_dtype)
    indexer = Indexer(IndexerConfig.deepseek_v4_flash(), device=device).init_random(0)
    rows: list = []
    for batch in args.batch:
        for context in args.context:
            v4_cell(indexer, timer, target, batch, context, rows)
            op_layer_cell(timer, target, indexer.fp8_dtype, batch, context, rows)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report = {"command": "python3 benchmarks/bench_decode_v4.py " + " ".join(sys.argv[1:]), "device": str(device),
              "target": str(target), "ceilings": ceilings, "repeats": args.repeats, "timing": timer.mode,
              "rows": rows}
    for row in rows:
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
