"""A reference key compressor for DeepSeek-V4's C4 indexer (4 tokens -> 1 index key).

The compressor belongs to the model's attention; the library only needs its output. This pure-torch module exists
so that `dsa-indexer run --model deepseek-v4-flash` is a complete demo and the C4 path can be tested end to end.
It implements gated pooling over overlapping windows as the public V4 description states it: compressed entry j
pools the tokens of window ``[4j - 4, 4j + 4)`` (its own 4 tokens and the 4 before, clipped at 0) with
softmax gates computed per channel from the tokens plus a learned per-offset bias, then RMSNorm. The entry becomes
visible once its last token ``4j + 3`` exists: a query at position t sees entries ``j < (t + 1) // 4``.
It has not been checked against a V4 checkpoint (none is available here); treat its weights layout as ours.
"""

from __future__ import annotations

import torch
from torch import nn

from . import ops
from .config import IndexerConfig


class ReferenceCompressor(nn.Module):
    def __init__(self, config: IndexerConfig, device=None, dtype=torch.bfloat16) -> None:
        super().__init__()
        if config.compress_ratio != 4:
            raise ValueError(f"ReferenceCompressor is for compress_ratio 4 (C4) configs, got {config.compress_ratio}")
        self.config = config
        self.ratio = config.compress_ratio
        self.window = 2 * config.compress_ratio  # overlapping: own tokens + the previous window's
        d = config.head_dim
        self.wkv = nn.Linear(config.hidden_size, d, bias=False, device=device, dtype=dtype)
        self.wgate = nn.Linear(config.hidden_size, d, bias=False, device=device, dtype=dtype)
        self.position_bias = nn.Parameter(torch.zeros(self.window, d, device=device, dtype=torch.float32))
        self.norm_weight = nn.Parameter(torch.ones(d, device=device, dtype=dtype))

    @torch.no_grad()
    def init_random(self, seed: int = 0) -> "ReferenceCompressor":
        gen = torch.Generator().manual_seed(seed)
        h = self.config.hidden_size
        for lin in (self.wkv, self.wgate):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * h ** -0.5)
        self.position_bias.copy_(torch.randn(self.position_bias.shape, generator=gen) * 0.1)
        self.norm_weight.copy_(1 + 0.1 * torch.randn(self.norm_weight.shape, generator=gen))
        return self

    def forward(self, x: torch.Tensor, first_entry: int = 0, start: int = 0) -> torch.Tensor:
        """Compress a request's tokens ``x [L, hidden]`` at positions ``start .. start + L - 1`` into its complete
        entries from ``first_entry`` on: returns bf16 ``[E, head_dim]`` (normed, before RoPE). ``x`` must cover
        every window it computes (from position ``4 * first_entry - 4``, clipped at 0)."""
        length = start + x.shape[0]
        n_entries = length // self.ratio
        if start > max(0, first_entry * self.ratio - self.ratio):
            raise ValueError(f"x starts at position {start} but entry {first_entry} needs tokens from "
                             f"{max(0, first_entry * self.ratio - self.ratio)}")
        if n_entries <= first_entry:
            return x.new_empty(0, self.config.head_dim)
        kv = self.wkv(x).float()
        gate = self.wgate(x).float()
        entries = torch.arange(first_entry, n_entries, device=x.device)
        offsets = torch.arange(self.window, device=x.device)
        tokens = entries[:, None] * self.ratio - self.ratio + offsets[None, :]  # [E, window] positions
        valid = tokens >= 0
        tokens = tokens.clamp_min(0) - start
        scores = gate[tokens] + self.position_bias[None]
        scores = scores.masked_fill(~valid[..., None], float("-inf"))
        pooled = (torch.softmax(scores, dim=1) * kv[tokens]).sum(dim=1)
        from .backends.reference.kernels import rmsnorm

        return rmsnorm(pooled, self.norm_weight, self.config.norm_eps).to(x.dtype)

    def store(self, entries: torch.Tensor, first_entry: int, block_table_row: torch.Tensor, cos_sin: torch.Tensor,
              kv_cache: torch.Tensor, fp8_dtype: torch.dtype) -> None:
        """RoPE (at the entry's first token position), Hadamard, fp8 and the store of compressed entries into the
        index-K cache, through the library's `k_prologue_store` op (norm "none": the compressor already normed)."""
        if entries.shape[0] == 0:
            return
        cfg = self.config
        idx = torch.arange(first_entry, first_entry + entries.shape[0], device=entries.device)
        slots = block_table_row.to(entries.device).long()[idx // 64] * 64 + idx % 64
        ops.k_prologue_store(entries, None, None, cfg.norm_eps, idx * self.ratio, cos_sin, kv_cache, slots,
                             rope_offset=cfg.rope_offset, interleaved=cfg.rope_interleaved, ue8m0=cfg.ue8m0,
                             fp8_dtype=fp8_dtype, norm="none")
