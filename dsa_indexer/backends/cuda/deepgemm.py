"""DeepGEMM adapters: NVIDIA's vendor kernels for the indexer's logits and its block-fp8 GEMM (sm90, sm100).

Every adapter takes exactly the signature of the matching reference kernel (`backends/reference/kernels.py`) and
returns what the reference returns. This file never imports ``deep_gemm`` itself: the probe and the factories
(`backends/cuda/__init__.py`) import it and pass the module in, so tests can hand in small fake modules.

Split by job: `deepgemm_api.py` detects the installed API, `deepgemm_kernels.py` holds the adapters and their
per-step scratch, and this file self-tests them and is the environment fact ``deep_gemm``'s probe; it re-exports
the other two (the backend and the tests use one name).

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
- gemm: fresh [M, N] bf16 (DeepGEMM writes into a tensor the adapter allocates). On sm100 DeepGEMM reads packed
  ue8m0 scales (int32 words of four exponent bytes, MN-major, TMA-aligned; b per row) and would convert fp32 ones by
  keeping their exponents only; the adapter packs power-of-two scales itself and refuses others by name
  (`deepgemm_kernels.pack_ue8m0`). The registration still declines sm100 (its problem does not carry the scale format).

FP4 (DeepSeek-V4's indexer recipe): ``fp8_fp4_mqa_logits`` / ``fp8_fp4_paged_mqa_logits`` take packed e2m1 with
packed ue8m0 block scales when q's scale tensor is given, on sm100 only (DeepGEMM 54e2261, csrc/apis/attention.hpp).
`deepgemm_fp4.make_fp4_paged_mqa_logits` reads V4's 68-byte FP4 pages (``paged64_fp4_e2m1``, DeepGEMM's own
layout) and is registered for sm100 (``paged_mqa_logits.cuda.deepgemm_fp4``, problem fact ``keys="fp4"``);
`deepgemm_fp4.make_fp4_ragged_mqa_logits` takes the FP4 rows gathered from those pages as stored (the ragged ops'
``keys="fp4"`` form) and is registered for sm100 too (``ragged_mqa_logits.cuda.deepgemm_fp4``).
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Callable

import torch

from ...contract.cache import PAGE_SIZE
from ...dispatch.vendor import VendorLibrary
from .deepgemm_api import *  # noqa: F401,F403 - one name for the backend and the tests
from .deepgemm_api import GEMM_NAMES, PAGED_LEGACY, PAGED_NEW, RAGGED_LEGACY, RAGGED_NEW, DeepGemmApi, detect_api
from .deepgemm_kernels import *  # noqa: F401,F403
from .deepgemm_fp4 import *  # noqa: F401,F403
from .deepgemm_kernels import MAKERS, make_paged_mqa_logits


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
        # Power-of-two scales ("ue8m0"), which every arch's adapter takes (sm100's takes no other).
        a, sa = ref.quant_fp8_groups(torch.randn(64, 256, generator=gen), 128, ue8m0=True)
        b = (torch.randn(256, 256, generator=gen) * 0.5).to(torch.float8_e4m3fn)
        sb = torch.exp2(torch.randint(-3, 2, (2, 2), generator=gen).float())
        args = [t.to(device) for t in (a, sa, b, sb)]
        got = make_gemm_fp8_blockscale(module, api)(*args, torch.bfloat16, "ue8m0").float()
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

