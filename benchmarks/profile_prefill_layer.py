"""Where one indexer layer's long prefill spends its GPU time (issue 27): a torch.profiler kernel table of
`Indexer.forward` over one request of T new tokens, grouped into the step's parts.

    python3 benchmarks/profile_prefill_layer.py --tokens 131072 [--model v32|v4] [--json OUT.json]

The layer is bench_prefill_layer.py's (random weights, no prefix, the default 2 GiB prefill budget, the default
implementations): one warm-up call, then one profiled call. Per part (the ragged logits, the top-k, the q path's
GEMM and prologue, the key path, the compressor, everything else) the summed kernel time in ms; per kernel its time
and launch count; beside them the wall time of the profiled call (CUDA events; the profiler's own overhead
included), the number of planned chunks, the host planning time and the peak memory above what was allocated before.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from dsa_indexer import CompressorState, Indexer, IndexerConfig, IndexKCache, PrefillBatch  # noqa: E402

# Kernel-name fragments -> the part of the layer they belong to (first match wins; lower-case).
PARTS = (
    ("logits", ("mqa_logits", "_ragged_logits", "logits_kernel")),
    ("top-k", ("topk", "top_k", "radix")),
    ("gemm (wq_b, x projections)", ("gemm", "nvjet", "sgemm", "cutlass", "splitk", "gemv")),
    ("q prologue", ("_q_prologue",)),
    ("key path (k prologue, store)", ("_k_prologue", "store")),
    ("compressor", ("compress", "pool")),
    ("quant", ("quant",)),
)


def part_of(kernel: str) -> str:
    name = kernel.lower()
    for part, fragments in PARTS:
        if any(fragment in name for fragment in fragments):
            return part
    return "other (torch elementwise, copies, reductions)"


def profile_layer(tokens: int, model: str) -> dict:
    if model == "v4":
        cfg, ratio = IndexerConfig.deepseek_v4_flash(), 4
    else:
        cfg, ratio = IndexerConfig.deepseek_v32(max_position=max(163840, tokens + 64)), 1
    indexer = Indexer(cfg, device="cuda").init_random(0)
    pages = tokens // ratio // 64 + 2
    table = torch.randperm(pages).to(torch.int32).view(1, pages)
    state = CompressorState.allocate(1, cfg, "cuda") if ratio == 4 else None
    batch = PrefillBatch.build([0], [tokens], table, num_cache_pages=pages, device="cuda", compress_ratio=ratio)
    start = time.perf_counter()
    chunks = batch.plan_chunks(indexer.logits_budget_bytes, *indexer.scoring_plan_bytes())
    plan_ms = (time.perf_counter() - start) * 1e3
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, cfg.hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
    q_lora = torch.randn(tokens, cfg.q_lora_rank, device="cuda", generator=gen).to(torch.bfloat16)
    cache = IndexKCache.allocate(pages, "cuda", indexer.fp8_dtype)

    def layer():
        return indexer(x, q_lora, batch.positions, batch, cache, compressor_state=state)

    layer()  # warm-up: resolutions, JIT builds, autotuning
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        begin.record()
        out = layer()
        end.record()
        torch.cuda.synchronize()
    peak_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels[event.name]
            entry[0] += (event.device_time if hasattr(event, "device_time") else event.cuda_time) / 1e3
            entry[1] += 1
    parts: dict[str, float] = defaultdict(float)
    for name, (ms, _) in kernels.items():
        parts[part_of(name)] += ms
    rows = sorted(({"kernel": name, "ms": ms, "launches": count, "part": part_of(name)}
                   for name, (ms, count) in kernels.items()), key=lambda r: -r["ms"])
    del out
    return {"model": cfg.name, "tokens": tokens, "keys": tokens // ratio, "topk": cfg.topk, "chunks": len(chunks),
            "plan_ms": plan_ms, "budget_GiB": indexer.logits_budget_bytes / 2**30, "peak_GiB": peak_gib,
            "wall_ms_profiled": begin.elapsed_time(end), "kernel_ms": sum(parts.values()),
            "parts_ms": dict(sorted(parts.items(), key=lambda kv: -kv[1])), "kernels": rows[:25]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="131072", help="comma-separated prefill lengths T")
    parser.add_argument("--model", choices=("v32", "v4"), default="v32")
    parser.add_argument("--json", default=None, help="write the reports here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_prefill_layer.py needs a CUDA GPU (torch sees none)", file=sys.stderr)
        return 2
    reports = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        report = profile_layer(tokens, args.model)
        reports.append(report)
        print(f"{report['model']} T={tokens}: wall {report['wall_ms_profiled']:.1f} ms (profiled), kernels "
              f"{report['kernel_ms']:.1f} ms, {report['chunks']} chunks, plan {report['plan_ms']:.2f} ms, peak "
              f"{report['peak_GiB']:.2f} GiB (budget {report['budget_GiB']:.1f})")
        for part, ms in report["parts_ms"].items():
            print(f"  {ms:10.2f} ms  {part}")
        for row in report["kernels"][:12]:
            print(f"    {row['ms']:9.2f} ms  x{row['launches']:<6d} {row['kernel'][:90]}")
    if args.json:
        command = "python3 benchmarks/profile_prefill_layer.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        Path(args.json).write_text(json.dumps({"command": command, "reports": reports}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
