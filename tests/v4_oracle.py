"""A float64 oracle of DeepSeek-V4's C4 indexer, written from the public description (docs/v4.md lists the facts
and where they come from), never by calling the library: loops over entries and channels where that reads plainer.

- RoPE: theta 160000, YaRN (factor 16, original 65536, beta 32 / 1) always on; GPT-J pairs over the trailing dims.
- Compressor: entry j pools tokens [4j - 4, 4j + 4); tokens before 4j use channels [:d] of wkv / wgate / ape, the
  entry's own tokens channels [d:]; gate = wgate x + ape[position % 4]; softmax per channel over the 8 tokens (a
  token before 0 is absent); the pooled value is rounded to bf16, then RMSNorm (eps 1e-6) times its weight.
- Keys: RoPE at position 4j. Queries: wq_b q_lora, RoPE at the token's position. The Hadamard is orthonormal on
  both sides, so it leaves q . k unchanged and the oracle omits it.
- Logits: sum_h w_h relu(q_h . k_j), w = weights_proj(x) / sqrt(H * D); query t sees j < (t + 1) // 4.
"""

from __future__ import annotations

import math

import torch


def yarn_inv_freqs(rope_dim: int = 64, theta: float = 160000.0, factor: float = 16.0, original: int = 65536,
                   beta_fast: float = 32.0, beta_slow: float = 1.0) -> torch.Tensor:
    inv = [1.0 / theta ** (2 * i / rope_dim) for i in range(rope_dim // 2)]

    def correction(rotations: float) -> float:  # pair index that turns `rotations` times over the original length
        return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction(beta_fast)), 0)
    high = min(math.ceil(correction(beta_slow)), rope_dim - 1)
    out = []
    for i, f in enumerate(inv):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0 below low (keep), 1 above high (interpolate)
        out.append(f * (1 - ramp) + f / factor * ramp)
    return torch.tensor(out, dtype=torch.float64)


def rope_trailing_pairs(t: torch.Tensor, positions: torch.Tensor, inv_freqs: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2 * len(inv_freqs) dims of ``t`` [N, ..., D] in GPT-J pairs (2i, 2i + 1)."""
    r = 2 * inv_freqs.shape[0]
    angle = positions.double()[:, None] * inv_freqs[None, :]
    cos, sin = angle.cos(), angle.sin()
    while cos.dim() < t.dim():
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    head, tail = t[..., :-r], t[..., -r:]
    a, b = tail[..., 0::2], tail[..., 1::2]
    return torch.cat([head, torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)], dim=-1)


def compress(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor, ape: torch.Tensor, norm_weight: torch.Tensor,
             eps: float = 1e-6) -> torch.Tensor:
    """Entries [L // 4, d] float64 of one request whose tokens ``x`` [L, hidden] start at position 0."""
    d = wkv.shape[0] // 2
    kv = x.double() @ wkv.double().T
    gate = x.double() @ wgate.double().T
    entries = []
    for j in range(x.shape[0] // 4):
        pooled = torch.empty(d, dtype=torch.float64)
        for c in range(d):
            values, scores = [], []
            for i in range(4):  # the previous group's tokens: channel c
                tok = 4 * j - 4 + i
                if tok >= 0:
                    values.append(kv[tok, c])
                    scores.append(gate[tok, c] + ape[i, c].double())
            for i in range(4):  # the entry's own tokens: channel d + c
                tok = 4 * j + i
                values.append(kv[tok, d + c])
                scores.append(gate[tok, d + c] + ape[i, d + c].double())
            s = torch.stack(scores)
            p = torch.exp(s - s.max())
            pooled[c] = (p / p.sum() * torch.stack(values)).sum()
        rounded = pooled.to(torch.bfloat16).double()
        normed = rounded / torch.sqrt((rounded ** 2).mean() + eps) * norm_weight.double()
        entries.append(normed)
    return torch.stack(entries) if entries else torch.zeros(0, d, dtype=torch.float64)


def c4_logits(q_lora: torch.Tensor, x: torch.Tensor, wq_b: torch.Tensor, weights_proj: torch.Tensor,
              entries: torch.Tensor, n_heads: int, inv_freqs: torch.Tensor) -> torch.Tensor:
    """[L, E] float64 logits of every query over every entry (no mask)."""
    length, d = q_lora.shape[0], entries.shape[1]
    q = (q_lora.double() @ wq_b.double().T).view(length, n_heads, d)
    q = rope_trailing_pairs(q, torch.arange(length, device=q.device), inv_freqs)
    k = rope_trailing_pairs(entries, torch.arange(entries.shape[0], device=q.device) * 4, inv_freqs)
    w = x.double() @ weights_proj.double().T / math.sqrt(n_heads * d)
    return torch.einsum("ths,th->ts", torch.einsum("thd,sd->ths", q, k).clamp_min(0), w)


def topk_of_row(logits_row: torch.Tensor, visible: int, k: int) -> list[int]:
    """The k best of entries [0, visible): larger logit first, lower index on ties."""
    return sorted(range(visible), key=lambda j: (-logits_row[j].item(), j))[:k]


def compress_vectorized(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor, ape: torch.Tensor,
                        norm_weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`compress` for long prompts (GPU tests): the same float64 math as whole-tensor ops, checked equal to the
    loop form on CPU. Tokens are grouped by 4; group j - 1 gives part A, group j part B."""
    d = wkv.shape[0] // 2
    n = x.shape[0] // 4
    xd = x.double()[: 4 * n]
    kv = (xd @ wkv.double().T).view(n, 4, 2 * d)
    gate = (xd @ wgate.double().T).view(n, 4, 2 * d) + ape.double()[None]
    prev_kv = torch.cat([torch.zeros_like(kv[:1, :, :d]), kv[:-1, :, :d]])
    prev_gate = torch.cat([torch.full_like(gate[:1, :, :d], float("-inf")), gate[:-1, :, :d]])
    values = torch.cat([prev_kv, kv[:, :, d:]], dim=1)  # [n, 8, d]
    scores = torch.cat([prev_gate, gate[:, :, d:]], dim=1)
    pooled = (torch.softmax(scores, dim=1) * values).sum(dim=1)
    rounded = pooled.to(torch.bfloat16).double()
    return rounded / torch.sqrt((rounded ** 2).mean(dim=-1, keepdim=True) + eps) * norm_weight.double()
