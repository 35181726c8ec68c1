"""Helpers for tests and benchmarks: synthetic caches and decode steps (not used by the library itself)."""

from __future__ import annotations

import torch

from . import ops
from .batch import DecodeBatch
from .contract.cache import PAGE_SIZE, IndexKCache, page_views
from .dispatch.platform import platform_of
from .compressor import CompressorState
from .config import IndexerConfig
from .indexer import Indexer


def random_cache(num_pages: int, device, fp8_dtype: torch.dtype = torch.float8_e4m3fn, seed: int = 0,
                 layout: str = "paged64_fp8_e4m3"):
    """An index-K cache of random finite keys with positive scales, generated on ``device`` in chunks (a
    128 x 128K-token cache is 2 GiB: no host copy of it). ``layout``: the fp8 pages, or a plain layout (bf16 keys,
    or int8 keys with fp16 scales) for the targets whose kernels read those."""
    cache = IndexKCache.allocate(num_pages, device, fp8_dtype, layout)
    gen = torch.Generator(device=device).manual_seed(seed)
    if cache.is_plain:
        for start in range(0, num_pages, 2048):
            stop = min(num_pages, start + 2048)
            values = torch.randn(stop - start, *cache.data.shape[1:], device=device, generator=gen)
            if cache.scales is None:
                cache.data[start:stop] = values.to(cache.data.dtype)
            else:
                cache.data[start:stop] = (values * 40).clamp(-127, 127).round().to(torch.int8)
                cache.scales[start:stop] = (torch.rand(stop - start, *cache.scales.shape[1:], device=device,
                                                       generator=gen) * 0.01 + 1e-3).to(torch.float16)
        return cache
    keys, scales = page_views(cache.data, fp8_dtype)
    limit = torch.finfo(fp8_dtype).max
    step = 2048
    for start in range(0, num_pages, step):
        stop = min(num_pages, start + step)
        keys[start:stop] = (torch.randn(stop - start, *keys.shape[1:], device=device, generator=gen) * 100).clamp(
            -limit, limit).to(fp8_dtype)
        scales[start:stop] = torch.rand(stop - start, scales.shape[1], device=device, generator=gen) * 0.01 + 1e-3
    return cache


def decode_step(cfg: IndexerConfig, indexer: Indexer, batch: int, context: int, device, seed: int = 0):
    """(x, q_lora, q_lora_quant, DecodeBatch, cache, compressor_state) of one synthetic decode step over
    ``context`` tokens, every request alike; the cache has the layout the target's platform stores (what
    `Indexer.allocate_cache` picks); the compressor state (C4 only, else None) is fresh: the step pools its own
    tokens. ``q_lora_quant`` is what attention hands over (RMSNorm + fp8 quant of a random q_a)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    keys = context // cfg.compress_ratio + 1
    pages = -(-keys // PAGE_SIZE)
    layout = platform_of(indexer.target.vendor).cache_layout(cfg.compress_ratio)
    cache = random_cache(batch * pages, device, indexer.fp8_dtype, seed, layout=layout)
    table = torch.randperm(batch * pages, generator=gen).to(torch.int32).view(batch, pages)
    db = DecodeBatch.build([context] * batch, table, num_cache_pages=batch * pages, device=device,
                           compress_ratio=cfg.compress_ratio)
    x = torch.randn(batch, cfg.hidden_size, generator=gen).to(device, torch.bfloat16)
    q_a = (torch.randn(batch, cfg.q_lora_rank, generator=gen) * 2).to(device, torch.bfloat16)
    norm_w = (torch.rand(cfg.q_lora_rank, generator=gen) + 0.5).to(device, torch.bfloat16)
    q_lora, q_lora_quant = ops.rmsnorm_quant_fp8(q_a, norm_w, 1e-6)
    state = CompressorState.allocate(batch, cfg, device) if cfg.compress_ratio > 1 else None
    return x, q_lora, q_lora_quant, db, cache, state


def real_decode_logits(batch: int, context: int, device, seed: int = 0, indexer: Indexer | None = None,
                       x_scale: float = 1.0):
    """Indexer logits as a real V3.2 decode step makes them: keys of ``context`` random tokens stored by the
    indexer's own k path, queries from its q path, paged logits through the registry (DeepGEMM or Triton on a
    GPU). Random activations and seeded random weights, never zeros. Returns ``(logits [B, context] fp32,
    context_lens [B, 1] int32, block_table, q_fp8, weights, cache)``."""
    cfg = IndexerConfig.deepseek_v32()
    indexer = indexer or Indexer(cfg, device=device).init_random(seed)
    plan = indexer.step_plan(4096, decode=False)  # the indexer's own steps, as a prefill runs them
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    pages = -(-context // PAGE_SIZE)
    cache = IndexKCache.allocate(batch * pages, device, indexer.fp8_dtype)
    table = torch.randperm(batch * pages, generator=gen).to(torch.int32).view(batch, pages).to(device)
    step = 4096
    for b in range(batch):
        for start in range(0, context, step):
            n = min(step, context - start)
            x = (torch.randn(n, cfg.hidden_size, generator=gen) * x_scale).to(device, torch.bfloat16)
            pos = torch.arange(start, start + n, device=device)
            slots = table[b].long()[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
            plan.steps.k_path(plan, x, pos, slots, cache.data)
    x = (torch.randn(batch, cfg.hidden_size, generator=gen) * x_scale).to(device, torch.bfloat16)
    q_lora = torch.randn(batch, cfg.q_lora_rank, generator=gen).to(device, torch.bfloat16)
    positions = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
    q_fp8, weights = plan.steps.q_path(plan, x, q_lora, positions, None)
    lens = torch.full((batch, 1), context, dtype=torch.int32, device=device)
    q = q_fp8.view(batch, 1, cfg.n_heads, cfg.head_dim)
    logits = ops.paged_mqa_logits(q, cache.data, weights, lens, table, context)
    return logits, lens, table, q, weights, cache


def cuda_kernels(fn) -> "Counter[str]":
    """The CUDA kernels one call of ``fn`` launches, by name (torch profiler; memcpy / memset left out). ``fn`` runs
    once before, so JIT compiles and first resolutions stay out of the count."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return Counter(e.name for e in prof.events() if e.device_type.name == "CUDA" and "Memcpy" not in e.name
                   and "Memset" not in e.name)
