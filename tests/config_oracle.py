"""A float64 oracle of one indexer step for any `IndexerConfig` with fp8 keys, written from the contract (the
DeepSeek indexer's steps as docs/ops.md and docs/v4.md state them), never by calling the library's ops: for the
config-property test of tests/ops/test_bad_input_round2.py.

It simulates each rounding the contract names and computes everything else in float64:
- the fp8 GEMM inputs (q_lora into a block-fp8 ``wq_b``, x into an fp8 ``wk``): per 128, ``s = max(amax, 1e-4) / 448``,
  rounded up to a power of two for ``scale_fmt="ue8m0"``; every GEMM output in the activation dtype (bf16), except
  ``weights_proj`` under ``weights_proj_dtype="fp32"``;
- keys: ``wk(x)``, the config's ``k_norm`` (LayerNorm with weight and bias, RMSNorm with weight, or none); C4 keys are
  the compressor's entries (`v4_oracle.compress_vectorized`: pooled, rounded to bf16, RMSNorm);
- RoPE on ``rope_dim`` dims at ``rope_offset`` (NeoX halves or GPT-J pairs), frequencies ``theta ** (-2i / rope_dim)``
  with DeepSeek's YaRN ramp when configured; C4 keys are rotated at position 4j;
- the orthonormal Hadamard, then fp8 e4m3 per row of 128 (ue8m0 scales when ``config.ue8m0``);
- logits ``k_scale * sum_h w_h relu(q_h . k)`` with ``w = weights_proj(x) * H**-0.5 * D**-0.5 * q_scale``; a query at
  position t sees keys ``s <= t`` (C4: entries ``j < (t + 1) // 4``).
"""

from __future__ import annotations

import math

import torch

import v4_oracle

FP8_MAX = 448.0


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def fp8_groups(x: torch.Tensor, group: int, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized values, scales [..., n_groups]) of the fp8 e4m3 quantization per ``group`` along the last dim."""
    g = x.reshape(*x.shape[:-1], -1, group)
    s = g.abs().amax(-1, keepdim=True).clamp_min(1e-4) / FP8_MAX
    if ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    codes = (g / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).double()
    return (codes * s).reshape(x.shape), s.squeeze(-1)


def block_dequant(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A block-fp8 weight [N, K] with one scale per 128 x 128 block, in float64."""
    n, k = weight.shape
    full = scales.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return weight.double() * full


def inv_freqs(cfg) -> torch.Tensor:
    """theta ** (-2i / R) per pair i, with DeepSeek's YaRN ramp (pairs below the fast correction keep their
    frequency, above the slow one are divided by the factor, linear between) when the config has YaRN on."""
    r, theta = cfg.rope_dim, float(cfg.rope_theta)
    base = [theta ** (-2.0 * i / r) for i in range(r // 2)]
    yarn = cfg.yarn
    if yarn is None or yarn.original_max_position <= 0:
        return torch.tensor(base, dtype=torch.float64)

    def pair_turning(rotations: float) -> float:
        return r * math.log(yarn.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(pair_turning(yarn.beta_fast)), 0)
    high = min(math.ceil(pair_turning(yarn.beta_slow)), r - 1)
    out = []
    for i, f in enumerate(base):
        ramp = (1.0 if i > low else 0.0) if high == low else min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(f * (1 - ramp) + f / yarn.factor * ramp)
    return torch.tensor(out, dtype=torch.float64)


def rope(t: torch.Tensor, positions: torch.Tensor, cfg) -> torch.Tensor:
    """Rotate dims [offset, offset + R) of ``t`` [N, ..., D] by angle position * f_i per pair."""
    r = cfg.rope_dim
    offset = 0 if cfg.rope_position == "first" else cfg.head_dim - r
    angle = positions.double()[:, None] * inv_freqs(cfg)[None, :]
    cos, sin = angle.cos(), angle.sin()
    while cos.dim() < t.dim():
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    part = t[..., offset:offset + r]
    if cfg.rope_interleaved:
        a, b = part[..., 0::2], part[..., 1::2]
        rotated = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    else:
        a, b = part[..., : r // 2], part[..., r // 2:]
        rotated = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return torch.cat([t[..., :offset], rotated, t[..., offset + r:]], dim=-1)


def hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def key_norm(k: torch.Tensor, cfg, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    if cfg.k_norm == "layernorm":
        mean = k.mean(-1, keepdim=True)
        var = ((k - mean) ** 2).mean(-1, keepdim=True)
        return (k - mean) / torch.sqrt(var + cfg.norm_eps) * weight.double() + bias.double()
    if cfg.k_norm == "rmsnorm":
        return k / torch.sqrt((k * k).mean(-1, keepdim=True) + cfg.norm_eps) * weight.double()
    assert cfg.k_norm == "none", cfg.k_norm
    return k


def request_logits(indexer, x: torch.Tensor, q_lora: torch.Tensor) -> torch.Tensor:
    """[L, keys] float64 logits of one request's tokens at positions 0 .. L - 1 over all its keys (no mask)."""
    cfg = indexer.config
    gemm_ue8m0 = cfg.scale_fmt == "ue8m0"
    length = x.shape[0]
    positions = torch.arange(length)
    if indexer.wq_b_is_block_fp8:
        q_in, _ = fp8_groups(q_lora.double(), 128, gemm_ue8m0)
        wq = block_dequant(indexer.wq_b.weight, indexer.wq_b.weight_scale_inv)
    else:
        q_in, wq = q_lora.double(), indexer.wq_b.weight.double()
    q = bf16(q_in @ wq.T).view(length, cfg.n_heads, cfg.head_dim)
    head_w = x.double() @ indexer.weights_proj.weight.double().T
    if cfg.weights_proj_dtype == "bf16":
        head_w = bf16(head_w)
    if cfg.compress_ratio == 1:
        if indexer.wk_is_block_fp8:
            k = bf16(fp8_groups(x.double(), 128, gemm_ue8m0)[0] @ block_dequant(indexer.wk.weight,
                                                                                  indexer.wk.weight_scale_inv).T)
        else:
            k = bf16(x.double() @ indexer.wk.weight.double().T)
        k = rope(key_norm(k, cfg, indexer.k_norm.weight, indexer.k_norm.bias), positions, cfg)
    else:
        comp = indexer.compressor
        entries = v4_oracle.compress_vectorized(x, comp.wkv.weight, comp.wgate.weight, comp.ape, comp.norm.weight,
                                                cfg.norm_eps)
        k = rope(entries, torch.arange(entries.shape[0]) * 4, cfg)
    h = hadamard(cfg.head_dim)
    q_deq, q_scale = fp8_groups(rope(q, positions, cfg) @ h, cfg.head_dim, cfg.ue8m0)
    k_deq, _ = fp8_groups(k @ h, cfg.head_dim, cfg.ue8m0)
    w = head_w * cfg.n_heads ** -0.5 * cfg.head_dim ** -0.5
    # q_deq = codes * q_scale: folding q_scale into w (as the contract does) is the same product.
    return torch.einsum("thd,sd->ths", q_deq, k_deq).clamp_min(0).mul(w[..., None]).sum(1)


def visible_keys(cfg, position: int) -> int:
    return (position + 1) // cfg.compress_ratio


def topk_slack(row: list[int], logits: torch.Tensor, visible: int, k: int) -> float:
    """How far ``row`` (a top-k result, -1 padded) is from a top-k of ``logits[:visible]``: 0 when it is one; else the
    largest logit it left out minus the smallest it took (> 0). Structure errors (count, range, repeats, padding)
    raise AssertionError."""
    taken = [i for i in row if i >= 0]
    assert len(taken) == min(k, visible), f"{len(taken)} indices for min(k={k}, visible={visible})"
    assert row[len(taken):] == [-1] * (k - len(taken)), "the -1 padding must come after the indices"
    assert len(set(taken)) == len(taken), "an index repeats"
    assert all(0 <= i < visible for i in taken), f"an index outside the {visible} visible keys"
    if visible <= k:
        return 0.0
    mask = torch.zeros(visible, dtype=torch.bool)
    mask[taken] = True
    values = logits[:visible]
    return max(0.0, float(values[~mask].max() - values[mask].min()))
