"""How much of a DeepSeek-V4-Flash C4 indexer step is its key compressor (decode under CUDA-graph replay, prefill
eager with CUDA events), to decide whether the pure-torch compressor needs its own kernel.

    python benchmarks/bench_v4_compressor.py --out benchmarks/results

Decode: B in {1, 32, 64} requests at context 32768 tokens (8192 entries), one token each; the whole indexer step
(compressor + q path + logits + top-k) and the compressor alone (`Indexer.store_keys`), each captured in a graph,
medians of 15 x 20 replays. Prefill: one request of 16384 new tokens after a 16384-token prefix, forward vs
store_keys, medians of 5 runs. Also the compressor's fp32 projection GEMM alone ([T, 4096] x [4096, 512]).
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from bench_q_lora_reuse import cuda_bench_args, replay_us


def event_ms(fn, runs: int = 5) -> float:
    from dsa_indexer.bench.timing import eager_event_times

    return statistics.median(eager_event_times(fn, runs))


def main() -> int:
    args = cuda_bench_args(__doc__)
    if args is None:
        return 0
    from bench_pipeline import capture
    from dsa_indexer import CompressorState, IndexerConfig, Indexer, PrefillBatch
    from dsa_indexer.dispatch.plugins import default_registry
    from dsa_indexer.testing import decode_step, random_cache

    cfg = IndexerConfig.deepseek_v4_flash()
    indexer = Indexer(cfg, device="cuda").init_random(0)
    decode = []
    for batch in (1, 32, 64):
        x, q_lora, quant, db, cache, state = decode_step(cfg, indexer, batch, args.context, "cuda", seed=batch)
        g_step, _ = capture(lambda: indexer(x, q_lora, db.positions, db, cache, q_lora_quant=quant,
                                            compressor_state=state))
        g_comp, _ = capture(lambda: indexer.store_keys(x, db, cache, compressor_state=state))
        step_us, comp_us = [], []
        for _ in range(3):
            step_us.append(replay_us(g_step))
            comp_us.append(replay_us(g_comp))
        row = {"batch": batch, "context": args.context, "step_us": statistics.median(step_us),
               "compressor_us": statistics.median(comp_us)}
        row["compressor_share"] = row["compressor_us"] / row["step_us"]
        decode.append(row)
        print(f"decode B={batch:3d}: step {row['step_us']:7.1f} us, compressor alone {row['compressor_us']:6.1f} us "
              f"({row['compressor_share']:.0%})")
    prefix, new = 16384, 16384
    pages = -(-((prefix + new) // 4) // 64)
    cache = random_cache(pages, "cuda", indexer.fp8_dtype, 1)
    table = torch.arange(pages, dtype=torch.int32)[None].cuda()
    state = CompressorState.allocate(1, cfg, "cuda")
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(new, cfg.hidden_size, generator=gen).to("cuda", torch.bfloat16)
    q_lora = torch.randn(new, cfg.q_lora_rank, generator=gen).to("cuda", torch.bfloat16)
    pb = PrefillBatch.build([prefix], [new], table, device="cuda", compress_ratio=4)
    forward_ms = event_ms(lambda: indexer(x, q_lora, pb.positions, pb, cache, compressor_state=state))
    store_ms = event_ms(lambda: indexer.store_keys(x, pb, cache, compressor_state=state))
    weight = indexer.compressor.projection_weight()
    gemm_ms = event_ms(lambda: torch.nn.functional.linear(x.float(), weight))
    prefill = {"prefix": prefix, "new_tokens": new, "forward_ms": forward_ms, "compressor_ms": store_ms,
               "compressor_share": store_ms / forward_ms, "projection_gemm_fp32_ms": gemm_ms}
    print(f"prefill {new} tokens after {prefix}: forward {forward_ms:.2f} ms, compressor {store_ms:.2f} ms "
          f"({prefill['compressor_share']:.0%}), of which the fp32 projection GEMM {gemm_ms:.2f} ms")
    used = {op: res.chosen.impl_id for (op, _, _), res in default_registry().used.items()}
    result = {"command": " ".join(["python"] + sys.argv), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "model": cfg.name, "decode": decode, "prefill": prefill,
              "implementations": used}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "v4_compressor.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
