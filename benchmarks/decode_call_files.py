"""Which of the package's source files a warm decode call runs through, and how many registry resolutions it makes.

    python benchmarks/decode_call_files.py [--target sm90] [--out benchmarks/results]

A tiny V3.2 indexer on the CPU (optionally resolving for a simulated target; the full V3.2 shape on a GPU), one decode step to warm every cache,
then a second step traced with `sys.setprofile`: the distinct `dsa_indexer` files whose functions it entered, the
calls into `Registry.resolve` / `Registry.choose` (each a full resolution), and into `Registry.call` /
`Registry.function` (cached lookups). The issue-22 goal: at most half the files of before, nothing resolved twice.
"""

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

import dsa_indexer
from dsa_indexer import DecodeBatch, Indexer, IndexerConfig

PACKAGE = Path(dsa_indexer.__file__).parent


def trace_decode(target: str | None, device: str = "cpu") -> dict:
    # On a GPU the real V3.2 shape (64 heads: what the vendor kernels serve); on the CPU a tiny one.
    cfg = (IndexerConfig.deepseek_v32() if device != "cpu" else
           IndexerConfig(name="tiny", hidden_size=256, q_lora_rank=256, n_heads=4, topk=16, max_position=1024))
    indexer = Indexer(cfg, target=target, device=device).init_random(0)
    cache = indexer.allocate_cache(8)
    batch = DecodeBatch.build([40, 70], [[0, 1], [2, 3]], num_cache_pages=cache.num_pages, device=device)
    t = batch.num_tokens
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(t, cfg.hidden_size, generator=gen).to(device, torch.bfloat16)
    q_lora = torch.randn(t, cfg.q_lora_rank, generator=gen).to(device, torch.bfloat16)
    indexer(x, q_lora, batch.positions, batch, cache)  # warm: resolutions, caches, factories
    files: collections.Counter[str] = collections.Counter()
    registry_calls: collections.Counter[str] = collections.Counter()

    def profile(frame, event, arg):
        if event != "call":
            return
        path = Path(frame.f_code.co_filename)
        if PACKAGE in path.parents:
            rel = str(path.relative_to(PACKAGE.parent))
            files[rel] += 1
            if rel.endswith("dispatch/registry.py") and frame.f_code.co_name in ("resolve", "choose", "call",
                                                                                 "function"):
                registry_calls[frame.f_code.co_name] += 1

    sys.setprofile(profile)
    try:
        indexer(x, q_lora, batch.positions, batch, cache)
    finally:
        sys.setprofile(None)
    return {"target": target or str(indexer.target), "device": device, "files": len(files), "file_list": sorted(files),
            "registry_calls": dict(registry_calls)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", action="append", help="simulated target(s), default: the CPU and sm90")
    parser.add_argument("--device", default="cpu", help="where the tensors live (cuda: the real GPU path)")
    parser.add_argument("--out", help="folder to write decode_call_files.json into")
    args = parser.parse_args()
    targets = args.target or (["cpu", "sm90"] if args.device == "cpu" else ["detected"])
    rows = [trace_decode(None if t in ("cpu", "detected") else t, args.device) for t in targets]
    for row in rows:
        print(f"{row['target']:>6}: {row['files']} files, registry {row['registry_calls']}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        result = {"command": "python benchmarks/decode_call_files.py " + " ".join(sys.argv[1:]), "rows": rows}
        (Path(args.out) / "decode_call_files.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
