"""Indexer configurations of the DeepSeek models (sizes, RoPE layout, quant recipe)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .rope import YarnScaling


@dataclass(frozen=True)
class IndexerConfig:
    name: str
    hidden_size: int
    q_lora_rank: int
    n_heads: int = 64
    head_dim: int = 128
    rope_dim: int = 64
    topk: int = 2048
    rope_position: str = "first"  # "first": dims [0, 64) (V3.2); "last": the trailing 64 dims (V4)
    rope_interleaved: bool = False  # NeoX rotate-half (V3.2) or GPT-J pairs (V4 reference)
    rope_theta: float = 10000.0
    yarn: YarnScaling | None = YarnScaling()
    max_position: int = 163840
    ue8m0: bool = True  # power-of-two scales for the indexer's q and k fp8 (V3.2 scale_fmt "ue8m0")
    k_norm: str = "layernorm"
    norm_eps: float = 1e-6
    compress_ratio: int = 1  # 4 for V4's C4 indexer: one key per 4 tokens
    fp8_block: int = 128
    # Where a layer's indexer tensors live in the checkpoint ({layer} is the layer number).
    checkpoint_prefix: str = "model.layers.{layer}.self_attn.indexer."

    def __post_init__(self) -> None:
        for name in ("hidden_size", "q_lora_rank", "n_heads", "head_dim", "rope_dim", "topk", "max_position",
                     "fp8_block"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"IndexerConfig.{name} must be a positive int, got {value!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"IndexerConfig.norm_eps must be > 0, got {self.norm_eps!r}")
        if self.rope_position not in ("first", "last"):
            raise ValueError(f"rope_position must be 'first' or 'last', got {self.rope_position!r}")
        if self.head_dim != 128:
            raise ValueError(f"head_dim must be 128 (the index-K cache layout), got {self.head_dim}")
        if self.q_lora_rank % self.fp8_block or self.hidden_size % self.fp8_block:
            raise ValueError("q_lora_rank and hidden_size must be multiples of 128 (the fp8 block)")
        if self.compress_ratio not in (1, 4):
            raise ValueError(f"compress_ratio must be 1 or 4, got {self.compress_ratio}")

    @property
    def rope_offset(self) -> int:
        return 0 if self.rope_position == "first" else self.head_dim - self.rope_dim

    @property
    def weight_scale(self) -> float:
        """Folded into the head weights: H**-0.5 (head averaging) * D**-0.5 (softmax scale)."""
        return self.n_heads ** -0.5 * self.head_dim ** -0.5

    @classmethod
    def deepseek_v32(cls, **overrides) -> "IndexerConfig":
        """DeepSeek-V3.2: hidden 7168, q_lora_rank 1536, 64 heads x 128, top-2048, NeoX RoPE on the first 64 dims."""
        return replace(cls(name="deepseek-v3.2", hidden_size=7168, q_lora_rank=1536), **overrides)

    @classmethod
    def deepseek_v4_flash(cls, key_quant: str = "fp8_ue8m0", **overrides) -> "IndexerConfig":
        """DeepSeek-V4-Flash C4 indexer: hidden 4096, q_lora_rank 1024, 64 heads x 128, top-512, interleaved RoPE
        on the trailing 64 dims with ``compress_rope_theta`` 160000 and YaRN (factor 16, original 65536, beta 32/1)
        over 1,048,576 positions, keys compressed 4:1 by the indexer's own `Compressor`.

        ``key_quant``: how q and the compressed keys are quantized for the fp8 logits (see `V4_KEY_QUANT`).
        Default ``"fp8_ue8m0"`` (vLLM's recipe, and V4's ``scale_fmt: ue8m0``): power-of-two scales, which every
        backend consumes, Blackwell DeepGEMM's packed UE8M0 scales included. ``"fp8_fp32"`` is SGLang's default
        (plain amax / 448 scales). Both fill the same cache layout and feed the same kernels."""
        if key_quant not in V4_KEY_QUANT:
            hint = (" DeepSeek's reference code simulates FP4 (e2m1, block 32) for the indexer's q and k; the index-K "
                    "cache holds fp8 keys with one scale each, so that recipe is not supported here."
                    if key_quant.startswith("fp4") else "")
            raise ValueError(f"key_quant must be one of {sorted(V4_KEY_QUANT)}, got {key_quant!r}.{hint}")
        base = cls(name="deepseek-v4-flash", hidden_size=4096, q_lora_rank=1024, topk=512, rope_position="last",
                   rope_interleaved=True, rope_theta=160000.0,
                   yarn=YarnScaling(factor=16.0, original_max_position=65536, beta_fast=32.0, beta_slow=1.0),
                   max_position=1 << 20, ue8m0=V4_KEY_QUANT[key_quant][0], k_norm="none", compress_ratio=4,
                   checkpoint_prefix="layers.{layer}.attn.indexer.")
        return replace(base, **overrides)


# name -> (power-of-two scales?, who uses it)
V4_KEY_QUANT = {
    "fp8_ue8m0": (True, "vLLM: fp8 e4m3, one power-of-two (UE8M0) scale per 128 values, stored as fp32"),
    "fp8_fp32": (False, "SGLang's default: fp8 e4m3, one fp32 scale (amax / 448) per 128 values"),
}


MODELS = {"deepseek-v3.2": IndexerConfig.deepseek_v32, "deepseek-v4-flash": IndexerConfig.deepseek_v4_flash}
