"""The main job behind `dsa-indexer run`: one indexer layer on synthetic decode and prefill batches.

Seeded random weights and activations, a cache filled with synthetic context, `--steps` decode steps and one
prefill; it prints which implementation ran each op, per-phase timings, and checks a sample of rows against
the reference backend (same inputs, every op forced to its pure-torch implementation).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .batch import DecodeBatch, PrefillBatch
from .contract.cache import PAGE_SIZE, IndexKCache
from .compressor import CompressorState
from .config import MODELS
from .dispatch.plugins import default_registry
from .dispatch.target import Target, detect_target
from .indexer import Indexer
from . import ops
from .ops import OPS
from .pipeline import PIPELINE_OP


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
    if device.type == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None and torch.version.hip is None else "built with GPU support"
        raise ValueError(f"--device {name}: this torch ({torch.__version__}, {build}) sees no CUDA/ROCm GPU; "
                         "run without --device to use the CPU")
    return device


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

    def random_rows(n: int, width: int) -> torch.Tensor:
        return torch.randn(n, width, generator=gen).to(device, torch.bfloat16)

    def step_inputs(n: int):
        """x and the normed q_lora with attention's fp8 copy of it, as a model would pass them (a plain-layout cache
        has no fp8 q path: attention there makes no fp8 copy either)."""
        if cache.is_plain:
            normed = torch.nn.functional.rms_norm(random_rows(n, cfg.q_lora_rank).float(), (cfg.q_lora_rank,),
                                                  q_norm.float(), 1e-6)
            return random_rows(n, cfg.hidden_size), normed.to(torch.bfloat16), None
        q_lora, q_lora_quant = ops.rmsnorm_quant_fp8(random_rows(n, cfg.q_lora_rank), q_norm, 1e-6, target=target)
        return random_rows(n, cfg.hidden_size), q_lora, q_lora_quant

    clock = _Clock(device)
    seq_lens = [context - next_n] * batch

    def fill_all():
        lengths = seq_lens + [context]
        fill_bar = progress(len(lengths), "fill context keys") if progress else None
        for b, length in enumerate(lengths):
            _fill_context(indexer, cache, block_table, b, torch.randn(length, cfg.hidden_size, generator=gen
                                                                      ).to(torch.bfloat16), state)
            if fill_bar:
                fill_bar.update(b + 1)

    clock.time("fill context keys", fill_all)
    bar = progress(steps, "decode steps") if progress else None
    for step in range(steps):
        x, q_lora, q_lora_quant = step_inputs(batch * next_n)
        seq_lens = [s + next_n for s in seq_lens]
        db = DecodeBatch.build(seq_lens, block_table[:batch], next_n=next_n, num_cache_pages=num_pages,
                               device=device, compress_ratio=ratio)
        decode_inputs = (x, q_lora, q_lora_quant, db)
        # The verification re-runs the last step from the state it started from.
        state_before_step = _clone_state(state) if settings.verify and step == steps - 1 else None
        decode_out = clock.time("decode step", lambda: indexer(x, q_lora, db.positions, db, cache,
                                                               q_lora_quant=q_lora_quant, compressor_state=state))
        if bar:
            bar.update(step + 1)
    # Prefill: one request extends a cached prefix of `context` tokens by `prefill_new` tokens.
    xp, qp, qp_quant = step_inputs(prefill_new)
    pb = PrefillBatch.build([context], [prefill_new], block_table[batch:], num_cache_pages=num_pages, device=device,
                            compress_ratio=ratio, state_slots=[batch])
    cache_before_prefill = cache.clone() if settings.verify else None
    print(f"prefill: {prefill_new} new tokens after a {context}-token prefix ...", flush=True)
    prefill_out = clock.time("prefill", lambda: indexer(xp, qp, pb.positions, pb, cache, q_lora_quant=qp_quant,
                                                        compressor_state=state))

    registry = default_registry()
    used: dict[str, set] = {}
    for (op, _target, _problem), res in registry.used.items():
        used.setdefault(op, set()).add(res.chosen.impl_id)
    report = {"model": cfg.name, "device": str(device), "target": str(target), "batch": batch, "context": context,
              "next_n": next_n, "steps": steps, "prefill_tokens": prefill_new,
              "implementations": {op: sorted(ids) for op, ids in sorted(used.items())},
              "q_lora_quant": dict(indexer.reuse_stats),
              "timings_ms": {name: {"median": statistics.median(v), "count": len(v)} for name, v in
                             clock.phases.items()},
              "verified": None}
    print("\nimplementations that ran:")
    for op, ids in report["implementations"].items():
        print(f"  {op:<22} {', '.join(ids)}")
    print(f"q_lora fp8 reuse: {dict(indexer.reuse_stats) or 'not offered'}")
    print("\ntimings (median ms):")
    for name, entry in report["timings_ms"].items():
        print(f"  {name:<22} {entry['median']:10.3f}  (n={entry['count']})")
    if settings.verify:
        print("\nverifying against the reference backend (the last decode step and the prefill, every op forced to "
              "pure torch) ...", flush=True)
        started = time.perf_counter()
        report["verified"] = _verify(indexer, cache, cache_before_prefill, state_before_step, decode_inputs,
                                     decode_out, (xp, qp, qp_quant, pb), prefill_out, report)
        report["verification"]["seconds"] = time.perf_counter() - started
        print(f"verification took {report['verification']['seconds']:.1f} s")
    return report


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


def _verify(indexer, cache, cache_before_prefill, state_before_step, decode_inputs, decode_out, prefill_inputs,
            prefill_out, report) -> bool:
    """Re-run the last decode step and the prefill with every op forced to the pure-torch reference."""
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
    # Different kernels may round the fp8 prologue differently by one ulp, which can swap keys whose logits tie
    # at the k-th place; 99% set agreement catches any real error (a wrong page or mask moves far more).
    ok = decode_agree >= 0.99 and prefill_agree >= 0.99
    # The reference backend is the oracle of the other backends, but on a CPU it is also what ran: check the math
    # against an independent float64 recomputation too. fp8 q (the kernels quantize it, the oracle does not) moves
    # keys within ~1% of the k-th logit: 0.95 leaves room for that, and a wrong page, position or mask fails it.
    oracle_agree, oracle_rows = _float64_oracle_agreement(indexer, cache, decode_inputs, decode_out)
    oracle_ok = oracle_agree >= 0.95
    report["verification"] = {"decode_topk_agreement": decode_agree, "prefill_topk_agreement": prefill_agree,
                              "threshold": 0.99, "float64_oracle_topk_agreement": oracle_agree,
                              "float64_oracle_rows": oracle_rows, "float64_oracle_threshold": 0.95}
    print(f"\nverification against the reference backend: decode top-k agreement {decode_agree:.4%}, "
          f"prefill {prefill_agree:.4%} -> {'OK' if ok else 'MISMATCH'}")
    print(f"verification against a float64 oracle written independently of the ops ({oracle_rows} decode rows: q, "
          f"RoPE, Hadamard and logits recomputed from the step's inputs, keys read back from the cache): top-k "
          f"agreement {oracle_agree:.4%} -> {'OK' if oracle_ok else 'MISMATCH'}")
    return ok and oracle_ok
