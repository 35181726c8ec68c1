"""Which of the package's source files a warm decode step runs through, and how many registry calls it makes.

    python benchmarks/decode_call_files.py [--model v32 --model v4] [--target sm90] [--device cuda] [--out DIR]

For each model (V3.2, V4's C4 indexer) and target: one indexer on the CPU (tiny sizes; the real ones on a GPU), a
decode batch whose contexts are longer than the top-k (so the step runs its paged logits and its top-k, not the
"every key is visible" shortcut), one decode step to warm every cache, then a second step traced with
`sys.setprofile`: the distinct `dsa_indexer` files whose functions it entered, the Python calls it made into the
package (per file and per function), the calls into `Registry.resolve` / `Registry.choose` (each a full resolution) and into `Registry.call` /
`Registry.function` (a registry dispatch: a lookup per call). The goal of issue 36: no registry call in a warm step,
each model within ~9 files. The count is also split: the library's own files, and those under ``backends/`` (the
kernels' launchers, one file per kernel family on a GPU).
"""

import argparse
import collections
import dataclasses
import json
import sys
from pathlib import Path

import torch

import dsa_indexer
from dsa_indexer import CompressorState, DecodeBatch, Indexer, IndexerConfig

PACKAGE = Path(dsa_indexer.__file__).parent
REGISTRY_CALLS = ("resolve", "choose", "call", "function")


def model_config(model: str, device: str) -> IndexerConfig:
    """The real sizes on a GPU (what the vendor kernels serve), tiny ones on the CPU."""
    cfg = IndexerConfig.deepseek_v32() if model == "v32" else IndexerConfig.deepseek_v4_flash()
    if device != "cpu":
        return cfg
    return dataclasses.replace(cfg, name=f"{model}-tiny", hidden_size=256, q_lora_rank=256, n_heads=4, topk=16,
                               max_position=4096)


def trace_decode(model: str, target: str | None, device: str = "cpu") -> dict:
    cfg = model_config(model, device)
    indexer = Indexer(cfg, target=target, device=device).init_random(0)
    # Contexts of 3 and 5 times the top-k (in keys: tokens / compress_ratio): logits and top-k both run.
    keys = [3 * cfg.topk, 5 * cfg.topk]
    seq_lens = [n * cfg.compress_ratio for n in keys]
    pages = [-(-n // 64) for n in keys]
    table, first = [], 0
    for n in pages:
        table.append(list(range(first, first + max(pages))))
        first += max(pages)
    cache = indexer.allocate_cache(first)
    batch = DecodeBatch.build(seq_lens, table, num_cache_pages=cache.num_pages, device=device,
                              compress_ratio=cfg.compress_ratio)
    state = CompressorState.allocate(len(keys), cfg, device) if cfg.compress_ratio > 1 else None
    t = batch.num_tokens
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(t, cfg.hidden_size, generator=gen).to(device, torch.bfloat16)
    q_lora = torch.randn(t, cfg.q_lora_rank, generator=gen).to(device, torch.bfloat16)
    assert batch.max_context_len > cfg.topk  # the step scores (no all-visible shortcut)
    indexer(x, q_lora, batch.positions, batch, cache, compressor_state=state)  # warm: resolutions, caches, factories
    files: collections.Counter[str] = collections.Counter()
    registry_calls: collections.Counter[str] = collections.Counter()
    functions: collections.Counter[str] = collections.Counter()

    def profile(frame, event, arg):
        if event != "call":
            return
        path = Path(frame.f_code.co_filename)
        if PACKAGE in path.parents:
            rel = str(path.relative_to(PACKAGE.parent))
            files[rel] += 1
            functions[f"{rel}:{frame.f_code.co_name}"] += 1
            if rel.endswith("dispatch/registry.py") and frame.f_code.co_name in REGISTRY_CALLS:
                registry_calls[frame.f_code.co_name] += 1

    sys.setprofile(profile)
    try:
        indexer(x, q_lora, batch.positions, batch, cache, compressor_state=state)
    finally:
        sys.setprofile(None)
    kernel_files = [f for f in files if f.startswith("dsa_indexer/backends/")]
    return {"model": model, "target": target or str(indexer.target), "device": device, "context_keys": keys,
            "topk": cfg.topk, "files": len(files), "library_files": len(files) - len(kernel_files),
            "backend_files": len(kernel_files), "python_calls": sum(files.values()),
            "file_calls": dict(sorted(files.items())), "registry_calls": dict(registry_calls),
            "function_calls": dict(sorted(functions.items()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", action="append", choices=("v32", "v4"), help="default: both")
    parser.add_argument("--target", action="append", help="simulated target(s), default: the CPU and sm90")
    parser.add_argument("--device", default="cpu", help="where the tensors live (cuda: the real GPU path)")
    parser.add_argument("--out", help="folder to write decode_call_files.json into")
    args = parser.parse_args()
    targets = args.target or (["cpu", "sm90"] if args.device == "cpu" else ["detected"])
    rows = [trace_decode(m, None if t in ("cpu", "detected") else t, args.device)
            for m in args.model or ("v32", "v4") for t in targets]
    for row in rows:
        print(f"{row['model']:>4} {row['target']:>6}: {row['files']} files ({row['library_files']} library, "
              f"{row['backend_files']} backends/), {row['python_calls']} calls, registry {row['registry_calls']}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        result = {"command": "python benchmarks/decode_call_files.py " + " ".join(sys.argv[1:]), "rows": rows}
        (Path(args.out) / "decode_call_files.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
