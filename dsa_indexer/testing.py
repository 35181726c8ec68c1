"""Helpers for tests and benchmarks: synthetic caches and decode steps (not used by the library itself), and the
conformance check plugin authors run on their implementations (`check_implementation`)."""

from __future__ import annotations

import torch

from . import ops
from .batch import DecodeBatch
from .contract.cache import (E2M1_GRID, FP4_BLOCK, HEAD_DIM, LAYOUT_PAGED64_FP4, PAGE_SIZE, IndexKCache,
                             pack_e2m1, page_views, store_fp4_rows, ue8m0_bytes)
from .contract.validate import CPU_AS_DEVICE
from .dispatch.platform import platform_of
from .compressor import CompressorState
from .config import IndexerConfig
from .indexer import Indexer


def random_cache(num_pages: int, device, fp8_dtype: torch.dtype = torch.float8_e4m3fn, seed: int = 0,
                 layout: str = "paged64_fp8_e4m3"):
    """An index-K cache of random finite keys with positive scales, generated on ``device`` in chunks (a
    128 x 128K-token cache is 2 GiB: no host copy of it). ``layout``: the fp8 pages, or a plain layout (bf16 keys,
    or int8 keys with fp16 scales) for the targets whose kernels read those."""
    cache = IndexKCache.allocate(num_pages, device, fp8_dtype, layout)
    gen = torch.Generator(device=device).manual_seed(seed)
    if cache.is_plain:
        for start in range(0, num_pages, 2048):
            stop = min(num_pages, start + 2048)
            values = torch.randn(stop - start, *cache.data.shape[1:], device=device, generator=gen)
            if cache.scales is None:
                cache.data[start:stop] = values.to(cache.data.dtype)
            else:
                cache.data[start:stop] = (values * 40).clamp(-127, 127).round().to(torch.int8)
                cache.scales[start:stop] = (torch.rand(stop - start, *cache.scales.shape[1:], device=device,
                                                       generator=gen) * 0.01 + 1e-3).to(torch.float16)
        return cache
    keys, scales = page_views(cache.data, fp8_dtype)
    limit = torch.finfo(fp8_dtype).max
    step = 2048
    for start in range(0, num_pages, step):
        stop = min(num_pages, start + step)
        keys[start:stop] = (torch.randn(stop - start, *keys.shape[1:], device=device, generator=gen) * 100).clamp(
            -limit, limit).to(fp8_dtype)
        scales[start:stop] = torch.rand(stop - start, scales.shape[1], device=device, generator=gen) * 0.01 + 1e-3
    return cache


def decode_step(cfg: IndexerConfig, indexer: Indexer, batch: int, context: int, device, seed: int = 0):
    """(x, q_lora, q_lora_quant, DecodeBatch, cache, compressor_state) of one synthetic decode step over
    ``context`` tokens, every request alike; the cache has the layout the target's platform stores (what
    `Indexer.allocate_cache` picks); the compressor state (C4 only, else None) is fresh: the step pools its own
    tokens. ``q_lora_quant`` is what attention hands over (RMSNorm + fp8 quant of a random q_a)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    keys = context // cfg.compress_ratio + 1
    pages = -(-keys // PAGE_SIZE)
    layout = platform_of(indexer.target.vendor).cache_layout(cfg.compress_ratio)
    cache = random_cache(batch * pages, device, indexer.fp8_dtype, seed, layout=layout)
    table = torch.randperm(batch * pages, generator=gen).to(torch.int32).view(batch, pages)
    db = DecodeBatch.build([context] * batch, table, num_cache_pages=batch * pages, device=device,
                           compress_ratio=cfg.compress_ratio)
    x = torch.randn(batch, cfg.hidden_size, generator=gen).to(device, torch.bfloat16)
    q_a = (torch.randn(batch, cfg.q_lora_rank, generator=gen) * 2).to(device, torch.bfloat16)
    norm_w = (torch.rand(cfg.q_lora_rank, generator=gen) + 0.5).to(device, torch.bfloat16)
    q_lora, q_lora_quant = ops.rmsnorm_quant_fp8(q_a, norm_w, 1e-6)
    state = CompressorState.allocate(batch, cfg, device) if cfg.compress_ratio > 1 else None
    return x, q_lora, q_lora_quant, db, cache, state


def real_decode_logits(batch: int, context: int, device, seed: int = 0, indexer: Indexer | None = None,
                       x_scale: float = 1.0):
    """Indexer logits as a real V3.2 decode step makes them: keys of ``context`` random tokens stored by the
    indexer's own k path, queries from its q path, paged logits through the registry (DeepGEMM or Triton on a
    GPU). Random activations and seeded random weights, never zeros. Returns ``(logits [B, context] fp32,
    context_lens [B, 1] int32, block_table, q_fp8, weights, cache)``."""
    cfg = IndexerConfig.deepseek_v32()
    indexer = indexer or Indexer(cfg, device=device).init_random(seed)
    plan = indexer.step_plan(4096, decode=False)  # the indexer's own steps, as a prefill runs them
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    pages = -(-context // PAGE_SIZE)
    cache = IndexKCache.allocate(batch * pages, device, indexer.fp8_dtype)
    table = torch.randperm(batch * pages, generator=gen).to(torch.int32).view(batch, pages).to(device)
    step = 4096
    for b in range(batch):
        for start in range(0, context, step):
            n = min(step, context - start)
            x = (torch.randn(n, cfg.hidden_size, generator=gen) * x_scale).to(device, torch.bfloat16)
            pos = torch.arange(start, start + n, device=device)
            slots = table[b].long()[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
            plan.steps.k_path(plan, x, pos, slots, cache.data)
    x = (torch.randn(batch, cfg.hidden_size, generator=gen) * x_scale).to(device, torch.bfloat16)
    q_lora = torch.randn(batch, cfg.q_lora_rank, generator=gen).to(device, torch.bfloat16)
    positions = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
    q_fp8, weights = plan.steps.q_path(plan, x, q_lora, positions, None)
    lens = torch.full((batch, 1), context, dtype=torch.int32, device=device)
    q = q_fp8.view(batch, 1, cfg.n_heads, cfg.head_dim)
    logits = ops.paged_mqa_logits(q, cache.data, weights, lens, table, context)
    return logits, lens, table, q, weights, cache


def cuda_kernels(fn) -> "Counter[str]":
    """The CUDA kernels one call of ``fn`` launches, by name (torch profiler; memcpy / memset left out). ``fn`` runs
    once before, so JIT compiles and first resolutions stay out of the count."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return Counter(e.name for e in prof.events() if e.device_type.name == "CUDA" and "Memcpy" not in e.name
                   and "Memset" not in e.name)


# --- the conformance check: one implementation against the reference --------------------------------------------
# Tolerances, each with its reason. A plugin passing them computes the op's contract; a wrong rotation, layout, sign
# or index space fails them by far.
FP8_RTOL = 2**-3 + 2**-7  # one e4m3 step (3 mantissa bits: 1/8 of a value at the bottom of its binade), plus a scale
#                           from an amax rounded differently inside the kernel
FP8_ATOL_OF_SCALE = 2**-8  # two subnormal e4m3 steps (2^-9 of the group's scale each)
FP4_RTOL = 2**-1 + 2**-7  # one e2m1 step: 1 -> 1.5, 2 -> 3 and 4 -> 6 are half a value
INT8_RTOL = 2**-7  # the fp16 scale rounded from an amax computed in another precision
LOGITS_RTOL = 2e-3  # of a row's largest |logit|: fp8 products are exact, the fp32 sums' order is not (the ROCm
#                     self-tests use the same bound)
FLOAT_TOLERANCES = {  # output dtype -> (rtol, atol as a fraction of the row's largest |value|)
    torch.bfloat16: (2**-7, 2**-10),  # one bf16 step (8 significant bits), sums in another order
    torch.float16: (2**-10, 2**-12),  # one fp16 step (11 significant bits)
    torch.float32: (2**-10, 2**-10),  # fp32 sums of many products (GEMMs, softmax pooling) in another order / TF32
}


class ConformanceError(AssertionError):
    """An implementation disagrees with the reference (`check_implementation`); the message lists every failure."""


def _row_max(t: torch.Tensor) -> torch.Tensor:
    finite = torch.where(torch.isfinite(t), t.abs(), torch.zeros_like(t))
    return finite.amax(dim=-1, keepdim=True) if t.dim() else finite


def _within(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float, atol) -> str | None:
    """``|got - want| <= rtol * |want| + atol`` elementwise (fp32); infinities must match exactly, NaN never passes."""
    got, want = got.float(), want.float()
    inf = torch.isinf(want)
    bad = torch.isnan(got) | (inf & (got != want))
    allowed = rtol * want.abs() + atol
    diff = torch.where(inf, torch.zeros_like(want), (got - want).abs())
    bad |= ~inf & ~(diff <= allowed)
    count = int(bad.sum())
    if count == 0:
        return None
    at = tuple(int(i) for i in torch.nonzero(bad)[0])
    allowed_at = allowed.expand_as(want)[at] if isinstance(allowed, torch.Tensor) else allowed
    return (f"{name}: {count} of {want.numel()} values differ from the reference beyond the tolerance (first at "
            f"{list(at)}: {float(got[at]):.6g}, reference {float(want[at]):.6g}, allowed |diff| "
            f"{float(allowed_at):.3g})")


def _float_result(name: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    rtol, atol = FLOAT_TOLERANCES.get(want.dtype, FLOAT_TOLERANCES[torch.float32])
    return _within(name, got, want, rtol, atol * _row_max(want.float()))


def _fp8_values(name: str, got: torch.Tensor, want: torch.Tensor, want_scale: torch.Tensor) -> str | None:
    """Dequantized fp8 groups (values times their scale): one e4m3 step apart at most."""
    return _within(name, got, want, FP8_RTOL, FP8_ATOL_OF_SCALE * want_scale.abs())


def _grouped(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp8 codes [..., W] times their per-group scales [..., W / g] (fp32)."""
    groups = scales.shape[-1]
    values = codes.float().reshape(*scales.shape, codes.shape[-1] // groups)
    return (values * scales.float()[..., None]).reshape(codes.shape)


def _group_scale_like(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    groups = scales.shape[-1]
    return scales.float()[..., None].expand(*scales.shape, codes.shape[-1] // groups).reshape(codes.shape)


def _compare_quant_fp8_groups(args, want, got, want_args, got_args) -> list[str]:
    return [f for f in [_fp8_values("values x scales", _grouped(*got), _grouped(*want),
                                    _group_scale_like(*want))] if f]


def _compare_rmsnorm_quant_fp8(args, want, got, want_args, got_args) -> list[str]:
    found = [_float_result("normed x", got[0], want[0]),
             _fp8_values("values x scales", _grouped(got[1], got[2]), _grouped(want[1], want[2]),
                         _group_scale_like(want[1], want[2]))]
    return [f for f in found if f]


def _q_values(codes: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """What the logits read of a prologue's q: each head row's codes times its weight (the q scale is folded in)."""
    return codes.float() * weights.float()[..., None]


def _compare_q_prologue(args, want, got, want_args, got_args) -> list[str]:
    found = _fp8_values("q codes x head weights", _q_values(*got), _q_values(*want), want[1][..., None])
    return [found] if found else []


def _compare_q_prologue_fp4(args, want, got, want_args, got_args) -> list[str]:
    block = args[7]
    reference = _q_values(*want)
    blocks = reference.reshape(*reference.shape[:-1], -1, block)
    # An e2m1 step near zero is half the block's scale, a power of two below amax / 3.
    atol = (blocks.abs().amax(dim=-1, keepdim=True) / 6).expand_as(blocks).reshape(reference.shape)
    found = _within("q codes x head weights", _q_values(*got), reference, FP4_RTOL, atol)
    return [found] if found else []


def _untouched_rows(name: str, rows_got: torch.Tensor, rows_before: torch.Tensor, written: torch.Tensor
                    ) -> str | None:
    """The rows of a cache (or scale) view a store does not name must keep their bytes."""
    keep = torch.ones(rows_got.shape[0], dtype=torch.bool, device=rows_got.device)
    keep[written] = False
    changed = (rows_got[keep].reshape(int(keep.sum()), -1).view(torch.uint8)
               != rows_before[keep].reshape(int(keep.sum()), -1).view(torch.uint8)).any(dim=-1)
    count = int(changed.sum())
    return f"{name}: {count} slots that slot_mapping does not name were written" if count else None


def _compare_k_prologue_store(args, want, got, want_args, got_args) -> list[str]:
    fp8 = args[11]
    slots = args[7][args[7] >= 0].long()
    found = []
    rows = [page_views(a[6], fp8) for a in (got_args, want_args, args)]
    keys = [r[0].reshape(-1, r[0].shape[-1]) for r in rows]
    scales = [r[1].reshape(-1, 1) for r in rows]
    for name, views in (("kv_cache keys", keys), ("kv_cache scales", scales)):
        found.append(_untouched_rows(name, views[0], views[2], slots))
    found.append(_fp8_values("stored keys x scales", keys[0][slots].float() * scales[0][slots],
                             keys[1][slots].float() * scales[1][slots], scales[1][slots]))
    return [f for f in found if f]


def _compare_plain_q(args, want, got, want_args, got_args) -> list[str]:
    found = [_float_result("weights", got[2], want[2])]
    if args[7] == "bf16":
        found.append(_float_result("q", got[0], want[0]))
    else:
        found.append(_within("q int8 x scales", got[0].float() * got[1].float()[..., None],
                             want[0].float() * want[1].float()[..., None], INT8_RTOL,
                             want[1].float()[..., None]))  # one int8 step is the row's scale
    return [f for f in found if f]


def _compare_k_prologue_store_plain(args, want, got, want_args, got_args) -> list[str]:
    slots = args[8][args[8] >= 0].long()
    caches = [a[6].reshape(-1, a[6].shape[-1]) for a in (got_args, want_args, args)]
    found = [_untouched_rows("key_cache", caches[0], caches[2], slots)]
    if args[12] == "bf16":
        found.append(_float_result("stored keys", caches[0][slots], caches[1][slots]))
    else:
        scales = [a[7].reshape(-1, 1) for a in (got_args, want_args, args)]
        found.append(_untouched_rows("key_scales", scales[0], scales[2], slots))
        found.append(_within("stored keys x scales", caches[0][slots].float() * scales[0][slots].float(),
                             caches[1][slots].float() * scales[1][slots].float(), INT8_RTOL,
                             scales[1][slots].float()))
    return [f for f in found if f]


def _compare_floats(args, want, got, want_args, got_args) -> list[str]:
    pairs = zip(got, want) if isinstance(want, tuple) else [(got, want)]
    return [f for i, (g, w) in enumerate(pairs) if (f := _float_result(f"result {i}", g, w))]


def _compare_logits(args, want, got, want_args, got_args) -> list[str]:
    found = _within("logits", got, want, 0.0, LOGITS_RTOL * _row_max(want))
    return [found] if found else []


def _compare_exact(args, want, got, want_args, got_args) -> list[str]:
    pairs = zip(got, want) if isinstance(want, tuple) else [(got, want)]
    return [f"result {i}: {int((g != w).sum())} of {w.numel()} values differ from the reference (exact op)"
            for i, (g, w) in enumerate(pairs) if not torch.equal(g, w)]


def _compare_c4_compress_pool(args, want, got, want_args, got_args) -> list[str]:
    found = [_float_result("pooled entries", got, want)]
    if not torch.equal(got_args[1], want_args[1]):  # the state is a copy of proj rows: exact
        found.append(f"state: {int((got_args[1] != want_args[1]).sum())} values differ from the reference's roll")
    return [f for f in found if f]


def _slots_to_positions(slots: torch.Tensor, block_table: torch.Tensor, row_request: torch.Tensor) -> torch.Tensor:
    """Physical cache slots back to request-local positions (-1 stays; a slot outside the request's pages: -2)."""
    pages_total = int(block_table.max()) + 1 if block_table.numel() else 1
    logical = torch.full((block_table.shape[0], max(pages_total, int(slots.max()) // PAGE_SIZE + 1)), -2,
                         dtype=torch.long, device=slots.device)
    for b in range(block_table.shape[0]):
        row = block_table[b].long()
        used = row >= 0
        logical[b, row[used]] = torch.arange(row.shape[0], device=slots.device)[used]
    page = logical[row_request.long()[:, None], slots.clamp_min(0).long() // PAGE_SIZE]
    pos = torch.where(page >= 0, page * PAGE_SIZE + slots.long() % PAGE_SIZE, page)
    return torch.where(slots >= 0, pos, torch.full_like(pos, -1))


def _topk_failures(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor, starts: torch.Tensor | None,
                   tolerance: torch.Tensor | float) -> list[str]:
    """Each row must hold as many indices as the reference's (first, then -1), distinct, visible, and each at least
    the reference's worst chosen score minus ``tolerance`` (a tie or a near-tie may pick another key)."""
    failures = []
    rows = want.shape[0]
    tol = tolerance if isinstance(tolerance, torch.Tensor) else torch.full((rows, 1), float(tolerance))
    for r in range(rows):
        w, g = want[r].long(), got[r].long()
        count = int((w >= 0).sum())
        if int((g >= 0).sum()) != count or bool((g[:count] < 0).any()):
            failures.append(f"row {r} holds {int((g >= 0).sum())} indices where the reference holds {count} (the "
                            f"first {count} slots, -1 after)")
            continue
        picked = g[:count]
        if picked.unique().numel() != count:
            failures.append(f"row {r} repeats an index")
            continue
        start = int(starts[r]) if starts is not None else 0
        cols = picked + start
        seen = scores[r, cols.clamp(0, scores.shape[1] - 1)]
        if bool(((cols < 0) | (cols >= scores.shape[1])).any()) or bool(torch.isinf(seen).any()):
            failures.append(f"row {r} selects a key it cannot see ({picked.tolist()[:8]} ...)")
            continue
        if count == 0:
            continue
        worst = scores[r, w[:count] + start].min()
        below = scores[r, cols] < worst - float(tol[r, 0])
        if bool(below.any()):
            j = int(picked[below][0])
            failures.append(f"row {r} selects key {j} (score {float(scores[r, j + start]):.6g}) that is not among "
                            f"the top {count} (the reference's worst chosen score is {float(worst):.6g})")
    if len(failures) > 3:
        failures = failures[:3] + [f"... {len(failures) - 3} more rows"]
    return failures


def _compare_topk_indices(args, want, got, want_args, got_args) -> list[str]:
    logits, _, ends, starts, block_table, row_request = args
    cols = torch.arange(logits.shape[1], device=logits.device)
    first = torch.zeros_like(ends) if starts is None else starts
    visible = (cols >= first[:, None].long()) & (cols < ends[:, None].long())
    never = torch.full_like(logits.float(), float("-inf"))  # masked, and NaN: it ranks as -inf (the NaN rule)
    scores = torch.where(visible & ~torch.isnan(logits), logits.float(), never)
    if block_table is not None:
        requests = torch.arange(logits.shape[0], device=logits.device) if row_request is None else row_request
        got, want = (_slots_to_positions(t, block_table, requests) for t in (got, want))
    return _topk_failures(got, want, scores, first, 0.0)  # the scores are the input: only exact ties may differ


def _compare_lightning_indexer(args, want, got, want_args, got_args, *, logits_of) -> list[str]:
    q, kv_cache, weights, context_lens, block_table, max_context_len, _, return_slots = args
    scores = logits_of("paged_mqa_logits")(*args[:6])
    if return_slots:
        requests = torch.arange(q.shape[0], device=q.device).repeat_interleave(q.shape[1])
        got, want = (_slots_to_positions(t, block_table, requests) for t in (got, want))
    return _topk_failures(got, want, scores, None, LOGITS_RTOL * _row_max(scores))


def _compare_ragged_mqa_topk(args, want, got, want_args, got_args, *, logits_of) -> list[str]:
    scores = logits_of("ragged_mqa_logits")(*args[:6])
    return _topk_failures(got, want, scores, args[4], LOGITS_RTOL * _row_max(scores))


def _compare_lightning_indexer_ragged(args, want, got, want_args, got_args) -> list[str]:
    from .contract.cache import gather_plain_keys

    q, q_scales, key_cache, key_scales, weights, cu_seqlens_q, seq_lens_k, block_table, _, ratio = args
    qf = q.float() * (q_scales.float()[..., None] if q.dtype == torch.int8 else 1.0)
    cu, lens = cu_seqlens_q.tolist(), seq_lens_k.tolist()
    width = max(lens) // ratio if lens else 0
    scores = torch.full((q.shape[0], max(width, 1)), float("-inf"), device=q.device)
    for b, length in enumerate(lens):  # the contract's score: sum_h w[t, h] * relu(q[t, h] . k[j]), causal
        n, entries = cu[b + 1] - cu[b], length // ratio
        if n == 0 or entries == 0:
            continue
        keys = gather_plain_keys(key_cache, key_scales, block_table[b], entries)
        rows = slice(cu[b], cu[b + 1])
        s = torch.einsum("thd,sd->ths", qf[rows], keys).relu().mul(weights[rows].float()[..., None]).sum(1)
        ends = (length - n + torch.arange(1, n + 1, device=q.device)) // ratio
        visible = torch.arange(entries, device=q.device)[None, :] < ends[:, None]
        scores[rows, :entries] = torch.where(visible, s, torch.full_like(s, float("-inf")))
    return _topk_failures(got, want, scores, None, LOGITS_RTOL * _row_max(scores))


_COMPARE = {
    "quant_fp8_groups": _compare_quant_fp8_groups,
    "rmsnorm_quant_fp8": _compare_rmsnorm_quant_fp8,
    "q_prologue": _compare_q_prologue,
    "q_prologue_fp4": _compare_q_prologue_fp4,
    "k_prologue_store": _compare_k_prologue_store,
    "gemm_fp8_blockscale": _compare_floats,
    "ragged_mqa_logits": _compare_logits,
    "paged_mqa_logits": _compare_logits,
    "topk_indices": _compare_topk_indices,
    "lightning_indexer": _compare_lightning_indexer,
    "ragged_mqa_topk": _compare_ragged_mqa_topk,
    "c4_compress_pool": _compare_c4_compress_pool,
    "q_prologue_plain": _compare_plain_q,
    "k_prologue_store_plain": _compare_k_prologue_store_plain,
    "lightning_indexer_ragged": _compare_lightning_indexer_ragged,
    "x_projections": _compare_floats,
    "decode_metadata": _compare_exact,
}
_NEEDS_LOGITS = {"lightning_indexer", "ragged_mqa_topk"}


def sample_arguments(op: str, device="cpu", seed: int = 0, fp8_dtype: torch.dtype = torch.float8_e4m3fn
                     ) -> dict[str, tuple]:
    """Random arguments of ``op``, in its schema's order, DeepSeek's sizes (64 index heads, head dim 128) on a few
    tokens: label -> arguments. Never zeros; top-k rows both shorter and longer than k."""
    from .contract.declarations import DECLARED
    from .rope import cos_sin_table

    if op not in _COMPARE:
        raise ValueError(f"sample_arguments: unknown op {op!r}; ops: {', '.join(sorted(_COMPARE))}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dev = torch.device(device)

    def randn(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=gen) * scale).to(dev, dtype)

    def positive(*shape, dtype=torch.float32):
        return (torch.rand(*shape, generator=gen) + 0.05).to(dev, dtype)

    def fp8(*shape):
        return (torch.randn(*shape, generator=gen) * 3).to(dev, fp8_dtype)

    def ints(values, dtype=torch.int32):
        return torch.tensor(values, dtype=dtype, device=dev)

    def perm(n, dtype=torch.int32):
        return torch.randperm(n, generator=gen).to(dev, dtype)

    t, heads, dim = 6, 64, HEAD_DIM
    cos_sin = cos_sin_table(64, 4096, device=dev)
    positions = perm(4096, torch.int64)[:t]
    slots = torch.cat([perm(3 * PAGE_SIZE, torch.int64)[: t - 1], ints([-1], torch.int64)])  # one padding row
    norm_args = (positive(dim), randn(dim, scale=0.1), 1e-6)

    def fp4_rows(n):
        """Random keys as the FP4 pages store them: e2m1 values (never -0) and power-of-two block scales."""
        grid = torch.tensor(E2M1_GRID, dtype=torch.float32)
        values = grid[torch.randint(0, len(E2M1_GRID), (n, dim), generator=gen)]
        values = torch.where(torch.rand(n, dim, generator=gen) < 0.5, -values, values)
        scales = torch.ldexp(torch.ones(n, dim // FP4_BLOCK), torch.randint(-6, 3, (n, dim // FP4_BLOCK),
                                                                             generator=gen))
        return values.to(dev), scales.to(dev)

    def paged(batch, next_n, lens, pages_per_request, k, return_slots=False, fp4=False):
        if fp4:
            cache = IndexKCache.allocate(batch * pages_per_request, dev, fp8_dtype, LAYOUT_PAGED64_FP4)
            store_fp4_rows(cache.data, torch.arange(cache.num_pages * PAGE_SIZE, device=dev),
                           *fp4_rows(cache.num_pages * PAGE_SIZE))
        else:
            cache = random_cache(batch * pages_per_request, dev, fp8_dtype, seed)
        table = perm(batch * pages_per_request).view(batch, pages_per_request)
        context = ints([[max(1, length - next_n + 1 + j) for j in range(next_n)] for length in lens])
        args = (fp8(batch, next_n, heads, dim), cache.data, randn(batch * next_n, heads), context, table,
                pages_per_request * PAGE_SIZE)
        return args if k is None else (*args, k, return_slots)

    def ragged(rows, keys, k=None, fp4=False):
        starts = ints(sorted(torch.randint(0, keys // 4, (rows,), generator=gen).tolist()))
        ends = torch.clamp(starts + ints(torch.randint(keys // 4, keys, (rows,), generator=gen).tolist()), max=keys)
        if fp4:
            values, scales = fp4_rows(keys)
            k_rows, k_scales = pack_e2m1(values), ue8m0_bytes(scales)
        else:
            k_rows, k_scales = fp8(keys, dim), positive(keys)
        args = (fp8(rows, heads, dim), k_rows, k_scales, randn(rows, heads), starts, ends.to(torch.int32))
        return args if k is None else (*args, k)

    def plain_cache(fmt, pages):
        cache = IndexKCache.allocate(pages, dev, layout=f"paged64_{fmt}")
        if fmt == "bf16":
            cache.data.copy_(randn(*cache.data.shape, dtype=torch.bfloat16))
            return cache.data, torch.empty(0, dtype=torch.float16, device=dev)
        cache.data.copy_(torch.randint(-127, 128, cache.data.shape, generator=gen).to(dev, torch.int8))
        cache.scales.copy_(positive(*cache.scales.shape, dtype=torch.float16) * 0.01)
        return cache.data, cache.scales

    q_bf16 = randn(t, heads, dim, scale=2.0, dtype=torch.bfloat16)
    head_weights = randn(t, heads)
    weight_scale = heads ** -0.5 * dim ** -0.5
    if op == "quant_fp8_groups":
        x = randn(t, 1536, scale=3.0, dtype=torch.bfloat16)
        return {"fp32 scales": (x, 128, False, fp8_dtype), "ue8m0 scales": (x, 128, True, fp8_dtype)}
    if op == "rmsnorm_quant_fp8":
        return {"q_lora": (randn(t, 1536, scale=3.0, dtype=torch.bfloat16), positive(1536, dtype=torch.bfloat16),
                           1e-6, 128, False, fp8_dtype)}
    if op == "q_prologue":
        return {"V3.2": (q_bf16, positions, cos_sin, head_weights, weight_scale, 0, False, True, fp8_dtype)}
    if op == "q_prologue_fp4":
        return {"V4": (q_bf16, positions, cos_sin, head_weights, weight_scale, dim - 64, True, 32, fp8_dtype)}
    if op == "k_prologue_store":
        cache = random_cache(3, dev, fp8_dtype, seed)
        return {"V3.2": (randn(t, dim, scale=2.0, dtype=torch.bfloat16), *norm_args, positions, cos_sin, cache.data,
                         slots, 0, False, True, fp8_dtype, "layernorm")}
    if op == "gemm_fp8_blockscale":
        return {"wq_b block": (fp8(t, 512), positive(t, 4) * 0.01, fp8(256, 512), positive(2, 4) * 0.01,
                               torch.bfloat16, "fp32")}
    if op == "ragged_mqa_logits":
        return {"prefill rows": ragged(8, 300), "fp4 keys": ragged(8, 300, fp4=True)}
    if op == "paged_mqa_logits":
        return {"decode": paged(3, 1, [150, 40, 256], 4, None), "next_n 2": paged(2, 2, [200, 129], 4, None),
                "fp4 pages": paged(2, 1, [150, 256], 4, None, fp4=True)}
    if op == "topk_indices":
        rows, cols = 6, 300
        logits = randn(rows, cols)
        ends = ints([300, 10, 120, 250, 16, 299])
        starts = ints([0, 0, 20, 100, 0, 7])
        table = perm(2 * 5).view(2, 5)
        return {"k 16": (logits, 16, ends, None, None, None),
                "k 16 with starts": (logits, 16, ends, starts, None, None),
                "slots": (logits, 16, ends, None, table, ints([0, 0, 0, 1, 1, 1])),
                "k 2048": (randn(3, 2600), 2048, ints([2600, 1000, 2100]), None, None, None)}
    if op == "lightning_indexer":
        return {"k 16": paged(3, 1, [150, 12, 256], 4, 16), "k 16 slots": paged(2, 2, [200, 129], 4, 16, True),
                "k 2048": paged(2, 1, [2500, 700], 40, 2048),
                "k 16 fp4 pages": paged(2, 1, [150, 256], 4, 16, fp4=True)}
    if op == "ragged_mqa_topk":
        return {"k 16": ragged(8, 300, 16), "k 2048": ragged(4, 2600, 2048),
                "k 16 fp4 keys": ragged(8, 300, 16, fp4=True)}
    if op == "c4_compress_pool":
        proj = randn(t, 4 * dim)
        state = randn(3, 8, 4 * dim)
        return {"one request": (proj, state, randn(4, 2 * dim, scale=0.1), torch.arange(3, 3 + t, device=dev),
                                ints([0] * t), ints([0] * t, torch.int64), ints([0, 4]))}
    if op == "q_prologue_plain":
        return {fmt: (q_bf16, positions, cos_sin, head_weights, weight_scale, 0, False, fmt)
                for fmt in ("bf16", "int8")}
    if op == "k_prologue_store_plain":
        return {fmt: (randn(t, dim, scale=2.0, dtype=torch.bfloat16), *norm_args, positions, cos_sin,
                      *plain_cache(fmt, 3), slots, 0, False, "layernorm", fmt) for fmt in ("bf16", "int8")}
    if op == "lightning_indexer_ragged":
        cases = {}
        for fmt in ("bf16", "int8"):
            key_cache, key_scales = plain_cache(fmt, 8)
            if fmt == "bf16":
                q, q_scales = q_bf16, torch.empty(0, dtype=torch.float16, device=dev)
            else:
                q = torch.randint(-127, 128, (t, heads, dim), generator=gen).to(dev, torch.int8)
                q_scales = positive(t, heads, dtype=torch.float16) * 0.01
            cases[f"{fmt} k 16"] = (q, q_scales, key_cache, key_scales, randn(t, heads), ints([0, 2, 6]),
                                    ints([180, 250]), perm(8).view(2, 4), 16, 1)
        return cases
    if op == "x_projections":
        x = randn(t, 512, dtype=torch.bfloat16)
        return {"fp32 head weights": (x, randn(heads, 512, scale=0.05), randn(dim, 512, scale=0.05,
                                                                              dtype=torch.bfloat16)),
                "bf16 head weights": (x, randn(heads, 512, scale=0.05, dtype=torch.bfloat16),
                                      randn(dim, 512, scale=0.05, dtype=torch.bfloat16))}
    if op == "decode_metadata":
        table = perm(12).view(3, 4)
        return {"V3.2": (ints([70, 129, 1]), table, ints([1, 0, 2], torch.int64), 1, 1),
                "C4 next_n 2": (ints([70, 129, 0]), table, ints([1, 0, 2], torch.int64), 2, 4)}
    raise AssertionError(f"{op} is in the comparison table but has no sample ({sorted(DECLARED)})")


def _clone(args: tuple) -> tuple:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def check_implementation(impl_id: str, *, cases: dict[str, tuple] | None = None, target=None, device=None,
                         seed: int = 0, registry=None) -> list[str]:
    """Run the registered implementation ``impl_id`` (``<op>.<vendor>.<variant>``) and the op's reference on the same
    random inputs (`sample_arguments`, or ``cases``: label -> schema-ordered arguments of your own shapes) and check
    the result's structure, dtype, shape and device against the op's declaration, its values against the
    reference's within the op's tolerance (the constants above say why each is what it is), that only the arguments
    the op mutates were written, and, for stores, that no slot outside ``slot_mapping`` changed.

    ``target`` (default: this device's if the implementation serves it, else the first arch it names) decides the
    fp8 flavour and resolution: a case whose problem the implementation rejects there is skipped and listed. Raises
    `ConformanceError` listing every failure, ValueError when no case could run; returns one line per case.
    A plugin's test: ``assert check_implementation("topk_indices.myvendor.radix")``."""
    from . import ops as ops_module
    from .contract.declarations import DECLARED
    from .dispatch import results
    from .dispatch.plugins import default_registry
    from .dispatch.platform import vendors
    from .dispatch.target import device_of, detect_target, parse_target

    registry = registry or default_registry()
    op = impl_id.split(".", 1)[0]
    if op not in DECLARED or op not in _COMPARE:
        raise ValueError(f"check_implementation checks implementations of the declared ops ({', '.join(DECLARED)}); "
                         f"{impl_id!r} is not one (a pipeline strategy is checked end to end: Indexer.forward with "
                         f"it forced against the reference)")
    impl = next((i for i in registry.implementations(op) if i.impl_id == impl_id), None)
    if impl is None:
        raise ValueError(f"check_implementation: {impl_id!r} is not registered; registered for {op}: "
                         f"{', '.join(i.impl_id for i in registry.implementations(op))}")
    device = torch.device(device) if device is not None else device_of(None)
    if target is None:
        here = detect_target(device)
        arches = [parse_target(platform_of(t).archs[0] if t in vendors() else t) for t in impl.targets
                  if t in vendors() or (t != "*" and _parses(t))]
        target = here if impl.serves(here) or not arches else arches[0]
    elif isinstance(target, str):
        target = parse_target(target, "check_implementation(target=)")
    decl = DECLARED[op]
    reference = _reference_function(registry, op)
    cases = cases if cases is not None else sample_arguments(op, device, seed, target.fp8_dtype)
    # A composition is built per problem (its factory takes the ops it uses, bound for the target and problem).
    built = {}

    def build(problem):
        key = problem if impl.uses else None
        if key not in built:
            try:
                built[key] = registry.composition(impl, target, problem) if impl.uses else impl.factory()
            except Exception as exc:  # noqa: BLE001 - reported as the check's failure
                raise ConformanceError(f"{impl_id}: factory failed: {type(exc).__name__}: {exc}") from exc
            if not callable(built[key]):
                raise ConformanceError(f"{impl_id}: factory returned {built[key]!r}, not a callable")
        return built[key]

    if not impl.uses:
        build(None)  # a broken factory fails the check before any case
    lines, failures, skipped = [], [], []
    checked = ops_module.OPERATORS[op].arguments  # the public op's checks, which name the bad argument
    for label, args in cases.items():
        try:
            args = checked(**dict(zip(decl.arguments, args)), target=target)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"check_implementation: case {label!r} is not a valid call of {op}: {exc}") from None
        problem = ops_module.OPERATORS[op].problem(*args)
        res = registry.resolve(op, target, problem, force=impl_id)
        if res.chosen is not impl:
            reason = next(c.reason for c in res.candidates if c.impl.impl_id == impl_id)
            skipped.append(f"{label}: skipped, {impl_id} rejects {problem} on {target}: {reason}")
            continue
        want_args, got_args = _clone(args), _clone(args)
        want = reference(*want_args)
        try:
            got = build(problem)(*got_args)
        except Exception as exc:  # noqa: BLE001 - reported as the case's failure
            failures.append(f"{label}: raised {type(exc).__name__}: {exc}")
            continue
        found = []
        meta = results.mismatch(results.expected_result(decl, args), got, args[0].device)
        if meta is not None:
            found.append(f"wrong result: {meta}")
        else:
            for name, before, after in zip(decl.arguments, args, got_args):
                if isinstance(before, torch.Tensor) and name not in decl.mutates and not _same_bytes(before, after):
                    found.append(f"wrote its input {name}, which {op} does not mutate")
            compare = _COMPARE[op]
            if op in _NEEDS_LOGITS:
                found += compare(args, want, got, want_args, got_args,
                                 logits_of=lambda other: _reference_function(registry, other))
            else:
                found += compare(args, want, got, want_args, got_args)
        failures += [f"{label}: {f}" for f in found]
        lines.append(f"{label}: {'ok' if not found else 'FAILED'}")
    if failures:
        raise ConformanceError(f"{impl_id} on {target} disagrees with {op}.reference.torch:\n  "
                               + "\n  ".join(failures))
    if not lines:
        raise ValueError(f"{impl_id} ran on none of the cases: " + "; ".join(skipped) + "; pass cases= with "
                         f"arguments it takes")
    return lines + skipped


def _parses(name: str) -> bool:
    from .dispatch.target import parse_target

    try:
        parse_target(name)
    except ValueError:
        return False
    return True


def _reference_function(registry, op: str):
    """The op's reference implementation (the oracle), built from its registration."""
    ref_id = f"{op}.reference.torch"
    impl = next((i for i in registry.implementations(op) if i.impl_id == ref_id), None)
    if impl is None:
        raise ValueError(f"{op} has no reference implementation registered ({ref_id})")
    return impl.factory()


# --- host syncs inside a step ------------------------------------------------------------------------------------
class HostSyncError(AssertionError):
    """A tensor's value was read on the host (or a shape made to depend on values) inside `forbid_host_syncs`."""


# Reading a value on the host, or an op whose output shape depends on the values (the host must wait for the device
# to know how much to allocate). On a GPU or NPU each one blocks the host until the device catches up, so nothing
# queued after it (the other stream's work, the next launch) is enqueued early: the overlap a second stream was for
# is lost, and a graph capture fails.
_READS = frozenset({"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__complex__",
                    "__array__", "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount",
                    "nonzero_static_without_size"})


def _has_mask(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class _HostSyncGuard(torch.overrides.TorchFunctionMode):
    def __init__(self, where: str, cpu_as_device: bool) -> None:
        super().__init__()
        self.where = where
        self.cpu_as_device = cpu_as_device
        self._token = None

    def __enter__(self):
        if self.cpu_as_device:
            self._token = CPU_AS_DEVICE.set(True)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self._token is not None:
                CPU_AS_DEVICE.reset(self._token)
                self._token = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        what = None
        if name in _READS:
            what = f"{name}()"
        elif name in ("__getitem__", "__setitem__") and len(args) > 1 and _has_mask(args[1]):
            what = f"{name} with a boolean mask (its result's size depends on the values)"
        elif name == "where" and len(args) + len(kwargs) == 1:
            what = "where(condition) (nonzero)"
        elif name == "repeat_interleave" and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"),
                                                        torch.Tensor) and kwargs.get("output_size") is None:
            what = "repeat_interleave with tensor repeats and no output_size"
        if what is not None:
            raise HostSyncError(f"host sync inside {self.where}: {what} reads a device tensor's values on the host")
        return func(*args, **kwargs)


def forbid_host_syncs(where: str = "a step", cpu_as_device: bool = True):
    """A context in which every host read of a tensor's value raises `HostSyncError`: ``.item()``, ``.tolist()``,
    ``bool(t)`` / ``int(t)`` / ``float(t)``, ``nonzero``, indexing by a boolean mask, ``unique`` and the other ops
    whose result size depends on the values. Device-agnostic (a torch function mode), so CPU tests catch the syncs
    a GPU or NPU run would make: wrap a pipeline strategy or any op that must only enqueue work. With
    ``cpu_as_device`` (the default) CPU tensors count as device tensors for the library's value checks too
    (`contract.validate.ranges_checked` answers as on a GPU without ``DSA_INDEXER_CHECK_RANGES``)."""
    return _HostSyncGuard(where, cpu_as_device)
