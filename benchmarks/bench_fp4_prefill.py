"""V4-Flash's FP4 indexer prefill over the 68-byte FP4 pages (issue 24): the keys read as stored ("packed", the FP4
ragged logits) against the keys folded into fp8 rows ("folded", the fp8 ragged kernels), on a GPU.

    python benchmarks/bench_fp4_prefill.py [--tokens 8192,32768,131072] [--repeats 5] [--json PATH]
        [--configs "block_m=2;block_m=4;block_n=64,num_warps=4"]

One request of T new tokens from position 0, ``key_quant="fp4_e2m1"``, random weights; the compressor stores T / 4
FP4 keys, then each prefill row takes its top-512. For each T and each ``Indexer.fp4_prefill_keys``:

* the whole layer (`Indexer.forward`, keys stored then scored), CUDA events, median of --repeats after a warm-up;
* over the same planned chunks and the same q: the gather of every key (`gather_packed`: 68 bytes per key, or
  `gather`: the fold, 132 bytes), the ragged logits alone (the implementation resolved for the keys' format), and
  `ragged_mqa_topk` as resolved (for FP4 keys the composition of the FP4 logits and the top-k);
* the FP4 logits kernel at other tile choices (--configs: `logits.config_override("ragged", ...)` keys: block_m,
  query rows per program, 2 by default at 64 heads; block_n, num_warps, num_stages);
* the two paths' top-512 sets compared row by row (sampled rows).

The logits are compute bound here ([rows x keys x 64 heads x 128] fp8 MMAs); the FP4 kernel also decodes each
key tile's nibbles once per row tile, which is its extra work over the fp8 kernel.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dsa_indexer import CompressorState, IndexerConfig, Indexer, PrefillBatch, ops  # noqa: E402
from dsa_indexer.bench.timing import eager_event_times, topk_set_agreement  # noqa: E402
from dsa_indexer.dispatch.plugins import default_registry  # noqa: E402

FP4_LAYOUT = "paged64_fp4_e2m1"
KNOBS = ("packed", "folded")


def _median_ms(fn, repeats: int) -> float:
    return statistics.median(eager_event_times(fn, repeats))


def bench(tokens: int, repeats: int, configs: list[dict]) -> dict:
    cfg = dataclasses.replace(IndexerConfig.deepseek_v4_flash(key_quant="fp4_e2m1"),
                              max_position=max(65536, tokens + 64))
    indexer = Indexer(cfg, device="cuda").init_random(0)
    pages = tokens // 4 // 64 + 2
    table = torch.randperm(pages).to(torch.int32).view(1, pages)
    batch = PrefillBatch.build([0], [tokens], table, num_cache_pages=pages, device="cuda", compress_ratio=4)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, cfg.hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
    q_lora = torch.randn(tokens, cfg.q_lora_rank, device="cuda", generator=gen).to(torch.bfloat16)
    registry = default_registry()
    report: dict = {"model": cfg.name, "tokens": tokens, "keys": tokens // 4, "topk": cfg.topk, "layer_ms": {},
                    "gather_ms": {}, "logits_ms": {}, "topk_ms": {}, "resolved": {}}
    outputs = {}
    cache = indexer.allocate_cache(pages, FP4_LAYOUT)
    for knob in KNOBS:
        indexer.fp4_prefill_keys = knob
        state = CompressorState.allocate(1, cfg, "cuda")  # a request from position 0 never reads it
        report["layer_ms"][knob] = _median_ms(
            lambda: outputs.__setitem__(knob, indexer(x, q_lora, batch.positions, batch, cache,
                                                      compressor_state=state)), repeats)
    report["set_agreement_packed_vs_folded"] = topk_set_agreement(outputs["packed"], outputs["folded"])

    plan = indexer.step_plan(tokens, False, cache_layout=FP4_LAYOUT)
    q_fp8, weights = plan.steps.q_path(plan, x, q_lora, batch.positions, None)
    chunks = batch.plan_chunks(indexer.logits_budget_bytes, *plan.scoring_bytes)
    report["chunks"] = len(chunks)
    gathers = {"packed": cache.gather_packed, "folded": cache.gather}
    for knob, gather in gathers.items():
        report["gather_ms"][knob] = _median_ms(lambda: gather(batch.gather_slots), repeats)
        keys, scales = gather(batch.gather_slots)
        problem_keys = "fp4" if knob == "packed" else "fp8"
        logits_fn = registry.function("ragged_mqa_logits", indexer.target,
                                      ops.problem("ragged_mqa_logits", heads=64, dim=128, fp8="fn", keys=problem_keys))
        topk_problem = ops.problem("ragged_mqa_topk", heads=64, dim=128, fp8="fn", k=cfg.topk, keys=problem_keys)
        report["resolved"][knob] = {
            "ragged_mqa_logits": registry.resolve("ragged_mqa_logits", indexer.target,
                                                  ops.problem("ragged_mqa_logits", heads=64, dim=128, fp8="fn",
                                                              keys=problem_keys)).chosen.impl_id,
            "ragged_mqa_topk": registry.resolve("ragged_mqa_topk", indexer.target, topk_problem).chosen.impl_id}
        logits_fn = getattr(logits_fn, "padded", logits_fn)  # DeepGEMM: its padded rows, no contiguous copy

        def over_chunks(fn):
            for start, stop, lo, hi in chunks:
                fn(q_fp8[start:stop], keys[lo:hi], scales[lo:hi], weights[start:stop], batch.ks[start:stop] - lo,
                   batch.ke[start:stop] - lo)

        report["logits_ms"][knob] = _median_ms(lambda: over_chunks(logits_fn), repeats)
        report["topk_ms"][knob] = _median_ms(
            lambda: over_chunks(lambda *a: ops.ragged_mqa_topk(*a, cfg.topk)), repeats)
        if knob == "packed" and configs:
            from dsa_indexer.backends.triton import logits as triton_logits
            from dsa_indexer.backends.triton.logits_fp4 import ragged_mqa_logits_fp4

            report["fp4_logits_ms_by_config"] = {}
            for config in configs:
                with triton_logits.config_override("ragged", **config):
                    report["fp4_logits_ms_by_config"][json.dumps(config)] = _median_ms(
                        lambda: over_chunks(ragged_mqa_logits_fp4), repeats)
        del keys, scales
    pairs = sum((stop - start) * (hi - lo) for start, stop, lo, hi in chunks)
    report["logits_pairs_scheduled"] = pairs
    return report


def tile_configs(text: str) -> list[dict]:
    """--configs: ';'-separated tile choices, each 'key=value,...' (`logits.config_override` keys); '' for none."""
    return [{key: int(value) for key, value in (item.split("=") for item in part.split(","))}
            for part in text.split(";") if part]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="8192,32768,131072", help="comma-separated T (prefill tokens)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--configs", default="block_m=2;block_m=4;block_n=64,num_warps=4",
                        help="FP4 logits tile choices to time, ';'-separated, each 'key=value,...' ('' for none)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp4_prefill needs a CUDA GPU")
        return 0
    results = {"command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]),
               "device": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": []}
    configs = tile_configs(args.configs)
    for tokens in (int(t) for t in args.tokens.split(",") if t):
        started = time.perf_counter()
        run = bench(tokens, args.repeats, configs)
        run["wall_s"] = time.perf_counter() - started
        torch.cuda.empty_cache()
        results["runs"].append(run)
        print(json.dumps(run, separators=(",", ":")), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
