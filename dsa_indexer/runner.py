"""The main job behind `dsa-indexer run`: one indexer layer on synthetic decode and prefill batches.

Seeded random weights and activations, a cache filled with synthetic context, `--steps` decode steps and one
prefill; it prints which implementation ran each op, per-phase timings, and checks a sample of rows against
the reference backend (same inputs, every op forced to its pure-torch implementation).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .batch import DecodeBatch, PrefillBatch
from .cache import PAGE_SIZE, IndexKCache
from .config import MODELS
from .dispatch.plugins import default_registry
from .dispatch.target import detect_target
from .indexer import Indexer
from .ops import OPS
from .pipeline import PIPELINE_OP


@dataclass
class RunSettings:
    model: str = "deepseek-v3.2"
    device: str | None = None
    batch: int | None = None
    context: int | None = None
    steps: int | None = None
    prefill_tokens: int | None = None
    next_n: int = 1
    seed: int = 0
    verify: bool = True


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Clock:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.phases: dict[str, list[float]] = {}

    def time(self, name: str, fn: Callable):
        _sync(self.device)
        start = time.perf_counter()
        out = fn()
        _sync(self.device)
        self.phases.setdefault(name, []).append((time.perf_counter() - start) * 1e3)
        return out


def _fill_context(indexer: Indexer, cache: IndexKCache, seq_lens: list[int], block_table: torch.Tensor,
                  gen: torch.Generator, device: torch.device) -> None:
    """Store keys for every context position (the k path alone: what past steps would have written)."""
    cfg = indexer.config
    for b, length in enumerate(seq_lens):
        for start in range(0, length, 4096):
            n = min(4096, length - start)
            pos = torch.arange(start, start + n, device=device)
            x = torch.randn(n, cfg.hidden_size, generator=gen).to(device, torch.bfloat16)
            slots = block_table[b].to(device).long()[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
            from .pipeline import k_path

            k_path(indexer, x, pos, slots, cache.data)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of |set(a) & set(b)| / |set(b)| (ignoring -1 padding)."""
    total, agree = 0, 0
    for row_a, row_b in zip(a.cpu().tolist(), b.cpu().tolist()):
        want = {i for i in row_b if i >= 0}
        got = {i for i in row_a if i >= 0}
        total += max(1, len(want))
        agree += len(want & got) if want else (1 if not got else 0)
    return agree / max(1, total)


def run_main_job(settings: RunSettings, progress=None) -> dict:
    device = torch.device(settings.device) if settings.device else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    on_gpu = device.type != "cpu"
    batch = settings.batch or (32 if on_gpu else 4)
    cfg = MODELS[settings.model]()
    context = settings.context or (8192 if on_gpu else 4096)
    steps = settings.steps or (20 if on_gpu else 3)
    prefill_new = settings.prefill_tokens or (4096 if on_gpu else 512)
    next_n = settings.next_n
    if cfg.compress_ratio != 1:
        from .compressor import run_v4_demo

        return run_v4_demo(cfg, settings, device, batch, context, steps, prefill_new, progress)
    gen = torch.Generator().manual_seed(settings.seed)
    torch.manual_seed(settings.seed)
    max_len = context + steps * next_n + prefill_new + 1
    cfg = type(cfg)(**{**cfg.__dict__, "max_position": max(cfg.max_position if on_gpu else 0, max_len)})
    target = detect_target(device)
    print(f"dsa-indexer run: {cfg.name} on {device} (target {target}), batch {batch} x context {context}, "
          f"next_n {next_n}, {steps} decode steps, prefill {prefill_new} new tokens after a {context}-token prefix")
    indexer = Indexer(cfg, device=device).init_random(settings.seed)
    pages_per_req = -(-max_len // PAGE_SIZE)
    num_pages = (batch + 1) * pages_per_req
    cache = IndexKCache.allocate(num_pages, device, indexer.fp8_dtype)
    # A shuffled page assignment, so a kernel that ignores the block table cannot pass.
    block_table = torch.randperm(num_pages, generator=gen).to(torch.int32).view(batch + 1, pages_per_req)
    clock = _Clock(device)
    seq_lens = [context - next_n] * batch
    clock.time("fill context keys", lambda: _fill_context(indexer, cache, seq_lens + [context], block_table, gen,
                                                           device))
    bar = progress(steps, "decode steps") if progress else None
    decode_out = None
    for step in range(steps):
        seq_lens = [s + next_n for s in seq_lens]
        db = DecodeBatch.build(seq_lens, block_table[:batch], next_n=next_n, num_cache_pages=num_pages, device=device)
        t = db.num_tokens
        x = torch.randn(t, cfg.hidden_size, generator=gen).to(device, torch.bfloat16)
        q_lora = torch.randn(t, cfg.q_lora_rank, generator=gen).to(device, torch.bfloat16)
        decode_inputs = (x, q_lora, db)
        decode_out = clock.time("decode step", lambda: indexer(x, q_lora, db.positions, db, cache))
        if bar:
            bar.update(step + 1)
    # Prefill: one request extends a cached prefix of `context` tokens by `prefill_new` tokens.
    pb = PrefillBatch.build([context], [prefill_new], block_table[batch:], num_cache_pages=num_pages, device=device)
    xp = torch.randn(pb.num_tokens, cfg.hidden_size, generator=gen).to(device, torch.bfloat16)
    qp = torch.randn(pb.num_tokens, cfg.q_lora_rank, generator=gen).to(device, torch.bfloat16)
    cache_before_prefill = cache.data.clone() if settings.verify else None
    prefill_out = clock.time("prefill", lambda: indexer(xp, qp, pb.positions, pb, cache))

    registry = default_registry()
    used = {}
    for (op, _target, _problem), res in registry.used.items():
        used.setdefault(op, set()).add(res.chosen.impl_id)
    report = {"model": cfg.name, "device": str(device), "target": str(target), "batch": batch, "context": context,
              "next_n": next_n, "steps": steps, "prefill_tokens": prefill_new,
              "implementations": {op: sorted(ids) for op, ids in sorted(used.items())},
              "timings_ms": {name: {"median": statistics.median(v), "count": len(v)} for name, v in
                             clock.phases.items()},
              "verified": None}
    print("\nimplementations that ran:")
    for op, ids in report["implementations"].items():
        print(f"  {op:<22} {', '.join(ids)}")
    print("\ntimings (median ms):")
    for name, entry in report["timings_ms"].items():
        print(f"  {name:<22} {entry['median']:10.3f}  (n={entry['count']})")

    if settings.verify:
        report["verified"] = _verify(indexer, cache, cache_before_prefill, decode_inputs, decode_out,
                                     (xp, qp, pb), prefill_out, report)
    return report


def _verify(indexer, cache, cache_before_prefill, decode_inputs, decode_out, prefill_inputs, prefill_out,
            report) -> bool:
    """Re-run the last decode step and the prefill with every op forced to the pure-torch reference."""
    registry = default_registry()
    forced = [op for op in OPS] + [PIPELINE_OP]
    x, q_lora, db = decode_inputs
    xp, qp, pb = prefill_inputs
    ref_cache = IndexKCache(cache_before_prefill.clone(), cache.fp8_dtype)
    try:
        for op in forced:
            impl = f"{op}.reference.torch" if op != PIPELINE_OP else f"{op}.generic.single_stream"
            registry.force(op, impl)
        # The decode step's own keys are already in the cache; storing them again writes the same bytes.
        ref_decode = indexer(x, q_lora, db.positions, db, ref_cache)
        ref_prefill = indexer(xp, qp, pb.positions, pb, ref_cache)
    finally:
        for op in forced:
            registry.force(op, None)
    decode_agree = _overlap(decode_out, ref_decode)
    prefill_agree = _overlap(prefill_out, ref_prefill)
    # Different kernels may round the fp8 prologue differently by one ulp, which can swap keys whose logits tie
    # at the k-th place; 99% set agreement catches any real error (a wrong page or mask moves far more).
    ok = decode_agree >= 0.99 and prefill_agree >= 0.99
    report["verification"] = {"decode_topk_agreement": decode_agree, "prefill_topk_agreement": prefill_agree,
                              "threshold": 0.99}
    print(f"\nverification against the reference backend: decode top-k agreement {decode_agree:.4%}, "
          f"prefill {prefill_agree:.4%} -> {'OK' if ok else 'MISMATCH'}")
    return ok
