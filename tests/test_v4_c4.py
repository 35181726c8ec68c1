"""DeepSeek-V4 C4 indexer: visibility of compressed entries and top-k against a float64 oracle from the spec."""

import dataclasses
import math

import torch

from dsa_indexer import DecodeBatch, IndexerConfig, IndexKCache, Indexer, PrefillBatch
from dsa_indexer.compressor import ReferenceCompressor

V4_TINY = dataclasses.replace(IndexerConfig.deepseek_v4_flash(), name="v4-tiny", hidden_size=256, q_lora_rank=256,
                              n_heads=4, topk=8, max_position=4096)


def test_v4_flash_config_matches_the_published_sizes():
    cfg = IndexerConfig.deepseek_v4_flash()
    assert (cfg.hidden_size, cfg.q_lora_rank, cfg.n_heads, cfg.head_dim, cfg.topk) == (4096, 1024, 64, 128, 512)
    assert cfg.compress_ratio == 4 and cfg.rope_position == "last" and cfg.rope_interleaved
    assert cfg.rope_offset == 64
    assert math.isclose(cfg.weight_scale, 64 ** -0.5 * 128 ** -0.5)


def _rope_interleaved_tail(t, pos, cfg):
    """GPT-J pairs (2i, 2i+1) over the trailing 64 dims, float64, theta 10000 (no YaRN in this config)."""
    half = cfg.rope_dim // 2
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(half, dtype=torch.float64) * 2 / cfg.rope_dim))
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()
    while cos.dim() < t.dim():
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    head, tail = t[..., :-cfg.rope_dim], t[..., -cfg.rope_dim:]
    a, b = tail[..., 0::2], tail[..., 1::2]
    rotated = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return torch.cat([head, rotated], dim=-1)


def test_c4_prefill_and_decode_visibility_and_topk_against_float64_oracle():
    cfg = V4_TINY
    seed = torch.randint(0, 10_000, ()).item()
    torch.manual_seed(seed)
    indexer = Indexer(cfg).init_random(seed)
    compressor = ReferenceCompressor(cfg).init_random(seed + 1)
    length = 301  # 75 complete entries; the last token starts entry 75, not yet visible
    x = torch.randn(length, cfg.hidden_size, dtype=torch.bfloat16)
    q_lora = torch.randn(length, cfg.q_lora_rank, dtype=torch.bfloat16)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    cache = IndexKCache.allocate(4)
    entries = compressor(x)
    assert entries.shape == (length // 4, cfg.head_dim)
    compressor.store(entries, 0, table[0], indexer.cos_sin, cache.data, indexer.fp8_dtype)

    pb = PrefillBatch.build([0], [length - 1], table, num_cache_pages=4, compress_ratio=4)
    prefill = indexer(x[:-1], q_lora[:-1], pb.positions, pb, cache)
    db = DecodeBatch.build([length], table, num_cache_pages=4, compress_ratio=4)
    assert db.context_lens.tolist() == [[length // 4]]
    decode = indexer(x[-1:], q_lora[-1:], db.positions, db, cache)
    got = torch.cat([prefill, decode])

    # Oracle in float64 from the spec: q = wq_b q_lora with RoPE at the token's position; keys are the compressor's
    # entries with RoPE at their first token's position (4j); logits = sum_h w_h relu(q_h . k_j) / sqrt(H D);
    # query t sees entries j < (t + 1) // 4; top-k by (value desc, index asc). Hadamard is orthonormal: dropped.
    q = (q_lora.double() @ indexer.wq_b.dequantize().double().T).view(length, cfg.n_heads, cfg.head_dim)
    q = _rope_interleaved_tail(q, torch.arange(length), cfg)
    k = _rope_interleaved_tail(entries.double(), torch.arange(entries.shape[0]) * 4, cfg)
    w = x.double() @ indexer.weights_proj.weight.double().T * cfg.weight_scale
    logits = torch.einsum("ths,th->ts", torch.einsum("thd,sd->ths", q, k).clamp_min(0), w)
    agree = total = 0
    for t in range(length):
        visible = (t + 1) // 4
        row = [i for i in got[t].tolist() if i >= 0]
        assert all(0 <= i < visible for i in row), f"query {t} got an entry it may not see"
        assert len(row) == min(cfg.topk, visible) and len(set(row)) == len(row)
        want = sorted(range(visible), key=lambda j: (-logits[t, j].item(), j))[: cfg.topk]
        agree += len(set(row) & set(want))
        total += len(want)
    # fp8 quantization of q, keys and q_lora can swap keys whose logits are within ~1% at the k-th place; a wrong
    # RoPE layout or visibility rule breaks most of the set.
    assert agree / total >= 0.85
