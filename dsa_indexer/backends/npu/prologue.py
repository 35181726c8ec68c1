"""The plain-layout prologues on torch_npu's kernels: RoPE by ``npu_rotary_mul``, int8 by ``npu_dynamic_quant``, the
key store by ``npu_scatter_nd_update_`` (the kernels the Ascend integrations use for their indexer), with the norm and
the Hadamard rotation as torch ops on NPU tensors.

``npu_rotary_mul(x, r1, r2, rotary_mode)`` computes ``x * r1 + rotate(x) * r2`` with full-width cos / sin: "half"
pairs dim i with i + D/2 (V3.2's indexer RoPE), "interleave" pairs 2i with 2i + 1 (V4's). Its documented limits
(op-plugin ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_rotary_mul.md``, master 517f2e7d, the same in 7.3.0 /
26.0.0 / 26.1.0; A2 / A3 with jit_compile=False): half mode B < 1000 and N < 1000, interleave mode B * N < 1000 and
r1 / r2 in a ``1S1D`` layout for BSND input; D even and < 896. So the T tokens go on the S axis: input
``[1, T, N, R]`` (BSND, B = 1) with r1 / r2 ``[1, T, 1, R]`` (1S1D), which no T exceeds and both modes take. (With
jit_compile=True, for older SoCs, the op documents half mode only and D = 128; this adapter's R is the RoPE width, 64:
not covered.)

The int8 path quantizes the bf16-rounded rotated values (``npu_dynamic_quant`` takes fp16 / bf16) and keeps the scale
in fp16, as the kernels take it; the reference quantizes the fp32 values with the fp16-rounded scale, so the two may
differ by about 1.5 int8 steps (bf16 rounding moves a value by up to 0.25 of a step; tests/backends/test_npu_backend.py bounds
it).

NaN: the stored keys are checked finite on the host before the scatter (`lightning.require_finite`), naming ``k``
when the input already held them, else the norm weights / cos_sin, so no NaN key reaches torch_npu's indexers, whose
NaN order is undefined.
"""

from __future__ import annotations

import torch

from .api import NpuApi
from .lightning import require_finite


ROTARY_MAX_HEADS = 999  # B * N < 1000 (interleave) and N < 1000 (half), with B = 1
ROTARY_MAX_DIM = 894  # D < 896 and even


def _rope(api: NpuApi, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, rope_offset: int,
          interleaved: bool) -> torch.Tensor:
    """RoPE of fp32 ``x [T, N, D]`` on dims [rope_offset, rope_offset + R) through npu_rotary_mul."""
    rope_dim = cos_sin.shape[1]
    heads = x.shape[1]
    if heads > ROTARY_MAX_HEADS or rope_dim > ROTARY_MAX_DIM or rope_dim % 2:
        raise ValueError(f"npu_rotary_mul takes at most {ROTARY_MAX_HEADS} heads and an even width below 896; got "
                         f"{heads} heads of RoPE width {rope_dim}")
    cs = cos_sin[positions.long()]
    cos, sin = cs[:, : rope_dim // 2], cs[:, rope_dim // 2:]
    if interleaved:
        r1, r2 = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    else:
        r1, r2 = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    part = x[None, :, :, rope_offset:rope_offset + rope_dim].contiguous()  # [1, T, N, R]: BSND with B = 1
    shape = (1, x.shape[0], 1, rope_dim)  # 1S1D: the layout both modes take
    mode = {"rotary_mode": "interleave" if interleaved else "half"} if api.rotary_interleave else {}
    rotated = api.rotary(part, r1.reshape(shape).contiguous(), r2.reshape(shape).contiguous(), **mode)
    out = x.clone()
    out[..., rope_offset:rope_offset + rope_dim] = rotated[0]
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
        # the int8 kernels' scales hide a NaN row (npu_dynamic_quant's NaN handling is not documented): check first
        require_finite("q (after RoPE by cos_sin)", x)
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
        keep = slot_mapping >= 0  # padding rows store nothing (this selection syncs with the host)
        rows = slot_mapping[keep].long().view(-1, 1)
        x = x[keep]
        if not bool(torch.isfinite(x).all()):
            culprit = "k" if not bool(torch.isfinite(k[keep]).all()) else "norm_weight / norm_bias or cos_sin"
            require_finite(f"the keys to store (from {culprit})", x, keep.nonzero().flatten())
        keys, scales = (x.to(torch.bfloat16), None) if key_format == "bf16" else _int8(api, x)
        if scales is not None:
            require_finite("the key scales to store (fp16)", scales)
        api.scatter(key_cache.view(-1, key_cache.shape[-1]), rows, keys.to(key_cache.dtype))
        if scales is not None:
            api.scatter(key_scales.view(-1, 1), rows, scales.reshape(-1, 1).to(key_scales.dtype))

    return k_prologue_store_plain
