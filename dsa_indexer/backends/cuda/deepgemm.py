"""DeepGEMM adapters: NVIDIA's vendor kernels for the indexer's logits and its block-fp8 GEMM (sm90, sm100).

Every adapter takes exactly the signature of the matching reference kernel (`backends/reference/kernels.py`) and
returns what the reference returns. This file never imports ``deep_gemm`` itself: the probe and the factories
(`backends/cuda/__init__.py`) import it and pass the module in, so tests can hand in small fake modules.

DeepGEMM's Python API drifted between releases; the adapters follow the installed one by feature, never by
version string (`detect_api`):

- "fp8_fp4" generation (2.6.1 seen): ``fp8_fp4_paged_mqa_logits((q, None), kv_cache, weights, context_lens [B, N],
  block_table, schedule_meta, max_context_len, clean_logits=False, logits_dtype=..., indices=None)``,
  ``fp8_fp4_mqa_logits((q, None), (k, k_scale), weights, ks, ke, clean_logits, max_seqlen_k, logits_dtype)``,
  ``fp8_fp4_gemm_nt((a, sfa), (b, sfb), d, c=None, recipe=None, ...)`` (alias ``fp8_gemm_nt``). Context lengths
  must be 2-D; ``clean_logits=True`` asserts for paged logits, so the adapter masks the tail itself.
- "legacy" generation: ``fp8_paged_mqa_logits(q, ...)`` and ``fp8_mqa_logits(q, (k, k_scale), ...)`` with a bare q
  (2.6.1 still has them as wrappers). The oldest take 1-D context lengths ``[B]`` with causal semantics inside
  next_n (row j of request b sees keys ``< ctx[b] - next_n + j + 1``); later ones take 2-D. Which one is installed
  is decided by the self-test, which tries 1-D first and then 2-D (`self_test`).
- "gemm only" (1.x): ``gemm_fp8_fp8_bf16_nt((a, sfa), (b, sfb), out)``, no attention kernels.

Output contracts (the reference's):
- paged: fresh [B*N, max_context_len] fp32, -inf where ``col >= context_lens[row]``. DeepGEMM schedules request b
  by ``context_lens[b, -1]``, so every row's length must be <= its request's last one (DecodeBatch's always are;
  checked on host tensors). DeepGEMM returns a view whose
  rows are padded to a multiple of 256 columns and leaves garbage past each row's length; the adapter writes
  -inf over that tail in place (one small Triton kernel on CUDA) and returns the view itself when it is already
  contiguous (max_context_len a multiple of 256, e.g. 8192), else a contiguous copy.
- ragged: fresh [S, N] fp32, -inf outside ``[ks, ke)`` (DeepGEMM's ``clean_logits=True`` writes those); its result
  is a view with a padded row stride, so the adapter returns a contiguous copy: custom-op fakes and callers may
  assume contiguity. (Returning the view would save one copy of the logits; every top-k here honours the row
  stride, but torch.compile's fake kernels promise contiguous outputs.)
- gemm: fresh [M, N] bf16 (DeepGEMM writes into a tensor the adapter allocates).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import torch

from ...contract.cache import PAGE_SIZE
from ...contract.validate import IndexerInputError, ranges_checked
from ...dispatch.vendor import VendorLibrary

log = logging.getLogger("dsa_indexer")

try:  # triton is a dependency of the package; the masks fall back to torch ops without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None

# Names per API generation, newest first.
PAGED_NEW, PAGED_LEGACY = "fp8_fp4_paged_mqa_logits", "fp8_paged_mqa_logits"
RAGGED_NEW, RAGGED_LEGACY = "fp8_fp4_mqa_logits", "fp8_mqa_logits"
GEMM_NAMES = ("fp8_fp4_gemm_nt", "fp8_gemm_nt", "gemm_fp8_fp8_bf16_nt")
METADATA = "get_paged_mqa_logits_metadata"
SM90_RECIPE = (1, 128, 128)  # per-token groups of 128 for a, 128x128 blocks for b
INSTALL_HINT = "build upstream DeepGEMM (bash .deps/build_deepgemm.sh) or pip install sgl-deep-gemm"


# ----------------------------------------------------------------------------------------------------------------
# API detection
def param_names(fn: Callable) -> tuple[str, ...] | None:
    """The parameter names of ``fn``: from `inspect.signature`, else from a pybind11 docstring
    (``name(q: tuple[...], kv_cache: torch.Tensor, clean_logits: bool = False) -> torch.Tensor``); None if unknown."""
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        pass
    doc = getattr(fn, "__doc__", None) or ""
    name = getattr(fn, "__name__", "")
    start = doc.find(f"{name}(") if name else -1
    if start < 0:
        return None
    start += len(name) + 1
    names, depth, part = [], 0, []
    for ch in doc[start:]:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                break
            depth -= 1
        if ch == "," and depth == 0:
            names.append("".join(part))
            part = []
        else:
            part.append(ch)
    names.append("".join(part))
    out = tuple(p.split(":")[0].split("=")[0].strip() for p in names)
    return tuple(n for n in out if n and n not in ("*", "/"))


@dataclass(frozen=True)
class DeepGemmApi:
    """What the installed deep_gemm offers, found by feature. ``None`` names mean "absent"."""

    version: str
    paged_fn: str | None = None
    paged_params: tuple[str, ...] = ()
    context_lens_2d: bool | None = None  # None: not known before the self-test (legacy paged API)
    ragged_fn: str | None = None
    ragged_params: tuple[str, ...] = ()
    gemm_fn: str | None = None
    gemm_params: tuple[str, ...] = ()
    self_tested: bool = False

    @property
    def paged_tuple_q(self) -> bool:
        return self.paged_fn == PAGED_NEW

    @property
    def ragged_tuple_q(self) -> bool:
        return self.ragged_fn == RAGGED_NEW

    @property
    def generation(self) -> str:
        if self.paged_fn == PAGED_NEW or self.ragged_fn == RAGGED_NEW:
            return "fp8_fp4"
        if self.paged_fn or self.ragged_fn:
            return "legacy"
        return "gemm only" if self.gemm_fn else "none"

    def function_for(self, op: str) -> str | None:
        return {"paged_mqa_logits": self.paged_fn, "ragged_mqa_logits": self.ragged_fn,
                "gemm_fp8_blockscale": self.gemm_fn}.get(op)

    def describe(self) -> str:
        lens = {None: "context lens 1-D or 2-D (untested)", True: "2-D context lens", False: "1-D context lens"}
        return (f"deep_gemm {self.version} ({self.generation} API: paged={self.paged_fn} "
                f"[{lens[self.context_lens_2d] if self.paged_fn else '-'}], ragged={self.ragged_fn}, "
                f"gemm={self.gemm_fn})")


def _version(module: ModuleType) -> str:
    version = getattr(module, "__version__", None)
    if version:
        return str(version)
    try:
        from importlib import metadata

        for dist in ("deep_gemm", "deep-gemm", "sgl-deep-gemm"):
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
    except Exception:
        pass
    return "(unknown version)"


def detect_api(module: ModuleType) -> DeepGemmApi:
    """Which generation of the API ``module`` exposes: names first, then parameter lists.

    Paged logits need the metadata function too. Context lengths are 2-D for the fp8_fp4 names; for the legacy
    name it stays unknown (None) until `self_test` tries a call.
    """

    def fn(name: str) -> Callable | None:
        value = getattr(module, name, None)
        return value if callable(value) else None

    api = DeepGemmApi(version=_version(module))
    paged = next((n for n in (PAGED_NEW, PAGED_LEGACY) if fn(n)), None)
    if paged is not None and fn(METADATA):
        api = dataclasses.replace(api, paged_fn=paged, paged_params=param_names(fn(paged)) or (),
                                  context_lens_2d=True if paged == PAGED_NEW else None)
    ragged = next((n for n in (RAGGED_NEW, RAGGED_LEGACY) if fn(n)), None)
    if ragged is not None:
        api = dataclasses.replace(api, ragged_fn=ragged, ragged_params=param_names(fn(ragged)) or ())
    gemm = next((n for n in GEMM_NAMES if fn(n)), None)
    if gemm is not None:
        api = dataclasses.replace(api, gemm_fn=gemm, gemm_params=param_names(fn(gemm)) or ())
    return api


# ----------------------------------------------------------------------------------------------------------------
# Masks
def mask_tail_(logits: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """In place: ``logits[r, c] = -inf`` for ``c >= lens[r]`` (``logits`` fp32 [R, W]): the shared column mask."""
    from ..triton.masks import mask_columns_

    return mask_columns_(logits, lens, use_triton=logits.is_cuda and triton is not None)


def causal_lens_hold(context_lens: torch.Tensor) -> bool:
    """``context_lens[b, j] == max(0, context_lens[b, -1] - (next_n - 1 - j))`` for every row: the semantics the
    1-D legacy API computes from ``context_lens[:, -1]`` (what `DecodeBatch` builds; padding rows are all 0)."""
    n = context_lens.shape[1]
    last = context_lens[:, -1:].long()
    expected = (last - (n - 1 - torch.arange(n, device=context_lens.device))[None, :]).clamp_min(0)
    return bool(torch.equal(context_lens.long(), expected))


# ----------------------------------------------------------------------------------------------------------------
# Per-step scratch
def step_memo(owner: torch.Tensor, key: tuple, compute: Callable[[], Any]) -> Any:
    """``compute()`` once per (``owner`` tensor, ``key``) while ``owner`` is not modified in place.

    The decode batch's ``context_lens`` is built once per step and read by every layer, so values derived from it
    alone (DeepGEMM's schedule metadata) are computed by the first layer and reused by the others. The memo lives
    on the tensor itself: it dies with the step's batch, and an in-place write (which bumps ``_version``)
    invalidates it. Under CUDA-graph capture the first layer's kernel is captured and the later layers read its
    output, so a replay recomputes it once per step too. Tensors made under ``torch.inference_mode`` keep no
    version counter, so in-place writes to them cannot be seen: for those the value is computed on every call."""
    try:
        version = owner._version
    except RuntimeError:  # an inference tensor
        return compute()
    memo = owner.__dict__.get("_dsa_indexer_step_memo")
    if memo is None or memo[0] != version:
        memo = (version, {})
        owner.__dict__["_dsa_indexer_step_memo"] = memo
    cache = memo[1]
    if key not in cache:
        cache[key] = compute()
    return cache[key]


# ----------------------------------------------------------------------------------------------------------------
# Adapters
def _num_sms(module: ModuleType, device: torch.device) -> int:
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

    def schedule(context_lens: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(the lengths DeepGEMM is given, its schedule metadata), computed once per decode step: cached on the
        step's ``context_lens`` tensor, so every layer of a step (and every layer captured into one graph)
        shares one metadata kernel."""
        num_sms = _num_sms(module, device)

        def compute() -> tuple[torch.Tensor, torch.Tensor]:
            lens2d = context_lens.contiguous()
            lens = lens2d if two_d else lens2d[:, -1].contiguous()
            # Rows with no visible key (CUDA-graph padding, warm-up) would make DeepGEMM fault: give it one key
            # to read (page block_table[b, 0]); consumers mask or skip the row from the true lengths.
            lens = lens.clamp_min(1)
            return lens, metadata(lens, PAGE_SIZE, num_sms)

        return step_memo(context_lens, ("deepgemm_paged_schedule", num_sms, two_d), compute)

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
                 block_table: torch.Tensor, max_context_len: int) -> torch.Tensor:
        """DeepGEMM's logits as it returns them: a view with padded rows, garbage past each row's length
        (for consumers that read only [0, context_lens[row]), such as the top-k)."""
        check_lengths(context_lens)
        lens, meta = schedule(context_lens, q.device)
        q_arg = (q.contiguous(), None) if tuple_q else q.contiguous()
        return kernel(q_arg, kv_cache, weights.contiguous(), lens, block_table, meta, max_context_len, **extra)

    def paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor,
                         block_table: torch.Tensor, max_context_len: int) -> torch.Tensor:
        logits = unmasked(q, kv_cache, weights, context_lens, block_table, max_context_len)
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

    def ragged_mqa_logits(q: torch.Tensor, k: torch.Tensor, k_scales: torch.Tensor, weights: torch.Tensor,
                          ks: torch.Tensor, ke: torch.Tensor) -> torch.Tensor:
        q_arg = (q.contiguous(), None) if tuple_q else q.contiguous()
        logits = kernel(q_arg, (k.contiguous(), k_scales.contiguous()), weights.contiguous(), ks.contiguous(),
                        ke.contiguous(), **extra)
        if not cleans:  # an API without the option: mask outside [ks, ke) here
            cols = torch.arange(logits.shape[1], device=logits.device)
            outside = (cols[None, :] < ks.long()[:, None]) | (cols[None, :] >= ke.long()[:, None])
            logits = logits.masked_fill(outside, float("-inf"))
        return logits.contiguous()

    ragged_mqa_logits.api = api  # type: ignore[attr-defined]
    return ragged_mqa_logits


def make_gemm_fp8_blockscale(module: ModuleType, api: DeepGemmApi) -> Callable[..., torch.Tensor]:
    if api.gemm_fn is None:
        raise RuntimeError(f"{api.describe()} has no block-fp8 GEMM (looked for {', '.join(GEMM_NAMES)}); "
                           "the deep_gemm probe should have rejected it")
    kernel = getattr(module, api.gemm_fn)
    extra: dict[str, Any] = {"recipe": SM90_RECIPE} if "recipe" in api.gemm_params else {}
    # The 1.x API wants a's scales column-major and TMA-aligned; later ones convert them inside the call.
    align = getattr(module, "get_col_major_tma_aligned_tensor", None) if api.gemm_fn == GEMM_NAMES[2] else None

    def gemm_fp8_blockscale(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                            out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        if out_dtype != torch.bfloat16:
            raise IndexerInputError(f"the DeepGEMM adapter writes bf16 output, got out_dtype={out_dtype} "
                                    "(its supports() check should have rejected this problem)")
        d = torch.empty(a.shape[0], b.shape[0], dtype=torch.bfloat16, device=a.device)
        sfa = align(a_scales) if callable(align) else a_scales.contiguous()
        kernel((a.contiguous(), sfa), (b.contiguous(), b_scales.contiguous()), d, **extra)
        return d

    gemm_fp8_blockscale.api = api  # type: ignore[attr-defined]
    return gemm_fp8_blockscale


MAKERS = {"paged_mqa_logits": make_paged_mqa_logits, "ragged_mqa_logits": make_ragged_mqa_logits,
          "gemm_fp8_blockscale": make_gemm_fp8_blockscale}


# ----------------------------------------------------------------------------------------------------------------
# Self-test
def _paged_case(device: torch.device, next_n: int = 2, heads: int = 64, seed: int = 1234):
    """A tiny decode problem: 2 requests of different lengths, all block-table entries valid pages (so an API
    that misreads the lengths reads wrong but in-bounds pages), DecodeBatch lengths."""
    from ..reference import kernels as ref
    from ...contract.cache import store_rows

    gen = torch.Generator().manual_seed(seed)
    batch, pages_per_req, dim = 2, 4, 128
    num_pages = batch * pages_per_req
    kv_cache = torch.zeros(num_pages, PAGE_SIZE, 1, 132, dtype=torch.uint8)
    k_fp8, k_scale = ref.quant_fp8_groups(torch.randn(num_pages * PAGE_SIZE, dim, generator=gen), dim)
    store_rows(kv_cache, torch.arange(num_pages * PAGE_SIZE), k_fp8, k_scale.squeeze(-1))
    block_table = torch.randperm(num_pages, generator=gen).to(torch.int32).view(batch, pages_per_req)
    seq = torch.tensor([150, 77])
    context_lens = (seq[:, None] - next_n + torch.arange(next_n)[None, :] + 1).to(torch.int32)
    q_fp8, _ = ref.quant_fp8_groups(torch.randn(batch, next_n, heads, dim, generator=gen), dim)
    weights = torch.randn(batch * next_n, heads, generator=gen)
    to = lambda t: t.to(device)  # noqa: E731
    return (to(q_fp8), to(kv_cache), to(weights), to(context_lens), to(block_table), pages_per_req * PAGE_SIZE)


def check_paged_adapter(adapter: Callable[..., torch.Tensor], device: torch.device) -> None:
    """Run ``adapter`` on `_paged_case` and compare with the reference; raise with the discrepancy."""
    from ..reference import kernels as ref

    case = _paged_case(device)
    got = adapter(*case)
    want = ref.paged_mqa_logits(*case)
    if tuple(got.shape) != tuple(want.shape) or got.dtype != torch.float32:
        raise RuntimeError(f"paged logits shape/dtype {list(got.shape)} {got.dtype}, expected {list(want.shape)} fp32")
    hidden = torch.isneginf(want)
    if not torch.equal(torch.isneginf(got), hidden):
        raise RuntimeError("paged logits: the -inf pattern differs from the reference (masking or lengths wrong)")
    diff = (got[~hidden] - want[~hidden]).abs().max().item() if bool((~hidden).any()) else 0.0
    scale = want[~hidden].abs().max().item() if bool((~hidden).any()) else 1.0
    if not diff <= 2e-3 * max(scale, 1e-6):  # fp8 tensor-core sums keep ~14 mantissa bits; also catches NaN
        raise RuntimeError(f"paged logits differ from the reference: max |diff| {diff:.3g} vs max |ref| {scale:.3g}")


def self_test(module: ModuleType, api: DeepGemmApi, device: torch.device | str) -> DeepGemmApi:
    """Check the paged-logits adapter once against the reference on ``device``; returns ``api`` with the
    context-length mode that worked. A legacy API is tried with 1-D lengths first (always right for DecodeBatch
    semantics where both are accepted), then 2-D. Without a paged API the GEMM is checked instead.
    Raises RuntimeError naming what failed."""
    device = torch.device(device)
    if api.paged_fn is not None:
        modes = (api.context_lens_2d,) if api.context_lens_2d is not None else (False, True)
        errors = []
        for mode in modes:
            candidate = dataclasses.replace(api, context_lens_2d=mode, self_tested=True)
            try:
                check_paged_adapter(make_paged_mqa_logits(module, candidate), device)
                return candidate
            except Exception as exc:  # noqa: BLE001 - every failure becomes part of the reason
                errors.append(f"{api.paged_fn} with {'2-D' if mode else '1-D'} context lens: "
                              f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
        raise RuntimeError("; ".join(errors))
    if api.gemm_fn is not None:
        from ..reference import kernels as ref

        gen = torch.Generator().manual_seed(7)
        a, sa = ref.quant_fp8_groups(torch.randn(64, 256, generator=gen), 128)
        b = (torch.randn(256, 256, generator=gen) * 0.5).to(torch.float8_e4m3fn)
        sb = torch.rand(2, 2, generator=gen) + 0.5
        args = [t.to(device) for t in (a, sa, b, sb)]
        got = make_gemm_fp8_blockscale(module, api)(*args).float()
        want = ref.gemm_fp8_blockscale(*args).float()
        err = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
        if not err < 1e-2:  # bf16 output: one rounding, ~2e-3 relative
            raise RuntimeError(f"{api.gemm_fn}: relative error {err:.3g} against the reference")
        return dataclasses.replace(api, self_tested=True)
    return api


# ----------------------------------------------------------------------------------------------------------------
# The environment fact "deep_gemm" (the shared vendor-library probe, dispatch/vendor.py)
def _device_check() -> str | None:
    if torch.version.hip:
        return "deep_gemm is NVIDIA-only and this torch is a ROCm build"
    if not torch.cuda.is_available():
        return "deep_gemm is installed but torch sees no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if major not in (9, 10):
        return f"deep_gemm's kernels need sm90 or sm100; this GPU is sm{major}{minor}"
    return None


def _usable(api: DeepGemmApi) -> str | None:
    if api.generation == "none":
        return (f"deep_gemm {api.version} exposes none of the APIs this backend adapts ({PAGED_NEW}, {PAGED_LEGACY}, "
                f"{RAGGED_NEW}, {RAGGED_LEGACY}, {', '.join(GEMM_NAMES)})")
    return None


# The lambdas look the functions up at call time, so tests can patch this module's detect_api / self_test.
LIBRARY = VendorLibrary(module="deep_gemm", install_hint=INSTALL_HINT, device_check=_device_check,
                        detect=lambda module: detect_api(module), usable=_usable,
                        self_test=lambda module, api, device: self_test(module, api, device),
                        describe=lambda api: f"deep_gemm {api.version}" if isinstance(api, DeepGemmApi) else
                        "deep_gemm")


def detected_api() -> DeepGemmApi | None:
    """The API the probe found and self-tested in this process (None before the probe ran or when it failed)."""
    return LIBRARY.detected_api()


def api_for(module: ModuleType) -> DeepGemmApi:
    """The API to build adapters for: the self-tested one when the probe ran on this module, else detection by
    names alone (legacy paged logits then take the 1-D lengths, right for DecodeBatch semantics)."""
    if LIBRARY.detected is not None and LIBRARY.detected[0] is module:
        return LIBRARY.detected[1]
    return detect_api(module)


def probe() -> str | None:
    """None when deep_gemm imports, exposes an API the adapters know and passes the self-test on this GPU;
    else the reason. Runs once per process (the environment caches the answer)."""
    return LIBRARY.probe()


def reset_detection() -> None:
    """Forget the probe's result (tests)."""
    LIBRARY.reset()
