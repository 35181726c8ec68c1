"""DeepGEMM adapters (the kernels' side): each takes exactly the matching reference kernel's signature and returns
what the reference returns (`deepgemm.py` states the output contracts), plus the per-step scratch they share."""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, Callable

import torch

from ...contract.cache import PAGE_SIZE
from ...contract.step import StepContext, step_scratch
from ...contract.validate import IndexerInputError, ranges_checked
from ..triton.pdl import pdl_options
from .deepgemm_api import (GEMM_NAMES, METADATA, PAGED_LEGACY, PAGED_NEW, RAGGED_LEGACY, RAGGED_NEW,
                           SM90_RECIPE, SM100_RECIPE, DeepGemmApi, param_names)


# ----------------------------------------------------------------------------------------------------------------
# Masks
def mask_tail_(logits: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """In place: ``logits[r, c] = -inf`` for ``c >= lens[r]`` (``logits`` fp32 [R, W]): the shared column mask."""
    from ..triton.masks import mask_columns_

    return mask_columns_(logits, lens, use_triton=logits.is_cuda)


def causal_lens_hold(context_lens: torch.Tensor) -> bool:
    """``context_lens[b, j] == max(0, context_lens[b, -1] - (next_n - 1 - j))`` for every row: the semantics the
    1-D legacy API computes from ``context_lens[:, -1]`` (what `DecodeBatch` builds; padding rows are all 0)."""
    n = context_lens.shape[1]
    last = context_lens[:, -1:].long()
    expected = (last - (n - 1 - torch.arange(n, device=context_lens.device))[None, :]).clamp_min(0)
    return bool(torch.equal(context_lens.long(), expected))


# ----------------------------------------------------------------------------------------------------------------
# Per-step scratch
# A decode step's schedule (and row map) is computed once per step and read by every layer: the step's
# `contract.step.StepContext` holds it (`step_scratch`; the plan passes ``context=`` to these adapters, registered
# with ``info={"step_context": True}``). A call without a context (a public op called alone) computes it for itself.
# Under CUDA-graph capture the first layer's kernel is captured and the later layers read its output, so a replay
# recomputes it once per step too.


def weight_memo(owner: torch.Tensor, key: tuple, compute: Callable[[], Any]) -> Any:
    """``compute()`` once per (weight tensor ``owner``, ``key``) while ``owner`` is not modified in place: a layout of
    a weight (its packed scales), made at its first GEMM and kept with the weight (a library parameter, not a
    caller's per-step tensor). A weight made under ``torch.inference_mode`` keeps no version counter: computed on
    every call then."""
    try:
        version = owner._version
    except RuntimeError:  # an inference tensor
        return compute()
    memo = owner.__dict__.get("_dsa_indexer_weight_memo")
    if memo is None or memo[0] != version:
        memo = (version, {})
        owner.__dict__["_dsa_indexer_weight_memo"] = memo
    cache = memo[1]
    if key not in cache:
        cache[key] = compute()
    return cache[key]


# ----------------------------------------------------------------------------------------------------------------
# sm100 layouts: packed ue8m0 scales and FP4 e2m1 (DeepGEMM's csrc/utils/layout.hpp, jit_kernels/impls/smxx_layout.hpp
# and csrc/apis/attention.hpp, read at commit 54e2261)
def require_powers_of_two(name: str, scales: torch.Tensor) -> None:
    """``scales`` must be positive normal powers of two, what a ue8m0 byte holds exactly (DeepGEMM on sm100 keeps
    only the exponent of an fp32 scale: anything else would be rounded down silently). Checked where that costs no
    host sync (`ranges_checked`)."""
    if scales.numel() == 0 or not ranges_checked(scales):
        return
    bits = scales.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    ok = ((bits & ~0x7F800000) == 0) & (exponent > 0) & (exponent < 255)
    if not bool(ok.all()):
        bad = scales.reshape(-1)[~ok.reshape(-1)][:3].tolist()
        raise IndexerInputError(
            f"{name} must be powers of two for DeepGEMM on sm100 (it reads packed ue8m0 scales), got e.g. {bad}: "
            "quantize with scale_fmt='ue8m0' (power-of-two scales), or use the Triton GEMM for fp32 scales")


def ue8m0_bytes(scales: torch.Tensor) -> torch.Tensor:
    """The ue8m0 byte of each power-of-two fp32 scale: its biased exponent (uint8, same shape)."""
    return ((scales.float().contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def tma_aligned(rows: int, element_bytes: int) -> int:
    """``rows`` rounded up to 16 bytes of elements: the MN stride DeepGEMM's TMA loads of scales need."""
    per = 16 // element_bytes
    return -(-rows // per) * per


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """fp32 power-of-two scales [MN, G] as DeepGEMM's sm100 GEMMs read them: int32 [MN, ceil(G / 4)] whose word w
    holds the ue8m0 bytes of groups 4w .. 4w + 3 (little-endian: group 4w in the low byte; missing groups 0),
    MN-major with the MN stride padded to 16 bytes (strides ``(1, tma_aligned(MN, 4))``)."""
    mn, groups = scales.shape
    words = -(-groups // 4)
    padded = torch.zeros(mn, words * 4, dtype=torch.uint8, device=scales.device)
    padded[:, :groups] = ue8m0_bytes(scales)
    out = torch.empty_strided((mn, words), (1, tma_aligned(mn, 4)), dtype=torch.int32, device=scales.device)
    out.copy_(padded.view(torch.int32))
    return out


# ----------------------------------------------------------------------------------------------------------------
# Adapters
def device_sm_count(module: ModuleType, device: torch.device) -> int:
    get = getattr(module, "get_num_sms", None)
    if callable(get):
        return int(get())  # DeepGEMM checks the metadata against its own (settable) SM count
    return torch.cuda.get_device_properties(device).multi_processor_count


def make_paged_mqa_logits(module: ModuleType, api: DeepGemmApi) -> Callable[..., torch.Tensor]:
    if api.paged_fn is None:
        raise RuntimeError(f"{api.describe()} has no paged MQA logits API (looked for {PAGED_NEW} / {PAGED_LEGACY} "
                           f"with {METADATA}); the deep_gemm probe should have rejected it")
    kernel = getattr(module, api.paged_fn)
    metadata = getattr(module, METADATA)
    tuple_q = api.paged_tuple_q
    two_d = api.context_lens_2d is not False if tuple_q else bool(api.context_lens_2d)
    extra: dict[str, Any] = {}
    if "clean_logits" in api.paged_params:
        extra["clean_logits"] = False  # 2.6.1 asserts on True with 2-D lens; the tail is masked below
    if "logits_dtype" in api.paged_params:
        extra["logits_dtype"] = torch.float32

    def schedule(context_lens: torch.Tensor, device: torch.device, context: StepContext | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the lengths DeepGEMM is given, its schedule metadata), computed once per decode step: kept in the
        step's context, so every layer of a step (and every layer captured into one graph) shares one metadata
        kernel."""
        num_sms = device_sm_count(module, device)
        key = ("deepgemm_paged_schedule", num_sms, two_d)
        if context is not None:
            # Every layer after the step's first reads the schedule straight from the step's scratch: a dict read,
            # no call into the contract (the warm step's path stays within this file).
            found = context.scratch.get(key)
            if found is not None:
                return found

        def compute() -> tuple[torch.Tensor, torch.Tensor]:
            lens2d = context_lens.contiguous()
            lens = lens2d if two_d else lens2d[:, -1].contiguous()
            # Rows with no visible key (CUDA-graph padding, warm-up) would make DeepGEMM fault: give it one key
            # to read (page block_table[b, 0]); consumers mask or skip the row from the true lengths.
            lens = lens.clamp_min(1)
            return lens, metadata(lens, PAGE_SIZE, num_sms)

        return step_scratch(context, key, compute)

    def check_lengths(context_lens: torch.Tensor) -> None:
        if not ranges_checked(context_lens):
            return  # values are only checked where that costs no host sync
        lens2d = context_lens.contiguous()
        if two_d:
            # DeepGEMM schedules each request by its LAST row's length: no row may see more keys than that.
            if not bool((lens2d[:, -1:] >= lens2d).all()):
                raise IndexerInputError(f"{api.describe()} computes keys up to context_lens[b, -1] for every row of "
                                        "request b: context_lens[b, j] must be <= context_lens[b, -1]")
        elif not causal_lens_hold(context_lens):
            # The 1-D API derives row j's length as ctx - next_n + j + 1: right for DecodeBatch's lengths.
            raise IndexerInputError(
                f"{api.describe()} takes 1-D context lengths with causal next_n semantics; context_lens must "
                "satisfy context_lens[b, j] == context_lens[b, -1] - (next_n - 1 - j) (what DecodeBatch builds)")

    def unmasked(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor,
                 block_table: torch.Tensor, max_context_len: int, context: StepContext | None = None
                 ) -> torch.Tensor:
        """DeepGEMM's logits as it returns them: a view with padded rows, garbage past each row's length
        (for consumers that read only [0, context_lens[row]), such as the top-k)."""
        check_lengths(context_lens)
        lens, meta = schedule(context_lens, q.device, context)
        q_arg = (q.contiguous(), None) if tuple_q else q.contiguous()
        return kernel(q_arg, kv_cache, weights.contiguous(), lens, block_table, meta, max_context_len, **extra)

    def paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor,
                         block_table: torch.Tensor, max_context_len: int, *, context: StepContext | None = None
                         ) -> torch.Tensor:
        logits = unmasked(q, kv_cache, weights, context_lens, block_table, max_context_len, context)
        mask_tail_(logits, context_lens.reshape(-1))
        return logits if logits.is_contiguous() else logits.contiguous()

    paged_mqa_logits.unmasked = unmasked  # type: ignore[attr-defined]
    paged_mqa_logits.api = api  # type: ignore[attr-defined]
    return paged_mqa_logits


def make_ragged_mqa_logits(module: ModuleType, api: DeepGemmApi) -> Callable[..., torch.Tensor]:
    if api.ragged_fn is None:
        raise RuntimeError(f"{api.describe()} has no ragged MQA logits API (looked for {RAGGED_NEW} / {RAGGED_LEGACY}); "
                           "the deep_gemm probe should have rejected it")
    kernel = getattr(module, api.ragged_fn)
    tuple_q = api.ragged_tuple_q
    cleans = "clean_logits" in api.ragged_params
    extra: dict[str, Any] = {"clean_logits": True} if cleans else {}
    if "logits_dtype" in api.ragged_params:
        extra["logits_dtype"] = torch.float32
    # max_seqlen_k stays at its default 0: a positive value switches DeepGEMM to logits indexed from ks (a
    # different contract).

    def padded(q: torch.Tensor, k: torch.Tensor, k_scales: torch.Tensor, weights: torch.Tensor,
               ks: torch.Tensor, ke: torch.Tensor) -> torch.Tensor:
        """The logits as DeepGEMM returns them: a view whose rows may be padded (row stride >= N, unit column
        stride). A consumer that takes a row stride (the CUDA top-k) reads it as it is; at a 128K-token prefill
        the contiguous copy costs a second pass over the chunk's logits and a second chunk-sized buffer."""
        q_arg = (q.contiguous(), None) if tuple_q else q.contiguous()
        logits = kernel(q_arg, (k.contiguous(), k_scales.contiguous()), weights.contiguous(), ks.contiguous(),
                        ke.contiguous(), **extra)
        if not cleans:  # an API without the option: mask outside [ks, ke) here
            cols = torch.arange(logits.shape[1], device=logits.device)
            outside = (cols[None, :] < ks.long()[:, None]) | (cols[None, :] >= ke.long()[:, None])
            logits = logits.masked_fill(outside, float("-inf"))
        return logits

    def ragged_mqa_logits(q: torch.Tensor, k: torch.Tensor, k_scales: torch.Tensor, weights: torch.Tensor,
                          ks: torch.Tensor, ke: torch.Tensor) -> torch.Tensor:
        return padded(q, k, k_scales, weights, ks, ke).contiguous()  # the op's contract: a contiguous [S, N]

    ragged_mqa_logits.padded = padded  # type: ignore[attr-defined]
    ragged_mqa_logits.api = api  # type: ignore[attr-defined]
    return ragged_mqa_logits


def device_arch_major(device: torch.device) -> int:
    """The compute capability major of ``device`` (9: Hopper, 10: Blackwell datacenter); 0 off CUDA (the CPU
    tensors of tests with fake modules take the sm90 argument forms)."""
    return torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else 0


def make_gemm_fp8_blockscale(module: ModuleType, api: DeepGemmApi, arch_major: int | None = None
                             ) -> Callable[..., torch.Tensor]:
    """The block-fp8 GEMM. sm90: plain fp32 scales, recipe (1, 128, 128). sm100 (``arch_major`` 10; None: the
    tensors' device says): DeepGEMM reads packed ue8m0 scales there and would turn fp32 ones into ue8m0 by keeping
    only their exponents (rounding a non-power-of-two scale down); the adapter packs them itself (`pack_ue8m0`; b's
    128 x 128 block scales broadcast to its rows, packed once per weight) and passes recipe (1, 1, 128). It takes
    only ``scale_fmt="ue8m0"`` there (the caller's host fact that both scale tensors are powers of two: the ue8m0
    recipe, V4's e8m0 checkpoint scales; resolution sends "fp32" to the next implementation), and checks the values
    where that costs no host sync."""
    if api.gemm_fn is None:
        raise RuntimeError(f"{api.describe()} has no block-fp8 GEMM (looked for {', '.join(GEMM_NAMES)}); "
                           "the deep_gemm probe should have rejected it")
    kernel = getattr(module, api.gemm_fn)
    has_recipe = "recipe" in api.gemm_params
    extra: dict[str, Any] = {"recipe": SM90_RECIPE} if has_recipe else {}
    # The 1.x API wants a's scales column-major and TMA-aligned; later ones convert them inside the call.
    align = getattr(module, "get_col_major_tma_aligned_tensor", None) if api.gemm_fn == GEMM_NAMES[2] else None

    def sm100_scales(a_scales: torch.Tensor, b_scales: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if api.gemm_fn == GEMM_NAMES[2]:
            raise IndexerInputError(f"{api.describe()}: {api.gemm_fn} is the sm90-only 1.x API; sm100 needs "
                                    f"{GEMM_NAMES[0]} (DeepGEMM 2.x)")
        require_powers_of_two("a_scales", a_scales)
        require_powers_of_two("b_scales", b_scales)

        def packed_weight_scales() -> torch.Tensor:
            return pack_ue8m0(b_scales.repeat_interleave(128, dim=0)[:n])

        return pack_ue8m0(a_scales), weight_memo(b_scales, ("deepgemm_sm100_sfb", n), packed_weight_scales)

    def gemm_fp8_blockscale(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                            out_dtype: torch.dtype = torch.bfloat16, scale_fmt: str = "fp32") -> torch.Tensor:
        if out_dtype != torch.bfloat16:
            raise IndexerInputError(f"the DeepGEMM adapter writes bf16 output, got out_dtype={out_dtype} "
                                    "(its supports() check should have rejected this problem)")
        d = torch.empty(a.shape[0], b.shape[0], dtype=torch.bfloat16, device=a.device)
        major = arch_major if arch_major is not None else device_arch_major(a.device)
        if major == 10:
            if scale_fmt != "ue8m0":
                raise IndexerInputError(
                    f"scale_fmt={scale_fmt!r}: DeepGEMM on sm100 reads packed ue8m0 scales and would round fp32 ones "
                    "down to a power of two; pass scale_fmt='ue8m0' for power-of-two scales, or use the Triton GEMM "
                    "(resolution picks it for scale_fmt='fp32')")
            sfa, sfb = sm100_scales(a_scales, b_scales, b.shape[0])
            recipe = {"recipe": SM100_RECIPE} if has_recipe else {}
            kernel((a.contiguous(), sfa), (b.contiguous(), sfb), d, **recipe)
            return d
        sfa = align(a_scales) if callable(align) else a_scales.contiguous()
        kernel((a.contiguous(), sfa), (b.contiguous(), b_scales.contiguous()), d, **extra)
        return d

    gemm_fp8_blockscale.api = api  # type: ignore[attr-defined]
    return gemm_fp8_blockscale


def launching_with_pdl(adapter: Callable[..., Any], module: ModuleType) -> Callable[..., Any]:
    """``adapter`` with DeepGEMM's own programmatic dependent launch on around each call, where the step's kernels
    launch with PDL (``DSA_INDEXER_PDL=1``, `backends/triton/pdl.py`; decided by the first argument's device).
    DeepGEMM's kernels wait for their predecessor themselves (``cudaGridDependencySynchronize``), and its runtime
    launches them with PDL while ``set_pdl(True)``. That setting is process-wide, so each call restores it: an
    engine's own DeepGEMM calls keep theirs. A DeepGEMM without ``set_pdl`` / ``get_pdl`` gets the adapter as is."""
    set_pdl, get_pdl = getattr(module, "set_pdl", None), getattr(module, "get_pdl", None)
    if not (callable(set_pdl) and callable(get_pdl)):
        return adapter

    def with_pdl(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)  # keeps the adapter's attributes (``api``)
        def call(*args, **kwargs):
            if not pdl_options(args[0].device):
                return fn(*args, **kwargs)
            previous = get_pdl()
            set_pdl(True)
            try:
                return fn(*args, **kwargs)
            finally:
                set_pdl(previous)

        return call

    wrapped = with_pdl(adapter)
    for entry in ("unmasked", "padded"):  # the adapters' other entry points (`lightning.py`, the prefill scorer)
        inner = getattr(adapter, entry, None)
        if callable(inner):
            setattr(wrapped, entry, with_pdl(inner))
    return wrapped


MAKERS = {"paged_mqa_logits": make_paged_mqa_logits, "ragged_mqa_logits": make_ragged_mqa_logits,
          "gemm_fp8_blockscale": make_gemm_fp8_blockscale}


