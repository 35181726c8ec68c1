"""Helpers for tests and benchmarks: synthetic caches and decode steps (not used by the library itself)."""

from __future__ import annotations

import torch

from . import ops
from .batch import DecodeBatch
from .cache import PAGE_SIZE, IndexKCache, page_views
from .config import IndexerConfig
from .indexer import Indexer


def random_cache(num_pages: int, device, fp8_dtype=torch.float8_e4m3fn, seed: int = 0) -> IndexKCache:
    """A cache full of random finite fp8 keys with positive scales (what stored keys look like)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    cache = IndexKCache.allocate(num_pages, device, fp8_dtype)
    keys, scales = page_views(cache.data, fp8_dtype)
    keys.copy_((torch.randn(keys.shape, generator=gen) * 100).to(fp8_dtype))
    scales.copy_(torch.rand(scales.shape, generator=gen) * 0.01 + 1e-3)
    return cache


def decode_step(cfg: IndexerConfig, indexer: Indexer, batch: int, context: int, device, seed: int = 0):
    """(x, q_lora, q_lora_quant, DecodeBatch, cache) of one synthetic decode step over ``context`` tokens."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    keys = context // cfg.compress_ratio + 1
    pages = -(-keys // PAGE_SIZE)
    cache = random_cache(batch * pages, device, indexer.fp8_dtype, seed)
    table = torch.randperm(batch * pages, generator=gen).to(torch.int32).view(batch, pages)
    db = DecodeBatch.build([context] * batch, table, num_cache_pages=batch * pages, device=device,
                           compress_ratio=cfg.compress_ratio)
    x = torch.randn(batch, cfg.hidden_size, generator=gen).to(device, torch.bfloat16)
    q_a = (torch.randn(batch, cfg.q_lora_rank, generator=gen) * 2).to(device, torch.bfloat16)
    norm_w = (torch.rand(cfg.q_lora_rank, generator=gen) + 0.5).to(device, torch.bfloat16)
    q_lora, q_lora_quant = ops.rmsnorm_quant_fp8(q_a, norm_w, 1e-6)
    return x, q_lora, q_lora_quant, db, cache
