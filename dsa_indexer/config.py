"""Indexer configurations of the DeepSeek models (sizes, RoPE layout, quant recipe).

The numeric recipe is part of the config, so one object says how a model's indexer is reproduced:

- ``scale_fmt`` ("fp32" | "ue8m0"): the scales of the fp8 activation quant that feeds the block-fp8 GEMMs (q_lora into
  ``wq_b``; x into ``wk`` when ``wk_gemm`` is "fp8"). "ue8m0" rounds each ``amax / 448`` scale up to a power of two, as
  DeepSeek's inference code does for ``scale_fmt: "ue8m0"`` (V3.2 and V4 declare it); "fp32" keeps ``amax / 448``.
- ``ue8m0``: the same choice for the indexer's own q and k fp8 quant (the index-K cache stores fp32 scales, so both
  formats fit its layout).
- ``wk_gemm`` ("bf16" | "fp8"): V3.2's ``wk`` dequantized once and run as a bf16 GEMM fused with ``weights_proj``, or
  kept block-fp8 as the checkpoint stores it and run as an fp8 GEMM with x quantized per ``scale_fmt``.
- ``weights_proj_dtype`` ("bf16" | "fp32"): the precision of the head-weight projection (V3.2's code runs it in fp32).
- ``key_quant`` ("fp8" | "fp4_e2m1"): the indexer's q and key quant; "fp4_e2m1" is V4's published recipe (e2m1 in
  blocks of 32 with power-of-two scales; see `dsa_indexer.fp4`).

`IndexerConfig.from_hf_config` reads a model's config.json and takes the model's own recipe from it. The presets
(`deepseek_v32`, `deepseek_v4_flash`) keep the library's serving defaults (``recipe="serving"``, which docs/v4.md and
docs/ops.md explain); ``recipe="deepseek"`` gives the model's own numerics, every field of it (`DEEPSEEK_RECIPES`).
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from .contract.quant import SCALE_FMTS
from .rope import YarnScaling

WK_GEMMS = ("bf16", "fp8")
WEIGHTS_PROJ_DTYPES = ("bf16", "fp32")
KEY_QUANTS = ("fp8", "fp4_e2m1")
ROPE_POSITIONS = ("first", "last")
K_NORMS = ("layernorm", "rmsnorm", "none")  # what the key prologues apply (ops.NORMS)
INT32_MAX = 2**31 - 1
RECIPES = ("serving", "deepseek")

# DeepSeek's own numerics per model, as its inference code runs the published fp8 checkpoints (their config.json files
# declare ``quantization_config.scale_fmt: "ue8m0"``): what ``recipe="deepseek"`` sets and what `from_hf_config` reads
# from the official files. V3.2: q_lora and x quantized with power-of-two scales, wk kept block-fp8 (an fp8 GEMM),
# weights_proj in fp32, fp8 q / k with power-of-two scales. V4-Flash: the same q_lora scales and FP4 e2m1 (blocks of
# 32, power-of-two scales) for q and the compressed keys.
DEEPSEEK_RECIPES: dict[str, dict[str, Any]] = {
    "deepseek-v3.2": {"scale_fmt": "ue8m0", "ue8m0": True, "wk_gemm": "fp8", "weights_proj_dtype": "fp32",
                      "key_quant": "fp8"},
    "deepseek-v4-flash": {"scale_fmt": "ue8m0", "ue8m0": True, "wk_gemm": "bf16", "weights_proj_dtype": "bf16",
                          "key_quant": "fp4_e2m1", "fp4_block": 32},
}


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
    # The numeric recipe (module docstring): GEMM-input scales, wk's GEMM, weights_proj's precision, q / key quant.
    scale_fmt: str = "fp32"
    wk_gemm: str = "bf16"
    weights_proj_dtype: str = "bf16"
    key_quant: str = "fp8"
    fp4_block: int = 32

    def __post_init__(self) -> None:
        """Every field checked where it is set: a misspelled or impossible value would otherwise be read later by code
        that silently takes a default for it (an unknown ``k_norm`` applied no norm) or fails inside a kernel."""
        if not isinstance(self.name, str):
            raise ValueError(f"IndexerConfig.name must be a str, got {self.name!r}")
        for name in ("hidden_size", "q_lora_rank", "n_heads", "head_dim", "rope_dim", "topk", "max_position",
                     "fp8_block"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"IndexerConfig.{name} must be a positive int, got {value!r}")
        if self.topk > INT32_MAX:
            raise ValueError(f"IndexerConfig.topk={self.topk} is past the int32 limit {INT32_MAX}: the top-k indices "
                             "are int32")
        _check_choice("rope_position", self.rope_position, ROPE_POSITIONS)
        _check_choice("k_norm", self.k_norm, K_NORMS)
        for name in ("rope_interleaved", "ue8m0"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"IndexerConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if not _positive_finite(self.norm_eps):
            raise ValueError(f"IndexerConfig.norm_eps must be a finite number > 0, got {self.norm_eps!r}")
        if self.head_dim != 128:
            raise ValueError(f"head_dim must be 128 (the index-K cache layout), got {self.head_dim}")
        if self.rope_dim % 2 or self.rope_dim > self.head_dim:
            raise ValueError(f"IndexerConfig.rope_dim must be even (RoPE turns pairs of dims) and at most head_dim="
                             f"{self.head_dim}, got {self.rope_dim} (a config.json's qk_rope_head_dim)")
        if not (_positive_finite(self.rope_theta) and self.rope_theta > 1):
            raise ValueError(f"IndexerConfig.rope_theta must be a finite number > 1 (the RoPE base: each pair's "
                             f"frequency theta ** (-2i / rope_dim) falls with i; DeepSeek uses 10000, V4's compressed "
                             f"keys 160000), got {self.rope_theta!r}")
        _check_yarn(self.yarn)
        if self.fp8_block != 128:
            raise ValueError(f"IndexerConfig.fp8_block must be 128 (the block of every block-fp8 weight and GEMM "
                             f"input here), got {self.fp8_block}")
        if self.q_lora_rank % self.fp8_block or self.hidden_size % self.fp8_block:
            raise ValueError("q_lora_rank and hidden_size must be multiples of 128 (the fp8 block)")
        if isinstance(self.compress_ratio, bool) or not isinstance(self.compress_ratio, int) or \
                self.compress_ratio not in (1, 4):
            raise ValueError(f"compress_ratio must be 1 or 4, got {self.compress_ratio!r}")
        if not isinstance(self.checkpoint_prefix, str):
            raise ValueError(f"IndexerConfig.checkpoint_prefix must be a str, got {self.checkpoint_prefix!r}")
        try:
            self.checkpoint_prefix.format(layer=0)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"IndexerConfig.checkpoint_prefix {self.checkpoint_prefix!r} must format with {{layer}} "
                             f"as its only field (e.g. 'model.layers.{{layer}}.self_attn.indexer.'): {exc!r}") from None
        for name, allowed in (("scale_fmt", SCALE_FMTS), ("wk_gemm", WK_GEMMS),
                              ("weights_proj_dtype", WEIGHTS_PROJ_DTYPES), ("key_quant", KEY_QUANTS)):
            _check_choice(name, getattr(self, name), allowed)
        if isinstance(self.fp4_block, bool) or self.fp4_block not in (16, 32, 64, 128):
            raise ValueError(f"IndexerConfig.fp4_block must be 16, 32, 64 or 128 (a divisor of the head dim), got "
                             f"{self.fp4_block!r}")
        if self.wk_gemm == "fp8" and self.compress_ratio != 1:
            raise ValueError("IndexerConfig.wk_gemm='fp8' is for V3.2's wk; a C4 indexer (compress_ratio 4) has no wk "
                             "(its keys come from the compressor)")
        if self.k_norm != "none" and self.compress_ratio != 1:
            raise ValueError(f"IndexerConfig.k_norm={self.k_norm!r}, but a C4 indexer (compress_ratio 4) has no key "
                             "norm of its own: its compressor RMSNorms every entry. Use k_norm='none' (what "
                             "IndexerConfig.deepseek_v4_flash() sets)")
        if self.key_quant == "fp4_e2m1" and self.compress_ratio != 4:
            raise ValueError("IndexerConfig.key_quant='fp4_e2m1' is V4's C4 indexer recipe (compress_ratio 4); V3.2's "
                             "indexer quantizes q and k to fp8 (key_quant='fp8')")

    @property
    def gemm_ue8m0(self) -> bool:
        """Whether the fp8 GEMM inputs (q_lora for wq_b, x for an fp8 wk) get power-of-two scales."""
        return self.scale_fmt == "ue8m0"

    def recipe(self) -> dict[str, Any]:
        """The numeric recipe as plain data (for reports, `dsa-indexer info` and test ids)."""
        return {"scale_fmt": self.scale_fmt, "index_ue8m0": self.ue8m0, "wk_gemm": self.wk_gemm,
                "weights_proj_dtype": self.weights_proj_dtype, "key_quant": self.key_quant,
                "fp4_block": self.fp4_block}

    @property
    def rope_offset(self) -> int:
        return 0 if self.rope_position == "first" else self.head_dim - self.rope_dim

    @property
    def weight_scale(self) -> float:
        """Folded into the head weights: H**-0.5 (head averaging) * D**-0.5 (softmax scale)."""
        return self.n_heads ** -0.5 * self.head_dim ** -0.5

    @classmethod
    def deepseek_v32(cls, recipe: str = "serving", **overrides) -> "IndexerConfig":
        """DeepSeek-V3.2: hidden 7168, q_lora_rank 1536, 64 heads x 128, top-2048, NeoX RoPE on the first 64 dims,
        ``weights_proj`` in fp32 (as DeepSeek's inference code runs it).

        ``recipe``: ``"serving"`` (default) keeps the GEMM-input scales plain fp32 and runs ``wk`` dequantized (bf16,
        fused with weights_proj); ``"deepseek"`` is the model's own numerics, what `from_hf_config` gives for
        DeepSeek's config.json: ``scale_fmt="ue8m0", wk_gemm="fp8"`` (`DEEPSEEK_RECIPES`). ``overrides`` replace
        fields; one that contradicts ``recipe="deepseek"`` is refused."""
        base = cls(name="deepseek-v3.2", hidden_size=7168, q_lora_rank=1536, weights_proj_dtype="fp32")
        return _with_recipe(base, recipe, DEEPSEEK_RECIPES["deepseek-v3.2"], {}, overrides)

    @classmethod
    def deepseek_v4_flash(cls, key_quant: str | None = None, recipe: str = "serving", **overrides
                          ) -> "IndexerConfig":
        """DeepSeek-V4-Flash C4 indexer: hidden 4096, q_lora_rank 1024, 64 heads x 128, top-512, interleaved RoPE
        on the trailing 64 dims with ``compress_rope_theta`` 160000 and YaRN (factor 16, original 65536, beta 32/1)
        over 1,048,576 positions, keys compressed 4:1 by the indexer's own `Compressor`.

        ``recipe``: ``"serving"`` (default) or ``"deepseek"``, the model's own numerics (what `from_hf_config` gives
        for DeepSeek's config.json): ``key_quant="fp4_e2m1"`` AND ``scale_fmt="ue8m0"`` (`DEEPSEEK_RECIPES`); FP4
        without the ue8m0 q_lora scales agrees only 0.98 with DeepSeek's code (docs/v4.md).

        ``key_quant``: how q and the compressed keys are quantized for the logits (see `V4_KEY_QUANT`).
        Default ``"fp8_ue8m0"`` (vLLM's recipe, and V4's ``scale_fmt: ue8m0``): power-of-two scales, which every
        backend consumes, Blackwell DeepGEMM's packed UE8M0 scales included. ``"fp8_fp32"`` is SGLang's default
        (plain amax / 448 scales). ``"fp4_e2m1"`` is DeepSeek's (e2m1, block 32, power-of-two scales; docs/v4.md),
        the default of ``recipe="deepseek"``. All three fill the same cache layout and feed the same kernels."""
        if recipe not in RECIPES:
            raise _recipe_error(recipe)
        named = key_quant if key_quant is not None else ("fp4_e2m1" if recipe == "deepseek" else "fp8_ue8m0")
        if named not in V4_KEY_QUANT:
            hint = (" DeepSeek's FP4 recipe (e2m1, block 32, power-of-two scales) is 'fp4_e2m1'."
                    if str(named).lower().startswith("fp4") else "")
            raise ValueError(f"key_quant must be one of {sorted(V4_KEY_QUANT)}, got {named!r}.{hint}")
        ue8m0, quant = V4_KEY_QUANT[named][0], V4_KEY_QUANT[named][2]
        base = cls(name="deepseek-v4-flash", hidden_size=4096, q_lora_rank=1024, topk=512, rope_position="last",
                   rope_interleaved=True, rope_theta=160000.0,
                   yarn=YarnScaling(factor=16.0, original_max_position=65536, beta_fast=32.0, beta_slow=1.0),
                   max_position=1 << 20, ue8m0=ue8m0, k_norm="none", compress_ratio=4,
                   checkpoint_prefix="layers.{layer}.attn.indexer.", key_quant=quant)
        # key_quant is this preset's own name for the q / key quant: checked against the recipe like a field.
        named_fields = {"key_quant": ("fp4_e2m1", key_quant)} if key_quant is not None else {}
        return _with_recipe(base, recipe, DEEPSEEK_RECIPES["deepseek-v4-flash"], named_fields, overrides)

    @classmethod
    def from_hf_config(cls, source: "str | Path | Mapping[str, Any]", *, allow_missing_mscale: bool = False,
                       **overrides) -> "IndexerConfig":
        """The indexer config of a Hugging Face ``config.json`` (a path to the file or its folder, or the parsed dict)
        of DeepSeek-V3.2 (``model_type`` "deepseek_v32") or DeepSeek-V4 ("deepseek_v4"), with the model's own
        numeric recipe: ``quantization_config.scale_fmt`` sets the fp8 scale format (an fp8 checkpoint also keeps
        ``wk`` block-fp8, ``wk_gemm="fp8"``); V4 takes DeepSeek's FP4 indexer recipe. ``overrides`` replace fields.

        RoPE ``mscale``: DeepSeek's indexer RoPE is never amplitude-scaled (its configs carry ``mscale`` =
        ``mscale_all_dim`` = 1.0, a ratio of 1). A YaRN config without both keys would make transformers scale the
        indexer's cos / sin by ``0.1 ln(factor) + 1`` (1.369 for V3.2's factor 40): such a file is refused, naming
        the keys to add, unless ``allow_missing_mscale=True``, which builds DeepSeek's unscaled table anyway (with a
        warning). A config whose mscale ratio or ``attention_factor`` is not 1 is always refused. V4 is the
        exception that transformers makes too: its compress rope (the indexer's) gets ``attention_factor`` 1.0 when
        the file gives none, so DeepSeek-V4-Flash's own config.json (YaRN factor 16, no mscale keys) loads.

        A file's errors (not JSON, not an object, a value refused here) name the file."""
        data, origin = _read_hf_config(source)
        try:
            return cls._from_hf_fields(data, allow_missing_mscale, overrides)
        except ValueError as exc:
            if origin is None:
                raise
            raise ValueError(f"{origin}: {exc}") from None

    @classmethod
    def _from_hf_fields(cls, data: Mapping[str, Any], allow_missing_mscale: bool, overrides: Mapping[str, Any]
                        ) -> "IndexerConfig":
        model_type = data.get("model_type")
        if model_type == "deepseek_v32":
            base = cls.deepseek_v32()
            theta_key, compress = "rope_theta", False
        elif model_type == "deepseek_v4":
            base = cls.deepseek_v4_flash(key_quant="fp4_e2m1")
            theta_key, compress = "compress_rope_theta", True
        else:
            raise ValueError(f"config model_type is {model_type!r}; from_hf_config reads 'deepseek_v32' and "
                             "'deepseek_v4' configs (use IndexerConfig(...) or a preset for others)")
        fields: dict[str, Any] = {"name": str(data.get("_name_or_path") or base.name)}
        for key, field in (("hidden_size", "hidden_size"), ("q_lora_rank", "q_lora_rank"),
                           ("index_n_heads", "n_heads"), ("index_head_dim", "head_dim"), ("index_topk", "topk"),
                           ("qk_rope_head_dim", "rope_dim"), ("max_position_embeddings", "max_position")):
            if data.get(key) is not None:
                fields[field] = _config_int(data, key)
        rope = _rope_section(data, compress)
        if compress and rope.get("rope_type", rope.get("type")) == "yarn":
            # transformers' DeepseekV4Config.__post_init__ gives the compress rope (the indexer's) attention_factor 1.0
            # when the file has none (huggingface/transformers, src/transformers/models/deepseek_v4/
            # configuration_deepseek_v4.py @015c078164151a049126942989817713e83a8f3e; also in release 5.24.0), as
            # DeepSeek's V4 inference code never scales cos / sin: DeepSeek-V4-Flash's config.json has no mscale keys.
            rope.setdefault("attention_factor", 1.0)
        theta = data.get(theta_key, rope.get("rope_theta") if rope else None)
        if theta is not None:
            fields["rope_theta"] = float(theta)
        fields["yarn"] = _yarn_of(rope, allow_missing_mscale, model_type)
        quant = data.get("quantization_config") or {}
        scale_fmt = quant.get("scale_fmt", data.get("scale_fmt"))
        if scale_fmt is not None:
            if scale_fmt not in SCALE_FMTS:
                raise ValueError(f"config scale_fmt is {scale_fmt!r}; supported: {', '.join(SCALE_FMTS)}")
            fields["scale_fmt"] = scale_fmt
            if not compress:
                fields["ue8m0"] = scale_fmt == "ue8m0"
        if quant.get("quant_method") == "fp8" and not compress:
            fields["wk_gemm"] = "fp8"  # the checkpoint stores wk block-fp8; DeepSeek runs it as an fp8 GEMM
        if compress and data.get("compress_ratios") is not None and 4 not in data["compress_ratios"]:
            raise ValueError("config compress_ratios has no ratio-4 (C4) layer: this model has no lightning indexer")
        return replace(base, **{**fields, **overrides})


# name -> (power-of-two scales?, who uses it, IndexerConfig.key_quant)
V4_KEY_QUANT = {
    "fp8_ue8m0": (True, "vLLM: fp8 e4m3, one power-of-two (UE8M0) scale per 128 values, stored as fp32", "fp8"),
    "fp8_fp32": (False, "SGLang's default: fp8 e4m3, one fp32 scale (amax / 448) per 128 values", "fp8"),
    "fp4_e2m1": (True, "DeepSeek's reference: e2m1 per block of 32, power-of-two scales, bf16 scores", "fp4_e2m1"),
}


MODELS = {"deepseek-v3.2": IndexerConfig.deepseek_v32, "deepseek-v4-flash": IndexerConfig.deepseek_v4_flash}


def _check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed or not isinstance(value, str):
        def folded(text: str) -> str:
            return text.lower().replace("_", "").replace("-", "")

        close = [a for a in allowed if isinstance(value, str) and folded(a) == folded(value)]
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"IndexerConfig.{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}{hint}")


def _positive_finite(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _check_yarn(yarn: object) -> None:
    """YaRN's numbers enter logs and divisions when the RoPE table is built (at the first step): checked here."""
    if yarn is None:
        return
    if not isinstance(yarn, YarnScaling):
        raise ValueError(f"IndexerConfig.yarn must be a dsa_indexer.rope.YarnScaling or None, got "
                         f"{type(yarn).__name__}")
    for name in ("factor", "beta_fast", "beta_slow"):
        if not _positive_finite(getattr(yarn, name)):
            raise ValueError(f"IndexerConfig.yarn.{name} must be a finite number > 0, got {getattr(yarn, name)!r}")
    original = yarn.original_max_position
    if isinstance(original, bool) or not isinstance(original, int):
        raise ValueError(f"IndexerConfig.yarn.original_max_position must be an int (<= 0 turns YaRN off), got "
                         f"{original!r}")


def _check_yarn_section(rope: Mapping[str, Any], model_type: str) -> None:
    """A YaRN rope section's numbers, present and numeric, before they are read (else a bare KeyError)."""
    for key in ("factor", "original_max_position_embeddings"):
        value = rope.get(key)
        if value is None:
            raise ValueError(f"{model_type} config: the YaRN rope scaling has no {key!r} (DeepSeek-V3.2 declares "
                             "\"factor\": 40, \"original_max_position_embeddings\": 4096); add it, or drop the YaRN "
                             "section for plain RoPE")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{model_type} config: the YaRN rope scaling's {key!r} must be a number, got {value!r}")


def _with_recipe(base: IndexerConfig, recipe: str, deepseek: Mapping[str, Any],
                 named: Mapping[str, tuple[Any, Any]], overrides: Mapping[str, Any]) -> IndexerConfig:
    """``base`` under ``recipe``, then ``overrides``. Under "deepseek" a field (or a preset argument in ``named``:
    name -> (the recipe's value, the one passed)) that says otherwise is refused: which of the two was meant is not
    ours to guess."""
    if recipe not in RECIPES:
        raise _recipe_error(recipe)
    if recipe == "deepseek":
        given = {**{name: value for name, (_, value) in named.items()}, **overrides}
        wanted = {**{name: value for name, (value, _) in named.items()}, **deepseek}
        for name, value in given.items():
            if name in wanted and value != wanted[name]:
                raise ValueError(f"recipe='deepseek' sets {name}={wanted[name]!r} (DeepSeek's numerics for "
                                 f"{base.name}), got {name}={value!r}: pass one of the two (recipe='serving' "
                                 "with your fields, or the recipe alone)")
        base = replace(base, **deepseek)
    return replace(base, **overrides)


def _recipe_error(recipe: object) -> ValueError:
    return ValueError(f"recipe must be 'serving' or 'deepseek', got {recipe!r} ('serving': the library's defaults; "
                      "'deepseek': the model's own numerics, DEEPSEEK_RECIPES)")


def _read_hf_config(source) -> tuple[dict[str, Any], Path | None]:
    """The config as a dict, and the file it was read from (None for a dict or a transformers config)."""
    if isinstance(source, Mapping):
        return dict(source), None
    if hasattr(source, "to_dict"):  # a transformers PretrainedConfig
        return source.to_dict(), None
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path}")
    return read_json_object(path, "the object of a config.json"), path


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path``; a file that is not UTF-8 JSON text, or holds another JSON value, raises a
    ValueError naming the file (json's own errors name only a line and column)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:  # a permission error, a folder
        raise ValueError(f"{path} cannot be read ({exc.strerror or exc}); expected {what}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not a UTF-8 JSON text file (byte {exc.start} is {exc.object[exc.start]:#04x}); "
                         f"expected {what}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); expected "
                         f"{what}") from None
    if not isinstance(data, dict):
        kind = {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(type(data), "number")
        raise ValueError(f"{path} holds a JSON {kind}, not {what}")
    return data


def _config_int(data: Mapping[str, Any], key: str) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config {key} must be an int, got {value!r}")
    return value


def _rope_section(data: Mapping[str, Any], compress: bool) -> dict[str, Any]:
    """The RoPE scaling dict the indexer uses: ``rope_scaling`` (DeepSeek's files, transformers 4) or
    ``rope_parameters`` (transformers 5; V4 keys it by rope type, the indexer uses "compress")."""
    params = data.get("rope_parameters")
    if isinstance(params, Mapping) and compress and isinstance(params.get("compress"), Mapping):
        return dict(params["compress"])
    if isinstance(params, Mapping) and not any(isinstance(v, Mapping) for v in params.values()):
        return dict(params)
    scaling = data.get("rope_scaling")
    return dict(scaling) if isinstance(scaling, Mapping) else {}


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """DeepSeek / YaRN's amplitude term ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_of(rope: Mapping[str, Any], allow_missing_mscale: bool, model_type: str) -> YarnScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise ValueError(f"config rope type {kind!r}: DeepSeek's indexer uses YaRN (or no scaling)")
    _check_yarn_section(rope, model_type)
    factor = float(rope["factor"])
    yarn = YarnScaling(factor=factor, original_max_position=int(rope["original_max_position_embeddings"]),
                       beta_fast=float(rope.get("beta_fast", 32.0)), beta_slow=float(rope.get("beta_slow", 1.0)))
    attention_factor = rope.get("attention_factor")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if attention_factor is not None:
        amplitude = float(attention_factor)
        source = f"attention_factor {amplitude}"
    elif mscale and mscale_all_dim:
        amplitude = yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
        source = f"mscale {mscale} / mscale_all_dim {mscale_all_dim}"
    else:
        implied = yarn_mscale(factor)
        if implied == 1.0:
            return yarn
        message = (f"{model_type} config: the YaRN rope scaling (factor {factor:g}) has no 'mscale' and "
                   f"'mscale_all_dim', so transformers would scale the indexer's RoPE cos/sin by {implied:.3f} "
                   f"(0.1 * ln({factor:g}) + 1); DeepSeek's indexer RoPE is unscaled (its configs carry mscale = "
                   "mscale_all_dim = 1.0).")
        if not allow_missing_mscale:
            raise ValueError(message + " Add \"mscale\": 1.0, \"mscale_all_dim\": 1.0 to the rope scaling, or pass "
                             "allow_missing_mscale=True to build DeepSeek's unscaled table anyway")
        warnings.warn(message + " Building DeepSeek's unscaled table (allow_missing_mscale=True).", stacklevel=4)
        return yarn
    if not math.isclose(amplitude, 1.0, rel_tol=1e-9):
        raise ValueError(f"{model_type} config: the rope scaling's {source} scales the RoPE amplitude by "
                         f"{amplitude:.4f}; DeepSeek's indexer RoPE is unscaled and this library builds no scaled table")
    return yarn
