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

No host reads: both prologues run inside the pipeline (the store on the NPU side stream), where a host read would
block the host before the other path is enqueued and the streams would not overlap
(tests/backends/test_host_syncs_in_steps.py fails on one). So padding rows (slot -1) are not selected out (a
boolean-mask selection reads the mask on the host): they are redirected to rewrite a kept row's bytes
(`contract.cache.without_padding`). NaN: torch_npu's indexers rank NaN in an undefined order, so no NaN key may reach
them. The store writes non-finite rows as zeros and records them on the device (`lightning.STORE_CHECKS`, naming
``k`` when the input row already held them, else the norm weights / cos_sin); the next scoring over that cache raises
before its kernel runs. The int8 q prologue makes the scale of a non-finite q row NaN, which the scoring's
``q_scales`` check refuses.
"""

from __future__ import annotations

import torch

from ...contract.cache import without_padding
from .api import NpuApi
from .lightning import STORE_CHECKS


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
        # npu_dynamic_quant's NaN handling is not documented, so its scale could hide a NaN row: mark the row's
        # scale NaN here (no host read) and the scoring's q_scales check refuses it
        finite = torch.isfinite(x).all(dim=-1)
        q_int8, scale = _int8(api, torch.where(finite[..., None], x, torch.zeros_like(x)))
        return q_int8, torch.where(finite, scale, torch.full_like(scale, float("nan"))), weights

    return q_prologue_plain


def make_k_prologue_store_plain(api_of):
    from ..reference.kernels import key_norm

    def k_prologue_store_plain(k, norm_weight, norm_bias, eps, positions, cos_sin, key_cache, key_scales,
                               slot_mapping, rope_offset=0, interleaved=False, norm="layernorm",
                               key_format="bf16") -> None:
        api: NpuApi = api_of()
        if not slot_mapping.numel():
            return
        x = key_norm(k, norm_weight, norm_bias, eps, norm)
        x = _rope(api, x[:, None, :], positions, cos_sin, rope_offset, interleaved)[:, 0]
        keep = slot_mapping >= 0  # padding rows store nothing
        finite = torch.isfinite(x).all(dim=-1)
        numbers = torch.arange(x.shape[0], device=x.device)
        STORE_CHECKS.record(key_cache, "the keys to store", keep & ~finite, numbers,
                            from_input=~torch.isfinite(k).all(dim=-1))
        x = torch.where(finite[:, None], x, torch.zeros_like(x))
        keys, scales = (x.to(torch.bfloat16), None) if key_format == "bf16" else _int8(api, x)
        flat = key_cache.view(-1, key_cache.shape[-1])
        if scales is None:
            rows, (keys,) = without_padding(slot_mapping, (keys.to(key_cache.dtype),), lambda at: (flat[at],))
        else:
            scales = scales.reshape(-1, 1).to(key_scales.dtype)
            scale_ok = torch.isfinite(scales[:, 0])  # an fp32 scale past the fp16 range
            STORE_CHECKS.record(key_cache, "the key scales to store (fp16)", keep & ~scale_ok, numbers)
            scales = torch.where(scale_ok[:, None], scales, torch.zeros_like(scales))
            flat_scales = key_scales.view(-1, 1)
            rows, (keys, scales) = without_padding(slot_mapping, (keys.to(key_cache.dtype), scales),
                                                   lambda at: (flat[at], flat_scales[at]))
            api.scatter(flat_scales, rows.view(-1, 1), scales)
        api.scatter(flat, rows.view(-1, 1), keys)

    return k_prologue_store_plain
