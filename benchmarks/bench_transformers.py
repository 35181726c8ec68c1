"""transformers' own indexer vs dsa_indexer swapped in (dsa_indexer.integrations.transformers), inside generate().

A model with the real indexer dimensions (V3.2: hidden 7168, q_lora_rank 1536, 64 index heads x 128, top-2048;
V4-Flash: hidden 4096, q_lora_rank 1024, top-512) and everything else tiny (few attention heads, small MLP, 1-2
layers), random weights, batch 1. The prompt is prefilled in chunks (transformers' dense indexer would need
[S, 64, T] fp32 scores at once: 64 GiB at 16K), then generate() continues it for --new-tokens tokens. Measured per
mode (hf, swapped): the chunked prefill, the whole generate() call, and each indexer call of the decode steps (CUDA
events around the module, medians over layers x steps).

    python benchmarks/bench_transformers.py --prompt 16384 --new-tokens 32 --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def v32_model(dims: str, device: str):
    import transformers

    real = dims == "real"
    config = transformers.DeepseekV32Config(
        vocab_size=1024, hidden_size=7168 if real else 256, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=64, q_lora_rank=1536 if real else 128,
        qk_rope_head_dim=64, v_head_dim=32, qk_nope_head_dim=32, first_k_dense_replace=2, n_routed_experts=2,
        num_experts_per_tok=1, n_group=1, topk_group=1, moe_intermediate_size=32, max_position_embeddings=32768,
        index_topk=2048 if real else 64, index_head_dim=128, index_n_heads=64 if real else 8,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return transformers.DeepseekV32ForCausalLM(config).to(device, torch.bfloat16).eval()


def v4_model(dims: str, device: str):
    import transformers

    real = dims == "real"
    config = transformers.DeepseekV4Config(
        vocab_size=1024, hidden_size=4096 if real else 256, moe_intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, head_dim=512, partial_rotary_factor=0.125, q_lora_rank=1024 if real else 128,
        n_routed_experts=2, num_experts_per_tok=1, sliding_window=128, o_groups=1, o_lora_rank=64,
        index_n_heads=64 if real else 8, index_head_dim=128, index_topk=512 if real else 16,
        max_position_embeddings=32768, layer_types=["compressed_sparse_attention"], mlp_layer_types=["moe"],
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return transformers.DeepseekV4ForCausalLM(config).to(device, torch.bfloat16).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class IndexerTimer:
    """Times every decode-step call (one query token) of the given modules: CUDA events on a GPU, else wall time."""

    def __init__(self, modules, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.pending, self.samples, self.handles = [], [], []
        for module in modules:
            self.handles.append(module.register_forward_pre_hook(self._start, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._stop, with_kwargs=True))

    def _start(self, module, args, kwargs):
        if args[0].shape[1] != 1:
            return
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.pending.append(event)
        else:
            self.pending.append(time.perf_counter())

    def _stop(self, module, args, kwargs, out):
        if args[0].shape[1] != 1:
            return
        start = self.pending.pop()
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.samples.append((start, end))
        else:
            self.samples.append((time.perf_counter() - start) * 1e3)

    def micros(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [s.elapsed_time(e) * 1e3 for s, e in self.samples]
        return [ms * 1e3 for ms in self.samples]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def indexer_modules(model, family: str):
    layers = model.model.layers
    if family == "v32":
        return [layer.self_attn.indexer for layer in layers]
    return [layer.self_attn.compressor.indexer for layer in layers
            if getattr(layer.self_attn, "compressor", None) is not None
            and getattr(layer.self_attn.compressor, "indexer", None) is not None]


@torch.no_grad()
def run_mode(model, family: str, ids: torch.Tensor, chunk: int, new_tokens: int, device: str) -> dict:
    import transformers

    cache = transformers.DynamicCache(config=model.config)
    sync(device)
    start = time.perf_counter()
    prompt = ids.shape[1]
    for first in range(0, prompt - 1, chunk):
        model(ids[:, first:min(first + chunk, prompt - 1)], past_key_values=cache, use_cache=True)
    sync(device)
    prefill_s = time.perf_counter() - start
    timer = IndexerTimer(indexer_modules(model, family), device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    sync(device)
    generate_s = time.perf_counter() - start
    micros = timer.micros()
    timer.remove()
    return {"prefill_chunked_s": round(prefill_s, 4), "generate_s": round(generate_s, 4),
            "generate_ms_per_token": round(generate_s / new_tokens * 1e3, 3),
            "indexer_decode_us_median": round(statistics.median(micros), 1) if micros else None,
            "indexer_decode_us_p10": round(sorted(micros)[len(micros) // 10], 1) if micros else None,
            "indexer_decode_calls": len(micros), "new_token_ids": out[0, prompt:prompt + 8].tolist()}


def bench(family: str, args) -> dict:
    from dsa_indexer.integrations.transformers import restore_indexers, swap_indexers, swapped_indexers

    model = (v32_model if family == "v32" else v4_model)(args.dims, args.device)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 1024, (1, args.prompt), generator=gen).to(args.device)
    warm = ids[:, :min(args.prompt, 2 * args.chunk)]
    result: dict = {"family": family, "prompt": args.prompt, "new_tokens": args.new_tokens, "chunk": args.chunk}
    swap_indexers(model)
    result["dsa_indexer"] = swapped_indexers(model)[0].extra_repr()
    run_mode(model, family, warm, args.chunk, 4, args.device)  # JIT compiles, tables, allocator
    result["swapped"] = run_mode(model, family, ids, args.chunk, args.new_tokens, args.device)
    restore_indexers(model)
    run_mode(model, family, warm, args.chunk, 4, args.device)
    result["hf"] = run_mode(model, family, ids, args.chunk, args.new_tokens, args.device)
    hf, ours = result["hf"]["indexer_decode_us_median"], result["swapped"]["indexer_decode_us_median"]
    if hf and ours:
        result["indexer_decode_speedup"] = round(hf / ours, 2)
    result["generate_speedup"] = round(result["hf"]["generate_s"] / result["swapped"]["generate_s"], 2)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="v32,v4", help="comma list of v32, v4 (default: both)")
    parser.add_argument("--dims", choices=("real", "tiny"), default="real", help="the indexer's dimensions")
    parser.add_argument("--prompt", type=int, default=16384, help="prompt tokens (default 16384)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generate() adds (default 32)")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (default 2048)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, help="write the results JSON here (after each family)")
    args = parser.parse_args(argv)
    report = {"command": "python benchmarks/bench_transformers.py " + " ".join(argv if argv is not None
                                                                                else sys.argv[1:]),
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "results": []}
    try:
        import transformers

        report["transformers"] = transformers.__version__
    except ImportError:
        print("bench_transformers needs transformers (pip install 'dsa-indexer[transformers]')", file=sys.stderr)
        return 2
    for family in args.families.split(","):
        try:
            report["results"].append(bench(family.strip(), args))
        except Exception as exc:  # one family failing still reports the other
            report["results"].append({"family": family, "error": f"{type(exc).__name__}: {exc}"})
        if args.out:
            args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(report["results"][-1]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
