"""Does the CUDA prefill top-k's sampled threshold keep its fast path on real indexer rows? (issue 27; CPU)

    python benchmarks/prefill_topk_sample_check.py --tokens 1048576 --rows 8

Stores T keys of one V3.2 request through the Indexer's own k path (random weights, `init_random(0)`, random
activations, in 64K-token blocks), scores ``--rows`` queries at evenly spaced positions in [T/2, T) with the reference
ragged logits, and replays the kernel's threshold choice on each row (`csrc/topk_registers.cu`, prefill kernel):
2048 float4s evenly spaced over the window, the m-th largest sampled value with m = target * 8192 / width, target
min(2k, (k + 6144) / 2). The kernel takes its fast path when the keys at or above that value number between k and
its 6144 candidate slots; else it re-reads the whole row per radix level (exact, ~5x the reads). The replay uses
the sampled value itself where the kernel uses its 22-bit key prefix (a few more candidates), so it is a close
estimate, not the kernel. Prints one line per row.
"""

import argparse

import numpy as np
import torch

from dsa_indexer import Indexer, IndexerConfig, IndexKCache, PrefillBatch, ops

TOPK, CAPACITY, SAMPLE_VECS = 2048, 6144, 2048


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1 << 20)
    parser.add_argument("--rows", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    tokens = args.tokens
    cfg = IndexerConfig.deepseek_v32(max_position=max(163840, tokens + 64))
    indexer = Indexer(cfg, device="cpu").init_random(0)
    pages = tokens // 64 + 2
    table = torch.arange(pages, dtype=torch.int32).view(1, pages)
    cache = IndexKCache.allocate(pages, "cpu")
    block = 65536
    for p0 in range(0, tokens, block):
        n = min(block, tokens - p0)
        batch = PrefillBatch.build([p0], [n], table, num_cache_pages=pages)
        indexer.store_keys(torch.randn(n, cfg.hidden_size).to(torch.bfloat16), batch, cache)
    slots = torch.arange(tokens)
    keys, scales = cache.gather(table[0, slots // 64].long() * 64 + slots % 64)
    positions = torch.linspace(tokens // 2, tokens - 1, args.rows).long()
    step = indexer.step_plan(args.rows, False)
    q, weights = step.steps.q_path(step, torch.randn(args.rows, cfg.hidden_size).to(torch.bfloat16),
                                   torch.randn(args.rows, cfg.q_lora_rank).to(torch.bfloat16), positions, None)
    ends = (positions + 1).int()
    logits = ops.ragged_mqa_logits(q, keys, scales, weights, torch.zeros_like(ends), ends)
    target = min(2 * TOPK, (TOPK + CAPACITY) // 2)
    for r in range(args.rows):
        width = int(ends[r])
        row = logits[r, :width].numpy()
        nvec = (width + 3) // 4
        cols = (4 * ((np.arange(SAMPLE_VECS, dtype=np.int64) * nvec) // SAMPLE_VECS)[:, None] + np.arange(4)).ravel()
        sample = np.sort(row[cols[cols < width]])[::-1]
        m = max(1, min(CAPACITY, target * 4 * SAMPLE_VECS // width))
        candidates = int((row >= sample[m - 1]).sum())
        print(f"position {int(positions[r])}: width {width}, m {m}, candidates {candidates}, fast path "
              f"{TOPK <= candidates <= CAPACITY}")


if __name__ == "__main__":
    main()
