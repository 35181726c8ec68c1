"""What `DecodeGraph`'s in-graph batch derivation costs per decode step (issue 23's "<= 5 us per step" goal).

    python3 benchmarks/bench_decode_metadata.py [--batch 1 32 128] [--context 8192 131072] [--json OUT.json]

Per (B, context), timed like the bench (`dsa_indexer.bench.timing.Timer`: CUDA-graph replay, L2 flushed, median):
``derive`` is `DecodeBuffers.derive()` alone (positions, context lens, slot mapping from the device ``seq_lens`` and
block table: what a graph-decode engine step computes once for every layer), for V3.2 (ratio 1) and V4-Flash's C4
(ratio 4); its kernel count is read from torch.profiler. The DeepGEMM schedule metadata, also once per step, is in
the decode step's profile (benchmarks/profile_decode_step.py).

``--graph-step`` also times a whole captured `DecodeGraph` step of V3.2 (seeded random weights, random fp8 keys
in the cache, random lengths in [ctx / 2, ctx]): the replay of the graph that derives its batch and runs the layer,
timed by CUDA events around `CUDAGraph.replay` with L2 flushed before each (the derive's share is ``derive``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from dsa_indexer import Indexer, IndexerConfig  # noqa: E402
from dsa_indexer.bench.timing import Timer  # noqa: E402
from dsa_indexer.contract.cache import PAGE_SIZE, IndexKCache, page_views  # noqa: E402
from dsa_indexer.graphs import DecodeBuffers  # noqa: E402


def kernels_per_call(fn) -> int:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def measure(cfg: IndexerConfig, batch: int, context: int, timer: Timer) -> dict:
    device = torch.device("cuda")
    indexer = Indexer(cfg, device=device)  # weights unused: only the shapes of the buffers come from it
    keys = context // cfg.compress_ratio
    buffers = DecodeBuffers.allocate(indexer, batch, keys, 1, device)
    buffers.seq_lens.copy_(torch.randint(context // 2, context + 1, (batch,), dtype=torch.int32))
    pages = buffers.block_table.shape[1]
    buffers.block_table.copy_(torch.randperm(batch * pages, dtype=torch.int32).view(batch, pages) % (1 << 20))
    timing = timer(buffers.derive)
    return {"model": cfg.name, "batch": batch, "context": context, "derive_us": float(timing),
            "derive_spread_us": [min(timing.samples), max(timing.samples)], "timing_mode": timer.mode,
            "kernels": kernels_per_call(buffers.derive)}


def graph_step(batch: int, context: int, timer: Timer) -> dict:
    """One captured V3.2 DecodeGraph step (derive + the layer), replayed with random lengths."""
    device = torch.device("cuda")
    cfg = IndexerConfig.deepseek_v32()
    indexer = Indexer(cfg, device=device).init_random(0)
    pages = -(-context // PAGE_SIZE)
    cache = IndexKCache.allocate(batch * pages, device, indexer.fp8_dtype)
    keys, scales = page_views(cache.data, indexer.fp8_dtype)
    keys.copy_(torch.randn(keys.shape, device=device).to(indexer.fp8_dtype))
    scales.copy_(torch.rand(scales.shape, device=device) + 0.5)
    graph = indexer.capture_decode(cache, batch, context)
    seq_lens = torch.randint(context // 2, context + 1, (batch,), dtype=torch.int32, device=device)
    table = torch.randperm(batch * pages, dtype=torch.int32, device=device).view(batch, pages)
    x = torch.randn(batch, cfg.hidden_size, device=device).to(indexer.dtype)
    q_lora = torch.randn(batch, cfg.q_lora_rank, device=device).to(indexer.dtype)
    graph.replay(x, q_lora, seq_lens, table)
    timing = timer(graph.graph.replay)
    return {"model": cfg.name, "batch": batch, "context": context, "graph_step_us": float(timing),
            "graph_step_spread_us": [min(timing.samples), max(timing.samples)], "timing_mode": timer.mode}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--context", type=int, nargs="+", default=[8192, 131072])
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--json", default=None)
    parser.add_argument("--graph-step", action="store_true", help="also time a whole captured DecodeGraph step")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode_metadata.py needs a CUDA GPU (torch sees none)", file=sys.stderr)
        return 2
    timer = Timer(torch.device("cuda"), args.repeats)
    rows = []
    for cfg in (IndexerConfig.deepseek_v32(), IndexerConfig.deepseek_v4_flash()):
        for context in args.context:
            for batch in args.batch:
                row = measure(cfg, batch, context, timer)
                rows.append(row)
                print(f"{row['model']:18s} B={batch:<4d} ctx={context:<7d} derive {row['derive_us']:6.2f} us "
                      f"({row['kernels']} kernels; {row['timing_mode']})", flush=True)
    if args.graph_step:
        for context in args.context:
            for batch in args.batch:
                row = graph_step(batch, context, timer)
                rows.append(row)
                print(f"{row['model']:18s} B={batch:<4d} ctx={context:<7d} DecodeGraph step {row['graph_step_us']:7.2f} "
                      f"us ({row['timing_mode']})", flush=True)
    if args.json:
        command = "python3 benchmarks/bench_decode_metadata.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        Path(args.json).write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
