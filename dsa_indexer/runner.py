"""The main job behind `dsa-indexer run`: one indexer layer on synthetic decode and prefill batches.

Seeded random weights and activations, a cache filled with synthetic context, `--steps` decode steps and one
prefill; it prints which implementation ran each op, per-phase timings, and checks a sample of rows against
the reference backend (same inputs, every op forced to its pure-torch implementation) and against a float64
oracle written here.

Phases, in order (``timings_ms`` in the JSON):
- ``first-use compile / warm-up`` (on an accelerator; ``RunSettings.warmup`` overrides): one untimed fill,
  decode step and prefill of the same shapes, into a scratch cache, and on a CUDA/ROCm GPU the capture of the
  decode step's CUDA graph. First calls compile (the nvcc top-k, DeepGEMM's JIT, Triton's compile and autotune:
  tens of seconds on a cold cache), so they happen here, named, with the cache folders they fill (``warmup`` in the
  JSON), and stay out of the phases below;
- ``fill context keys``: the context of every request stored through ``store_keys``;
- ``decode step (eager)``: each step called eagerly, and on a GPU ``decode step (CUDA graph)``: the same step
  replayed from the captured `DecodeGraph` (its inputs copied into the graph's buffers, wall clock with a sync),
  how a serving engine runs decode; both outputs are checked;
- ``prefill``: one request extending its cached prefix.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .batch import DecodeBatch, PrefillBatch
from .contract.cache import LAYOUT_PAGE_BYTES, PAGE_SIZE, IndexKCache
from .contract.validate import device_unavailable, fits_in_memory
from .compressor import CompressorState
from .config import MODELS
from .dispatch.platform import platform_of
from .dispatch.plugins import default_registry
from .dispatch.target import Target, detect_target
from .indexer import Indexer
from . import ops
from .ops import OPS
from .contract.specs import PIPELINE_OP


@dataclass
class RunSettings:
    model: str = "deepseek-v3.2"
    device: str | None = None
    batch: int | None = None
    context: int | None = None
    steps: int | None = None
    prefill_tokens: int | None = None
    next_n: int = 1
    seed: int = 0
    verify: bool = True
    target: Target | None = None  # simulate this target for resolution (kernels still run on the device)
    # The untimed first-use phase: None runs it on an accelerator only (a CPU compiles nothing, and its steps are
    # slow enough that first calls do not move the timings).
    warmup: bool | None = None


WARMUP = "first-use compile / warm-up"
FILL = "fill context keys"
EAGER_DECODE = "decode step (eager)"
GRAPH_DECODE = "decode step (CUDA graph)"
PREFILL = "prefill"
# Different kernels may round the fp8 prologue differently by one ulp, which can swap keys whose logits tie at the
# k-th place; 99% set agreement catches any real error (a wrong page or mask moves far more).
REFERENCE_THRESHOLD = 0.99
# fp8 q (the kernels quantize it, the oracle does not) moves keys within ~1% of the k-th logit: 0.95 leaves room
# for that, and a wrong page, position or mask fails it.
ORACLE_THRESHOLD = 0.95


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Clock:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.phases: dict[str, list[float]] = {}

    def time(self, name: str, fn: Callable):
        _sync(self.device)
        start = time.perf_counter()
        out = fn()
        _sync(self.device)
        self.phases.setdefault(name, []).append((time.perf_counter() - start) * 1e3)
        return out


def _fill_context(indexer: Indexer, cache: IndexKCache, block_table: torch.Tensor, request: int, x: torch.Tensor,
                  compressor_state: CompressorState | None) -> None:
    """Store the keys of a request's first ``len(x)`` tokens (what earlier steps would have written), in chunks:
    V3.2 keys per token; C4 entries through the compressor, whose state then holds the request's last tokens."""
    device = cache.device
    ratio = indexer.config.compress_ratio
    for start in range(0, x.shape[0], 4096):
        chunk = x[start:start + 4096].to(device)
        batch = PrefillBatch.build([start], [chunk.shape[0]], block_table[request:request + 1], device=device,
                                   compress_ratio=ratio, state_slots=[request])
        indexer.store_keys(chunk, batch, cache, compressor_state=compressor_state)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of |set(a) & set(b)| / |set(b)| (ignoring -1 padding)."""
    total, agree = 0, 0
    for row_a, row_b in zip(a.cpu().tolist(), b.cpu().tolist()):
        want = {i for i in row_b if i >= 0}
        got = {i for i in row_a if i >= 0}
        total += max(1, len(want))
        agree += len(want & got) if want else (1 if not got else 0)
    return agree / max(1, total)


def _device(name: str | None) -> torch.device:
    if not name:
        if torch.cuda.is_available():  # CUDA and ROCm builds
            return torch.device("cuda")
        from .dispatch.platform import platforms

        for platform in platforms():  # another accelerator a platform sees (an Ascend NPU through torch_npu)
            if platform.is_accelerator and platform.default_device not in (None, "cuda") and platform.device_visible():
                try:
                    return torch.device(platform.default_device)
                except RuntimeError:  # the device type is not registered with this torch (no real backend loaded)
                    continue
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"--device {name!r} is not a torch device ({exc})") from None
    reason = device_unavailable(device)  # the message `Indexer(device=...)` gives too
    if reason is not None:
        raise ValueError(f"--device {name}: {reason}; run without --device to use the CPU")
    return device


def compile_caches() -> list[dict]:
    """The on-disk caches that first-use compiles fill: Triton's, and each platform's own (the CUDA platform: this
    package's nvcc-built kernels and DeepGEMM's JIT), as name, path and the variable that moves it. Reading them
    imports no vendor library."""
    from .dispatch.platform import platforms

    caches = [{"name": "Triton", "path": _triton_cache_dir(), "env": "TRITON_CACHE_DIR"}]
    for platform in platforms():
        caches += [dict(cache) for cache in platform.compile_caches()]
    return caches


def _compile_builds() -> list[dict]:
    """The builds every platform's first-use compiles made so far in this process."""
    from .dispatch.platform import platforms

    return [build for platform in platforms() for build in platform.compile_builds()]


def _triton_cache_dir() -> str:
    """Triton's cache folder: its own knob when triton is loaded, else what that knob defaults to."""
    triton = sys.modules.get("triton")
    try:
        return str(triton.knobs.cache.dir)
    except AttributeError:  # not loaded, or a triton without ``knobs`` (before 3.4)
        home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")
        return os.environ.get("TRITON_CACHE_DIR") or os.path.join(home, ".triton", "cache")


def _files_under(path: str) -> int:
    return sum(len(files) for _root, _dirs, files in os.walk(path)) if os.path.isdir(path) else 0


def versions_block() -> dict:
    """What ran: the versions `dsa-indexer info` shows (distribution metadata), and where each vendor module (and
    triton) would be imported from, None when it is not importable: a source build has no metadata but imports."""
    from .versions import package_versions
    from .dispatch.platform import vendor_libraries
    from .dispatch.vendor import importable_from

    out = dict(package_versions())
    out["importable"] = {module: importable_from(module) for module in sorted({"triton", *vendor_libraries().values()})}
    return out


def _check_run_fits(cfg, device: torch.device, target: Target, batch: int, context: int, max_len: int,
                    warmup: bool | None) -> None:
    """Refuse up front a run whose cache, RoPE table and context activations cannot fit the device: a long
    ``--context`` would otherwise end minutes in, in torch's allocator, naming no option."""
    layout = platform_of(target.vendor).cache_layout(cfg.compress_ratio)
    page_bytes = LAYOUT_PAGE_BYTES[layout]
    pages = (batch + 1) * -(-(max_len // cfg.compress_ratio + 1) // PAGE_SIZE)
    caches = 2 if (device.type != "cpu" if warmup is None else warmup) else 1  # the warm-up fills a scratch cache
    needed = (caches * pages * page_bytes + cfg.max_position * cfg.rope_dim * 4
              + context * cfg.hidden_size * (4 + 2))  # one request's context drawn in fp32, then its bf16 copy
    fits_in_memory(f"dsa-indexer run --context {context} --batch {batch} ({caches} index-K cache"
                   f"{'s' if caches > 1 else ''} of {pages} pages, the RoPE table, a request's context activations)",
                   needed, device, "use a smaller --context or --batch")


def run_main_job(settings: RunSettings, progress=None) -> dict:
    device = _device(settings.device)
    on_gpu = device.type != "cpu"
    batch = settings.batch or (32 if on_gpu else 4)
    base = MODELS[settings.model]()
    ratio = base.compress_ratio
    context = settings.context or (8192 if on_gpu else 4096)
    steps = settings.steps or (20 if on_gpu else 3)
    prefill_new = settings.prefill_tokens or (4096 if on_gpu else 512)
    next_n = settings.next_n
    gen = torch.Generator().manual_seed(settings.seed)
    torch.manual_seed(settings.seed)
    max_len = context + steps * next_n + prefill_new + 1
    if max_len > base.max_position:
        print(f"note: {max_len} positions exceed {base.name}'s max_position {base.max_position}; the RoPE table is "
              "extended for this synthetic run (a real model is not trained past it)")
    cfg = dataclasses.replace(base, max_position=max(base.max_position if on_gpu else 0, max_len))
    target = detect_target(device, settings.target)
    _check_run_fits(cfg, device, target, batch, context, max_len, settings.warmup)
    default_registry().start_recording_usage()  # the report lists what this run used, not what the process did
    decode_keys = (context + steps * next_n) // ratio
    if decode_keys <= base.topk:
        print(f"note: decode rows see at most {decode_keys} <= top-{base.topk} keys, so the decode steps run no logits "
              f"or top-k (the answer is every visible key); use --context > {base.topk * ratio} to exercise scoring")
    print(f"dsa-indexer run: {cfg.name} on {device} (target {target}), batch {batch} x context {context}, "
          f"next_n {next_n}, {steps} decode steps, prefill {prefill_new} new tokens after a {context}-token prefix"
          + (f"; C4 keys: one per {ratio} tokens, top-{cfg.topk}" if ratio > 1 else ""))
    indexer = Indexer(cfg, device=device, target=target).init_random(settings.seed)
    pages_per_req = -(-(max_len // ratio + 1) // PAGE_SIZE)
    num_pages = (batch + 1) * pages_per_req
    cache = indexer.allocate_cache(num_pages)  # the layout the target's kernels read
    # A shuffled page assignment, so a kernel that ignores the block table cannot pass.
    block_table = torch.randperm(num_pages, generator=gen).to(torch.int32).view(batch + 1, pages_per_req)
    state = CompressorState.allocate(batch + 1, cfg, device) if ratio > 1 else None
    q_norm = (1 + 0.1 * torch.randn(cfg.q_lora_rank, generator=gen)).to(device, torch.bfloat16)

    def random_rows(n: int, width: int, source: torch.Generator) -> torch.Tensor:
        return torch.randn(n, width, generator=source).to(device, torch.bfloat16)

    def step_inputs(n: int, source: torch.Generator = gen):
        """x and the normed q_lora with attention's fp8 copy of it, as a model would pass them (a plain-layout cache
        has no fp8 q path: attention there makes no fp8 copy either)."""
        if cache.is_plain:
            normed = torch.nn.functional.rms_norm(random_rows(n, cfg.q_lora_rank, source).float(),
                                                  (cfg.q_lora_rank,), q_norm.float(), 1e-6)
            return random_rows(n, cfg.hidden_size, source), normed.to(torch.bfloat16), None
        q_lora, q_lora_quant = ops.rmsnorm_quant_fp8(random_rows(n, cfg.q_lora_rank, source), q_norm, 1e-6,
                                                     target=target)
        return random_rows(n, cfg.hidden_size, source), q_lora, q_lora_quant

    clock = _Clock(device)
    seq_lens = [context - next_n] * batch
    graph_width = max(PAGE_SIZE, -(-decode_keys // PAGE_SIZE) * PAGE_SIZE)  # keys of the last step, page-rounded

    def prefill_batch() -> PrefillBatch:
        return PrefillBatch.build([context], [prefill_new], block_table[batch:], num_cache_pages=num_pages,
                                  device=device, compress_ratio=ratio, state_slots=[batch])

    def capture():
        # Captured with all-padding inputs: the capture writes nothing into the real cache or state.
        return _capture_decode_graph(indexer, cache, state, batch, graph_width, next_n)

    def warm_up():
        """Every phase once, untimed, on the shapes the timed phases use, into a scratch cache and state (the real
        ones stay as they were), with inputs of their own (the timed phases see the same inputs as without it)."""
        warm_gen = torch.Generator().manual_seed(settings.seed + 1)
        scratch = indexer.allocate_cache(num_pages)
        scratch_state = CompressorState.allocate(batch + 1, cfg, device) if ratio > 1 else None
        # The first request's length and the prefill request's: the chunk shapes the fill phase stores.
        warm_fill_gen = torch.Generator(device=device).manual_seed(settings.seed + 2)
        for b, length in ((0, seq_lens[0]), (batch, context)):
            x = torch.randn(length, cfg.hidden_size, generator=warm_fill_gen, device=device).to(torch.bfloat16)
            _fill_context(indexer, scratch, block_table, b, x, scratch_state)
        x, q_lora, q_lora_quant = step_inputs(batch * next_n, warm_gen)
        db = DecodeBatch.build([s + next_n for s in seq_lens], block_table[:batch], next_n=next_n,
                               num_cache_pages=num_pages, device=device, compress_ratio=ratio)
        indexer(x, q_lora, db.positions, db, scratch, q_lora_quant=q_lora_quant, compressor_state=scratch_state)
        xp, qp, qp_quant = step_inputs(prefill_new, warm_gen)
        pb = prefill_batch()
        indexer(xp, qp, pb.positions, pb, scratch, q_lora_quant=qp_quant, compressor_state=scratch_state)
        return capture()

    on_accelerator = device.type != "cpu"
    run_warmup = on_accelerator if settings.warmup is None else settings.warmup
    if run_warmup:
        graph, graph_reason, warmup = _first_use_phase(clock, warm_up, on_accelerator)
        indexer.reuse_stats.clear()  # the q_lora reuse counts are the timed phases'
    else:
        graph, graph_reason = capture()
        warmup = {"ran": False, "reason": "a CPU run compiles nothing; its first calls stay in the timings"
                  if not on_accelerator else "turned off: first-use compiles are in the phases' timings"}
    decode_graph = {"captured": graph is not None, "reason": graph_reason, "max_context_len": graph_width}
    if graph is None and on_accelerator:
        print(f"note: the decode steps run eagerly only: {graph_reason}")

    # The context's activations are drawn on the device: on the host, 33 x 8192 x 7168 normal samples took ~15 s of
    # the H200 run's "fill context keys" (the keys themselves take milliseconds).
    fill_gen = torch.Generator(device=device).manual_seed(settings.seed + 1)

    def fill_all():
        lengths = seq_lens + [context]
        fill_bar = progress(len(lengths), FILL) if progress else None
        for b, length in enumerate(lengths):
            x = torch.randn(length, cfg.hidden_size, generator=fill_gen, device=device).to(torch.bfloat16)
            _fill_context(indexer, cache, block_table, b, x, state)
            if fill_bar:
                fill_bar.update(b + 1)

    clock.time(FILL, fill_all)
    bar = progress(steps, "decode steps") if progress else None
    graph_table = block_table[:batch, :graph_width // PAGE_SIZE]
    graph_agreement = []
    graph_out = None
    for step in range(steps):
        x, q_lora, q_lora_quant = step_inputs(batch * next_n)
        seq_lens = [s + next_n for s in seq_lens]
        db = DecodeBatch.build(seq_lens, block_table[:batch], next_n=next_n, num_cache_pages=num_pages,
                               device=device, compress_ratio=ratio)
        decode_inputs = (x, q_lora, q_lora_quant, db)
        # The verification re-runs the last step from the state it started from.
        state_before_step = _clone_state(state) if settings.verify and step == steps - 1 else None
        if graph is not None:
            # The replay stores this step's keys and compressor window as the eager call then stores them again
            # (same x, same slots): running both leaves the cache and the state as one step does.
            lens = torch.tensor(seq_lens, dtype=torch.int32)
            graph_out = clock.time(GRAPH_DECODE, lambda: graph.replay(x, q_lora, lens, graph_table)).clone()
        decode_out = clock.time(EAGER_DECODE, lambda: indexer(x, q_lora, db.positions, db, cache,
                                                              q_lora_quant=q_lora_quant, compressor_state=state))
        if graph_out is not None:
            graph_agreement.append(_overlap(graph_out, decode_out))
        if bar:
            bar.update(step + 1)
    # Prefill: one request extends a cached prefix of `context` tokens by `prefill_new` tokens.
    xp, qp, qp_quant = step_inputs(prefill_new)
    pb = prefill_batch()
    cache_before_prefill = cache.clone() if settings.verify else None
    print(f"prefill: {prefill_new} new tokens after a {context}-token prefix ...", flush=True)
    prefill_out = clock.time(PREFILL, lambda: indexer(xp, qp, pb.positions, pb, cache, q_lora_quant=qp_quant,
                                                      compressor_state=state))

    registry = default_registry()
    used: dict[str, set] = {}
    for (op, _target, _problem), res in registry.used.items():
        used.setdefault(op, set()).add(res.chosen.impl_id)
    timings = {name: {"median": statistics.median(v), "count": len(v)} for name, v in clock.phases.items()}
    eager_us = timings[EAGER_DECODE]["median"] * 1e3
    decode_graph["eager_us_per_step"] = eager_us
    if graph is not None:
        decode_graph["us_per_step"] = timings[GRAPH_DECODE]["median"] * 1e3
        decode_graph["min_topk_agreement_with_eager"] = min(graph_agreement)
    report = {"model": cfg.name, "device": str(device), "target": str(target), "batch": batch, "context": context,
              "next_n": next_n, "steps": steps, "prefill_tokens": prefill_new,
              "implementations": {op: sorted(ids) for op, ids in sorted(used.items())},
              "q_lora_quant": dict(indexer.reuse_stats),
              "timings_ms": timings, "warmup": warmup, "decode_graph": decode_graph,
              "thresholds": {"reference_topk_agreement": REFERENCE_THRESHOLD,
                             "float64_oracle_topk_agreement": ORACLE_THRESHOLD},
              "versions": versions_block(), "verified": None}
    print("\nimplementations that ran:")
    for op, ids in report["implementations"].items():
        print(f"  {op:<22} {', '.join(ids)}")
    print(f"q_lora fp8 reuse: {dict(indexer.reuse_stats) or 'not offered'}")
    print("\ntimings (median ms):")
    for name, entry in timings.items():
        note = "  (every phase once, untimed: first-use compiles and first calls)" if name == WARMUP else ""
        print(f"  {name:<28} {entry['median']:10.3f}  (n={entry['count']}){note}")
    print(_compile_line(warmup, on_accelerator) if warmup["ran"] else f"{WARMUP}: not run ({warmup['reason']})")
    if graph is not None:
        print(f"decode: {_duration(decode_graph['us_per_step'])} per step replaying the CUDA graph (inputs copied "
              f"into its buffers, wall clock), {_duration(eager_us)} per step eager; top-k agreement of the two at "
              f"least {decode_graph['min_topk_agreement_with_eager']:.4%}")
    else:
        print(f"decode: {_duration(eager_us)} per step eager (no CUDA graph: {graph_reason})")
    if settings.verify:
        print("\nverifying against the reference backend (the last decode step and the prefill, every op forced to "
              "pure torch) ...", flush=True)
        started = time.perf_counter()
        report["verified"] = _verify(indexer, cache, cache_before_prefill, state_before_step, decode_inputs,
                                     decode_out, (xp, qp, qp_quant, pb), prefill_out, report, graph_out)
        report["verification"]["seconds"] = time.perf_counter() - started
        print(f"verification took {report['verification']['seconds']:.1f} s")
    return report


def _first_use_phase(clock: _Clock, warm_up: Callable, on_accelerator: bool):
    """Run ``warm_up`` as the named phase WARMUP, saying first where its compiles land; returns ``(graph, reason,
    the JSON's warmup block)`` with the files each compile cache gained and the nvcc builds it made."""
    caches = compile_caches()
    if on_accelerator:
        print(f"{WARMUP}: one untimed fill, decode step and prefill" +
              (" (and the decode CUDA graph's capture)" if clock.device.type == "cuda" else "") + ", so "
              "first-use compiles stay out of the timed phases; on a cold cache this takes tens of seconds. Caches: "
              + "; ".join(f"{c['name']} {c['path']}" for c in caches), flush=True)
    files_before = [_files_under(c["path"]) for c in caches]
    builds_before = len(_compile_builds())
    graph, graph_reason = clock.time(WARMUP, warm_up)
    for entry, before in zip(caches, files_before):
        entry["new_files"] = _files_under(entry["path"]) - before
    warmup = {"ran": True, "seconds": clock.phases[WARMUP][0] / 1e3, "caches": caches,
              "cuda_jit_builds": _compile_builds()[builds_before:],
              "what": "one untimed fill (2 requests), decode step and prefill of the timed shapes into a scratch "
                      "cache" + ("; the decode CUDA graph's capture" if graph is not None else "")}
    return graph, graph_reason, warmup


def _capture_decode_graph(indexer, cache, state, batch: int, width: int, next_n: int):
    """``(DecodeGraph, None)``, or ``(None, why not)`` where the decode step is not captured here."""
    if cache.device.type != "cuda":
        return None, f"CUDA graphs need a CUDA or ROCm device (this run is on {cache.device})"
    if cache.is_plain:
        return None, f"a {cache.layout} cache is not captured (graphs capture the fp8-page path)"
    from .graphs import DecodeGraph

    try:
        return DecodeGraph.capture(indexer, cache, batch, width, next_n=next_n, compressor_state=state), None
    except Exception as exc:  # noqa: BLE001 - the eager steps still run and are reported; the reason is printed
        text = (str(exc).strip().splitlines() or [""])[0]
        return None, f"capture failed ({type(exc).__name__}: {text})"


def _duration(us: float) -> str:
    return f"{us:.1f} us" if us < 10_000 else f"{us / 1e3:.1f} ms"


def _compile_line(warmup: dict, on_accelerator: bool) -> str:
    new = [c for c in warmup["caches"] if c.get("new_files")]
    builds = "; ".join(f"{b['source']} {b['seconds']:.1f} s" for b in warmup["cuda_jit_builds"])
    if not new and not builds:
        return (f"{WARMUP}: {warmup['seconds']:.1f} s, no new files in the compile caches"
                + ("" if on_accelerator else " (a CPU run compiles nothing: first calls only)"))
    return (f"{WARMUP}: {warmup['seconds']:.1f} s; new in the compile caches: "
            + "; ".join(f"{c['name']} {c['path']}: {c['new_files']} files" for c in new)
            + (f"; nvcc built: {builds}" if builds else ""))


def _clone_state(state: CompressorState | None) -> CompressorState | None:
    return None if state is None else state.clone()


def _float64_oracle_agreement(indexer, cache, decode_inputs, decode_out, rows: int = 4) -> tuple[float, int]:
    """Top-k set agreement of ``rows`` decode rows with a float64 recomputation of the indexer math written here,
    independently of the ops: q = wq_b q_lora, RoPE at the row's position (float64 angles), the orthonormal Hadamard,
    head weights weights_proj(x) / sqrt(H D); logits sum_h w_h relu(q_h . k) over the row's visible keys, read back
    from the cache through the block table (fp8 values x scale); top-k by value, lower index on ties."""
    from .contract.cache import gather_plain_keys, page_views
    from .rope import rope_frequencies

    cfg = indexer.config
    x, q_lora, _, db = decode_inputs
    picked = torch.linspace(0, db.num_tokens - 1, steps=min(rows, db.num_tokens)).long().tolist()
    wq = indexer.wq_b.dequantize() if indexer.wq_b_is_block_fp8 else indexer.wq_b.weight
    freqs = rope_frequencies(cfg.rope_dim, cfg.rope_theta, cfg.yarn)
    hadamard = torch.ones(1, 1, dtype=torch.float64)
    while hadamard.shape[0] < cfg.head_dim:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
    hadamard = hadamard / cfg.head_dim ** 0.5
    if not cache.is_plain:
        keys_fp8, scales = (t.cpu() for t in page_views(cache.data, cache.fp8_dtype))
    else:  # bf16 keys are stored unrotated: no Hadamard on q either (a rotation of both leaves q . k as it is)
        plain = cache.data.cpu(), cache.scales_or_empty().cpu()
        if cache.key_format == "bf16":
            hadamard = torch.eye(cfg.head_dim, dtype=torch.float64)
    wq, w_proj, table = wq.double().cpu(), indexer.weights_proj.weight.double().cpu(), db.block_table.long().cpu()
    agree = total = 0
    for row in picked:
        q = (q_lora[row].double().cpu() @ wq.T).view(cfg.n_heads, cfg.head_dim)
        angle = float(db.positions[row]) * freqs
        cos, sin = angle.cos(), angle.sin()
        part = q[:, cfg.rope_offset:cfg.rope_offset + cfg.rope_dim]
        if cfg.rope_interleaved:
            a, b = part[:, 0::2], part[:, 1::2]
            rotated = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
        else:
            a, b = part.chunk(2, dim=-1)
            rotated = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
        q = torch.cat([q[:, :cfg.rope_offset], rotated, q[:, cfg.rope_offset + cfg.rope_dim:]], dim=-1) @ hadamard
        w = x[row].double().cpu() @ w_proj.T * cfg.weight_scale
        request = int(db.row_request[row])
        visible = int(db.context_lens.reshape(-1)[row])
        pos = torch.arange(visible)
        pages = table[request][pos // 64]
        if cache.is_plain:
            keys = gather_plain_keys(plain[0], plain[1], table[request], visible).double()
        else:
            keys = keys_fp8[pages, pos % 64].double() * scales[pages, pos % 64].double()[:, None]
        logits = ((q @ keys.T).clamp_min(0) * w[:, None]).sum(dim=0)
        order = sorted(range(visible), key=lambda j: (-logits[j].item(), j))[:cfg.topk]
        got = {i for i in decode_out[row].tolist() if i >= 0}
        agree += len(got & set(order))
        total += len(order)
    return agree / max(1, total), len(picked)


def reference_ran_itself(implementations: dict[str, list[str]]) -> bool:
    """Whether every op that ran is the pure-torch reference or composed of it (a CPU run without plugins): then
    the comparison with the reference backend compares the reference with itself."""
    return all(".reference." in impl or ".generic." in impl for ids in implementations.values() for impl in ids)


def _verify(indexer, cache, cache_before_prefill, state_before_step, decode_inputs, decode_out, prefill_inputs,
            prefill_out, report, graph_out=None) -> bool:
    """Re-run the last decode step and the prefill with every op forced to the pure-torch reference; compare the
    eager step, the CUDA-graph replay of it (``graph_out``, when captured) and the prefill with it, and the decode
    step with the float64 oracle."""
    registry = default_registry()
    forced = [op for op in OPS] + [PIPELINE_OP]
    x, q_lora, q_lora_quant, db = decode_inputs
    xp, qp, qp_quant, pb = prefill_inputs
    ref_cache = cache_before_prefill.clone()
    single = "single_stream" if not cache.is_plain else "plain_single_stream"
    try:
        for op in forced:
            impl = f"{op}.reference.torch" if op != PIPELINE_OP else f"{op}.generic.{single}"
            registry.force(op, impl)
        # The decode step's own keys are already in the cache; the reference stores them again (its own bytes).
        # The C4 state replays from before the last decode step; that step leaves it as the prefill found it.
        ref_decode = indexer(x, q_lora, db.positions, db, ref_cache, q_lora_quant=q_lora_quant,
                             compressor_state=state_before_step)
        ref_prefill = indexer(xp, qp, pb.positions, pb, ref_cache, q_lora_quant=qp_quant,
                              compressor_state=state_before_step)
    finally:
        for op in forced:
            registry.force(op, None)
    decode_agree = _overlap(decode_out, ref_decode)
    prefill_agree = _overlap(prefill_out, ref_prefill)
    graph_agree = _overlap(graph_out, ref_decode) if graph_out is not None else None
    ok = min(decode_agree, prefill_agree, 1.0 if graph_agree is None else graph_agree) >= REFERENCE_THRESHOLD
    # The reference backend is the oracle of the other backends, but on a CPU it is also what ran: check the math
    # against an independent float64 recomputation too.
    oracle_agree, oracle_rows = _float64_oracle_agreement(indexer, cache, decode_inputs, decode_out)
    oracle_ok = oracle_agree >= ORACLE_THRESHOLD
    itself = reference_ran_itself(report["implementations"])
    report["verification"] = {"decode_topk_agreement": decode_agree, "prefill_topk_agreement": prefill_agree,
                              "threshold": REFERENCE_THRESHOLD, "float64_oracle_topk_agreement": oracle_agree,
                              "float64_oracle_rows": oracle_rows, "float64_oracle_threshold": ORACLE_THRESHOLD,
                              "reference_compared_with_itself": itself}
    if graph_agree is not None:
        report["verification"]["decode_graph_topk_agreement"] = graph_agree
    graph_text = f", decode as a CUDA graph replay {graph_agree:.4%}" if graph_agree is not None else ""
    print(f"\nverification against the reference backend: decode top-k agreement {decode_agree:.4%}{graph_text}, "
          f"prefill {prefill_agree:.4%} (pass: each >= {REFERENCE_THRESHOLD:.0%}) -> {'OK' if ok else 'MISMATCH'}")
    if itself:
        print("  note: every op that ran here is the reference itself or composed of it, so this line compares the "
              "reference with itself: it is not a check; the float64 oracle line below is")
    print(f"verification against a float64 oracle written independently of the ops ({oracle_rows} decode rows: q, "
          f"RoPE, Hadamard and logits recomputed from the step's inputs, keys read back from the cache): top-k "
          f"agreement {oracle_agree:.4%} (pass: >= {ORACLE_THRESHOLD:.0%}) -> {'OK' if oracle_ok else 'MISMATCH'}")
    return ok and oracle_ok
