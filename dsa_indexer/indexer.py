"""`Indexer`: the model-facing module. Holds the weights under the checkpoint's names and runs one step.

Every op goes through the registry and the step's schedule is a pipeline strategy resolved per target, so this
file never names a vendor and does not change when a backend is added.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import Counter
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from . import ops
from .batch import DecodeBatch, PrefillBatch
from .contract.cache import (LAYOUT_PAGED64, LAYOUT_PAGED64_FP4, PAGE_SIZE, PLAIN_LAYOUT_FORMATS, IndexKCache,
                             indices_to_slots)
from .compressor import CompressionStep, Compressor, CompressorState
from .config import IndexerConfig, read_json_object
from .dispatch.plugins import default_registry
from .dispatch.problem import Problem
from .dispatch.bind import Bound, bind
from .dispatch.registry import Registry, Resolution
from .dispatch.target import Target, detect_target
from .contract.specs import PIPELINE_OP
from .pipeline import STEPS, k_path, k_path_plain
from .plan import (LayerWeights, Role, StepPlan, gemm_role, q_and_k_roles, quant_role, role_problem,
                   scoring_role)
from .contract.quant import Fp8GroupLayout, QuantizedActivation
from .contract.step import StepContext
from .rope import shared_cos_sin_table
from .contract.validate import (IndexerInputError, boolean as check_bool, device_argument as check_device,
                                fits_in_memory, ranges_checked as check_values, tensor as check_tensor,
                                used_pages_in_range)
from .contract.weights import (  # noqa: F401 - the weight formats, re-exported where they were
    E8M0_DTYPES, FLOAT_WEIGHT_DTYPES, FP8_WEIGHT_DTYPES, HF_V4_INDEXER_NAMES, HF_V4_PREFIX, SCALED_WEIGHTS,
    BlockFp8Linear, check_checkpoint_formats, checkpoint_schemes, dtype_name, e8m0_to_float, fn_to_fnuz,
    quantize_block_fp8)

log = logging.getLogger("dsa_indexer")

CHECKPOINT_PREFIX = "model.layers.{layer}.self_attn.indexer."  # V3.2; each config names its own
DEFAULT_LOGITS_BUDGET = 2 << 30  # bytes of a prefill chunk's fp32 logits and q-path intermediates, at once (2 GiB)


COMPRESSOR_KEYS = ("wkv.weight", "wgate.weight", "ape", "norm.weight")  # under <prefix>compressor.


# Where a block scale's recorded format lives: on the Parameter itself (it survives `.to()`, which swaps the data
# and keeps the version counter), with the version it was read at (an in-place write makes it unknown again).
SCALE_FMT_ATTR = "_dsa_indexer_scale_fmt"
FP8_GEMM_WEIGHTS = ("wq_b", "wk")


ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)  # of x, q_lora and the unquantized weights
BLOCK_SCALE_KEYS = ("wq_b.weight_scale_inv", "wq_b.scale", "wk.weight_scale_inv")


def _check_state(state, prefix) -> None:
    """What `load_checkpoint` reads must be real tensors: a meta tensor (a model built on the meta device and never
    materialized) has no values to copy, a str or None value is no tensor at all."""
    if not isinstance(state, Mapping):
        raise IndexerInputError(f"state must be a mapping of checkpoint keys to tensors (a state dict), got "
                                f"{type(state).__name__}")
    if not isinstance(prefix, str):
        raise IndexerInputError(f"prefix must be a str, got {prefix!r}")
    for key, value in state.items():
        if not isinstance(key, str) or not key.startswith(prefix):
            continue
        if not isinstance(value, torch.Tensor):
            raise IndexerInputError(f"checkpoint key {key} holds a {type(value).__name__}, not a torch.Tensor")
        if value.device.type == "meta":
            raise IndexerInputError(f"checkpoint key {key} is a meta tensor (no data): load the checkpoint's tensors "
                                    "themselves (e.g. safetensors' load_file), not a model built on the meta device")


def _check_block_scales(local: Mapping[str, torch.Tensor], prefix: str) -> None:
    """Each block scale multiplies a 128 x 128 block of fp8 codes: one <= 0 zeroes or flips the sign of the block's
    weights, which loads without complaint and scores garbage. A load-time host read."""
    for key in BLOCK_SCALE_KEYS:
        if key in local:
            values = e8m0_to_float(local[key])
            if values.numel() and not bool((values > 0).all()):
                raise IndexerInputError(f"{prefix}{key} holds block scales <= 0 (smallest {float(values.min()):g}): "
                                        "a block scale multiplies its block of fp8 weights and must be > 0; the "
                                        "checkpoint is damaged or the key holds another tensor")


def _record_after_load(module: "Indexer", incompatible_keys) -> None:
    """load_state_dict's post hook (a module-level function: a module holding it stays picklable)."""
    module.record_weight_scale_formats()


SHARD_INDEX = "model.safetensors.index.json"  # the shard index transformers' save_pretrained writes


def _read_checkpoint_tensors(path: Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The tensors under ``prefixes`` of a safetensors file, of a folder of them, or of the shards a
    ``model.safetensors.index.json`` names (`Indexer.from_safetensors` says which files are read)."""
    index = path if path.is_file() and path.name.endswith(".index.json") else path / SHARD_INDEX
    if index.is_file():
        weight_map = _shard_weight_map(index)
        by_file: dict[str, list[str]] = {}
        for key, file in weight_map.items():
            if key.startswith(prefixes):
                by_file.setdefault(file, []).append(key)
        state = {}
        for file, keys in sorted(by_file.items()):
            shard = index.parent / file
            if not shard.is_file():
                more = f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
                raise FileNotFoundError(f"{index} puts {keys[0]}{more} in {file}, but {shard} does not exist: "
                                        "download that shard (an incomplete download?)")
            with _safetensors_file(shard) as handle:
                held = set(handle.keys())
                for key in keys:
                    if key not in held:
                        raise ValueError(f"{index} puts {key} in {file}, but {shard} does not hold {key}: the index "
                                         "and its shards disagree (a stale index, or shards of another download)")
                    state[key] = handle.get_tensor(key)
        return state
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no safetensors file in {path}")
    state, origin = {}, {}
    for file in files:
        with _safetensors_file(file) as handle:
            for key in handle.keys():
                if not key.startswith(prefixes):
                    continue
                if key in origin:
                    # Which copy is current is unknown (a stale model.safetensors beside its shards, say).
                    raise ValueError(f"{key} is in both {origin[key]} and {file}: a folder without {SHARD_INDEX} "
                                     "must hold each tensor once (remove the stale file, or add the index that "
                                     "names each tensor's shard)")
                origin[key] = file
                state[key] = handle.get_tensor(key)
    return state


def _shard_weight_map(index: Path) -> dict[str, str]:
    weight_map = read_json_object(index, f"a {SHARD_INDEX} object").get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise ValueError(f"{index} has no 'weight_map' object of tensor name -> shard file name (the index format "
                         "transformers' save_pretrained writes)")
    return weight_map


@contextlib.contextmanager
def _safetensors_file(path: Path):
    """``safe_open`` whose format errors name the file (safetensors' own say only "header too large" and the like):
    a truncated download, a Git LFS pointer or another format under a .safetensors name."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            yield handle
    except SafetensorError as exc:
        raise ValueError(f"{path} is not a readable safetensors file ({exc}): a truncated or unfinished download, a "
                         "Git LFS pointer, or another format; download it again") from None


def _version_of(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter (weights are then written once)
        return -1


FP4_PREFILL_KEYS = ("auto", "packed", "folded")  # `Indexer.fp4_prefill_keys`


def _into(context: StepContext, out: torch.Tensor) -> torch.Tensor:
    """The step's result in the caller's buffer when the context holds one (``topk_out``), else as made."""
    if context.topk_out is None or out is context.topk_out:
        return out
    return context.topk_out.copy_(out)


class Indexer(nn.Module):
    """The DeepSeek lightning indexer of one layer.

    ``forward(x, q_lora, positions, batch, cache, q_lora_quant=None, compressor_state=None)`` -> int32 [T, topk]
    request-local key positions (compressed entry indices for V4's C4 indexer), -1 padded; `to_physical_slots` maps
    them to cache slots. ``q_lora_quant`` is attention's fp8 copy of ``q_lora`` (see `dsa_indexer.contract.quant`), reused
    for ``wq_b`` when its layout fits. A C4 indexer owns its key `Compressor` and needs ``compressor_state``
    (`CompressorState`): each step compresses and stores the entries its tokens complete.
    """

    def __init__(self, config: IndexerConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.bfloat16, wq_b_fp8: bool = True, target: Target | str | None = None,
                 logits_budget_bytes: int = DEFAULT_LOGITS_BUDGET) -> None:
        super().__init__()
        if not isinstance(config, IndexerConfig):
            raise IndexerInputError(f"config must be an IndexerConfig (e.g. IndexerConfig.deepseek_v32(), "
                                    f"IndexerConfig.from_hf_config(path)), got {type(config).__name__}")
        if dtype not in ACTIVATION_DTYPES:
            raise IndexerInputError(f"dtype must be torch.bfloat16 or torch.float16 (the dtype of x, q_lora and the "
                                    f"unquantized weights; the steps take no other), got {dtype!r}")
        check_bool("wq_b_fp8", wq_b_fp8)
        device = check_device("device", device if device is not None else "cpu",
                              "build the Indexer on a device this torch sees (device='cpu' by default)")
        self.config = config
        self.dtype = dtype
        self.logits_budget_bytes = logits_budget_bytes
        fits_in_memory(f"Indexer({config.name!r}: hidden_size {config.hidden_size}, q_lora_rank {config.q_lora_rank}, "
                       f"{config.n_heads} heads, topk {config.topk}, max_position {config.max_position}): its weights, "
                       "RoPE table and one token's step", self._bytes_at_least(dtype, wq_b_fp8), device)
        # The target is resolved once per device (argument, else DSA_INDEXER_TARGET, else the hardware) and passed to
        # every op this indexer calls: resolution never depends on ambient state set by someone else.
        self._target_override = target
        self._target: tuple[torch.device, Target] | None = None
        if isinstance(target, str):
            default_registry()  # plugins loaded first: an arch a plugin registers is known, not warned about
        fp8 = detect_target(device, target).fp8_dtype
        self.fp8_dtype = fp8
        hd = config.n_heads * config.head_dim
        self.wq_b: nn.Module = (BlockFp8Linear(config.q_lora_rank, hd, device, fp8) if wq_b_fp8
                                else nn.Linear(config.q_lora_rank, hd, bias=False, device=device, dtype=dtype))
        self.weights_proj = nn.Linear(config.hidden_size, config.n_heads, bias=False, device=device, dtype=dtype)
        if config.compress_ratio == 1:
            # wk as the recipe runs it: block-fp8 (the checkpoint's storage, an fp8 GEMM) or dequantized (bf16 GEMM).
            self.wk: nn.Module | None = (BlockFp8Linear(config.hidden_size, config.head_dim, device, fp8)
                                         if config.wk_gemm == "fp8" else
                                         nn.Linear(config.hidden_size, config.head_dim, bias=False, device=device,
                                                   dtype=dtype))
            self.k_norm: nn.LayerNorm | None = nn.LayerNorm(config.head_dim, eps=config.norm_eps, device=device,
                                                            dtype=dtype)
        else:
            self.wk = None  # V4: keys are pooled by the indexer's compressor
            self.k_norm = None
        self.compressor: Compressor | None = Compressor(config, device) if config.compress_ratio > 1 else None
        self.requires_grad_(False)  # an inference module: its output is integer indices
        self.reuse_stats: Counter[str] = Counter()
        # Reuse a q_lora_quant quantized before bf16 rounding (aiter's fused kernel; one fp8 ulp may differ)?
        # None: as the target's platform says (AMD: yes, as the seed integration does; NVIDIA: no, bit-identical).
        self.allow_unrounded_q_lora_quant: bool | None = None
        self.last_pipeline: Resolution | None = None
        # weights_proj and wk as one GEMM over their concatenated weight (one launch and one split-K reduce fewer
        # per decode step); False runs them as two GEMMs (the dual-stream strategy then overlaps wk with wq_b).
        self.fuse_x_projections = True
        # How prefill scores V4's FP4 pages (paged64_fp4_e2m1): "packed" reads the keys as stored (uint8 e2m1 rows and
        # their ue8m0 block bytes: half the gathered bytes, every block its own scale; the FP4 ragged logits),
        # "folded" folds them into fp8 rows with one power-of-two scale (the fp8 ragged kernels and top-ks; a block
        # more than 2^14 below its row's largest loses precision), "auto" (default): packed where the FP4 logits
        # resolved for the target multiply FP4 natively (registry info ``native_fp4``: DeepGEMM's fp8_fp4_mqa_logits
        # on sm100), else folded (the Triton FP4 kernel decodes nibbles: 3.8x the fp8 kernel's time at 128K on the
        # H200).
        self.fp4_prefill_keys = "auto"
        self._plans: dict[tuple, StepPlan] = {}
        self._registry = None  # default_registry(), taken on the first step  # `step_plan`: one per problem class, weights and registry state
        self._x_projection: tuple[tuple, torch.Tensor] | None = None
        self._activation_wq_b: tuple[tuple, torch.Tensor] | None = None
        self._fp32_weights_proj: tuple[tuple, torch.Tensor] | None = None
        self._scale_fmt_epoch = 0  # bumped by each record: a plan keyed on it sees a new format
        # load_state_dict writes the scales in place: read their format again after it (still load time).
        self.register_load_state_dict_post_hook(_record_after_load)
        self._records_scale_fmts = True  # from here on, assigning a block-fp8 wq_b / wk reads its scales' format

    @property
    def logits_budget_bytes(self) -> int:
        """Bytes a prefill chunk's logits and q-path intermediates may hold at once (`PrefillBatch.plan_chunks`)."""
        return self._logits_budget_bytes

    @logits_budget_bytes.setter
    def logits_budget_bytes(self, value: int) -> None:
        # Checked when set: the first long prefill would otherwise be the first to read it.
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise IndexerInputError(f"logits_budget_bytes must be an int >= 0 (bytes; 0 scores one row at a time), "
                                    f"got {value!r}")
        self._logits_budget_bytes = value

    def _bytes_at_least(self, dtype: torch.dtype, wq_b_fp8: bool) -> int:
        """A lower bound of what this indexer allocates: its weights, the shared RoPE table (built at the first step)
        and one token's step; checked against the device before anything is allocated."""
        cfg = self.config
        act = torch.empty((), dtype=dtype).element_size()
        hd = cfg.n_heads * cfg.head_dim
        blocks = -(-hd // 128) * -(-cfg.q_lora_rank // 128) * 4
        total = hd * cfg.q_lora_rank * (1 if wq_b_fp8 else act) + (blocks if wq_b_fp8 else 0)
        total += cfg.n_heads * cfg.hidden_size * act
        if cfg.compress_ratio == 1:
            total += cfg.head_dim * cfg.hidden_size * (1 if cfg.wk_gemm == "fp8" else act) + 2 * cfg.head_dim * act
        else:
            total += 2 * (2 * cfg.head_dim * cfg.hidden_size * 4)  # the compressor's fp32 wkv and wgate
        return total + cfg.max_position * cfg.rope_dim * 4 + self.q_path_bytes_per_row()

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        # Setting a block-fp8 module is a weight load (from_safetensors, transformers' swap_indexers): the one place
        # its scales' format may be read. __init__'s empty modules are skipped (nothing loaded yet).
        if name in FP8_GEMM_WEIGHTS and isinstance(value, BlockFp8Linear) and self.__dict__.get("_records_scale_fmts"):
            self._record_scale_fmt(value)

    # --- weights ------------------------------------------------------------------------------------------
    def _record_scale_fmt(self, layer: "BlockFp8Linear") -> None:
        scales = layer.weight_scale_inv
        if scales.device.type == "meta":
            return  # nothing to read: stays unknown ("fp32")
        scales.__dict__[SCALE_FMT_ATTR] = (_version_of(scales), ops.scale_format(scales))
        self._scale_fmt_epoch += 1

    @torch.no_grad()
    def record_weight_scale_formats(self) -> dict[str, str]:
        """Read the block-fp8 weights' scales once and record whether each holds powers of two ("ue8m0") or not
        ("fp32"); returns name -> format. A host read (a sync on a GPU): `load_checkpoint`, `from_safetensors`,
        `init_random`, `load_state_dict` and assigning a block-fp8 ``wq_b`` / ``wk`` call it; call it yourself after
        writing a block scale in place (until then that weight's GEMM takes ``scale_fmt="fp32"``: right everywhere,
        but not served by DeepGEMM on sm100). Never call it inside a step or a CUDA-graph capture."""
        for name in FP8_GEMM_WEIGHTS:
            layer = getattr(self, name, None)
            if isinstance(layer, BlockFp8Linear):
                self._record_scale_fmt(layer)
        return {name: self.weight_scale_fmt(name) for name in FP8_GEMM_WEIGHTS
                if isinstance(getattr(self, name, None), BlockFp8Linear)}

    def weight_scale_fmt(self, name: str) -> str:
        """The recorded format of block-fp8 weight ``name``'s scales ("wq_b" or "wk"), without reading them: "ue8m0"
        only when they were read as powers of two and not written since; else "fp32" (true of any scales)."""
        layer = getattr(self, name, None)
        if not isinstance(layer, BlockFp8Linear):
            raise IndexerInputError(f"{name} is not a block-fp8 weight of this indexer")
        scales = layer.weight_scale_inv
        recorded = scales.__dict__.get(SCALE_FMT_ATTR)
        return recorded[1] if recorded is not None and recorded[0] == _version_of(scales) else "fp32"

    def gemm_scale_fmt(self, name: str) -> str:
        """The ``scale_fmt`` fact of the fp8 GEMM with weight ``name``: "ue8m0" when both operands' scales are powers
        of two (the recipe's activation scales, ``config.scale_fmt``, and the weight's recorded block scales), else
        "fp32". Host facts only: safe while a plan is built during graph capture."""
        return "ue8m0" if self.config.gemm_ue8m0 and self.weight_scale_fmt(name) == "ue8m0" else "fp32"

    @property
    def wq_b_is_block_fp8(self) -> bool:
        return isinstance(self.wq_b, BlockFp8Linear)

    @property
    def wk_is_block_fp8(self) -> bool:
        return isinstance(self.wk, BlockFp8Linear)

    @property
    def x_projections_fusable(self) -> bool:
        """Whether weights_proj and wk can run as one GEMM: both in the activation dtype (a block-fp8 wk or an fp32
        weights_proj runs its own GEMM)."""
        return self.wk is not None and not self.wk_is_block_fp8 and self.config.weights_proj_dtype == "bf16"

    def fp32_weights_proj(self) -> torch.Tensor:
        """weights_proj's weight in fp32 (cached, rebuilt when the weight changes), for ``weights_proj_dtype="fp32"``."""
        w = self.weights_proj.weight
        key = (w.data_ptr(), _version_of(w), w.device)
        if self._fp32_weights_proj is None or self._fp32_weights_proj[0] != key:
            self._fp32_weights_proj = (key, w.float().contiguous())
        return self._fp32_weights_proj[1]

    @torch.no_grad()
    def init_random(self, seed: int = 0) -> "Indexer":
        """Seeded random weights at the checkpoint's scale (for demos, tests and benchmarks)."""
        if isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**64:
            raise IndexerInputError(f"seed must be an int (a torch.Generator seed, -2**63 <= seed < 2**64), got "
                                    f"{seed!r}")
        gen = torch.Generator().manual_seed(seed)
        cfg = self.config

        def rand(*shape, std):
            return (torch.randn(*shape, generator=gen) * std)

        wq = rand(cfg.n_heads * cfg.head_dim, cfg.q_lora_rank, std=cfg.q_lora_rank ** -0.5)
        if self.wq_b_is_block_fp8:
            q, s = quantize_block_fp8(wq, self.fp8_dtype)
            self.wq_b.weight.copy_(q)
            self.wq_b.weight_scale_inv.copy_(s)
        else:
            self.wq_b.weight.copy_(wq)
        self.weights_proj.weight.copy_(rand(cfg.n_heads, cfg.hidden_size, std=cfg.hidden_size ** -0.5))
        if self.wk is not None:
            wk = rand(cfg.head_dim, cfg.hidden_size, std=cfg.hidden_size ** -0.5)
            if self.wk_is_block_fp8:
                q, s = quantize_block_fp8(wk, self.fp8_dtype)
                self.wk.weight.copy_(q)
                self.wk.weight_scale_inv.copy_(s)
            else:
                self.wk.weight.copy_(wk)
            self.k_norm.weight.copy_(1 + 0.1 * rand(cfg.head_dim, std=1.0))
            self.k_norm.bias.copy_(0.1 * rand(cfg.head_dim, std=1.0))
        if self.compressor is not None:
            self.compressor.init_random(gen)
        self.record_weight_scale_formats()  # amax scales: "fp32" (they are not rounded to powers of two)
        return self

    @property
    def cos_sin(self) -> torch.Tensor:
        """The RoPE table ``[max_position, rope_dim]`` fp32 of this config on this indexer's device, shared by
        every layer (`dsa_indexer.rope.shared_cos_sin_table`; built on first use)."""
        cfg = self.config
        return shared_cos_sin_table(cfg.rope_dim, cfg.max_position, cfg.rope_theta, cfg.yarn,
                                    self.weights_proj.weight.device)

    @torch.no_grad()
    def load_checkpoint(self, state: Mapping[str, torch.Tensor], prefix: str = "") -> "Indexer":
        """Load DeepSeek checkpoint tensors (keys ``<prefix>wq_b.weight`` ...). A block scale for ``wq_b`` makes it
        block-fp8: ``wq_b.weight_scale_inv`` (fp32, V3.2 / HF) or ``wq_b.scale`` (UE8M0, V4's inference format).
        An fp8 ``wk`` with its scale stays block-fp8 when ``config.wk_gemm`` is "fp8" (DeepSeek's fp8 GEMM), else it
        is dequantized once (the bf16 path). A C4 indexer also loads its compressor
        (``compressor.{wkv.weight, wgate.weight, ape, norm.weight}``). Missing or extra keys and shape mismatches
        raise, naming the key."""
        _check_state(state, prefix)
        wanted = ["wq_b.weight", "weights_proj.weight"]
        if self.wk is not None:
            wanted += ["wk.weight", "k_norm.weight", "k_norm.bias"]
        if self.compressor is not None:
            wanted += [f"compressor.{name}" for name in COMPRESSOR_KEYS]
        optional = {"wq_b.weight_scale_inv", "wq_b.scale", "wk.weight_scale_inv"}
        local = {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}
        missing = [k for k in wanted if k not in local]
        if missing:
            raise KeyError(f"checkpoint is missing {', '.join(prefix + k for k in missing)}")
        extra = sorted(set(local) - set(wanted) - optional)
        if extra:
            raise KeyError(f"unexpected checkpoint keys: {', '.join(prefix + k for k in extra)}")
        if "wq_b.weight_scale_inv" in local and "wq_b.scale" in local:
            raise KeyError(f"checkpoint has both {prefix}wq_b.weight_scale_inv and {prefix}wq_b.scale; expected one")
        check_checkpoint_formats(local, prefix)
        _check_block_scales(local, prefix)
        cfg = self.config
        device = self.weights_proj.weight.device
        wq = local["wq_b.weight"]
        expect = (cfg.n_heads * cfg.head_dim, cfg.q_lora_rank)
        if tuple(wq.shape) != expect:
            raise ValueError(f"{prefix}wq_b.weight has shape {list(wq.shape)}, expected {list(expect)}")
        scale_key = "wq_b.weight_scale_inv" if "wq_b.weight_scale_inv" in local else "wq_b.scale"
        if scale_key in local:
            layer = BlockFp8Linear(cfg.q_lora_rank, expect[0], device, self.fp8_dtype)
            scale = e8m0_to_float(local[scale_key])
            if tuple(scale.shape) != tuple(layer.weight_scale_inv.shape):
                raise ValueError(f"{prefix}{scale_key} has shape {list(scale.shape)}, expected "
                                 f"{list(layer.weight_scale_inv.shape)}")
            if wq.dtype == torch.float8_e4m3fn and self.fp8_dtype == torch.float8_e4m3fnuz:
                wq, scale = fn_to_fnuz(wq, scale)
            layer.weight.copy_(wq.to(device))
            layer.weight_scale_inv.copy_(scale)
            self.wq_b = layer
        else:
            self.wq_b = nn.Linear(cfg.q_lora_rank, expect[0], bias=False, device=device, dtype=self.dtype)
            self.wq_b.requires_grad_(False)
            self.wq_b.weight.copy_(wq)

        def put(name: str, param: torch.Tensor, value: torch.Tensor) -> None:
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"{prefix}{name} has shape {list(value.shape)}, expected {list(param.shape)}")
            param.copy_(value)

        put("weights_proj.weight", self.weights_proj.weight, local["weights_proj.weight"])
        if self.wk is not None:
            wk = local["wk.weight"]
            if self.wk_is_block_fp8:
                if "wk.weight_scale_inv" not in local:
                    raise ValueError(f"{prefix}wk.weight is {dtype_name(wk.dtype)} without a block scale, but the "
                                     "config's wk_gemm='fp8' runs the block-fp8 wk an fp8 checkpoint stores; build "
                                     "the config with wk_gemm='bf16' for this checkpoint")
                scale = local["wk.weight_scale_inv"].float()
                put("wk.weight_scale_inv", self.wk.weight_scale_inv, scale)
                if wk.dtype == torch.float8_e4m3fn and self.fp8_dtype == torch.float8_e4m3fnuz:
                    wk, scale = fn_to_fnuz(wk, scale)
                    self.wk.weight_scale_inv.copy_(scale)
                put("wk.weight", self.wk.weight, wk)
            else:
                if "wk.weight_scale_inv" in local:
                    tmp = BlockFp8Linear(cfg.hidden_size, cfg.head_dim, "cpu", wk.dtype)
                    tmp.weight.copy_(wk)
                    tmp.weight_scale_inv.copy_(local["wk.weight_scale_inv"].float())
                    wk = tmp.dequantize()
                put("wk.weight", self.wk.weight, wk)
            put("k_norm.weight", self.k_norm.weight, local["k_norm.weight"])
            put("k_norm.bias", self.k_norm.bias, local["k_norm.bias"])
        if self.compressor is not None:
            params = dict(self.compressor.named_parameters())
            for name in COMPRESSOR_KEYS:
                put(f"compressor.{name}", params[name], local[f"compressor.{name}"])
        self.record_weight_scale_formats()
        return self

    @classmethod
    def from_safetensors(cls, path: str | Path, layer: int, config: IndexerConfig | None = None, **kwargs
                         ) -> "Indexer":
        """Build the indexer of ``layer`` from a safetensors file (or a folder of them) of a DeepSeek checkpoint.

        Key naming schemes read (`checkpoint_schemes`): V3.2's HF names ``model.layers.{L}.self_attn.indexer.*``;
        V4's inference names ``layers.{L}.attn.indexer.*``, also under the ``model.`` prefix that transformers'
        ``save_pretrained`` writes; and transformers' own V4 module names
        ``model.layers.{L}.self_attn.compressor.indexer.{q_b_proj, scorer.weights_proj, kv_proj, gate_proj,
        position_bias, kv_norm}``, mapped to the inference names. Without ``config`` the model is recognized by
        which scheme the file holds (V3.2 or V4-Flash sizes); a ``config.json`` beside the file (HF format) is read
        with `IndexerConfig.from_hf_config` when present.

        Which files are read: ``path`` itself when it is a file; in a folder with a ``model.safetensors.index.json``
        (or given that index), exactly the shards its ``weight_map`` names for this layer's tensors, each tensor from
        the shard the index names (other files in the folder, such as a stale ``model.safetensors``, are not read;
        shards holding none of these tensors need not be present); in a folder without an index, every
        ``*.safetensors`` file, and a tensor found in two of them is refused, naming it and both files."""
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise IndexerInputError(f"layer must be an int >= 0 (the layer number in the checkpoint's keys), got "
                                    f"{layer!r}")
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"no safetensors file at {path}")
        if config is None:
            config_json = (path if path.is_dir() else path.parent) / "config.json"
            if config_json.is_file():
                config = IndexerConfig.from_hf_config(config_json)
        candidates = [config] if config is not None else [IndexerConfig.deepseek_v32(),
                                                          IndexerConfig.deepseek_v4_flash()]
        schemes = [(c, prefix, names) for c in candidates for prefix, names in checkpoint_schemes(c, layer)]
        state = _read_checkpoint_tensors(path, tuple(prefix for _, prefix, _ in schemes))
        found = [(c, prefix, names) for c, prefix, names in schemes if any(k.startswith(prefix) for k in state)]
        if not found:
            raise KeyError(f"no tensors under {' or '.join(repr(p) for _, p, _ in schemes)} in {path}")
        if len(found) > 1:
            raise KeyError(f"{path} holds tensors under {' and '.join(repr(p) for _, p, _ in found)}; pass config= "
                           "(and keep one naming scheme per file)")
        config, prefix, names = found[0]
        # Errors name the file's keys: the prefix is kept, and a renamed key is read under its inference name.
        local = {prefix + names.get(key[len(prefix):], key[len(prefix):]): value
                 for key, value in state.items() if key.startswith(prefix)}
        block_fp8 = f"{prefix}wq_b.weight_scale_inv" in local or f"{prefix}wq_b.scale" in local
        indexer = cls(config, wq_b_fp8=block_fp8, **kwargs)
        return indexer.load_checkpoint(local, prefix)

    def x_projection_weight(self) -> torch.Tensor:
        """``[weights_proj; wk]`` ([H + D, hidden]) when the two can run as one GEMM (`x_projections_fusable`),
        else weights_proj's weight. Rebuilt when either weight is replaced or written in place (keyed by storage and
        version counter)."""
        if not self.x_projections_fusable:
            return self.weights_proj.weight
        parts = (self.weights_proj.weight, self.wk.weight)
        key = tuple((p.data_ptr(), _version_of(p), p.dtype, p.device) for p in parts)
        if self._x_projection is None or self._x_projection[0] != key:
            self._x_projection = (key, torch.cat(parts, dim=0).contiguous())
        return self._x_projection[1]

    def activation_wq_b(self) -> torch.Tensor:
        """``wq_b``'s weight in the activation dtype ([H * D, q_lora_rank]): the block-fp8 weight dequantized once
        (cached, rebuilt when the weight changes), for the plain-layout q path, which runs no fp8 GEMM."""
        if not self.wq_b_is_block_fp8:
            return self.wq_b.weight
        parts = (self.wq_b.weight, self.wq_b.weight_scale_inv)
        key = tuple((p.data_ptr(), _version_of(p), p.device) for p in parts)
        if self._activation_wq_b is None or self._activation_wq_b[0] != key:
            self._activation_wq_b = (key, self.wq_b.dequantize().to(self.dtype).contiguous())
        return self._activation_wq_b[1]

    def allocate_cache(self, num_pages: int, layout: str | None = None) -> IndexKCache:
        """An empty index-K cache of ``num_pages`` 64-token pages on this indexer's device, in ``layout`` (default:
        what the target's platform stores: the fp8 132-byte pages, or on Ascend the plain bf16 layout for V3.2 and
        the int8 one for V4's C4 indexer, which torch_npu's indexer kernels read). ``"paged64_fp4_e2m1"`` (68 bytes
        per token, V4's FP4 keys as made) is for a ``key_quant="fp4_e2m1"`` config only."""
        from .dispatch.platform import platform_of

        if layout is None:
            layout = platform_of(self.target.vendor).cache_layout(self.config.compress_ratio)
        self._check_layout(layout, "layout")
        return IndexKCache.allocate(num_pages, self.weights_proj.weight.device, self.fp8_dtype, layout)

    def _check_layout(self, layout: str, name: str) -> None:
        """The FP4 pages hold V4's FP4 keys and nothing else: only a ``key_quant="fp4_e2m1"`` config writes them."""
        if layout == LAYOUT_PAGED64_FP4 and self.config.key_quant != "fp4_e2m1":
            what = ("V3.2's indexer (compress_ratio 1) stores fp8 keys" if self.config.compress_ratio == 1 else
                    f"this config's key_quant is {self.config.key_quant!r}")
            raise IndexerInputError(f"{name}={LAYOUT_PAGED64_FP4!r} holds FP4 e2m1 keys, but {what}: use "
                                    f"{LAYOUT_PAGED64!r} (the fp8 pages), or a V4 config with key_quant='fp4_e2m1' "
                                    "(IndexerConfig.deepseek_v4_flash(key_quant='fp4_e2m1'))")

    # --- resolution helpers -------------------------------------------------------------------------------
    @property
    def target(self) -> Target:
        """The target this indexer resolves its ops for (re-detected when the module moves to another device)."""
        device = self.weights_proj.weight.device
        if self._target is None or self._target[0] != device:
            self._target = (device, detect_target(device, self._target_override))
        return self._target[1]

    def _gemm_layout(self, info) -> Fp8GroupLayout:
        """The activation layout this indexer quantizes a GEMM input to, and what a reusable q_lora_quant must match:
        the bound block-fp8 GEMM's layout (its ``info["input_layout"]``: group size, scale order, fp8 flavour) with
        the recipe's scale format (``config.scale_fmt``: power-of-two scales for "ue8m0")."""
        layout = info.get("input_layout") or Fp8GroupLayout(fp8_dtype=self.fp8_dtype)
        if layout.fp8_dtype is None:  # "the target's flavour"
            layout = dataclasses.replace(layout, fp8_dtype=self.fp8_dtype)
        # The scale format is the model's recipe, not the kernel's: every GEMM here takes fp32 scales, and
        # power-of-two ones are fp32 values too.
        return dataclasses.replace(layout, ue8m0=self.config.gemm_ue8m0)

    def quantize_q_lora(self, q_a: torch.Tensor, norm_weight: torch.Tensor, eps: float = 1e-6
                        ) -> tuple[torch.Tensor, QuantizedActivation]:
        """Attention's q_lora producer under this indexer's recipe: ``(q_lora, q_lora_quant)`` from the un-normed
        ``q_a`` [T, q_lora_rank] (RMSNorm + fp8 group quant, scales in ``config.scale_fmt``), so handing
        ``q_lora_quant`` to `forward` is reused and bit-identical to quantizing ``q_lora`` again."""
        return ops.rmsnorm_quant_fp8(q_a, norm_weight, eps, ue8m0=self.config.gemm_ue8m0, target=self.target)

    def reuses_unrounded_quant(self) -> bool:
        """Whether a q_lora_quant made before bf16 rounding is reused: the explicit setting, else the platform's."""
        if self.allow_unrounded_q_lora_quant is not None:
            return bool(self.allow_unrounded_q_lora_quant)
        from .dispatch.platform import platform_of

        return platform_of(self.target.vendor).reuse_unrounded_quant

    # --- the per-step plan ------------------------------------------------------------------------------
    def _weights_key(self) -> tuple:
        """Identity and version of every weight a plan reads: a replaced or rewritten weight makes a new plan."""
        parts = [self.wq_b.weight, getattr(self.wq_b, "weight_scale_inv", None), self.weights_proj.weight]
        if self.wk is not None:
            parts += [self.wk.weight, getattr(self.wk, "weight_scale_inv", None), self.k_norm.weight, self.k_norm.bias]
        return tuple((p.data_ptr(), _version_of(p)) if p is not None else None for p in parts)

    def step_plan(self, tokens: int, decode: bool, *, has_quant: bool = False, cache_layout: str = LAYOUT_PAGED64,
                  next_n: int = 1, dtype: torch.dtype | None = None, logits_pages: int | None = None,
                  cache_pages: int | None = None) -> StepPlan:
        """The plan of a step of ``tokens`` rows (`dsa_indexer.plan`): every kernel the step runs, bound for this
        problem class (role -> `Bound`), the weights in the forms the step reads and the GEMM layouts.
        ``logits_pages``: a plan for the decode-logits seam (`decode_logits`), whose paged logits take the cache's
        page count as a fact. ``cache_pages``: a decode step's cache page count, a fact of its scorer (the composed
        one binds its paged logits with it; None: a plan made without a cache). Built once and kept while the weights, the target, the registry's resolutions and
        the knobs (``fuse_x_projections``, ``allow_unrounded_q_lora_quant``, ``fp4_prefill_keys``) stay as they
        were."""
        registry = self._registry
        if registry is None:  # the process-wide registry is created once and never replaced: keep it
            registry = self._registry = default_registry()
        target = self.target
        bucket = 1 << max(0, tokens - 1).bit_length()  # `token_bucket`, inline: the warm path builds no Problem
        # id(target): the indexer keeps its Target (and a plan its own), so the id stays that object's.
        key = (id(registry), registry.generation, id(target), bucket, decode, has_quant, cache_layout, next_n,
               dtype or self.dtype, self.fuse_x_projections, self.allow_unrounded_q_lora_quant, self._weights_key(),
               self._scale_fmt_epoch, self.fp4_prefill_keys, logits_pages, cache_pages)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= 64:  # stale keys (old weights, old generations) are never asked for again
                self._plans.clear()
            problem = Problem(tokens=bucket, decode=decode, q_lora_quant=has_quant, cache=cache_layout)
            plan = self._plans[key] = self._build_plan(registry, problem, cache_layout, dtype or self.dtype, next_n,
                                                       logits_pages, cache_pages)
        return plan

    def _build_plan(self, registry, problem: Problem, cache_layout: str, dtype: torch.dtype, next_n: int = 1,
                    logits_pages: int | None = None, cache_pages: int | None = None) -> StepPlan:
        """Bind every role of the step (`dsa_indexer.plan`), each for a problem made from the facts given here."""
        cfg, target = self.config, self.target
        decode = problem["decode"]
        strategy = bind(PIPELINE_OP, target, problem, registry)
        wq_b_fp8, wk_fp8 = self.wq_b_is_block_fp8, self.wk_is_block_fp8
        fp8 = ops.fp8_name(self.fp8_dtype)
        plain_format = PLAIN_LAYOUT_FORMATS.get(cache_layout)
        # The GEMMs' scale_fmt facts from what weight load recorded: no value is read here (a capture may build it).
        wq_b_fmt = self.gemm_scale_fmt("wq_b") if wq_b_fp8 else "fp32"
        wk_fmt = self.gemm_scale_fmt("wk") if wk_fp8 else "fp32"
        weights = LayerWeights(
            wq_b=self.wq_b.weight, wq_b_scale=self.wq_b.weight_scale_inv if wq_b_fp8 else None,
            weights_proj=self.fp32_weights_proj() if cfg.weights_proj_dtype == "fp32" else self.weights_proj.weight,
            x_projection=self.x_projection_weight() if self.x_projections_fusable else None,
            wk=self.wk.weight if self.wk is not None else None,
            wk_scale=self.wk.weight_scale_inv if wk_fp8 else None,
            k_norm_weight=self.k_norm.weight if self.k_norm is not None else None,
            k_norm_bias=self.k_norm.bias if self.k_norm is not None else None,
            cos_sin=self.cos_sin,
            wq_b_activation=self.activation_wq_b() if plain_format is not None else None,
            compressor=self.compressor)
        kernels: dict[str, Bound] = {"pipeline": strategy}
        reasons = {"pipeline": f"the step's schedule ({'decode' if decode else 'prefill'}, a {problem['tokens']}-token "
                               f"bucket, {cache_layout})"}
        roles: dict[str, Role] = {}
        layouts: dict[str, Fp8GroupLayout | None] = {"wq_b": None, "wk": None}
        # The fp8 GEMMs first: the quant that feeds each is bound for the input layout its GEMM's info names. A
        # plain layout runs wq_b in the activation dtype (`LayerWeights.wq_b_activation`).
        gemms = (("wq_b", wq_b_fp8 and plain_format is None, "q_lora_quant", cfg.q_lora_rank, wq_b_fmt),
                 ("wk", wk_fp8, "x_quant", cfg.hidden_size, wk_fmt))
        for name, used, quant, width, fmt in gemms:
            if not used:
                continue
            role = gemm_role(getattr(self, name).weight, dtype, fmt, f"{name}: a block-fp8 weight ({fmt} scales)")
            gemm = kernels[f"{name}_gemm"] = bind(role.op, target, role.problem, registry)
            reasons[f"{name}_gemm"] = role.why
            layout = layouts[name] = self._gemm_layout(gemm.info)
            roles[quant] = quant_role(layout, width, f"{name}_gemm's input, in the layout it takes")
        roles.update(q_and_k_roles(cfg, fp8, cache_layout, plain_format, weights, self.fuse_x_projections, wk_fp8))
        prefill_keys = "fp8" if decode else self._prefill_keys(cache_layout, registry)
        scoring, role = scoring_role(cfg, fp8, decode, next_n, cache_layout, plain_format, prefill_keys, logits_pages,
                                     cache_pages)
        roles[scoring] = role
        for name, role in roles.items():
            kernels[name] = bind(role.op, target, role.problem, registry)
            reasons[name] = role.why
        scoring_bytes = self._scoring_bytes(kernels["score"].info) if not decode and logits_pages is None else None
        return StepPlan(
            config=cfg, target=target, fp8_dtype=self.fp8_dtype, weights=weights, problem=problem,
            pipeline=strategy.resolution, strategy=strategy.fn, steps=STEPS, registry=registry,
            fuse_x_projections=self.fuse_x_projections, kernels=kernels,
            wq_b_layout=layouts["wq_b"], wk_layout=layouts["wk"],
            wq_b_scale_fmt=wq_b_fmt, wk_scale_fmt=wk_fmt,
            reuse_unrounded=self.reuses_unrounded_quant(), reuse_stats=self.reuse_stats,
            weight_scale=cfg.weight_scale, rope_offset=cfg.rope_offset,
            prefill_keys=prefill_keys, scoring_bytes=scoring_bytes, reasons=reasons)

    def _prefill_keys(self, cache_layout: str, registry: Registry) -> str:
        """The ``keys`` fact of prefill's ragged scoring over a ``cache_layout`` cache: "fp4" (the FP4 pages' keys
        as stored) or "fp8" (gathered fp8 rows: the fp8 pages, or the FP4 ones folded), per ``fp4_prefill_keys``;
        "auto" reads ``native_fp4`` from the info of the FP4 ragged logits resolved for the target."""
        knob = self.fp4_prefill_keys
        if knob not in FP4_PREFILL_KEYS:
            raise IndexerInputError(f"fp4_prefill_keys must be one of {', '.join(map(repr, FP4_PREFILL_KEYS))}, got "
                                    f"{knob!r}")
        if cache_layout != LAYOUT_PAGED64_FP4 or knob == "folded":
            return "fp8"
        if knob == "packed":
            return "fp4"
        cfg = self.config
        problem = role_problem("ragged_mqa_logits", heads=cfg.n_heads, dim=cfg.head_dim,
                               fp8=ops.fp8_name(self.fp8_dtype), keys="fp4")
        # A fact read, not a call: the pure resolution (no factory is built for it; a strict target refusing the
        # reference still gets its answer: the fold).
        chosen = registry.resolve("ragged_mqa_logits", self.target, problem).chosen
        return "fp4" if chosen is not None and chosen.info.get("native_fp4") else "fp8"

    def prefill_key_format(self, cache_layout: str, registry: Registry | None = None) -> str:
        """The ``keys`` fact the prefill plan of a ``cache_layout`` cache scores with (`_prefill_keys`)."""
        return self._prefill_keys(cache_layout, registry or default_registry())

    def _scoring_bytes(self, info) -> tuple[int, int]:
        """(bytes per row, bytes per (row, key)) a prefill chunk holds: the q path's intermediates per row, plus what
        the bound ``ragged_mqa_topk`` declares in its ``info`` (``plan_row_bytes(topk)`` / ``plan_key_bytes``); by
        default its fp32 logits, 4 B per key."""
        row_bytes = info.get("plan_row_bytes")
        extra = int(row_bytes(self.config.topk)) if callable(row_bytes) else int(row_bytes or 0)
        return self.q_path_bytes_per_row() + extra, int(info.get("plan_key_bytes", 4))

    def explain_step(self, tokens: int = 1, decode: bool = True, *, has_quant: bool = False,
                     cache_layout: str | None = None, next_n: int = 1, dtype: torch.dtype | None = None) -> str:
        """What a step of this problem class runs, as one table: role -> op -> implementation -> why, read from the
        plan `step_plan` builds for it (building it binds; nothing runs). ``cache_layout``: default, the one
        `allocate_cache` makes for this target."""
        if cache_layout is None:
            from .dispatch.platform import platform_of

            cache_layout = platform_of(self.target.vendor).cache_layout(self.config.compress_ratio)
        plan = self.step_plan(tokens, decode, has_quant=has_quant, cache_layout=cache_layout, next_n=next_n,
                              dtype=dtype)
        rows = [("role", "op", "implementation", "why")] + plan.explain()
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        head = (f"{self.config.name} on {self.target}: a {'decode' if decode else 'prefill'} step of {tokens} "
                f"token(s){f', next_n {next_n}' if decode else ''}, {cache_layout} cache")
        return "\n".join([head] + ["  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3]
                                   for row in rows])

    # --- the step -----------------------------------------------------------------------------------------
    def check_inputs(self, x, q_lora, positions, batch, cache, q_lora_quant) -> int:
        """Every check `forward` makes of its arguments (a public seam: context-parallel prefill makes the same
        ones); returns the token count T."""
        cfg = self.config
        self._check_activation(x)
        t = x.shape[0]
        if x.shape[1] != cfg.hidden_size:
            raise IndexerInputError(f"x must be [T, hidden_size={cfg.hidden_size}], got {list(x.shape)}")
        check_tensor("q_lora", q_lora, dtype=x.dtype, shape=(t, cfg.q_lora_rank), device=x.device)
        check_tensor("positions", positions, dtype=(torch.int32, torch.int64), shape=(t,), device=x.device)
        if not isinstance(batch, (DecodeBatch, PrefillBatch)):
            raise IndexerInputError(f"batch must be a DecodeBatch or PrefillBatch, got {type(batch).__name__}")
        if batch.num_tokens != t:
            raise IndexerInputError(f"batch describes {batch.num_tokens} tokens but x has {t}")
        if batch.compress_ratio != cfg.compress_ratio:
            raise IndexerInputError(f"batch was built with compress_ratio={batch.compress_ratio}, the config says "
                                    f"{cfg.compress_ratio}")
        if not isinstance(cache, IndexKCache):
            raise IndexerInputError(f"cache must be an IndexKCache, got {type(cache).__name__}")
        if cache.device != x.device:
            raise IndexerInputError(f"cache is on {cache.device} but x is on {x.device}")
        self._check_positions(batch)
        if batch.max_page >= cache.num_pages:
            raise IndexerInputError(f"batch's block_table uses cache page {batch.max_page} but the cache has "
                                    f"{cache.num_pages} pages: build the batch with num_cache_pages=cache.num_pages")
        if batch.max_page < 0 and isinstance(batch, DecodeBatch) and check_values(batch.block_table):
            # A batch derived on the device (`DecodeBuffers.derive`) has no host copy of its largest page; where its
            # values are free to read (CPU) or asked for (DSA_INDEXER_CHECK_RANGES=1) its table is checked here.
            used_pages_in_range("block_table", batch.block_table, batch.context_lens.max(dim=1).values, PAGE_SIZE,
                                cache.num_pages, "cache pages, for the pages a context uses")
        if batch.positions.device != x.device:
            raise IndexerInputError(f"batch is on {batch.positions.device} but x is on {x.device}: build the batch "
                                    f"with device={str(x.device)!r}")
        if positions is not batch.positions and check_values(positions):
            # Keys are stored at the batch's slots (from batch.positions) but RoPE'd at these positions: they must be
            # the same tokens. Free on the host; a host sync on a device (DSA_INDEXER_CHECK_RANGES=1 turns it on).
            mismatch = (positions.to(batch.positions.device, torch.long) != batch.positions.long()).nonzero()
            if mismatch.numel():
                row = int(mismatch[0, 0])
                raise IndexerInputError(
                    f"positions disagree with batch.positions at {mismatch.shape[0]} of {t} rows (first: row {row}, "
                    f"positions[{row}]={int(positions[row])}, batch.positions[{row}]={int(batch.positions[row])}): "
                    "keys would be stored at the batch's slots but rotated for other positions; pass "
                    "batch.positions")
        if check_values(x):
            for name, value in (("x", x), ("q_lora", q_lora)):
                if not bool(torch.isfinite(value).all()):
                    raise IndexerInputError(f"{name} holds NaN or inf values (the top-k of such rows is meaningless "
                                            "and their keys would be stored)")
        self._check_layout(cache.layout, "cache.layout")
        if not cache.is_plain and cache.fp8_dtype != self.fp8_dtype:
            raise IndexerInputError(f"cache holds {cache.fp8_dtype} keys but this target's indexer writes "
                                    f"{self.fp8_dtype}: never mix e4m3fn and e4m3fnuz")
        if q_lora_quant is not None and not isinstance(q_lora_quant, QuantizedActivation):
            raise IndexerInputError(f"q_lora_quant must be a QuantizedActivation, got {type(q_lora_quant).__name__}")
        return t

    def _check_activation(self, x) -> None:
        """x in the dtype of the weights its GEMMs multiply it (and q_lora) with directly: torch would refuse a
        float16 x against bfloat16 weights only inside the step. Those weights are the unquantized linears in an
        activation dtype (block-fp8 GEMMs and fp32 weights take either; transformers' swapped modules keep theirs)."""
        check_tensor("x", x, dtype=ACTIVATION_DTYPES, ndim=2)
        modules = self._modules
        for name in ("weights_proj", "wk", "wq_b"):
            layer = modules.get(name)
            if isinstance(layer, nn.Linear) and layer.weight.dtype in ACTIVATION_DTYPES and \
                    layer.weight.dtype != x.dtype:
                want = dtype_name(layer.weight.dtype)
                raise IndexerInputError(f"x must have dtype {want} (the dtype of this Indexer's {name}; q_lora "
                                        f"too), got {dtype_name(x.dtype)}: convert the activations, or build "
                                        f"Indexer(config, dtype=torch.{dtype_name(x.dtype)})")

    def _check_positions(self, batch: DecodeBatch | PrefillBatch) -> None:
        """Positions against the RoPE table, from the batch's host metadata (no device read): on a GPU the prologue
        kernels would otherwise read past the table."""
        position, request = batch.last_position
        if position >= self.config.max_position:
            raise IndexerInputError(f"request {request} has a token at position {position}, past the RoPE table "
                                    f"(max_position={self.config.max_position} of {self.config.name}); build the "
                                    "config with a larger max_position if the model supports it")

    def compression_step(self, batch: DecodeBatch | PrefillBatch, state) -> CompressionStep:
        """Check ``compressor_state`` against this C4 step and bundle what the compressor needs (a public seam: graph
        decode runs the same checks before capture)."""
        if state is None:
            raise IndexerInputError(
                "compressor_state is required for a C4 indexer (compress_ratio 4): each step compresses the entries "
                "its tokens complete into the cache. Allocate one per layer with CompressorState.allocate(num_slots, "
                "config, device) and keep it with the cache")
        if not isinstance(state, CompressorState):
            raise IndexerInputError(f"compressor_state must be a CompressorState, got {type(state).__name__}")
        if state.device != batch.positions.device:
            raise IndexerInputError(f"compressor_state is on {state.device} but the batch is on {batch.positions.device}")
        if tuple(state.window.shape[1:]) != (8, 4 * self.config.head_dim):
            raise IndexerInputError(f"compressor_state holds [{', '.join(map(str, state.window.shape[1:]))}] per "
                                    f"slot, this config needs [8, {4 * self.config.head_dim}]")
        if batch.state_slot is None or batch.compress_rows is None:
            raise IndexerInputError("batch has no compressor metadata: build it with DecodeBatch.build / "
                                    "PrefillBatch.build(compress_ratio=4)")
        if batch.max_state_slot >= state.num_slots:
            raise IndexerInputError(f"batch uses compressor state slot {batch.max_state_slot} but compressor_state "
                                    f"has {state.num_slots} slots")
        return CompressionStep(state, batch.positions, batch.row_request, batch.state_slot, batch.compress_rows,
                               batch.slot_mapping)

    def forward(self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor,
                batch: DecodeBatch | PrefillBatch, cache: IndexKCache, *,
                q_lora_quant: QuantizedActivation | None = None,
                compressor_state: CompressorState | None = None, context: StepContext | None = None
                ) -> torch.Tensor:
        """One step (see the class docstring). ``context``: the step's `StepContext` (default: the batch's own,
        shared by every layer that runs the batch); an engine passes its own to hand in a caller-owned output
        buffer (``topk_out``, returned filled), a side stream, or scratch it computed itself."""
        self.check_inputs(x, q_lora, positions, batch, cache, q_lora_quant)
        context = self._step_context(context, batch, x)
        decode = isinstance(batch, DecodeBatch)
        plan = self.step_plan(x.shape[0], decode, has_quant=q_lora_quant is not None, cache_layout=cache.layout,
                              next_n=batch.next_n if decode else 1, dtype=x.dtype,
                              cache_pages=cache.num_pages if decode else None)
        self.last_pipeline = plan.pipeline
        key_store = (batch.slot_mapping if self.compressor is None
                     else self.compression_step(batch, compressor_state))
        if not decode and batch.max_keys_per_row > self.config.topk:
            chunks = batch.plan_chunks(self.logits_budget_bytes, *plan.scoring_bytes)
            if len(chunks) > 1:  # the whole batch does not fit the budget: keys first, then q + scoring per chunk
                self._store_all_keys(plan, x, positions, key_store, cache, chunks)
                return self._score_rows(plan, x, q_lora, positions, batch, cache, q_lora_quant, chunks, context)
        if cache.is_plain:  # one fused `lightning_indexer_ragged` over the batch's rows, decode and prefill alike
            q, q_scales, weights = plan.schedule(context, x, q_lora, positions, key_store, cache, q_lora_quant)
            return _into(context, self._score_plain(plan, q, q_scales, weights, batch.request_rows(), cache, context))
        q_fp8, weights = plan.schedule(context, x, q_lora, positions, key_store, cache.data, q_lora_quant)
        if decode:
            return _into(context, self._score_decode(plan, q_fp8, weights, batch, cache, context))
        return self._score_planned(plan, batch, cache, lambda start, stop: (q_fp8[start:stop], weights[start:stop]),
                                   context=context)

    def _step_context(self, context: StepContext | None, batch, x: torch.Tensor) -> StepContext:
        """The caller's context, checked, else the batch's."""
        if context is None:
            return batch.context
        if not isinstance(context, StepContext):
            raise IndexerInputError(f"context must be a StepContext (dsa_indexer.StepContext), got "
                                    f"{type(context).__name__}")
        if context.topk_out is not None:
            check_tensor("context.topk_out", context.topk_out, dtype=torch.int32,
                         shape=(batch.num_tokens, self.config.topk), device=x.device)
        return context

    def scoring_plan_bytes(self, keys: str = "fp8") -> tuple[int, int]:
        """(bytes per row, bytes per (row, key)) that a prefill chunk holds, for `PrefillBatch.plan_chunks`: the q
        path's intermediates per row plus what the ``ragged_mqa_topk`` bound for ``keys`` (the gathered keys'
        format) declares (`_scoring_bytes`); a prefill plan reads the same from its "score" role."""
        cfg = self.config
        problem = role_problem("ragged_mqa_topk", heads=cfg.n_heads, dim=cfg.head_dim,
                               fp8=ops.fp8_name(self.fp8_dtype), k=cfg.topk, keys=keys)
        return self._scoring_bytes(bind("ragged_mqa_topk", self.target, problem).info)

    def q_path_bytes_per_row(self) -> int:
        """Peak bytes the q path holds per token: wq_b's bf16 output, fp32 prologue temporaries, the fp8 q, the head
        weights, a quantized q_lora, x in fp32 when weights_proj runs in fp32 (V3.2's recipe), and the row's int32
        top-k result (about 86 KiB at V3.2 size); counted against the prefill budget with the logits."""
        cfg = self.config
        hd = cfg.n_heads * cfg.head_dim
        fp32_x = cfg.hidden_size * 4 if cfg.weights_proj_dtype == "fp32" else 0
        return hd * (2 + 4 + 1) + cfg.n_heads * 4 * 2 + cfg.q_lora_rank * 2 + fp32_x + cfg.topk * 4

    def _store(self, plan: StepPlan, x, positions, key_store, cache: IndexKCache) -> None:
        """The k path of ``cache``'s layout: the fp8 pages, or a plain (bf16 / int8) layout."""
        if cache.is_plain:
            k_path_plain(plan, x, positions, key_store, cache)
        else:
            k_path(plan, x, positions, key_store, cache.data)

    def _store_all_keys(self, plan: StepPlan, x, positions, key_store, cache: IndexKCache, chunks) -> None:
        """Every key of a bounded prefill's batch, before any scoring (a query sees the keys of the tokens before it
        in the same batch), in the chunks' token blocks, in order: V3.2's rows each store their own key; C4's blocks
        run the compressor's step block by block on the rolling state (`CompressionStep.rows`), so its fp32
        projection (2 KiB per token at V4 size) is held for one block, not the whole batch."""
        for start, stop, _, _ in chunks:
            block = key_store.rows(start, stop) if self.compressor is not None else key_store[start:stop]
            self._store(plan, x[start:stop], positions[start:stop], block, cache)

    def score_rows(self, x, q_lora, positions, batch: PrefillBatch, cache: IndexKCache, q_lora_quant,
                   context: StepContext | None = None) -> torch.Tensor:
        """q path, logits and top-k of ``batch``'s rows, chunk by planned chunk, over keys already in the cache (a
        public seam: context-parallel prefill scores its own rows with it)."""
        plan = self.step_plan(batch.num_tokens, False, has_quant=q_lora_quant is not None,
                              cache_layout=cache.layout, dtype=x.dtype)
        chunks = batch.plan_chunks(self.logits_budget_bytes, *plan.scoring_bytes)
        return self._score_rows(plan, x, q_lora, positions, batch, cache, q_lora_quant, chunks,
                                self._step_context(context, batch, x))

    def decode_logits(self, x, q_lora, positions, batch: DecodeBatch, cache: IndexKCache, *,
                      q_lora_quant: QuantizedActivation | None = None,
                      compressor_state: CompressorState | None = None) -> torch.Tensor:
        """A decode step up to its logits: the keys stored (C4: the compressor's step), then fp32
        ``[B * next_n, batch.max_context_len]`` from `paged_mqa_logits`, -inf past each row's length (a public seam:
        context-parallel decode takes its shard's top-k with the scores the exact merge compares)."""
        if not isinstance(batch, DecodeBatch):
            raise IndexerInputError(f"batch must be a DecodeBatch, got {type(batch).__name__}")
        self.check_inputs(x, q_lora, positions, batch, cache, q_lora_quant)
        if cache.is_plain:
            raise IndexerInputError(f"decode_logits reads the fp8 paged cache; a {cache.layout} cache (the NPU's plain "
                                    "layout) is scored by the fused lightning_indexer_ragged only: call the indexer")
        plan = self.step_plan(x.shape[0], True, has_quant=q_lora_quant is not None, cache_layout=cache.layout,
                              next_n=batch.next_n, dtype=x.dtype, logits_pages=cache.num_pages)
        key_store = (batch.slot_mapping if self.compressor is None
                     else self.compression_step(batch, compressor_state))
        context = batch.context
        q_fp8, weights = plan.schedule(context, x, q_lora, positions, key_store, cache.data, q_lora_quant)
        q = q_fp8.view(batch.batch_size, batch.next_n, self.config.n_heads, self.config.head_dim)
        return plan.run("logits", "paged_mqa_logits", q, cache.data, weights, batch.context_lens, batch.block_table,
                        batch.max_context_len, context=context)

    def _score_rows(self, plan: StepPlan, x, q_lora, positions, batch: PrefillBatch, cache: IndexKCache,
                    q_lora_quant, chunks, context: StepContext) -> torch.Tensor:
        """Bounded scoring: per planned chunk of rows, the q path of the chunk, then its logits and top-k (for a plain
        layout, the fused indexer over the chunk's rows), so no intermediate grows with the batch beyond the budget
        (the int32 [T, topk] output aside)."""
        def q_of(start: int, stop: int):
            quant = q_lora_quant.select_rows(slice(start, stop)) if q_lora_quant is not None else None
            if cache.is_plain:
                return plan.steps.q_path_plain(plan, x[start:stop], q_lora[start:stop], positions[start:stop], quant,
                                               cache.key_format)
            return plan.steps.q_path(plan, x[start:stop], q_lora[start:stop], positions[start:stop], quant)

        if cache.is_plain:
            out = context.topk_out
            if out is None:
                out = torch.empty(batch.num_tokens, self.config.topk, dtype=torch.int32, device=x.device)
            for start, stop, _, _ in chunks:
                q, q_scales, weights = q_of(start, stop)
                out[start:stop] = self._score_plain(plan, q, q_scales, weights, batch.request_rows(start, stop), cache,
                                                    context)
            return out
        return self._score_planned(plan, batch, cache, q_of, chunks, context)

    def _score_plain(self, plan: StepPlan, q, q_scales, weights, request_rows, cache: IndexKCache,
                     context: StepContext) -> torch.Tensor:
        cu, seq_lens, block_table = request_rows
        return plan.run("score", "lightning_indexer_ragged", q.contiguous(), q_scales, cache.data, cache.scales_or_empty(), weights.contiguous(),
                        cu, seq_lens, block_table, self.config.topk, self.config.compress_ratio, context=context)

    def store_keys(self, x: torch.Tensor, batch: DecodeBatch | PrefillBatch, cache: IndexKCache, *,
                   compressor_state: CompressorState | None = None) -> None:
        """Store the keys of ``batch``'s tokens ``x`` [T, hidden] without scoring any query (what a model does for
        context it only needs to remember, e.g. filling a cache in chunks). V3.2: wk, norm, RoPE, Hadamard, fp8.
        C4: the compressor's step (entries completed by these tokens; the state rolls forward)."""
        self._check_activation(x)
        if x.shape != (batch.num_tokens, self.config.hidden_size):
            raise IndexerInputError(f"x must be [{batch.num_tokens}, {self.config.hidden_size}] (the batch's tokens), "
                                    f"got {list(x.shape)}")
        if not isinstance(cache, IndexKCache):
            raise IndexerInputError(f"cache must be an IndexKCache, got {type(cache).__name__}")
        self._check_positions(batch)
        key_store = (batch.slot_mapping if self.compressor is None
                     else self.compression_step(batch, compressor_state))
        plan = self.step_plan(batch.num_tokens, False, cache_layout=cache.layout, dtype=x.dtype)
        self._store(plan, x, batch.positions, key_store, cache)

    def _all_visible(self, counts: torch.Tensor) -> torch.Tensor:
        """Rows that see <= topk keys need no logits: the answer is every visible key, then -1."""
        k = self.config.topk
        idx = torch.arange(k, device=counts.device, dtype=torch.int32)
        return torch.where(idx[None, :] < counts[:, None], idx[None, :], torch.full_like(idx, -1)[None, :])

    def _score_decode(self, plan: StepPlan, q_fp8, weights, batch: DecodeBatch, cache: IndexKCache,
                      context: StepContext) -> torch.Tensor:
        k = self.config.topk
        if batch.max_context_len <= k:
            return self._all_visible(batch.context_lens.reshape(-1))
        q = q_fp8.view(batch.batch_size, batch.next_n, self.config.n_heads, self.config.head_dim)
        return plan.run("score", "lightning_indexer", q, cache.data, weights, batch.context_lens, batch.block_table, batch.max_context_len,
                        k, False, context=context)

    def _score_planned(self, plan: StepPlan, batch: PrefillBatch, cache: IndexKCache, q_of, chunks=None,
                       context: StepContext | None = None) -> torch.Tensor:
        """Prefill scoring over the batch's planned chunks; ``q_of(start, stop)`` gives the chunk's (q_fp8, weights),
        already computed (one-pass prefill) or computed per chunk (bounded and context-parallel prefill). Each
        chunk runs `ragged_mqa_topk` over the gathered keys (a fused kernel where one serves, else the two ops)."""
        k = self.config.topk
        context = context if context is not None else batch.context
        if batch.max_keys_per_row <= k:
            return _into(context, self._all_visible(batch.ke - batch.ks))
        gather = cache.gather_packed if plan.prefill_keys == "fp4" else cache.gather
        keys, key_scales = gather(batch.gather_slots)
        out = context.topk_out
        if out is None:
            out = torch.empty(batch.num_tokens, k, dtype=torch.int32, device=batch.ks.device)
        for start, stop, lo, hi in chunks or batch.plan_chunks(self.logits_budget_bytes, *plan.scoring_bytes):
            q_fp8, weights = q_of(start, stop)
            ks, ke = batch.ks[start:stop] - lo, batch.ke[start:stop] - lo
            out[start:stop] = plan.run("score", "ragged_mqa_topk", q_fp8, keys[lo:hi], key_scales[lo:hi], weights, ks, ke, k,
                                       context=context)
        return out

    # --- CUDA-graph decode (dsa_indexer.graphs) ------------------------------------------------------------
    def capture_decode(self, cache: IndexKCache, batch_size: int, max_context_len: int, next_n: int = 1,
                       warmup: int = 2, **kwargs):
        """Capture this layer's decode step into a CUDA graph: see `dsa_indexer.graphs.DecodeGraph.capture`."""
        from .graphs import DecodeGraph

        return DecodeGraph.capture(self, cache, batch_size, max_context_len, next_n=next_n, warmup=warmup, **kwargs)

    def to_physical_slots(self, indices: torch.Tensor, batch: DecodeBatch | PrefillBatch) -> torch.Tensor:
        """Request-local positions -> cache slots ``block_table[req, pos // 64] * 64 + pos % 64``; -1 stays -1."""
        if not isinstance(batch, (DecodeBatch, PrefillBatch)):
            raise IndexerInputError(f"batch must be a DecodeBatch or PrefillBatch, got {type(batch).__name__}")
        check_tensor("indices", indices, dtype=(torch.int32, torch.int64), ndim=2, device=batch.block_table.device)
        if indices.shape[0] != batch.num_tokens:
            raise IndexerInputError(f"indices must have one row per token of the batch ({batch.num_tokens}), got "
                                    f"{list(indices.shape)}")
        if check_values(indices) and indices.numel():
            limit = batch.block_table.shape[1] * 64
            if int(indices.max()) >= limit or int(indices.min()) < -1:
                raise IndexerInputError(f"indices must lie in [-1, {limit}) (the block table's positions), got range "
                                        f"[{int(indices.min())}, {int(indices.max())}]")
        return indices_to_slots(indices, batch.block_table, batch.row_request)

    def extra_repr(self) -> str:
        return (f"{self.config.name}, wq_b={'block-fp8' if self.wq_b_is_block_fp8 else 'bf16'}"
                + (f", wk={'block-fp8' if self.wk_is_block_fp8 else 'bf16'}" if self.wk is not None else "")
                + f", weights_proj={self.config.weights_proj_dtype}, scale_fmt={self.config.scale_fmt}"
                + f", key_quant={self.config.key_quant}")

