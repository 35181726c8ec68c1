"""Hugging Face transformers: this library's indexer inside DeepSeek-V3.2 and DeepSeek-V4 causal-LM models.

    model = DeepseekV32ForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    swap_indexers(model)        # every layer's indexer now runs dsa_indexer (fp8 / FP4 logits, paged index-K cache)
    model.generate(...)
    restore_indexers(model)     # transformers' own modules are back

What a swap does (transformers >= 5.23; 5.23 and 5.24 tested; ``models/deepseek_v32`` and ``models/deepseek_v4``):

- Where: V3.2 replaces ``model.layers[i].self_attn.indexer``; V4 replaces ``self_attn.compressor.indexer`` of every
  compressed-sparse-attention (CSA) layer (the HCA and sliding layers have no indexer).
- Weights: the replacement holds transformers' own weight modules (shared, never copied) under transformers' names,
  so ``state_dict()`` and ``save_pretrained`` see the same keys. Copies are made only where the recipe runs another
  precision than the module stores: V4's compressor projection runs in fp32 (one [512, hidden] fp32 weight per
  layer, as `Compressor` keeps), and fp32 copies of tiny vectors a model cast to bf16 holds.
- Config: `IndexerConfig.from_hf_config` of the model's config, then ``config_overrides``. One departure: V4 runs
  the fp8 key recipe by default, because transformers' V4 indexer (what a drop-in reproduces) scores plain bf16 q and
  keys; ``key_quant="fp4_e2m1"`` selects DeepSeek's FP4 recipe (what `from_hf_config` reads) instead.
- State: each layer's paged index-K cache (and V4's compressor window) lives on transformers' cache layer object,
  ``past_key_values.layers[i]``, so it lives and dies with the cache of one ``generate()`` call. The layer object's
  class becomes a subclass whose cache operations (``reorder_cache`` for beam search, ``crop``, ``reset``,
  ``batch_repeat_interleave``, ``batch_select_indices``, ``offload`` / ``prefetch``) also apply to that state.
- Batch metadata (the `DecodeBatch` / `PrefillBatch`, which tokens are real, the output mapping) is built once per
  forward by the first swapped layer that runs and shared by the others: one small host read per step (the last
  mask row for V3.2, the position ids for V4).
- V3.2 output: what transformers' indexer returns, int32 ``[B, S, min(k, T)]`` columns of its key axis (left padding
  included), never -1. A row that sees fewer than k keys gets, after all its visible keys, distinct columns its own
  mask excludes, as transformers' top-k over -inf scores does, so the scattered mask is the same.
- V4 output: int64 ``[B, S, min(k, entries)]`` compressed-entry ids, -1 where invalid, as transformers' V4 indexer.
  transformers passes V4's indexer no mask, and its V4 scores a left-padded row differently from the same row alone,
  so a padded V4 batch is refused (`PADDED_V4_MESSAGE`) rather than guessed at.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..batch import DecodeBatch, PrefillBatch
from ..compressor import Compressor, CompressorState
from ..config import IndexerConfig
from ..contract.cache import PAGE_SIZE, IndexKCache
from ..contract.validate import IndexerInputError
from ..dispatch.target import Target, detect_target
from ..contract.weights import BlockFp8Linear, e8m0_to_float, fn_to_fnuz
from ..indexer import Indexer

__all__ = ["swap_indexers", "restore_indexers", "swapped_indexers", "DeepseekV32IndexerSwap",
           "DeepseekV4IndexerSwap", "PADDED_V4_MESSAGE"]

SUPPORTED_MODEL_TYPES = ("deepseek_v32", "deepseek_v4")
STATE_ATTR = "_dsa_indexer_state"  # on a transformers cache layer: that layer's `_IndexerState`
_SWAP_ATTR = "_dsa_indexer_swap"  # on the model: the `_Swap` record restore_indexers undoes
CACHE_OPS = ("reorder_cache", "crop", "batch_repeat_interleave", "batch_select_indices", "offload", "prefetch",
             "reset")
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)

PADDED_V4_MESSAGE = (
    "DeepSeek-V4 with dsa_indexer does not take padded batches: transformers passes V4's indexer no attention mask, "
    "and its V4 scores a left-padded row differently from the same row alone, so there is no answer to reproduce. "
    "Generate each prompt in its own batch, or batch prompts of one length without padding.")


# --- the swap ---------------------------------------------------------------------------------------------------

@dataclass
class _Swap:
    entries: list[tuple[nn.Module, str, nn.Module]]  # (parent, attribute, transformers' module)
    hooks: list[Any] = field(default_factory=list)


def swap_indexers(model: nn.Module, *, target: Target | str | None = None, **config_overrides) -> nn.Module:
    """Replace every indexer of a transformers DeepSeek-V3.2 / V4 model (``*ForCausalLM`` or the bare ``*Model``) by
    this library's, in place; returns ``model``. ``target``: the dsa_indexer target (default: the weights' device,
    or ``DSA_INDEXER_TARGET``). ``config_overrides``: `IndexerConfig` fields that replace what `from_hf_config` reads
    (e.g. ``key_quant="fp4_e2m1"`` for DeepSeek's FP4 recipe on V4). The model must be in bfloat16 or float16."""
    if getattr(model, _SWAP_ATTR, None) is not None:
        raise ValueError("swap_indexers: this model's indexers are already swapped (restore_indexers(model) first)")
    hf_config = getattr(model, "config", None)
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"swap_indexers supports transformers' DeepSeek-V3.2 ('deepseek_v32') and DeepSeek-V4 "
                         f"('deepseek_v4') models, got model_type {model_type!r}")
    base = _base_model(model)
    sites = list(_indexer_sites(base, model_type))
    if not sites:
        raise ValueError(f"swap_indexers: the {model_type} model has no indexer module (no layer has "
                         f"{'self_attn.indexer' if model_type == 'deepseek_v32' else 'a CSA compressor'})")
    first = sites[0][2]
    config = _indexer_config(hf_config, model_type, first, config_overrides)
    device = _weight(first, model_type).device
    resolved = detect_target(device, target)
    context = _StepContext()
    swap = _Swap([])
    for layer_idx, parent, hf_module in sites:
        indexer = _build_indexer(hf_module, model_type, config, resolved, layer_idx)
        cls = DeepseekV32IndexerSwap if model_type == "deepseek_v32" else DeepseekV4IndexerSwap
        parent.indexer = cls(hf_module, indexer, context, layer_idx)
        swap.entries.append((parent, "indexer", hf_module))
    if model_type == "deepseek_v4":
        swap.hooks.append(base.register_forward_pre_hook(_refuse_padded_v4, with_kwargs=True))
    object.__setattr__(model, _SWAP_ATTR, swap)
    return model


def restore_indexers(model: nn.Module) -> nn.Module:
    """Put transformers' own indexer modules back (undoes `swap_indexers`); returns ``model``. Caches made while
    swapped keep their dsa_indexer state until they are dropped; a new ``generate()`` makes a fresh cache."""
    swap = getattr(model, _SWAP_ATTR, None)
    if swap is None:
        raise ValueError("restore_indexers: this model's indexers are not swapped (swap_indexers(model) swaps them)")
    for parent, name, original in swap.entries:
        setattr(parent, name, original)
    for hook in swap.hooks:
        hook.remove()
    object.__delattr__(model, _SWAP_ATTR)
    return model


def swapped_indexers(model: nn.Module) -> list["_SwappedIndexer"]:
    """The replacement modules of a swapped model, in layer order (empty when not swapped)."""
    swap = getattr(model, _SWAP_ATTR, None)
    return [] if swap is None else [getattr(parent, name) for parent, name, _ in swap.entries]


def _base_model(model: nn.Module) -> nn.Module:
    if hasattr(model, "layers"):
        return model
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers"):
        raise ValueError(f"swap_indexers: {type(model).__name__} has no decoder layers (model.layers or "
                         "model.model.layers)")
    return inner


def _indexer_sites(base: nn.Module, model_type: str):
    """(layer index, module holding the indexer, transformers' indexer) of every layer that has one."""
    for layer_idx, layer in enumerate(base.layers):
        attn = getattr(layer, "self_attn", None)
        parent = attn if model_type == "deepseek_v32" else getattr(attn, "compressor", None)
        hf_module = getattr(parent, "indexer", None)
        if hf_module is not None:
            yield layer_idx, parent, hf_module


def _weight(hf_module: nn.Module, model_type: str) -> torch.Tensor:
    return (hf_module.wq_b if model_type == "deepseek_v32" else hf_module.q_b_proj).weight


def _indexer_config(hf_config, model_type: str, hf_module: nn.Module, overrides: dict) -> IndexerConfig:
    """`from_hf_config` plus what only the live modules say: the RoPE width transformers computes
    (``qk_rope_head_dim``, a runtime attribute for V4), the norm epsilon the modules use, and weights_proj in fp32
    when the module stores it so (transformers keeps V3.2's in fp32)."""
    fields: dict[str, Any] = {"rope_dim": int(hf_config.qk_rope_head_dim)}
    if model_type == "deepseek_v32":
        fields["norm_eps"] = float(hf_module.k_norm.eps)
        weights_proj = hf_module.weights_proj.weight
    else:
        fields["norm_eps"] = float(hf_module.kv_norm.variance_epsilon)
        weights_proj = hf_module.scorer.weights_proj.weight
    if weights_proj.dtype == torch.float32:
        fields["weights_proj_dtype"] = "fp32"
    if model_type == "deepseek_v4":
        # transformers' V4 indexer scores bf16 q and keys (no FP4 simulation); the fp8 recipe (power-of-two scales,
        # vLLM's) is the closest the kernels get to it: top-k agreement 0.99 vs 0.94 for DeepSeek's FP4 recipe on
        # tiny random models. key_quant="fp4_e2m1" selects DeepSeek's own recipe (docs/v4.md).
        fields["key_quant"] = "fp8"
    return IndexerConfig.from_hf_config(hf_config, **{**fields, **overrides})


# --- weights: transformers' modules, shared -----------------------------------------------------------------------

def _check_activation_weight(name: str, weight: torch.Tensor) -> None:
    if weight.dtype not in ACTIVATION_DTYPES + FP8_DTYPES:
        raise ValueError(f"swap_indexers: {name} is {weight.dtype}; the indexer runs in bfloat16 or float16 "
                         "(load the model with dtype=torch.bfloat16, or call model.to(torch.bfloat16))")


def _linear_for(hf_linear: nn.Module, name: str, fp8_dtype: torch.dtype, keep_fp8: bool) -> nn.Module:
    """transformers' linear as the `Indexer` runs it: a bf16 / fp16 `nn.Linear` as is (shared); an fp8 block-scaled
    one (transformers' ``FP8Linear``, 128 x 128 blocks) as a `BlockFp8Linear` on the same fp8 weight (its scales in
    fp32: converted if stored as UE8M0), or dequantized when ``keep_fp8`` is False."""
    weight = hf_linear.weight
    _check_activation_weight(name, weight)
    if weight.dtype not in FP8_DTYPES:
        return hf_linear
    block = tuple(getattr(hf_linear, "block_size", None) or ())
    scale = getattr(hf_linear, "weight_scale_inv", None)
    if block != (128, 128) or scale is None:
        raise ValueError(f"swap_indexers: {name} is fp8 with block size {block or None}; the indexer's fp8 GEMM "
                         "takes 128 x 128 blocks with a weight_scale_inv")
    scale = e8m0_to_float(scale.detach())
    if weight.dtype == torch.float8_e4m3fn and fp8_dtype == torch.float8_e4m3fnuz:
        weight, scale = fn_to_fnuz(weight.detach(), scale)  # gfx942 reads fnuz: a reinterpreted copy
    layer = BlockFp8Linear(hf_linear.in_features, hf_linear.out_features, "meta", fp8_dtype)
    layer.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
    layer.weight_scale_inv = nn.Parameter(scale.float(), requires_grad=False)
    if keep_fp8:
        return layer
    dense = nn.Linear(hf_linear.in_features, hf_linear.out_features, bias=False, device="meta")
    dense.weight = nn.Parameter(layer.dequantize().to(torch.bfloat16), requires_grad=False)
    return dense


def _version_of(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter
        return -1


def _source_key(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), _version_of(tensor), tensor.device, tensor.dtype


def _as_fp32_parameter(tensor: torch.Tensor) -> nn.Parameter:
    """``tensor`` as an fp32 parameter: the same storage when it is fp32, else an fp32 copy."""
    return nn.Parameter(tensor.detach() if tensor.dtype == torch.float32 else tensor.detach().float(),
                        requires_grad=False)


class _SharedCompressor(Compressor):
    """V4's C4 compressor on transformers' indexer weights: ``kv_proj`` / ``gate_proj`` (the recipe's projection
    runs in fp32: one concatenated fp32 copy, as `Compressor.projection_weight` keeps), ``position_bias`` (ape) and
    ``kv_norm`` (transformers keeps both in fp32; fp32 copies only if the model was cast). Re-read from
    transformers' modules whenever they change (moved, reloaded)."""

    def __init__(self, config: IndexerConfig, hf_indexer: nn.Module) -> None:
        super().__init__(config, device="meta")  # placeholder parameters, replaced by transformers' below
        self.wkv, self.wgate = hf_indexer.kv_proj, hf_indexer.gate_proj
        object.__setattr__(self, "_hf", hf_indexer)
        self._sources: tuple | None = None
        self._refresh()

    def _refresh(self) -> None:
        hf = self._hf
        sources = (_source_key(hf.position_bias), _source_key(hf.kv_norm.weight))
        if sources == self._sources:
            return
        self.ape = _as_fp32_parameter(hf.position_bias)
        norm = nn.RMSNorm(self.config.head_dim, eps=self.config.norm_eps, device="meta")
        norm.weight = _as_fp32_parameter(hf.kv_norm.weight)
        self.norm = norm
        self._sources = sources

    def projection_weight(self) -> torch.Tensor:
        parts = (self.wkv.weight, self.wgate.weight)
        key = tuple(_source_key(p) for p in parts)
        if self._projection is None or self._projection[0] != key:
            self._projection = (key, torch.cat([p.detach().float() for p in parts], dim=0).contiguous())
        return self._projection[1]

    def step(self, *args, **kwargs) -> None:
        self._refresh()
        super().step(*args, **kwargs)


def _build_indexer(hf_module: nn.Module, model_type: str, config: IndexerConfig, target: Target,
                   layer_idx: int) -> Indexer:
    """An `Indexer` whose modules are transformers' (built on the host with placeholder weights, which are then
    replaced: nothing is allocated on the model's device)."""
    prefix = f"layers.{layer_idx}." + ("self_attn.indexer." if model_type == "deepseek_v32"
                                        else "self_attn.compressor.indexer.")
    indexer = Indexer(config, device="cpu", target=target, wq_b_fp8=False)
    if model_type == "deepseek_v32":
        indexer.wq_b = _linear_for(hf_module.wq_b, prefix + "wq_b", indexer.fp8_dtype, keep_fp8=True)
        indexer.wk = _linear_for(hf_module.wk, prefix + "wk", indexer.fp8_dtype, keep_fp8=config.wk_gemm == "fp8")
        if config.wk_gemm == "fp8" and not isinstance(indexer.wk, BlockFp8Linear):
            indexer.config = dataclasses.replace(config, wk_gemm="bf16")  # a bf16 wk runs the bf16 GEMM
        indexer.k_norm = hf_module.k_norm
        indexer.weights_proj = hf_module.weights_proj
    else:
        indexer.wq_b = _linear_for(hf_module.q_b_proj, prefix + "q_b_proj", indexer.fp8_dtype, keep_fp8=True)
        indexer.weights_proj = hf_module.scorer.weights_proj
        indexer.compressor = _SharedCompressor(config, hf_module)
    _check_activation_weight(prefix + "weights_proj", indexer.weights_proj.weight)
    if indexer.weights_proj.weight.device != _weight(hf_module, model_type).device:
        raise ValueError(f"swap_indexers: {prefix} has weights on several devices")
    return indexer


# --- per-step batch metadata ------------------------------------------------------------------------------------

@dataclass
class _Step:
    """One forward's batch as the library sees it, shared by every swapped layer of that forward.

    Row b of transformers' batch is request b of the index-K cache. ``prefix[b]`` tokens (V3.2) of it are cached,
    ``new[b]`` arrive in this step (its real tokens; the rest of the step's rows are padding), ``total = prefix +
    new``. ``token_index``: flat ``[B * S]`` positions of the real tokens (None: every token, in order)."""

    key: tuple
    batch_size: int
    seq_len: int
    width: int  # columns of transformers' output
    prefix: list[int]
    new: list[int]
    compress_ratio: int
    device: torch.device
    token_index: torch.Tensor | None = None
    pad: torch.Tensor | None = None  # V3.2: [T_real, 1] int32, the left-pad offset of each real token's row
    used: set[int] = field(default_factory=set)
    _batches: dict[int, DecodeBatch | PrefillBatch] = field(default_factory=dict)

    @property
    def total(self) -> list[int]:
        return [p + n for p, n in zip(self.prefix, self.new)]

    @property
    def rows(self) -> list[int]:
        return [b for b, n in enumerate(self.new) if n > 0]

    def pages_needed(self) -> int:
        keys = max(t // self.compress_ratio for t in self.total)
        return max(1, -(-keys // PAGE_SIZE))

    def batch(self, pages_per_row: int) -> DecodeBatch | PrefillBatch:
        """The library batch for caches whose row b owns pages ``[b * P, (b + 1) * P)`` (built once per P)."""
        cached = self._batches.get(pages_per_row)
        if cached is not None:
            return cached
        rows = self.rows
        table = torch.arange(self.batch_size * pages_per_row, dtype=torch.int32).view(self.batch_size, -1)[rows]
        pages = self.batch_size * pages_per_row
        total, prefix, new = ([values[b] for b in rows] for values in (self.total, self.prefix, self.new))
        if self.seq_len == 1 and all(n == 1 for n in new):
            batch = DecodeBatch.build(total, table, num_cache_pages=pages, device=self.device,
                                      compress_ratio=self.compress_ratio, state_slots=rows)
        else:
            batch = PrefillBatch.build(prefix, new, table, num_cache_pages=pages, device=self.device,
                                       compress_ratio=self.compress_ratio, state_slots=rows)
        self._batches[pages_per_row] = batch
        return batch

    def gather(self, hidden: torch.Tensor) -> torch.Tensor:
        """The real tokens of ``hidden`` [B, S, ...] as the library's flat rows."""
        flat = hidden.reshape(self.batch_size * self.seq_len, *hidden.shape[2:])
        return flat if self.token_index is None else flat.index_select(0, self.token_index)


class _StepContext:
    """The current forward's `_Step`, shared by the swapped layers of one model. A layer that meets a step it already
    used, or one of another shape, starts the next step: every forward runs each swapped layer once."""

    def __init__(self) -> None:
        self.step: _Step | None = None

    def get(self, layer_idx: int, key: tuple, build: Callable[[], _Step]) -> _Step:
        step = self.step
        if step is None or layer_idx in step.used or step.key != key:
            step = build()
            self.step = step
        step.used.add(layer_idx)
        return step


def _visible(mask: torch.Tensor) -> torch.Tensor:
    """Which entries of a transformers attention mask let a query see a key (bool, or additive 0 / min)."""
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def _v32_step(key: tuple, attention_mask: torch.Tensor, position_ids: torch.Tensor | None, batch_size: int,
              seq_len: int, topk: int, device: torch.device) -> _Step:
    """Row b's keys are one contiguous run of columns ``[first, end)`` of the step's last query row (left padding
    before it); the step's queries are the last ``seq_len`` columns before ``end``, of which ``new[b]`` are real."""
    if attention_mask is None or attention_mask.dim() != 3 or tuple(attention_mask.shape[:2]) != (batch_size,
                                                                                                  seq_len):
        got = None if attention_mask is None else list(attention_mask.shape)
        raise IndexerInputError(f"attention_mask must be transformers' [B={batch_size}, S={seq_len}, T] indexer mask, "
                                f"got {got}")
    width = attention_mask.shape[-1]
    visible = _visible(attention_mask[:, -1, :]).to("cpu")
    count = visible.sum(-1)
    if bool((count == 0).any()):
        b = int((count == 0).nonzero()[0, 0])
        raise IndexerInputError(f"attention_mask: the last query of row {b} sees no key (an all-padding row)")
    first = visible.int().argmax(-1)
    end = width - visible.flip(-1).int().argmax(-1)
    if bool((end - first != count).any()):
        b = int((end - first != count).nonzero()[0, 0])
        raise IndexerInputError(f"attention_mask: row {b}'s keys are not one contiguous run of columns; the "
                                "integration supports left padding only (no padding inside or after a sequence)")
    start = end - seq_len  # key column of the step's first query
    if bool((start < 0).any()):
        raise IndexerInputError(f"attention_mask: {seq_len} queries cannot end at key column {int(end.min())}")
    new = end - torch.maximum(start, first)
    prefix = (end - first) - new
    if position_ids is not None:
        _check_v32_positions(position_ids, prefix, new, batch_size, seq_len)
    step = _Step(key, batch_size, seq_len, min(topk, width), prefix.tolist(), new.tolist(), 1, device)
    if not bool((new == seq_len).all()):
        rows = step.rows
        step.token_index = torch.cat([b * seq_len + torch.arange(seq_len - step.new[b], seq_len) for b in rows]
                                     ).to(device)
    real_rows = torch.tensor(step.rows)
    step.pad = first[real_rows].repeat_interleave(new[real_rows]).to(device, torch.int32)[:, None]
    return step


def _check_v32_positions(position_ids: torch.Tensor, prefix: torch.Tensor, new: torch.Tensor, batch_size: int,
                         seq_len: int) -> None:
    """The RoPE positions transformers used must count the real tokens only (what generate() passes: the 2-D mask's
    cumsum - 1): the library rotates q and k at the positions of the tokens in its cache."""
    pos = position_ids.to("cpu").long().expand(batch_size, seq_len)
    s = torch.arange(seq_len)
    first_real = seq_len - new
    expected = prefix[:, None] + s[None, :] - first_real[:, None]
    wrong = (s[None, :] >= first_real[:, None]) & (pos != expected)
    if bool(wrong.any()):
        b, i = (int(v) for v in wrong.nonzero()[0])
        raise IndexerInputError(
            f"position_ids[{b}, {i}] is {int(pos[b, i])}, but that token is real token {int(expected[b, i])} of its "
            "row: with left padding, pass position_ids = attention_mask.cumsum(-1) - 1 (what generate() does)")


def _v4_step(key: tuple, position_ids: torch.Tensor | None, batch_size: int, seq_len: int, topk: int,
             device: torch.device) -> _Step:
    if position_ids is None:
        raise IndexerInputError("DeepSeek-V4's indexer needs position_ids (transformers' model passes them)")
    pos = position_ids.to("cpu").long().expand(batch_size, seq_len)
    start = pos[:, :1]
    if bool((pos != start + torch.arange(seq_len)).any()) or bool((start != start[0]).any()):
        raise IndexerInputError(PADDED_V4_MESSAGE + f" (position_ids of this step: {pos.tolist()})")
    first = int(start[0, 0])
    entries = (first + seq_len) // 4
    return _Step(key, batch_size, seq_len, min(topk, entries), [first] * batch_size, [seq_len] * batch_size, 4,
                 device)


def _refuse_padded_v4(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of a swapped V4 model: a 2-D attention mask with padding is refused before any work."""
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.bool().all()):
        raise IndexerInputError(PADDED_V4_MESSAGE)


# --- per-layer state on transformers' cache layer ---------------------------------------------------------------

class _IndexerState:
    """One layer's dsa_indexer state for one transformers cache: the index-K cache, in which row b of the batch owns
    pages ``[b * P, (b + 1) * P)`` (P grows by doubling, the same way in every layer), the tokens each row has
    stored (host ints), and V4's compressor window (one slot per row)."""

    def __init__(self, indexer: Indexer, rows: int, device: torch.device) -> None:
        self.rows = rows
        self.pages_per_row = 0
        self.lengths = [0] * rows
        self.cache: IndexKCache | None = None
        self._allocate = indexer.allocate_cache
        self.device = device
        self.compressor = (CompressorState.allocate(rows, indexer.config, device)
                           if indexer.config.compress_ratio > 1 else None)
        self.unusable: str | None = None

    def check(self, step: _Step) -> None:
        if self.unusable is not None:
            raise IndexerInputError(self.unusable)
        if step.batch_size != self.rows:
            raise IndexerInputError(f"the batch has {step.batch_size} rows but this layer's index-K cache holds "
                                    f"{self.rows}: the cache was changed by an operation dsa_indexer did not see "
                                    "(start generation with a fresh cache)")
        if step.prefix != self.lengths:
            raise IndexerInputError(f"this step continues rows of {step.prefix} tokens but the layer's index-K cache "
                                    f"holds {self.lengths}: the cache and the index-K cache disagree (a cache "
                                    "operation dsa_indexer did not see, or a step run twice)")
        if self.cache is not None and self.cache.device != step.device:
            self.prefetch()

    def reserve(self, pages: int) -> int:
        """Pages per row for ``pages`` needed: allocate, or grow by doubling (keys copied)."""
        if pages <= self.pages_per_row:
            return self.pages_per_row
        grown = max(pages, 2 * self.pages_per_row, 1)
        fresh = self._allocate(self.rows * grown)
        if self.cache is not None:
            for new, old in ((fresh.data, self.cache.data), (fresh.scales, self.cache.scales)):
                if old is not None:
                    new.view(self.rows, grown, -1)[:, :self.pages_per_row] = old.view(self.rows, self.pages_per_row,
                                                                                      -1)
        self.cache, self.pages_per_row = fresh, grown
        return grown

    def _keep_rows(self, rows: list[int]) -> None:
        """Row i of the new batch is row ``rows[i]`` of the old one (beam reorder, repeat, select)."""
        if self.cache is not None:
            index = torch.tensor(rows, dtype=torch.long, device=self.cache.device)
            per_row = self.pages_per_row

            def take(t: torch.Tensor | None) -> torch.Tensor | None:
                if t is None:
                    return None
                return t.view(self.rows, -1).index_select(0, index).view(len(rows) * per_row, *t.shape[1:])

            self.cache = IndexKCache(take(self.cache.data), self.cache.fp8_dtype, self.cache.layout,
                                     take(self.cache.scales))
        if self.compressor is not None:
            window = self.compressor.window
            index = torch.tensor(rows, dtype=torch.long, device=window.device)
            self.compressor = CompressorState(torch.cat([window.index_select(0, index), window[-1:]]))
        self.lengths = [self.lengths[r] for r in rows]
        self.rows = len(rows)

    # transformers' cache operations, called after the cache layer's own
    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        self._keep_rows(beam_idx.to("cpu").long().tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._keep_rows([b for b in range(self.rows) for _ in range(repeats)])

    def batch_select_indices(self, indices) -> None:
        index = torch.as_tensor(indices).to("cpu")
        if index.dtype == torch.bool:
            index = index.nonzero().reshape(-1)
        self._keep_rows(torch.arange(self.rows)[index].reshape(-1).tolist())

    def crop(self, tokens_to_remove: int) -> None:
        drop = abs(int(tokens_to_remove))
        if drop == 0:
            return
        self.lengths = [max(0, length - drop) for length in self.lengths]
        if self.compressor is not None:
            # The compressor window of the dropped tokens is gone: later entries would pool the wrong tokens.
            self.unusable = ("this V4 cache was cropped; DeepSeek-V4's compressor state cannot be rewound "
                             "(transformers marks V4 stateful for the same reason): start generation with a fresh "
                             "cache")

    def offload(self) -> None:
        self._move("cpu")

    def prefetch(self) -> None:
        self._move(self.device)

    def _move(self, device) -> None:
        if self.cache is not None:
            self.cache = IndexKCache(self.cache.data.to(device, non_blocking=True), self.cache.fp8_dtype,
                                     self.cache.layout, None if self.cache.scales is None else
                                     self.cache.scales.to(device, non_blocking=True))
        if self.compressor is not None:
            self.compressor = CompressorState(self.compressor.window.to(device, non_blocking=True))


_STATEFUL_CLASSES: dict[type, type] = {}


def _stateful_class(base: type) -> type:
    """``base`` (a transformers cache layer class) whose cache operations also apply to the layer's dsa_indexer
    state; ``reset`` drops it. ``_layer_type = None`` keeps transformers from registering it as a layer type."""
    cls = _STATEFUL_CLASSES.get(base)
    if cls is not None:
        return cls

    def operation(name: str):
        def run(self, *args, **kwargs):
            result = getattr(super(cls, self), name)(*args, **kwargs)
            state = self.__dict__.get(STATE_ATTR)
            if state is not None:
                if name == "reset":
                    del self.__dict__[STATE_ATTR]
                else:
                    getattr(state, name)(*args, **kwargs)
            return result

        run.__name__ = run.__qualname__ = name
        return run

    namespace = {"_layer_type": None, "__module__": __name__,
                 "__doc__": f"{base.__name__} that also carries a dsa_indexer state (dsa_indexer.integrations)"}
    namespace.update({name: operation(name) for name in CACHE_OPS if hasattr(base, name)})
    cls = type(f"{base.__name__}WithDsaIndexer", (base,), namespace)
    _STATEFUL_CLASSES[base] = cls
    return cls


def _layer_state(past_key_values, layer_idx: int, make: Callable[[], _IndexerState]) -> _IndexerState:
    """The dsa_indexer state on ``past_key_values.layers[layer_idx]`` (made on first use); without a cache, a
    state for this one forward."""
    if past_key_values is None:
        return make()
    layers = getattr(past_key_values, "layers", None)
    if layers is None or layer_idx >= len(layers):
        raise IndexerInputError(f"past_key_values ({type(past_key_values).__name__}) has no layer {layer_idx}: the "
                                "integration keeps its state on transformers' per-layer cache objects")
    layer = layers[layer_idx]
    state = layer.__dict__.get(STATE_ATTR)
    if state is None:
        if type(layer) not in _STATEFUL_CLASSES.values():
            layer.__class__ = _stateful_class(type(layer))
        state = make()
        layer.__dict__[STATE_ATTR] = state
    return state


# --- the replacement modules ------------------------------------------------------------------------------------

class _SwappedIndexer(nn.Module):
    """Holds transformers' weight modules under their names (so the model's state_dict is unchanged) and the
    `Indexer` built on them (``dsa_indexer``); ``hf_indexer`` is transformers' module, put back by
    `restore_indexers` (neither is registered as a child, so no parameter is listed twice)."""

    def __init__(self, hf_module: nn.Module, indexer: Indexer, context: _StepContext, layer_idx: int) -> None:
        super().__init__()
        for name, child in hf_module.named_children():
            self.add_module(name, child)
        for name, param in hf_module.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buffer in hf_module.named_buffers(recurse=False):
            self.register_buffer(name, buffer, persistent=name not in hf_module._non_persistent_buffers_set)
        object.__setattr__(self, "hf_indexer", hf_module)
        object.__setattr__(self, "dsa_indexer", indexer)
        object.__setattr__(self, "_context", context)
        self.layer_idx = layer_idx

    def _run(self, step: _Step, hidden_states: torch.Tensor, q_resid: torch.Tensor, past_key_values, layer_idx: int
             ) -> torch.Tensor:
        indexer = self.dsa_indexer
        state = _layer_state(past_key_values, layer_idx,
                             lambda: _IndexerState(indexer, step.batch_size, hidden_states.device))
        state.check(step)
        batch = step.batch(state.reserve(step.pages_needed()))
        out = indexer(step.gather(hidden_states), step.gather(q_resid), batch.positions, batch, state.cache,
                      compressor_state=state.compressor)
        state.lengths = step.total
        return out

    def extra_repr(self) -> str:
        return f"layer {self.layer_idx}: dsa_indexer {self.dsa_indexer.extra_repr()}, target {self.dsa_indexer.target}"


class DeepseekV32IndexerSwap(_SwappedIndexer):
    """Drop-in for transformers' ``DeepseekV32Indexer``: the same call, the same int32 [B, S, min(k, T)] columns."""

    @torch.no_grad()
    def forward(self, hidden_states: torch.Tensor, q_resid: torch.Tensor, position_embeddings=None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                past_key_values=None, cache=None) -> torch.Tensor:
        # transformers 5.23 passes the cache as ``past_key_values=``, 5.24 as ``cache=``: the same object.
        past_key_values = cache if past_key_values is None else past_key_values
        batch_size, seq_len = hidden_states.shape[:2]
        topk = self.dsa_indexer.config.topk
        width = attention_mask.shape[-1] if attention_mask is not None else None
        key = ("v32", batch_size, seq_len, width, hidden_states.device)
        step = self._context.get(self.layer_idx, key, lambda: _v32_step(
            key, attention_mask, position_ids, batch_size, seq_len, topk, hidden_states.device))
        local = self._run(step, hidden_states, q_resid, past_key_values, self.layer_idx)
        return _v32_columns(step, local)


def _v32_columns(step: _Step, local: torch.Tensor) -> torch.Tensor:
    """Request-local positions (-1 padded) -> transformers' key columns, never -1: valid picks shift by the row's
    left padding; the c-th empty slot of a row with n visible keys ``[pad, pad + n)`` gets the c-th column outside
    them (c < pad: column c, else c + n), distinct and masked, as transformers' top-k over -inf scores yields."""
    width = step.width
    local = local[:, :width]
    valid = local >= 0
    visible = valid.sum(-1, keepdim=True, dtype=torch.int32)
    empty_rank = (~valid).cumsum(-1, dtype=torch.int32) - 1
    filler = torch.where(empty_rank < step.pad, empty_rank, empty_rank + visible)
    columns = torch.where(valid, local + step.pad, filler).to(torch.int32)
    if step.token_index is None:
        return columns.view(step.batch_size, step.seq_len, width)
    # Padding query rows: any valid columns do (their outputs are never read by a real token).
    out = torch.arange(width, dtype=torch.int32, device=columns.device).repeat(step.batch_size * step.seq_len, 1)
    out[step.token_index] = columns
    return out.view(step.batch_size, step.seq_len, width)


class DeepseekV4IndexerSwap(_SwappedIndexer):
    """Drop-in for transformers' ``DeepseekV4Indexer``: the same call, the same int64 [B, S, min(k, entries)] entry
    ids with -1 where invalid. Padded batches are refused (`PADDED_V4_MESSAGE`)."""

    @torch.no_grad()
    def forward(self, hidden_states: torch.Tensor, q_residual: torch.Tensor, position_ids: torch.Tensor | None,
                past_key_values, layer_idx: int) -> torch.Tensor:
        batch_size, seq_len = hidden_states.shape[:2]
        topk = self.dsa_indexer.config.topk
        key = ("v4", batch_size, seq_len, hidden_states.device)
        step = self._context.get(self.layer_idx, key, lambda: _v4_step(
            key, position_ids, batch_size, seq_len, topk, hidden_states.device))
        local = self._run(step, hidden_states, q_residual, past_key_values, layer_idx)
        return local[:, :step.width].long().view(batch_size, seq_len, step.width)
