"""V4's FP4 index-K cache (``paged64_fp4_e2m1``, 68 bytes per token) on the CPU: its bytes decoded here against
DeepGEMM's documented layout (docs/v4.md), store / gather, the reference paged logits over it, resolution of the
``keys`` fact, the refusals, and the whole C4 indexer with FP4 pages against the fold path (FP4 values folded into
the 132-byte fp8 pages)."""

import dataclasses

import pytest
import torch

from dsa_indexer import CompressorState, DecodeBatch, IndexerConfig, IndexKCache, Indexer, PrefillBatch, ops
from dsa_indexer.backends.reference import kernels as ref
from dsa_indexer.contract import cache as kc
from dsa_indexer.contract.validate import IndexerInputError
from dsa_indexer.dispatch.environment import Environment
from dsa_indexer.dispatch.plugins import default_registry
from dsa_indexer.dispatch.target import Target

FP4 = kc.LAYOUT_PAGED64_FP4
MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _fp4_rows(n: int, seed: int, spread: int = 3):
    """Random keys through the recipe's quant: (e2m1 values [n, 128], power-of-two block scales [n, 4])."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 128, generator=gen)
    x = x * torch.exp2(torch.randint(-spread, spread + 1, (n, 4, 1), generator=gen).float()).repeat_interleave(32, 1)[
        ..., 0]
    return ref.quant_fp4_e2m1(x, 32)


def _decode_token(page_bytes: torch.Tensor, row: int) -> torch.Tensor:
    """One token's 128 values from a page's 4352 raw bytes, decoded by hand from the documented layout: 64 value
    bytes at row * 64 (low nibble = element 2i, bit 3 = sign, bits 0-2 = code), its int32 word at 4096 + row * 4 (byte
    b = ue8m0 exponent of block b)."""
    raw = page_bytes.tolist()
    out = []
    word = raw[4096 + 4 * row: 4096 + 4 * row + 4]
    for i in range(64):
        byte = raw[row * 64 + i]
        for nib in (byte & 0xF, byte >> 4):
            mag = MAGNITUDES[nib & 7]
            out.append(-mag if nib & 8 else mag)
    scale = [2.0 ** (word[(j // 32)] - 127) for j in range(128)]
    return torch.tensor([v * s for v, s in zip(out, scale)])


def test_store_writes_deepgemms_paged_fp4_layout():
    values, scales = _fp4_rows(200, seed=1)
    cache = IndexKCache.allocate(5, layout=FP4)
    assert cache.data.shape == (5, 64, 1, 68) and cache.data.dtype == torch.uint8
    assert cache.key_format == "fp4" and not cache.is_plain and cache.num_pages == 5 and cache.capacity == 320
    gen = torch.Generator().manual_seed(2)
    slots = torch.randperm(320, generator=gen)[:200]
    slots[7] = -1  # a padding row stores nothing
    kc.store_fp4_rows(cache.data, slots, values, scales)
    want = ref.dequant_fp4_e2m1(values, scales)
    pages = cache.data.view(5, -1)
    for i in (0, 1, 50, 199):
        s = int(slots[i])
        assert torch.equal(_decode_token(pages[s // 64], s % 64), want[i])
    untouched = sorted(set(range(320)) - set(slots.tolist()))
    assert all(not _decode_token(pages[s // 64], s % 64).any() for s in untouched[:5])
    keep = slots >= 0
    got_values, got_scales = cache.gather_fp4(slots[keep])
    assert torch.equal(got_values.abs(), values[keep].abs()) and torch.equal(got_scales, scales[keep])
    assert torch.equal(ref.dequant_fp4_e2m1(got_values, got_scales), want[keep])


def test_gather_folds_into_the_fold_paths_fp8_values():
    values, scales = _fp4_rows(130, seed=3)
    for fp8 in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        cache = IndexKCache.allocate(3, fp8_dtype=fp8, layout=FP4)
        kc.store_fp4_rows(cache.data, torch.arange(130), values, scales)
        keys, row_scale = cache.gather(torch.arange(130))
        want_keys, want_row = ref.fold_fp4_to_fp8(values, scales, fp8)
        assert keys.dtype == fp8 and torch.equal(keys.float(), want_keys.float()) and torch.equal(row_scale, want_row)


def test_the_fp4_pages_keep_what_the_fold_loses():
    """A block 2^16 below its row's largest: the fold into e4m3 loses it (subnormals), the FP4 pages keep it."""
    values, scales = _fp4_rows(4, seed=4)
    scales[:, 1] = scales[:, 0] * 2.0 ** -16
    exact = ref.dequant_fp4_e2m1(values, scales)
    cache = IndexKCache.allocate(1, layout=FP4)
    kc.store_fp4_rows(cache.data, torch.arange(4), values, scales)
    assert torch.equal(ref.dequant_fp4_e2m1(*cache.gather_fp4(torch.arange(4))), exact)
    folded, row = ref.fold_fp4_to_fp8(values, scales)
    assert not torch.equal(folded.float() * row[:, None], exact)


def test_nan_block_and_off_grid_values():
    values, scales = _fp4_rows(2, seed=5)
    scales[1, 2] = float("nan")  # the quant's NaN rule: a block holding NaN has a NaN scale
    cache = IndexKCache.allocate(1, layout=FP4)
    kc.store_fp4_rows(cache.data, torch.arange(2), values, scales)
    keys = ref.dequant_fp4_e2m1(*cache.gather_fp4(torch.arange(2)))
    assert torch.isnan(keys[1, 64:96]).all() and torch.isfinite(keys[0]).all() and torch.isfinite(keys[1, :64]).all()
    with pytest.raises(IndexerInputError, match="e2m1 grid"):
        kc.pack_e2m1(torch.tensor([[0.5, 2.5]]))
    with pytest.raises(IndexerInputError, match=r"scales must be \[N, 4\]"):
        kc.store_fp4_rows(cache.data, torch.arange(2), values, scales[:, :2])


def test_the_layout_is_validated():
    with pytest.raises(IndexerInputError, match=r"paged64_fp4_e2m1 must have shape \[num_pages, 64, 1, 68\]"):
        IndexKCache(torch.zeros(2, 64, 1, 132, dtype=torch.uint8), layout=FP4)
    with pytest.raises(ValueError, match="scales must be None"):
        IndexKCache(torch.zeros(2, 64, 1, 68, dtype=torch.uint8), layout=FP4, scales=torch.zeros(2, 64, 1))
    with pytest.raises(ValueError, match="gather_fp4 reads the paged64_fp4_e2m1 layout"):
        IndexKCache.allocate(1).gather_fp4(torch.arange(3))
    cache = IndexKCache.allocate(1, layout=FP4)
    with pytest.raises(ValueError, match=r"slots must lie in \[0, 64\)"):
        cache.gather(torch.tensor([64]))
    clone = cache.clone()
    assert clone.layout == FP4 and clone.data.data_ptr() != cache.data.data_ptr()


def _caches_with_the_same_keys(pages: int, seed: int):
    values, scales = _fp4_rows(pages * 64, seed)
    fp4 = IndexKCache.allocate(pages, layout=FP4)
    kc.store_fp4_rows(fp4.data, torch.arange(pages * 64), values, scales)
    fp8 = IndexKCache.allocate(pages)
    kc.store_rows(fp8.data, torch.arange(pages * 64), *ref.fold_fp4_to_fp8(values, scales))
    return fp4, fp8


@pytest.mark.parametrize("next_n", [1, 2])
def test_reference_paged_logits_over_fp4_pages_equal_the_fold_path(next_n):
    fp4, fp8 = _caches_with_the_same_keys(6, seed=6)
    gen = torch.Generator().manual_seed(7)
    batch, heads = 3, 64
    q = (torch.randn(batch, next_n, heads, 128, generator=gen) * 3).to(torch.float8_e4m3fn)
    weights = torch.randn(batch * next_n, heads, generator=gen)
    table = torch.randperm(6, generator=gen).to(torch.int32).view(3, 2)
    last = torch.tensor([1, 0, 100], dtype=torch.int32)
    lens = (last[:, None] - (next_n - 1 - torch.arange(next_n))).clamp_min(0).to(torch.int32)
    got = ops.paged_mqa_logits(q, fp4.data, weights, lens, table, 128)
    want = ops.paged_mqa_logits(q, fp8.data, weights, lens, table, 128)
    assert got.shape == (batch * next_n, 128) and bool(torch.isneginf(got[lens.reshape(-1) == 0]).all())
    # Scaling every product by the power-of-two row scale before or after the same fp32 sums is exact.
    assert torch.equal(got, want)
    top = ops.lightning_indexer(q, fp4.data, weights, lens, table, 128, 16)
    assert torch.equal(top, ops.lightning_indexer(q, fp8.data, weights, lens, table, 128, 16))


def _resolve(op: str, arch: str, keys: str, **env):
    problem = dict(heads=64, dim=128, next_n=1, fp8="fn", keys=keys)
    if op == "lightning_indexer":
        problem.update(k=512, slots=False)
    return default_registry().resolve(op, Target("cuda", arch), ops.problem(op, **problem),
                                      environment=Environment.simulated(**env))


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_fp4_keys_resolve_to_the_fp4_kernel_and_every_fp8_reader_refuses(arch):
    env = dict(gpu=True, triton=True, deep_gemm=True, cuda_jit=True)
    res = _resolve("paged_mqa_logits", arch, "fp4", **env)
    # sm100 with DeepGEMM: its FP4 adapter (tests/backends/test_deepgemm_fp4_paged_cpu.py); else the Triton kernel.
    want = "paged_mqa_logits.cuda.deepgemm_fp4" if arch == "sm100" else "paged_mqa_logits.triton.logits_fp4"
    assert res.chosen.impl_id == want
    reasons = {c.impl.impl_id: c.reason for c in res.candidates}
    assert "keys=fp4: DeepGEMM paged logits takes fp8" in reasons["paged_mqa_logits.cuda.deepgemm"]
    assert "keys=fp4: the Triton logits kernel takes fp8" in reasons["paged_mqa_logits.triton.logits"]
    assert _resolve("paged_mqa_logits", arch, "fp8", **env).chosen.impl_id == "paged_mqa_logits.cuda.deepgemm"
    res = _resolve("lightning_indexer", arch, "fp4", **env)
    assert res.chosen.impl_id == "lightning_indexer.generic.composed"  # FP4 logits, then the top-k
    reasons = {c.impl.impl_id: c.reason for c in res.candidates}
    assert "keys=fp4" in reasons["lightning_indexer.cuda.deepgemm_radix"]
    assert "keys=fp4" in reasons["lightning_indexer.cuda.fused"]
    fp8 = _resolve("paged_mqa_logits", arch, "fp8", gpu=True, triton=True)
    assert fp8.chosen.impl_id == "paged_mqa_logits.triton.logits"  # the FP4 kernel never takes fp8 pages
    assert "keys=fp8" in {c.impl.impl_id: c.reason for c in fp8.candidates}["paged_mqa_logits.triton.logits_fp4"]


def test_aiter_refuses_fp4_keys():
    res = default_registry().resolve("paged_mqa_logits", Target("rocm", "gfx950"),
                                     ops.problem("paged_mqa_logits", heads=64, dim=128, next_n=1, fp8="fn",
                                                 keys="fp4"),
                                     environment=Environment.simulated(gpu=True, aiter=True, triton=True))
    reasons = {c.impl.impl_id: c.reason for c in res.candidates}
    assert "keys=fp4: aiter's paged kernel takes fp8" in reasons["paged_mqa_logits.rocm.aiter"]
    assert res.chosen.impl_id == "paged_mqa_logits.triton.logits_fp4"


def test_the_layout_is_refused_for_other_recipes():
    v32 = Indexer(IndexerConfig.deepseek_v32())
    with pytest.raises(IndexerInputError, match="layout='paged64_fp4_e2m1' holds FP4 e2m1 keys, but V3.2's indexer"):
        v32.allocate_cache(1, layout=FP4)
    v4_fp8 = Indexer(IndexerConfig.deepseek_v4_flash())
    with pytest.raises(IndexerInputError, match="key_quant is 'fp8'.*key_quant='fp4_e2m1'"):
        v4_fp8.allocate_cache(1, layout=FP4)
    cfg = dataclasses.replace(IndexerConfig.deepseek_v4_flash(), max_position=4096)
    indexer = Indexer(cfg).init_random(0)
    batch = PrefillBatch.build([0], [8], torch.zeros(1, 1, dtype=torch.int32), num_cache_pages=1, compress_ratio=4)
    x = torch.randn(8, cfg.hidden_size).to(torch.bfloat16)
    q_lora = torch.randn(8, cfg.q_lora_rank).to(torch.bfloat16)
    with pytest.raises(IndexerInputError, match="cache.layout='paged64_fp4_e2m1'"):
        indexer(x, q_lora, batch.positions, batch, IndexKCache.allocate(1, layout=FP4),
                compressor_state=CompressorState.allocate(1, cfg))
    assert Indexer(IndexerConfig.deepseek_v4_flash(key_quant="fp4_e2m1")).allocate_cache(2, FP4).layout == FP4


def test_fp4_block_other_than_32_is_refused_for_the_fp4_pages():
    cfg = dataclasses.replace(IndexerConfig.deepseek_v4_flash(key_quant="fp4_e2m1"), max_position=4096, fp4_block=16)
    indexer = Indexer(cfg).init_random(0)
    batch = PrefillBatch.build([0], [8], torch.zeros(1, 1, dtype=torch.int32), num_cache_pages=1, compress_ratio=4)
    x = torch.randn(8, cfg.hidden_size).to(torch.bfloat16)
    q_lora = torch.randn(8, cfg.q_lora_rank).to(torch.bfloat16)
    with pytest.raises(IndexerInputError, match="one scale per 32 values; IndexerConfig.fp4_block is 16"):
        indexer(x, q_lora, batch.positions, batch, indexer.allocate_cache(1, FP4),
                compressor_state=CompressorState.allocate(1, cfg))


PAGES_PER_REQUEST = 16


def _run_c4(layout: str, seed: int, lengths, decode_steps: int, budget: int | None = None,
            fp4_prefill_keys: str = "packed"):
    cfg = dataclasses.replace(IndexerConfig.deepseek_v4_flash(key_quant="fp4_e2m1"), max_position=8192, topk=64)
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths) + decode_steps * len(lengths)
    x = torch.randn(total, cfg.hidden_size, generator=gen).to(torch.bfloat16)
    q_lora = torch.randn(total, cfg.q_lora_rank, generator=gen).to(torch.bfloat16)
    pages = PAGES_PER_REQUEST * len(lengths)
    table = torch.arange(pages, dtype=torch.int32).view(len(lengths), PAGES_PER_REQUEST)
    indexer = Indexer(cfg).init_random(seed)
    indexer.fp4_prefill_keys = fp4_prefill_keys
    if budget is not None:
        indexer.logits_budget_bytes = budget
    cache = indexer.allocate_cache(pages, layout)
    state = CompressorState.allocate(len(lengths), cfg)
    pb = PrefillBatch.build([0] * len(lengths), lengths, table, num_cache_pages=pages, compress_ratio=4)
    n = sum(lengths)
    outs = [indexer(x[:n], q_lora[:n], pb.positions, pb, cache, compressor_state=state)]
    for step in range(decode_steps):
        db = DecodeBatch.build([length + step + 1 for length in lengths], table, num_cache_pages=pages,
                               compress_ratio=4)
        rows = slice(n + len(lengths) * step, n + len(lengths) * (step + 1))
        outs.append(indexer(x[rows], q_lora[rows], db.positions, db, cache, compressor_state=state))
    return outs, cache


def test_c4_indexer_with_fp4_pages_equals_the_fold_path():
    """Prefill then decode (contexts of 250-450 entries, top-64): the same top-k, row by row, as the fp8 pages the
    FP4 values are folded into; the FP4 pages hold the same keys (the fold is exact at these scale spreads)."""
    lengths = [1001, 1803]
    fp4_out, fp4_cache = _run_c4(FP4, seed=11, lengths=lengths, decode_steps=3)
    fp8_out, fp8_cache = _run_c4(kc.LAYOUT_PAGED64, seed=11, lengths=lengths, decode_steps=3)
    for got, want in zip(fp4_out, fp8_out):
        assert torch.equal(got, want)
    entries = torch.cat([torch.arange(length // 4) + 64 * PAGES_PER_REQUEST * r for r, length in enumerate(lengths)])
    fp4_keys, fp4_row = fp4_cache.gather(entries)
    fp8_keys, fp8_row = fp8_cache.gather(entries)
    assert torch.equal(fp4_keys.float() * fp4_row[:, None], fp8_keys.float() * fp8_row[:, None])
    assert bool(fp4_row.ne(fp4_row[0]).any())  # real, varied keys were stored


def test_bounded_c4_prefill_with_fp4_pages_equals_the_one_pass():
    # One CPU thread: the budgeted prefill runs its matmuls on other row counts than the one pass, and with several
    # threads the CPU BLAS may split (and so sum) those shapes differently; bit equality is the claim on one thread
    # (with two torch threads on a 2-core machine the comparison failed, on the code before this pin too).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lengths = [2411]
        one_pass, cache = _run_c4(FP4, seed=12, lengths=lengths, decode_steps=0)
        bounded, bounded_cache = _run_c4(FP4, seed=12, lengths=lengths, decode_steps=0, budget=4 << 20)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_pass[0], bounded[0]) and torch.equal(cache.data, bounded_cache.data)


# --- prefill over the FP4 pages' bytes as stored (ragged_mqa_logits with keys="fp4") ----------------------------
def test_gather_packed_reads_the_stored_bytes():
    values, scales = _fp4_rows(3 * 64, seed=21, spread=8)
    cache = IndexKCache.allocate(3, layout=FP4)
    kc.store_fp4_rows(cache.data, torch.arange(3 * 64), values, scales)
    slots = torch.tensor([130, 0, 63, 64, 191, 5])
    packed, scale_bytes = cache.gather_packed(slots)
    assert packed.dtype == scale_bytes.dtype == torch.uint8
    assert packed.shape == (6, 64) and scale_bytes.shape == (6, 4)
    pages = cache.data.view(3, -1)
    for i, slot in enumerate(slots.tolist()):
        hand = _decode_token(pages[slot // 64], slot % 64)
        assert torch.equal(kc.dequant_fp4_rows(packed[i], scale_bytes[i]), hand)
        assert torch.equal(hand, (values[slot].reshape(4, 32) * scales[slot][:, None]).reshape(128))
    with pytest.raises(ValueError, match="gather_packed reads the paged64_fp4_e2m1 layout"):
        IndexKCache.allocate(1).gather_packed(torch.arange(2))


def test_reference_ragged_logits_over_packed_keys_equal_the_fold_path():
    fp4, fp8 = _caches_with_the_same_keys(4, seed=22)
    gen = torch.Generator().manual_seed(23)
    slots = torch.randperm(4 * 64, generator=gen)[:200]
    packed = fp4.gather_packed(slots)
    folded = fp8.gather(slots)
    rows, heads = 9, 64
    q = (torch.randn(rows, heads, 128, generator=gen) * 3).to(torch.float8_e4m3fn)
    weights = torch.randn(rows, heads, generator=gen)
    ks = torch.randint(0, 100, (rows,), generator=gen).to(torch.int32)
    ke = (ks + torch.randint(0, 100, (rows,), generator=gen)).to(torch.int32)
    ke[0] = ks[0]
    got = ops.ragged_mqa_logits(q, *packed, weights, ks, ke)
    want = ops.ragged_mqa_logits(q, *folded, weights, ks, ke)
    assert bool(torch.isneginf(got[0]).all()) and bool(torch.isfinite(got[1, ks[1]:ke[1]]).all())
    assert torch.equal(got, want)  # power-of-two scales before or after the same fp32 sums: exact
    top = ops.ragged_mqa_topk(q, *packed, weights, ks, ke, 16)
    assert torch.equal(top, ops.ragged_mqa_topk(q, *folded, weights, ks, ke, 16))


def test_ragged_fp4_keys_are_validated():
    gen = torch.Generator().manual_seed(24)
    q = torch.randn(2, 32, 128, generator=gen).to(torch.float8_e4m3fn)
    weights, ks, ke = torch.randn(2, 32), torch.zeros(2, dtype=torch.int32), torch.full((2,), 8, dtype=torch.int32)
    packed, scale_bytes = torch.zeros(8, 64, dtype=torch.uint8), torch.full((8, 4), 127, dtype=torch.uint8)
    with pytest.raises(IndexerInputError, match=r"k must have shape \[\*, 64\]"):
        ops.ragged_mqa_logits(q, packed[:, :32], scale_bytes, weights, ks, ke)
    with pytest.raises(IndexerInputError, match="k_scales must have dtype uint8, got float32"):
        ops.ragged_mqa_logits(q, packed, torch.ones(8), weights, ks, ke)
    with pytest.raises(IndexerInputError, match=r"k_scales must have shape \[8, 4\]"):
        ops.ragged_mqa_logits(q, packed, scale_bytes[:, :2], weights, ks, ke)
    with pytest.raises(IndexerInputError, match="FP4 keys .* take head dim 128"):
        ops.ragged_mqa_topk(q[..., :64], packed, scale_bytes, weights, ks, ke, 4)
    with pytest.raises(IndexerInputError, match="ke"):
        ops.ragged_mqa_logits(q, packed, scale_bytes, weights, ks, ke + 1)


def _resolve_ragged(op: str, arch: str, keys: str, **env):
    problem = dict(heads=64, dim=128, fp8="fn", keys=keys, **({"k": 512} if op == "ragged_mqa_topk" else {}))
    platform = "rocm" if arch.startswith("gfx") else "cuda"
    res = default_registry().resolve(op, Target(platform, arch), ops.problem(op, **problem),
                                     environment=Environment.simulated(**env))
    return res, {c.impl.impl_id: c.reason for c in res.candidates}


def test_ragged_fp4_keys_resolve_to_an_fp4_reader_and_every_fp8_reader_refuses():
    env = dict(gpu=True, triton=True, deep_gemm=True, cuda_jit=True)
    res, reasons = _resolve_ragged("ragged_mqa_logits", "sm90", "fp4", **env)
    assert res.chosen.impl_id == "ragged_mqa_logits.triton.logits_fp4"
    assert "keys=fp4" in reasons["ragged_mqa_logits.cuda.deepgemm"]
    assert "keys=fp4" in reasons["ragged_mqa_logits.triton.logits"]
    res, reasons = _resolve_ragged("ragged_mqa_logits", "sm90", "fp8", **env)
    assert res.chosen.impl_id == "ragged_mqa_logits.cuda.deepgemm"
    assert "keys=fp8" in reasons["ragged_mqa_logits.triton.logits_fp4"]
    res, reasons = _resolve_ragged("ragged_mqa_topk", "sm90", "fp4", **env)
    assert res.chosen.impl_id == "ragged_mqa_topk.generic.composed"  # the FP4 logits, then the top-k
    assert "keys=fp4" in reasons["ragged_mqa_topk.triton.fused_topk"]
    assert "keys=fp4" in reasons["ragged_mqa_topk.cuda.deepgemm_radix"]
    res, reasons = _resolve_ragged("ragged_mqa_logits", "gfx950", "fp4", gpu=True, triton=True, aiter=True)
    assert res.chosen.impl_id == "ragged_mqa_logits.triton.logits_fp4"
    assert "keys=fp4: aiter's fp8_mqa_logits takes fp8" in reasons["ragged_mqa_logits.rocm.aiter"]


@pytest.mark.parametrize("budget", [None, 4 << 20])
def test_c4_prefill_scores_the_packed_fp4_keys_as_the_folded_ones(budget, monkeypatch):
    """Prefill (one pass and bounded) over the FP4 pages: reading the keys as stored (the default) and folding them
    into fp8 rows give the same top-k; only the packed run gathers the stored bytes."""
    lengths = [1203, 700]
    gathered = []
    real = IndexKCache.gather_packed
    monkeypatch.setattr(IndexKCache, "gather_packed",
                        lambda self, slots: gathered.append(len(slots)) or real(self, slots))
    packed, _ = _run_c4(FP4, seed=25, lengths=lengths, decode_steps=1, budget=budget)
    assert gathered == [sum(length // 4 for length in lengths)]  # one gather of every compressed entry
    folded, _ = _run_c4(FP4, seed=25, lengths=lengths, decode_steps=1, budget=budget, fp4_prefill_keys="folded")
    assert len(gathered) == 1
    for got, want in zip(packed, folded):
        assert torch.equal(got, want)
    assert bool((packed[0] >= 0).sum(1).gt(32).any())  # rows with a full top-64 among real keys


def test_the_fp4_prefill_keys_knob():
    cfg = IndexerConfig.deepseek_v4_flash(key_quant="fp4_e2m1")
    indexer = Indexer(cfg)
    assert indexer.fp4_prefill_keys == "auto"
    assert indexer.prefill_key_format(FP4) == "fp8"  # the CPU: no FP4-native logits, so the fold
    assert indexer.prefill_key_format(kc.LAYOUT_PAGED64) == "fp8"
    indexer.fp4_prefill_keys = "packed"
    assert indexer.prefill_key_format(FP4) == "fp4" and indexer.prefill_key_format(kc.LAYOUT_PAGED64) == "fp8"
    assert indexer.step_plan(256, False, cache_layout=FP4).prefill_keys == "fp4"
    assert indexer.step_plan(1, True, cache_layout=FP4).prefill_keys == "fp8"  # decode reads the pages in place
    indexer.fp4_prefill_keys = "folded"
    assert indexer.step_plan(256, False, cache_layout=FP4).prefill_keys == "fp8"
    indexer.fp4_prefill_keys = "fp4"
    with pytest.raises(IndexerInputError, match="fp4_prefill_keys must be one of 'auto', 'packed', 'folded', got"):
        indexer.step_plan(256, False, cache_layout=FP4)


@pytest.mark.parametrize("arch,want", [("sm100", "fp4"), ("sm90", "fp8")])
def test_auto_packs_the_fp4_keys_only_where_the_logits_are_fp4_native(arch, want):
    """sm100 with DeepGEMM: its fp8_fp4_mqa_logits (registry info native_fp4) reads the keys as stored; sm90 gets
    the Triton FP4 kernel, which decodes nibbles (3.8x the fp8 kernel's time at 128K on the H200), so the keys are folded."""
    from dsa_indexer.dispatch.plugins import load_plugins
    from dsa_indexer.dispatch.registry import Registry

    registry = Registry(environment=Environment.simulated(gpu=True, triton=True, deep_gemm=True, cuda_jit=True))
    load_plugins(registry, entry_points=False)
    indexer = Indexer(IndexerConfig.deepseek_v4_flash(key_quant="fp4_e2m1"), target=arch)
    assert indexer.prefill_key_format(FP4, registry) == want
