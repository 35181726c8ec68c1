"""The plain-layout prologues on torch_npu's kernels: RoPE by ``npu_rotary_mul``, int8 by ``npu_dynamic_quant``, the
key store by ``npu_scatter_nd_update_`` (the kernels the Ascend integrations use for their indexer), with the norm and
the Hadamard rotation as torch ops on NPU tensors.

``npu_rotary_mul(x [.., D], r1, r2, rotary_mode)`` computes ``x * r1 + rotate(x) * r2`` with full-width cos / sin:
"half" pairs dim i with i + D/2 (V3.2's indexer RoPE), "interleave" pairs 2i with 2i + 1 (V4's). The int8 path
quantizes the bf16-rounded rotated values (``npu_dynamic_quant`` takes fp16 / bf16) and keeps the scale in fp16, as
the kernels take it; the reference quantizes the fp32 values with the fp16-rounded scale, so the two may differ by
about 1.5 int8 steps (bf16 rounding moves a value by up to 0.25 of a step; tests/test_npu_backend.py bounds it).
"""

from __future__ import annotations

import torch

from .api import NpuApi


def _rope(api: NpuApi, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, rope_offset: int,
          interleaved: bool) -> torch.Tensor:
    """RoPE of fp32 ``x [T, N, D]`` on dims [rope_offset, rope_offset + R) through npu_rotary_mul."""
    rope_dim = cos_sin.shape[1]
    cs = cos_sin[positions.long()]
    cos, sin = cs[:, : rope_dim // 2], cs[:, rope_dim // 2:]
    if interleaved:
        r1, r2 = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    else:
        r1, r2 = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    part = x[:, None, :, rope_offset:rope_offset + rope_dim].contiguous()  # [T, 1, N, R]: BSND
    mode = {"rotary_mode": "interleave" if interleaved else "half"} if api.rotary_interleave else {}
    rotated = api.rotary(part, r1[:, None, None, :], r2[:, None, None, :], **mode)
    out = x.clone()
    out[..., rope_offset:rope_offset + rope_dim] = rotated[:, 0]
    return out


def _int8(api: NpuApi, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from ..reference.kernels import hadamard_matrix

    rotated = (x @ hadamard_matrix(x.shape[-1], x.device)).to(torch.bfloat16)
    q, scale = api.dynamic_quant(rotated)
    return q, scale.to(torch.float16)


def make_q_prologue_plain(api_of):
    def q_prologue_plain(q, positions, cos_sin, head_weights, weight_scale, rope_offset=0, interleaved=False,
                         key_format="bf16"):
        api: NpuApi = api_of()
        x = _rope(api, q.float(), positions, cos_sin, rope_offset, interleaved)
        weights = head_weights.float() * weight_scale
        if key_format == "bf16":
            return x.to(q.dtype), q.new_empty(0, dtype=torch.float16), weights
        q_int8, scale = _int8(api, x)
        return q_int8, scale, weights

    return q_prologue_plain


def make_k_prologue_store_plain(api_of):
    from ..reference.kernels import key_norm

    def k_prologue_store_plain(k, norm_weight, norm_bias, eps, positions, cos_sin, key_cache, key_scales,
                               slot_mapping, rope_offset=0, interleaved=False, norm="layernorm",
                               key_format="bf16") -> None:
        api: NpuApi = api_of()
        x = key_norm(k, norm_weight, norm_bias, eps, norm)
        x = _rope(api, x[:, None, :], positions, cos_sin, rope_offset, interleaved)[:, 0]
        keys, scales = (x.to(torch.bfloat16), None) if key_format == "bf16" else _int8(api, x)
        keep = slot_mapping >= 0  # padding rows store nothing (this selection syncs with the host)
        rows = slot_mapping[keep].long().view(-1, 1)
        api.scatter(key_cache.view(-1, key_cache.shape[-1]), rows, keys[keep].to(key_cache.dtype))
        if scales is not None:
            api.scatter(key_scales.view(-1, 1), rows, scales.reshape(-1, 1)[keep].to(key_scales.dtype))

    return k_prologue_store_plain
