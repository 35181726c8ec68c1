"""Per-layer time saved by q_lora fp8 reuse (DeepSeek-V4-Flash C4 indexer, decode) under CUDA-graph replay.

    python benchmarks/bench_q_lora_reuse.py --out DIR

For B in {1, 8, 32, 64} (context 32768 tokens = 8192 compressed keys), the decode step is captured twice, with
and without `q_lora_quant`, and the two graphs are replayed alternately; medians of CUDA-event timings.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch


def replay_us(graph, replays=20, repeats=15) -> float:
    samples = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        stop.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(stop) * 1e3 / replays)
    return statistics.median(samples)


def cuda_bench_args(doc: str) -> argparse.Namespace | None:
    """``--out`` and ``--context`` (default 32768) of a CUDA benchmark; None (after saying so) without CUDA."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--context", type=int, default=32768)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return None
    return args


def main() -> int:
    args = cuda_bench_args(__doc__)
    if args is None:
        return 0
    from bench_pipeline import capture  # the same warm-up-then-capture as the pipeline benchmark
    from dsa_indexer import IndexerConfig, Indexer
    from dsa_indexer.dispatch.plugins import default_registry
    from dsa_indexer.testing import decode_step

    cfg = IndexerConfig.deepseek_v4_flash(max_position=args.context + 64)
    indexer = Indexer(cfg, device="cuda").init_random(0)
    rows = []
    for batch in (1, 8, 32, 64):
        x, q_lora, quant, db, cache, state = decode_step(cfg, indexer, batch, args.context, "cuda", seed=batch)
        # next_n = 1: every replay reads the same state positions (p-7..p-1) and writes p; the step is idempotent.
        g_reuse, out_reuse = capture(lambda: indexer(x, q_lora, db.positions, db, cache, q_lora_quant=quant,
                                                     compressor_state=state))
        g_plain, out_plain = capture(lambda: indexer(x, q_lora, db.positions, db, cache, compressor_state=state))
        assert torch.equal(out_reuse, out_plain)
        plain, reuse = [], []
        for _ in range(3):  # alternate, so drift affects both
            plain.append(replay_us(g_plain))
            reuse.append(replay_us(g_reuse))
        row = {"batch": batch, "context": args.context, "without_reuse_us": statistics.median(plain),
               "with_reuse_us": statistics.median(reuse)}
        row["saved_us"] = row["without_reuse_us"] - row["with_reuse_us"]
        rows.append(row)
        print(f"B={batch:3d}: without {row['without_reuse_us']:7.1f} us, with {row['with_reuse_us']:7.1f} us, "
              f"saved {row['saved_us']:5.2f} us per layer")
    used = {op: res.chosen.impl_id for (op, _, _), res in default_registry().used.items()}
    result = {"command": " ".join(["python"] + sys.argv), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "model": cfg.name, "rows": rows, "implementations": used}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "q_lora_reuse.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
