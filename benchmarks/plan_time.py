"""Host time of planning a causal prefill of T tokens (one request): `PrefillBatch.build` and the first
`plan_chunks` at the Indexer's default budget and q-path bytes (later layers reuse the plan).

    python benchmarks/plan_time.py [--tokens 8192 32768 131072 1048576]   # a CUDA device holds the batch if present
"""

import argparse
import time

import torch

from dsa_indexer import Indexer, IndexerConfig, PrefillBatch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 131072, 1048576],
                        help="prefill lengths to plan (one request, no prefix)")
    args = parser.parse_args()
    indexer = Indexer(IndexerConfig.deepseek_v32(), device="cpu")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for tokens in args.tokens:
        pages = tokens // 64 + 2
        started = time.perf_counter()
        batch = PrefillBatch.build([0], [tokens], torch.arange(pages).view(1, pages).int(), device=device)
        built = time.perf_counter() - started
        started = time.perf_counter()
        plan = batch.plan_chunks(indexer.logits_budget_bytes, indexer.q_path_bytes_per_row())
        planned = time.perf_counter() - started
        print(f"T={tokens} chunks={len(plan)} build_ms={built * 1e3:.2f} plan_ms={planned * 1e3:.3f}")


if __name__ == "__main__":
    main()
