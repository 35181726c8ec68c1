"""DeepSeek-V4's C4 key compressor (4 tokens -> 1 index key), as the published V4 inference code defines it.

Facts (DeepSeek-V4-Flash ``inference/model.py``, class ``Compressor`` with ``compress_ratio`` 4; vLLM and SGLang read
the same checkpoint tensors the same way; docs/v4.md says what was checked against what):

- Weights (checkpoint ``layers.{L}.attn.indexer.compressor.*``): ``wkv`` and ``wgate`` [2 x 128, hidden] (bf16 in the
  checkpoint, run in fp32), ``ape`` [4, 256] fp32, ``norm.weight`` [128] (RMSNorm, eps 1e-6).
- Per token at position p: ``kv = wkv(x)`` and ``score = wgate(x) + ape[p % 4]``, in fp32, 256 channels each.
- Entry j pools the 8 tokens [4j - 4, 4j + 4): the previous group's 4 tokens contribute channels [:128], the entry's
  own 4 tokens channels [128:]. Per channel, a softmax over the 8 tokens (a missing token, before position 0, scores
  -inf) weights the kv values; the fp32 sum is rounded to bf16, then RMSNorm (fp32 math, bf16 out).
- The entry is complete when its last token 4j + 3 exists, so a decode step compresses when (p + 1) % 4 == 0, and a
  query at position t sees entries j < (t + 1) // 4. The key gets RoPE at position 4j (trailing 64 dims, interleaved),
  the Hadamard, fp8 quant and the store into the index-K cache (the library's `k_prologue_store` op).

Decode needs the projections of a request's last tokens: `CompressorState` keeps the kv and score of each request's
last 8 positions (ring index p % 8; fp32; 16 KiB per request).
Precision: the pooled value is rounded to bf16 before the norm, as published; the norm, RoPE and Hadamard then run
in fp32 in one kernel (the published code rounds to bf16 after each; one bf16 ulp, far below the fp8 step). Every step reads the window tokens that are not in
the step from the state, then writes the step's last 8 tokens per request into it, all with device ops (no host
sync), so a decode step with its compression can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import IndexerConfig
from .contract.cache import IndexKCache
from .contract.validate import IndexerInputError, device_argument, fits_in_memory, human_bytes

RATIO = 4
WINDOW = 2 * RATIO  # entry j pools tokens [4j - 4, 4j + 4)


def _version_of(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter
        return -1


@dataclass
class CompressorState:
    """Per-request rolling state of one layer's C4 compressor: ``window`` fp32 ``[num_slots + 1, 8, 512]``, the
    projections ``[wkv(x) | wgate(x)]`` (ape not added) of each request's last 8 token positions at ring index
    position % 8. The last row is scratch: padding rows of a captured graph write there.

    One state per layer, like the cache. A request's slot must hold its own history: a request that starts at
    position 0 never reads it, but one that resumes (chunked prefill, decode) reads the tokens before its step.
    After a prefix-cache hit, rebuild the slot with `Compressor.prime_state` from the prefix's last 8 tokens."""

    window: torch.Tensor

    @classmethod
    def allocate(cls, num_slots: int, config: IndexerConfig, device: torch.device | str = "cpu"
                 ) -> "CompressorState":
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots <= 0:
            raise ValueError(f"num_slots must be a positive int, got {num_slots!r}")
        if not isinstance(config, IndexerConfig):
            raise IndexerInputError(f"config must be an IndexerConfig, got {type(config).__name__}")
        if config.compress_ratio != RATIO:
            raise ValueError(f"CompressorState is for compress_ratio 4 (C4) configs, got {config.compress_ratio}")
        device = device_argument("device", device)
        slot_bytes = WINDOW * 4 * config.head_dim * 4
        fits_in_memory(f"CompressorState.allocate(num_slots={num_slots}) at {human_bytes(slot_bytes)} a slot",
                       (num_slots + 1) * slot_bytes, device, "allocate one slot per request that runs at once")
        return cls(torch.zeros(num_slots + 1, WINDOW, 4 * config.head_dim, dtype=torch.float32, device=device))

    @property
    def num_slots(self) -> int:
        return self.window.shape[0] - 1

    @property
    def device(self) -> torch.device:
        return self.window.device

    def clone(self) -> "CompressorState":
        return CompressorState(self.window.clone())


@dataclass
class CompressionStep:
    """What one indexer step hands the compressor (built by `Indexer.forward` from the batch)."""

    state: CompressorState
    positions: torch.Tensor  # [T] int64
    row_request: torch.Tensor  # [T] request index of each row (rows of a request are consecutive)
    state_slot: torch.Tensor  # [T] int64 state slot of each row; -1: a padding row that touches nothing
    compress_rows: torch.Tensor  # [E] int64 rows whose position completes an entry ((p + 1) % 4 == 0)
    entry_slots: torch.Tensor  # [T] int64 cache slot of the entry a row completes, -1 for other rows

    def rows(self, start: int, stop: int) -> "CompressionStep":
        """The step of rows [start, stop) alone, on the same state: steps over consecutive blocks of rows, run in
        order, pool and store exactly what the whole step does (each block's windows read the rows before it from
        the state the previous block rolled forward), with the projection held for one block only."""
        keep = (self.compress_rows >= start) & (self.compress_rows < stop)
        return CompressionStep(self.state, self.positions[start:stop], self.row_request[start:stop],
                               self.state_slot[start:stop], self.compress_rows[keep] - start,
                               self.entry_slots[start:stop])


class Compressor(nn.Module):
    """The C4 indexer's key compressor of one layer (child ``compressor`` of a C4 `Indexer`)."""

    def __init__(self, config: IndexerConfig, device=None) -> None:
        super().__init__()
        if config.compress_ratio != RATIO:
            raise ValueError(f"Compressor is for compress_ratio 4 (C4) configs, got {config.compress_ratio}")
        self.config = config
        d = config.head_dim
        # fp32 parameters: the published code declares them fp32 and runs the pooling in fp32.
        self.wkv = nn.Linear(config.hidden_size, 2 * d, bias=False, device=device, dtype=torch.float32)
        self.wgate = nn.Linear(config.hidden_size, 2 * d, bias=False, device=device, dtype=torch.float32)
        self.ape = nn.Parameter(torch.zeros(RATIO, 2 * d, device=device, dtype=torch.float32))
        self.norm = nn.RMSNorm(d, eps=config.norm_eps, device=device, dtype=torch.float32)
        self.requires_grad_(False)
        self._projection: tuple[tuple, torch.Tensor] | None = None

    @torch.no_grad()
    def init_random(self, generator: torch.Generator) -> "Compressor":
        h = self.config.hidden_size
        for lin in (self.wkv, self.wgate):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=generator) * h ** -0.5)
        self.ape.copy_(torch.randn(self.ape.shape, generator=generator) * 0.5)
        self.norm.weight.copy_(1 + 0.1 * torch.randn(self.norm.weight.shape, generator=generator))
        return self

    def projection_weight(self) -> torch.Tensor:
        """``[wkv; wgate]`` [512, hidden] fp32: one GEMM per step (rebuilt when either weight changes)."""
        parts = (self.wkv.weight, self.wgate.weight)
        key = tuple((p.data_ptr(), _version_of(p), p.device) for p in parts)
        if self._projection is None or self._projection[0] != key:
            self._projection = (key, torch.cat(parts, dim=0).contiguous())
        return self._projection[1]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """``[wkv(x) | wgate(x)]`` fp32 [T, 512] of tokens ``x`` [T, hidden] (one fp32 GEMM; ape is added when
        pooling, where each token's position in its group is known)."""
        return F.linear(x.float(), self.projection_weight())

    def pool(self, kv_window: torch.Tensor, score_window: torch.Tensor) -> torch.Tensor:
        """Window projections [E, 8, 256] (token offsets 0..7 of each entry's window) -> normed bf16 entries [E, 128]:
        offsets 0-3 use channels [:128], 4-7 channels [128:]; softmax per channel over the 8 offsets."""
        d = self.config.head_dim
        kv = torch.cat([kv_window[:, :RATIO, :d], kv_window[:, RATIO:, d:]], dim=1)
        score = torch.cat([score_window[:, :RATIO, :d], score_window[:, RATIO:, d:]], dim=1)
        pooled = (torch.softmax(score, dim=1) * kv).sum(dim=1)
        return self.norm(pooled.to(torch.bfloat16).float()).to(torch.bfloat16)

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        """All complete entries of ONE request from its tokens ``x`` [L, hidden] at positions 0 .. L - 1 -> bf16
        [L // 4, 128] (normed, before RoPE). Stateless: what a whole-prompt prefill computes, written as plain
        tensor ops (`step` computes the same entries batched and resumable, through the `c4_compress_pool` op)."""
        two_d = 2 * self.config.head_dim
        both = self.project(x)
        positions = torch.arange(x.shape[0], device=x.device)
        kv, score = both[:, :two_d], both[:, two_d:] + self.ape[positions % RATIO]
        n = x.shape[0] // RATIO
        if n == 0:
            return x.new_empty(0, self.config.head_dim, dtype=torch.bfloat16)
        tokens = torch.arange(n, device=x.device)[:, None] * RATIO - RATIO + torch.arange(WINDOW, device=x.device)
        missing = (tokens < 0)[..., None]
        kv_w = kv[tokens.clamp_min(0)].masked_fill(missing, 0.0)
        score_w = score[tokens.clamp_min(0)].masked_fill(missing, float("-inf"))
        return self.pool(kv_w, score_w)

    @torch.no_grad()
    def prime_state(self, state: CompressorState, slot: int, x_tail: torch.Tensor, first_position: int) -> None:
        """Write a request's last tokens (``x_tail`` [<= 8, hidden] at positions ``first_position ..``) into its
        state slot, e.g. after restoring a cached prefix whose keys are already in the index-K cache."""
        if not 0 <= slot < state.num_slots:
            raise IndexerInputError(f"slot must lie in [0, {state.num_slots}), got {slot}")
        if x_tail.shape[0] > WINDOW:
            x_tail, first_position = x_tail[-WINDOW:], first_position + x_tail.shape[0] - WINDOW
        ring = torch.arange(first_position, first_position + x_tail.shape[0], device=state.device) % WINDOW
        state.window[slot, ring] = self.project(x_tail.to(state.device))

    def step(self, plan, x: torch.Tensor, step: CompressionStep, kv_cache) -> None:
        """Compress and store every entry this step's tokens complete, then roll the state forward: the fp32
        projection GEMM, the `c4_compress_pool` kernel (window gather, softmax pooling, state update), and the
        `k_prologue_store` kernel (RMSNorm, RoPE at 4j, Hadamard, fp8, store; rows without an entry have slot -1).
        ``plan``: the step's `dsa_indexer.plan.StepPlan`, whose roles "c4_pool" and "c4_store" (or "c4_fp4_keys")
        are those kernels, bound once for the layer. ``kv_cache``: the fp8 (or FP4) page tensor, or a plain-layout
        `IndexKCache` (stored by `k_prologue_store_plain`)."""
        cfg = self.config
        if cfg.key_quant != "fp4_e2m1" and isinstance(kv_cache, torch.Tensor) and kv_cache.shape[-1] == 68:
            raise IndexerInputError(f"kv_cache is a paged64_fp4_e2m1 cache (68 bytes per token), which holds FP4 keys; "
                                    f"key_quant is {cfg.key_quant!r}: use key_quant='fp4_e2m1' or the fp8 cache "
                                    "(paged64_fp8_e4m3)")
        rows = step.compress_rows
        cos_sin = plan.weights.cos_sin
        pooled = plan.run("c4_pool", "c4_compress_pool", self.project(x), step.state.window, self.ape, step.positions,
                          step.row_request, step.state_slot, rows)
        # RoPE at 4j = p - 3. A captured graph pools every row (rows = all); the rows that complete no entry have
        # slot -1 and store nothing, but their position must still index the table: clamp at 0.
        entry_positions = (step.positions[rows] - (RATIO - 1)).clamp_min(0)
        if cfg.key_quant == "fp4_e2m1":
            self._store_fp4(plan, pooled, entry_positions, step.entry_slots[rows], kv_cache, cos_sin)
            return
        if isinstance(kv_cache, IndexKCache):
            plan.run("c4_store", "k_prologue_store_plain", pooled, self.norm.weight, None, cfg.norm_eps,
                     entry_positions, cos_sin, kv_cache.data, kv_cache.scales_or_empty(), step.entry_slots[rows],
                     plan.rope_offset, cfg.rope_interleaved, "rmsnorm", kv_cache.key_format)
            return
        plan.run("c4_store", "k_prologue_store", pooled, self.norm.weight, None, cfg.norm_eps, entry_positions,
                 cos_sin, kv_cache, step.entry_slots[rows], plan.rope_offset, cfg.rope_interleaved, cfg.ue8m0,
                 plan.fp8_dtype, "rmsnorm")

    def _store_fp4(self, plan, pooled: torch.Tensor, entry_positions: torch.Tensor, slots: torch.Tensor, kv_cache,
                   cos_sin: torch.Tensor) -> None:
        """V4's FP4 keys (`dsa_indexer.fp4`): RMSNorm (bf16 out), then RoPE at 4j (bf16 out), Hadamard + e2m1 quant.
        Into the ``paged64_fp4_e2m1`` pages (68 bytes per token): the e2m1 codes and block scales as made
        (`fp4.key_fp4`, torch ops on any device: E = T / 4 rows of one head). Into the fp8 pages: folded into fp8
        with one power-of-two scale (the plan's "c4_fp4_keys" role: `q_prologue_fp4` with one "head"). Slot -1
        stores nothing."""
        from . import fp4
        from .contract.cache import FP4_BLOCK, FP4_BYTES_PER_TOKEN, store_fp4_rows, store_rows

        cfg = self.config
        if isinstance(kv_cache, IndexKCache):
            raise IndexerInputError(f"key_quant='fp4_e2m1' stores its keys in the fp8 pages (paged64_fp8_e4m3) or the "
                                    f"FP4 pages (paged64_fp4_e2m1); a {kv_cache.layout} cache holds plain keys: "
                                    "allocate one of those, or use key_quant 'fp8' with the plain layouts")
        normed = fp4.normed_key(pooled, self.norm.weight, cfg.norm_eps)
        if kv_cache.shape[-1] == FP4_BYTES_PER_TOKEN:
            if cfg.fp4_block != FP4_BLOCK:
                raise IndexerInputError(f"the paged64_fp4_e2m1 cache holds one scale per {FP4_BLOCK} values; "
                                        f"IndexerConfig.fp4_block is {cfg.fp4_block}: use fp4_block={FP4_BLOCK} or "
                                        "the fp8 cache (paged64_fp8_e4m3)")
            values, scales = fp4.key_fp4(normed, entry_positions, cos_sin, plan.rope_offset, cfg.rope_interleaved,
                                         cfg.fp4_block)
            store_fp4_rows(kv_cache, slots, values, scales)
            return
        # The rest is V4's FP4 q recipe with one head and unit weights (RoPE rounded to bf16, Hadamard, e2m1, fold):
        # the q_prologue_fp4 kernel (one Triton launch on GPUs) returns the fp8 keys and, as the weights, their row
        # scales (1 * 1.0 * row_scale, exact).
        unit = torch.ones(normed.shape[0], 1, dtype=torch.float32, device=normed.device)
        keys, scales = plan.run("c4_fp4_keys", "q_prologue_fp4", normed[:, None, :], entry_positions, cos_sin, unit,
                                1.0, plan.rope_offset, cfg.rope_interleaved, cfg.fp4_block, plan.fp8_dtype)
        store_rows(kv_cache, slots, keys[:, 0], scales[:, 0])
