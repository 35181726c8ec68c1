"""The dual-stream pipeline strategy (NVIDIA): the q path and the k path of one step on two CUDA streams.

For small token counts (decode, speculative verify) the kernels of one step are too small to fill the GPU, and
the q path (weights_proj, wq_b, q prologue) and the k path (wk, k prologue + cache store) do not depend on each
other until the logits. Schedule (indexer spec, section 5), issued in this order:

    alt.wait_stream(main)            # alt sees x, positions, the key store and the cache as main left them
    alt:  pipeline.project_x(...)    # [weights_proj; wk] from one read of x (StepPlan.fuse_x_projections, default)
    alt:  pipeline.k_path(...)       # k_norm, RoPE + Hadamard + fp8 quant of k, store into the cache
    main: pipeline.project_q(...)    # the q_lora quant (unless reused) and the wq_b GEMM: no wait for x's GEMMs
    main.wait_stream(alt)            # the head weights, and this step's keys for the logits that follow on main
    main: pipeline.quantize_q(...)   # RoPE + Hadamard + fp8 quant of q, head weights folded with its scales

H200, V3.2 1x8K: x projections 7.6 us, wq_b with its quant 8.8 us, so moving the projections off main takes them
off the critical path (before, main ran them ahead of wq_b).
With ``fuse_x_projections=False`` (V4 C4, a block-fp8 wk) the q path runs whole on main (weights_proj first) and
the k path (wk or the compressor's step, which also rolls its state forward) on alt.

The steps are `pipeline.q_path` and `pipeline.k_path` themselves, so every kernel gets the same inputs as under
`single_stream` and the result is bit-identical. One alt stream per device, created on first use and reused, so a
captured CUDA graph holds exactly two streams whatever the number of layers.

Memory safety without ``record_stream``: the tensors alt reads or writes (x, positions, the key store: slots or
the C4 compressor's step and its state, the cache, the weights) belong to the caller and stay alive until this
function returns, which is after ``main.wait_stream(alt)``; any later reuse of their memory by main is ordered
after alt's work. Temporaries allocated on alt go back to alt's pool and are reused only by later work on alt,
which every step issues after ``alt.wait_stream(main)``. The one tensor made on alt that main reads, the head
weights, is read by main before the next such wait, so its block cannot be rewritten under that read.

Knobs, read when the registry first resolves the strategy (resolutions are cached; `Registry.clear_cache()`
re-reads them):
- ``DSA_INDEXER_DUAL_STREAM=0``: never choose this strategy.
- ``DSA_INDEXER_DUAL_STREAM_MAX_TOKENS`` (default 1024): the largest token bucket it takes (SGLang's threshold).
Read when the strategy's factory runs (once per process):
- ``DSA_INDEXER_DUAL_STREAM_GEMM_SMS``: limit DeepGEMM to this many SMs (or ``half``) while the q path is issued,
  leaving SMs to the k path (what SGLang does). Off by default: a different SM count may make DeepGEMM pick
  another tile shape, and bit-identity with `single_stream` is only promised with the default.
All three are also checked when the library first reads its environment (`envflags.check_environment`), so a bad
value is an error on any device, not only where this strategy is resolved.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Callable

import torch

from ...contract.cache import LAYOUT_PAGED64
from ...contract.step import STEP_CONTEXT_INFO
from ...envflags import EnvironmentFlagError, env_flag, parse_count, parse_sm_limit
from ...dispatch.capabilities import Capabilities
from ...dispatch.problem import Problem
from ...dispatch.target import Target
from ...dispatch.verification import ran_on
from ...contract.specs import PIPELINE_OP

log = logging.getLogger("dsa_indexer")

IMPL_ID = f"{PIPELINE_OP}.cuda.dual_stream"
PRIORITY = 100
ENABLE_ENV = "DSA_INDEXER_DUAL_STREAM"
MAX_TOKENS_ENV = "DSA_INDEXER_DUAL_STREAM_MAX_TOKENS"
GEMM_SMS_ENV = "DSA_INDEXER_DUAL_STREAM_GEMM_SMS"
DEFAULT_MAX_TOKENS = 1024

_streams: dict[int, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def alt_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream of ``device`` (created lazily, then reused: graphs stay at two streams)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _streams.get(index)
    if stream is None:
        with _streams_lock:
            stream = _streams.get(index)
            if stream is None:
                stream = torch.cuda.Stream(device=index)
                _streams[index] = stream
    return stream


def alt_streams() -> dict[int, torch.cuda.Stream]:
    """The side streams created so far, per device index (tests check there is one per device)."""
    return dict(_streams)


def max_tokens() -> int | str:
    """The token threshold, or a reason string when the variable does not parse."""
    try:
        value = parse_count(MAX_TOKENS_ENV, os.environ.get(MAX_TOKENS_ENV))
    except EnvironmentFlagError as exc:  # a reason, not a crash inside resolution: explain shows it
        return str(exc)
    return DEFAULT_MAX_TOKENS if value is None else value


# The layout it writes, as data: its k path stores the fp8 132-byte pages (V4's compressor runs single-stream).
CAPABILITIES = Capabilities("the dual-stream strategy", cache=(LAYOUT_PAGED64,))


def supports(problem: Problem, target: Target) -> list[str]:
    """What data cannot say: two environment knobs (on / off, and the token threshold, whose value the caller may
    set per process). Every reason at once (an empty list: yes)."""
    reasons = []
    try:
        if not env_flag(ENABLE_ENV, default=True):
            reasons.append(f"disabled by {ENABLE_ENV}=0")
    except EnvironmentFlagError as exc:  # a reason, not a crash inside resolution: explain shows it
        reasons.append(str(exc))
    limit = max_tokens()
    tokens = problem.get("tokens")
    if isinstance(limit, str):
        reasons.append(limit)
    elif tokens is not None and tokens > limit:
        reasons.append(f"tokens bucket {tokens} > {limit}: large steps fill the GPU on one stream "
                       f"(threshold {MAX_TOKENS_ENV})")
    return reasons


def _gemm_sm_limit() -> Callable[[], contextlib.AbstractContextManager] | None:
    """A context manager factory that limits DeepGEMM's SM count, when asked for and deep_gemm imports."""
    text = os.environ.get(GEMM_SMS_ENV, "")
    wanted = parse_sm_limit(GEMM_SMS_ENV, text)  # a bad value raises: the factory fails, naming the variable
    if wanted is None:
        return None
    try:
        import deep_gemm
    except Exception as exc:  # noqa: BLE001 - the knob is an optimization; say why it is ignored
        log.warning("dsa_indexer: %s=%s ignored: deep_gemm does not import (%s)", GEMM_SMS_ENV, text, exc)
        return None
    if not (callable(getattr(deep_gemm, "get_num_sms", None)) and callable(getattr(deep_gemm, "set_num_sms", None))):
        log.warning("dsa_indexer: %s ignored: this deep_gemm has no get_num_sms/set_num_sms", GEMM_SMS_ENV)
        return None
    total = deep_gemm.get_num_sms()
    sms = max(1, total // 2) if wanted == "half" else min(total, wanted)

    @contextlib.contextmanager
    def limit():
        previous = deep_gemm.get_num_sms()
        deep_gemm.set_num_sms(sms)
        try:
            yield
        finally:
            deep_gemm.set_num_sms(previous)

    return limit


def make_dual_stream(gemm_limit: Callable[[], contextlib.AbstractContextManager] | None = None) -> Callable:
    def dual_stream(plan, x, q_lora, positions, key_store, kv_cache, q_lora_quant, *, context=None):
        """q path on the current stream, k path on the device's alt stream (or the step context's
        ``side_stream``, a caller's own), joined before returning."""
        steps = plan.steps  # the model's shared steps (pipeline.PipelineSteps), not imported by this backend
        if x.device.type != "cuda":  # a simulated cuda target on host tensors: nothing to overlap
            return steps.single_stream(plan, x, q_lora, positions, key_store, kv_cache, q_lora_quant)
        main = torch.cuda.current_stream(x.device)
        side = getattr(context, "side_stream", None)
        alt = side if side is not None else alt_stream(x.device)
        alt.wait_stream(main)
        limit = gemm_limit() if gemm_limit is not None else contextlib.nullcontext()
        if not plan.fuse_x_projections:
            with limit:
                q_fp8, weights = steps.q_path(plan, x, q_lora, positions, q_lora_quant)
            with torch.cuda.stream(alt):
                steps.k_path(plan, x, positions, key_store, kv_cache)
            main.wait_stream(alt)
            return q_fp8, weights
        # The x projections (head weights and k) head the k path on alt, so main starts on wq_b at once: the q
        # prologue is the first kernel that needs the head weights. head_weights is made on alt and read on main
        # after the join; its block goes back to alt's pool when the caller drops it, and alt's next work comes
        # after the next step's alt.wait_stream(main), which orders it after every read here.
        with torch.cuda.stream(alt):
            head_weights, k = steps.project_x(plan, x)
            steps.k_path(plan, x, positions, key_store, kv_cache, k)
        with limit:
            q = steps.project_q(plan, q_lora, q_lora_quant)
        main.wait_stream(alt)
        return steps.quantize_q(plan, q, positions, head_weights)

    return dual_stream


def register_dual_stream(registry) -> None:
    def factory() -> Callable:
        return make_dual_stream(_gemm_sm_limit())

    registry.implementation(PIPELINE_OP, impl_id=IMPL_ID, targets=("cuda",), priority=PRIORITY, requires=("gpu",),
                            capabilities=CAPABILITIES, supports=supports,
                            info={STEP_CONTEXT_INFO: True},  # the context's side stream
                            description="q path on the current stream, k path on a side stream (<= 1024 tokens)",
                            verified=(ran_on("sm90", "90cca2e", "2026-12-02",
                                             "tests/gpu/test_cuda_backend_gpu.py (bit-identical to single stream); "
                                             "benchmarks/results/decode_s6_h200.json"),))(factory)
