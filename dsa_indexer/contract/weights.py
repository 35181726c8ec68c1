"""Weight formats of the indexer's checkpoints: block-fp8 linears (128 x 128 scales), UE8M0 scale bytes, the fn -> fnuz
reinterpretation gfx942 needs, the dtype and finiteness checks of a loaded checkpoint, and the key names a checkpoint
of each model may use (DeepSeek's own, with a leading ``model.``, transformers' V4 module names). Model-agnostic
data and functions: `Indexer` loads through them."""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..config import IndexerConfig


class BlockFp8Linear(nn.Module):
    """A linear layer stored as fp8 e4m3 with one fp32 scale per 128x128 block (``weight_scale_inv``)."""

    def __init__(self, in_features: int, out_features: int, device=None, fp8_dtype=torch.float8_e4m3fn) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=fp8_dtype, device=device),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.empty(-(-out_features // 128), -(-in_features // 128), dtype=torch.float32, device=device),
            requires_grad=False)

    def dequantize(self) -> torch.Tensor:
        scale = self.weight_scale_inv.repeat_interleave(128, 0)[: self.out_features]
        scale = scale.repeat_interleave(128, 1)[:, : self.in_features]
        return self.weight.float() * scale


def quantize_block_fp8(weight: torch.Tensor, fp8_dtype=torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [N, K] -> (fp8 [N, K], fp32 scales [N/128, K/128]) with one amax scale per 128x128 block."""
    n, k = weight.shape
    pad_n, pad_k = -n % 128, -k % 128
    w = F.pad(weight.float(), (0, pad_k, 0, pad_n))
    blocks = w.view(w.shape[0] // 128, 128, w.shape[1] // 128, 128)
    fmax = 224.0 if fp8_dtype == torch.float8_e4m3fnuz else 448.0
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / fmax
    q = (blocks / scale[:, None, :, None]).clamp(-fmax, fmax).view_as(w)[:n, :k].to(fp8_dtype)
    return q.contiguous(), scale.contiguous()


FLOAT_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
E8M0_DTYPES = tuple(d for d in (getattr(torch, "float8_e8m0fnu", None), torch.uint8) if d is not None)
# (weight key, its block-scale keys): a weight with a scale beside it must be fp8, one without must be a float type.
SCALED_WEIGHTS = {"wq_b.weight": ("wq_b.weight_scale_inv", "wq_b.scale"), "wk.weight": ("wk.weight_scale_inv",)}


# transformers' DeepseekV4 module names under ``model.layers.{L}.self_attn.compressor.indexer.`` -> the names of
# DeepSeek's inference checkpoint (what `Indexer.load_checkpoint` reads). Read from transformers 5.23's
# modeling_deepseek_v4.py (DeepseekV4Indexer / DeepseekV4IndexerScorer) and its conversion mapping.
HF_V4_INDEXER_NAMES = {
    "q_b_proj.weight": "wq_b.weight", "q_b_proj.weight_scale_inv": "wq_b.weight_scale_inv",
    "q_b_proj.scale": "wq_b.scale", "scorer.weights_proj.weight": "weights_proj.weight",
    "kv_proj.weight": "compressor.wkv.weight", "gate_proj.weight": "compressor.wgate.weight",
    "position_bias": "compressor.ape", "kv_norm.weight": "compressor.norm.weight",
}
HF_V4_PREFIX = "model.layers.{layer}.self_attn.compressor.indexer."


def checkpoint_schemes(config: IndexerConfig, layer: int) -> list[tuple[str, dict[str, str]]]:
    """The (key prefix, name map) pairs a checkpoint of ``config``'s model may use for ``layer``'s indexer: the
    config's own prefix, the same under a leading ``model.`` (what ``save_pretrained`` writes for V4's inference
    names), and for a C4 indexer transformers' V4 module names (`HF_V4_INDEXER_NAMES`)."""
    own = config.checkpoint_prefix.format(layer=layer)
    schemes = [(own, {})]
    if not own.startswith("model."):
        schemes.append(("model." + own, {}))
    if config.compress_ratio == 4:
        schemes.append((HF_V4_PREFIX.format(layer=layer), HF_V4_INDEXER_NAMES))
    return schemes


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_checkpoint_formats(local: Mapping[str, torch.Tensor], prefix: str = "") -> None:
    """Every checkpoint tensor's dtype against what its role takes, and every value finite; raises ValueError naming
    the key and the dtypes. Without it a bf16 ``wq_b.weight`` beside a block scale would be cast to fp8 codes, an fp8
    weight without its scale would load raw codes as values, and an int8 ``weights_proj`` would be cast: each loads
    as plausible garbage."""
    floats = ", ".join(map(dtype_name, FLOAT_WEIGHT_DTYPES))
    for key, value in local.items():
        name = prefix + key
        scale_keys = SCALED_WEIGHTS.get(key, ())
        scale_key = next((s for s in scale_keys if s in local), None)
        if scale_key is not None:
            if value.dtype not in FP8_WEIGHT_DTYPES:
                raise ValueError(f"{name} is {dtype_name(value.dtype)} but {prefix}{scale_key} is beside it: a "
                                 f"block-scaled weight must be float8_e4m3fn or float8_e4m3fnuz (drop the scale key "
                                 f"for a {floats} weight)")
        elif key in ("wq_b.weight_scale_inv", "wk.weight_scale_inv"):
            if value.dtype not in FLOAT_WEIGHT_DTYPES:
                raise ValueError(f"{name} is {dtype_name(value.dtype)}; block scales are {floats}")
        elif key == "wq_b.scale":
            if value.dtype not in E8M0_DTYPES + FLOAT_WEIGHT_DTYPES:
                raise ValueError(f"{name} is {dtype_name(value.dtype)}; V4's UE8M0 block scale is float8_e8m0fnu "
                                 f"(or its uint8 bytes), or a float scale ({floats})")
        elif value.dtype in FP8_WEIGHT_DTYPES and key in SCALED_WEIGHTS:
            raise ValueError(f"{name} is {dtype_name(value.dtype)} without its block scale "
                             f"({' or '.join(prefix + s for s in scale_keys)}): the raw fp8 codes are not the "
                             "weight's values")
        elif value.dtype not in FLOAT_WEIGHT_DTYPES:
            raise ValueError(f"{name} is {dtype_name(value.dtype)}; this weight is {floats} (never quantized in "
                             "DeepSeek's checkpoints)")
        values = e8m0_to_float(value) if key == "wq_b.scale" else value.float()
        if not bool(torch.isfinite(values).all()):
            raise ValueError(f"{name} holds NaN or inf values")


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales (``float8_e8m0fnu``: a biased power-of-two exponent per byte, V4's ``wq_b.scale``) -> fp32
    ``2 ** (byte - 127)``; the byte 255 is NaN."""
    if scale.dtype != getattr(torch, "float8_e8m0fnu", None) and scale.dtype != torch.uint8:
        return scale.float()
    exponent = scale.view(torch.uint8).to(torch.int32) - 127
    value = torch.ldexp(torch.ones(exponent.shape, dtype=torch.float32), exponent)
    return torch.where(exponent == 128, torch.full_like(value, float("nan")), value)


def fn_to_fnuz(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reinterpret e4m3fn bits as e4m3fnuz (which reads every code as half the value) and double the scale.

    The code 0x80 is -0 in fn but NaN in fnuz, so it becomes +0. This is how gfx942 consumes fn checkpoints.
    """
    bits = weight.view(torch.int8).clone()
    bits[bits == -128] = 0
    return bits.view(torch.float8_e4m3fnuz), scale * 2.0
