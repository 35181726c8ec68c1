"""DeepSeek-V4-Flash C4 indexer against a float64 oracle written from the public description (`v4_oracle`):
the config's RoPE, the compressor (whole prompt, chunked prefill, decode, next_n > 1, CUDA-graph-style padding),
the visibility rule and top-k, both key quant recipes, and a synthetic checkpoint under V4's real key names."""

import dataclasses
import math

import pytest
import torch
from safetensors.torch import save_file

import v4_oracle
from dsa_indexer import (Compressor, CompressorState, DecodeBatch, IndexerConfig, IndexerInputError, IndexKCache,
                         Indexer, PrefillBatch)
from dsa_indexer.graphs import DecodeBuffers
from dsa_indexer.rope import clear_shared_tables, cos_sin_table, shared_table_count

V4_TINY = dataclasses.replace(IndexerConfig.deepseek_v4_flash(), name="v4-tiny", hidden_size=256, q_lora_rank=256,
                              n_heads=4, topk=8, max_position=4096)


def fresh_seed() -> int:
    return int(torch.randint(0, 1 << 30, ()).item())


def test_v4_flash_config_carries_the_published_sizes_and_rope():
    cfg = IndexerConfig.deepseek_v4_flash()
    assert (cfg.hidden_size, cfg.q_lora_rank, cfg.n_heads, cfg.head_dim, cfg.topk) == (4096, 1024, 64, 128, 512)
    assert cfg.compress_ratio == 4 and cfg.rope_position == "last" and cfg.rope_interleaved and cfg.rope_offset == 64
    assert math.isclose(cfg.weight_scale, 64 ** -0.5 * 128 ** -0.5)
    assert cfg.rope_theta == 160000.0 and cfg.max_position == 1_048_576
    assert (cfg.yarn.factor, cfg.yarn.original_max_position, cfg.yarn.beta_fast, cfg.yarn.beta_slow) == (16, 65536, 32, 1)
    assert cfg.checkpoint_prefix.format(layer=2) == "layers.2.attn.indexer."
    assert cfg.ue8m0 and not IndexerConfig.deepseek_v4_flash(key_quant="fp8_fp32").ue8m0
    with pytest.raises(ValueError, match="FP4"):
        IndexerConfig.deepseek_v4_flash(key_quant="fp4_block32")


def test_v4_rope_table_is_yarn_scaled_even_when_the_table_is_short():
    """YaRN applies whenever configured (V4's rule), whatever the table length; 4096 rows < 65536 original."""
    table = cos_sin_table(64, 4096, V4_TINY.rope_theta, V4_TINY.yarn)
    inv = v4_oracle.yarn_inv_freqs()
    angle = torch.arange(4096, dtype=torch.float64)[:, None] * inv[None, :]
    want = torch.cat([angle.cos(), angle.sin()], dim=1)
    assert (table.double() - want).abs().max().item() < 1e-6  # fp32 rounding of values in [-1, 1]
    unscaled = 1.0 / 160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    assert not torch.allclose(inv, unscaled)  # the low frequencies really are divided by 16
    assert torch.allclose(inv[-1], unscaled[-1] / 16) and torch.allclose(inv[0], unscaled[0])


def test_rope_tables_are_shared_by_every_layer_of_a_config():
    clear_shared_tables()
    layers = [Indexer(V4_TINY) for _ in range(3)]
    assert layers[0].cos_sin is layers[2].cos_sin and shared_table_count() == 1
    other = Indexer(dataclasses.replace(V4_TINY, max_position=2048))
    assert other.cos_sin is not layers[0].cos_sin and shared_table_count() == 2


def _compressor(seed: int) -> Compressor:
    return Compressor(V4_TINY).init_random(torch.Generator().manual_seed(seed))


def test_compressor_matches_the_float64_oracle():
    seed = fresh_seed()
    comp = _compressor(seed)
    x = torch.randn(23, V4_TINY.hidden_size, generator=torch.Generator().manual_seed(seed + 1)).to(torch.bfloat16)
    got = comp.compress(x)
    want = v4_oracle.compress(x, comp.wkv.weight, comp.wgate.weight, comp.ape, comp.norm.weight)
    assert got.shape == (5, 128) and got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    # Both round the pooled value to bf16 before the norm; an fp32 vs float64 sum can land on either side of one
    # bf16 rounding, and the output is bf16 again: 2 bf16 ulps (2**-7 relative) cover it.
    assert torch.allclose(got.double(), want, rtol=2 ** -7, atol=2 ** -7), (got.double() - want).abs().max()
    # The vectorized oracle the GPU tests use is the loop oracle: float64 both, so only summation order differs.
    vec = v4_oracle.compress_vectorized(x, comp.wkv.weight, comp.wgate.weight, comp.ape, comp.norm.weight)
    assert torch.allclose(vec, want, rtol=1e-12, atol=1e-12)
    # Entry 0 has no previous group: changing the first group's part-A weights cannot change it.
    comp2 = _compressor(seed)
    comp2.wkv.weight[:128] += 1.0
    assert torch.equal(comp2.compress(x)[0], got[0]) and not torch.equal(comp2.compress(x)[1], got[1])


def _stored_keys(cache: IndexKCache, table_row: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.arange(n)
    return cache.gather(table_row.long()[idx // 64] * 64 + idx % 64)


@pytest.mark.parametrize("schedule", ["whole", "chunked_prefill", "decode_1", "decode_2", "mixed_requests"])
def test_every_step_schedule_stores_the_same_entries(schedule):
    """Prefill of a whole prompt, chunks of odd sizes, decode one token (or two) at a time, and a batch mixing
    requests at different phases all store the same compressed entries (state carried by CompressorState)."""
    seed = fresh_seed()
    indexer = Indexer(V4_TINY).init_random(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    length = 61
    xs = [torch.randn(length, V4_TINY.hidden_size, generator=gen).to(torch.bfloat16) for _ in range(2)]
    table = torch.tensor([[1], [3]], dtype=torch.int32)

    def run(steps) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cache = IndexKCache.allocate(4)
        state = CompressorState.allocate(2, V4_TINY)
        for kind, spans in steps:  # spans: [(request, start, stop)] in request order
            x = torch.cat([xs[r][a:b] for r, a, b in spans])
            reqs = [r for r, _, _ in spans]
            if kind == "prefill":
                batch = PrefillBatch.build([a for _, a, _ in spans], [b - a for _, a, b in spans], table[reqs],
                                           compress_ratio=4, state_slots=reqs)
            else:
                n = spans[0][2] - spans[0][1]
                batch = DecodeBatch.build([b for _, _, b in spans], table[reqs], next_n=n, compress_ratio=4,
                                          state_slots=reqs)
            indexer.store_keys(x, batch, cache, compressor_state=state)
        return [_stored_keys(cache, table[r], length // 4) for r in range(2)]

    whole = run([("prefill", [(0, 0, length), (1, 0, length)])])
    if schedule == "whole":
        got = run([("prefill", [(0, 0, length)]), ("prefill", [(1, 0, length)])])
    elif schedule == "chunked_prefill":
        cuts = [0, 3, 4, 11, 30, 31, length]
        got = run([("prefill", [(0, a, b), (1, a, b)]) for a, b in zip(cuts, cuts[1:])])
    elif schedule in ("decode_1", "decode_2"):
        n = 1 if schedule == "decode_1" else 2
        start = 9  # prefill 9 tokens, then decode the rest n at a time
        steps = [("prefill", [(0, 0, start), (1, 0, start)])]
        steps += [("decode", [(0, a, a + n), (1, a, a + n)]) for a in range(start, length - n + 1, n)]
        if (length - start) % n:
            steps += [("decode", [(0, length - 1, length), (1, length - 1, length)])]
        got = run(steps)
    else:
        got = run([("prefill", [(0, 0, 30)]), ("prefill", [(0, 30, 33), (1, 0, 50)]),
                   ("prefill", [(0, 33, length), (1, 50, length)])])
    for r in range(2):
        # The same fp8 bytes, up to a GEMM that may round the last fp32 bit differently for another row count.
        same = (got[r][0].float() == whole[r][0].float()).float().mean().item()
        assert same > 0.99 and torch.allclose(got[r][1], whole[r][1], rtol=1e-3)


def test_decode_buffers_derive_the_same_c4_metadata_as_the_builder():
    """The CUDA-graph derivation (device ops only) gives the builder's entry slots; padding rows touch nothing."""
    indexer = Indexer(V4_TINY)
    buffers = DecodeBuffers.allocate(indexer, batch_size=3, max_context_len=128, next_n=2, device=torch.device("cpu"))
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    seq = torch.tensor([67, 8], dtype=torch.int32)
    buffers.load(torch.zeros(4, 256, dtype=torch.bfloat16), torch.zeros(4, 256, dtype=torch.bfloat16), seq, table,
                 torch.tensor([1, 0]))
    got = buffers.derive()
    want = DecodeBatch.build(seq, table, next_n=2, compress_ratio=4, state_slots=[1, 0], max_context_len=128)
    assert torch.equal(got.slot_mapping[:4], want.slot_mapping) and torch.equal(got.state_slot[:4], want.state_slot)
    assert got.slot_mapping[4:].tolist() == [-1, -1] and got.state_slot[4:].tolist() == [-1, -1]
    assert set(want.compress_rows.tolist()) <= set(got.compress_rows.tolist())
    # 67 tokens: rows at positions 65, 66 (no entry); 8 tokens: positions 6, 7 -> 7 completes entry 1 at page 1.
    assert want.slot_mapping.tolist() == [-1, -1, -1, 1 * 64 + 1] and want.compress_rows.tolist() == [3]


@pytest.mark.parametrize("key_quant", ["fp8_ue8m0", "fp8_fp32"])
def test_c4_prefill_and_decode_topk_against_the_float64_oracle(key_quant):
    cfg = dataclasses.replace(IndexerConfig.deepseek_v4_flash(key_quant=key_quant), name="v4-tiny", hidden_size=256,
                              q_lora_rank=256, n_heads=4, topk=8, max_position=4096)
    seed = fresh_seed()
    indexer = Indexer(cfg).init_random(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    length = 301  # 75 complete entries; the last token (300) starts entry 75, not yet visible
    x = torch.randn(length, cfg.hidden_size, generator=gen).to(torch.bfloat16)
    q_lora = torch.randn(length, cfg.q_lora_rank, generator=gen).to(torch.bfloat16)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    cache = IndexKCache.allocate(4)
    state = CompressorState.allocate(1, cfg)
    prefill = []
    for a, b in ((0, 130), (130, length - 3)):  # chunked prefill, then 3 decode steps
        pb = PrefillBatch.build([a], [b - a], table, num_cache_pages=4, compress_ratio=4)
        prefill.append(indexer(x[a:b], q_lora[a:b], pb.positions, pb, cache, compressor_state=state))
    decode = []
    for t in range(length - 3, length):
        db = DecodeBatch.build([t + 1], table, num_cache_pages=4, compress_ratio=4)
        decode.append(indexer(x[t:t + 1], q_lora[t:t + 1], db.positions, db, cache, compressor_state=state))
    got = torch.cat(prefill + decode)

    comp = indexer.compressor
    entries = v4_oracle.compress(x, comp.wkv.weight, comp.wgate.weight, comp.ape, comp.norm.weight)
    logits = v4_oracle.c4_logits(q_lora, x, indexer.wq_b.dequantize(), indexer.weights_proj.weight, entries,
                                 cfg.n_heads, v4_oracle.yarn_inv_freqs())
    agree = total = 0
    for t in range(length):
        visible = (t + 1) // 4
        row = [i for i in got[t].tolist() if i >= 0]
        assert all(0 <= i < visible for i in row), f"query {t} got an entry it may not see"
        assert len(row) == min(cfg.topk, visible) and len(set(row)) == len(row)
        assert got[t].tolist()[len(row):] == [-1] * (cfg.topk - len(row))
        want = v4_oracle.topk_of_row(logits[t], visible, cfg.topk)
        agree += len(set(row) & set(want))
        total += len(want)
    # fp8 quantization of q, keys and q_lora can swap keys whose logits are within ~1% at the k-th place. Measured
    # with deliberate bugs: the two channel halves swapped -> 0.29, key RoPE at 4j + 3 instead of 4j -> 0.76-0.79.
    # (YaRN barely moves angles at positions < 300; the table test above checks it.)
    assert agree / total >= 0.85, agree / total


def test_c4_forward_needs_a_compressor_state():
    indexer = Indexer(V4_TINY).init_random(0)
    db = DecodeBatch.build([12], [[0]], compress_ratio=4)
    x = torch.randn(1, 256).to(torch.bfloat16)
    with pytest.raises(IndexerInputError, match="compressor_state is required"):
        indexer(x, x, db.positions, db, IndexKCache.allocate(1))
    with pytest.raises(IndexerInputError, match="state slot 1 but compressor_state has 1"):
        db2 = DecodeBatch.build([12], [[0]], compress_ratio=4, state_slots=[1])
        indexer(x, x, db2.positions, db2, IndexKCache.allocate(1), compressor_state=CompressorState.allocate(1, V4_TINY))
    with pytest.raises(IndexerInputError, match="state_slots must be distinct"):
        DecodeBatch.build([12, 13], [[0], [1]], compress_ratio=4, state_slots=[0, 0])


def _bf16(shape, gen, std=1.0):
    return (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)


def _v4_layer_tensors(cfg: IndexerConfig, layer: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One C4 layer as V4's inference checkpoint stores it (names, dtypes and shapes of model.safetensors.index.json
    of DeepSeek-V4-Flash), plus neighbouring tensors the indexer must ignore."""
    hd, d = cfg.n_heads * cfg.head_dim, cfg.head_dim
    p = f"layers.{layer}.attn."
    wq = torch.randn(hd, cfg.q_lora_rank, generator=gen) * 0.05
    exponents = torch.randint(120, 124, (hd // 128, cfg.q_lora_rank // 128), generator=gen, dtype=torch.int32)
    return {
        p + "indexer.wq_b.weight": wq.to(torch.float8_e4m3fn),
        p + "indexer.wq_b.scale": exponents.to(torch.uint8).view(torch.float8_e8m0fnu),
        p + "indexer.weights_proj.weight": _bf16((cfg.n_heads, cfg.hidden_size), gen, cfg.hidden_size ** -0.5),
        p + "indexer.compressor.wkv.weight": _bf16((2 * d, cfg.hidden_size), gen, cfg.hidden_size ** -0.5),
        p + "indexer.compressor.wgate.weight": _bf16((2 * d, cfg.hidden_size), gen, cfg.hidden_size ** -0.5),
        p + "indexer.compressor.ape": torch.randn(4, 2 * d, generator=gen) * 0.5,
        p + "indexer.compressor.norm.weight": (1 + 0.1 * torch.randn(d, generator=gen)).to(torch.bfloat16),
        # The attention's own compressor and projections sit beside the indexer under the same layer.
        p + "compressor.ape": torch.randn(4, 64, generator=gen),
        p + "wq_b.weight": _bf16((64, cfg.q_lora_rank), gen),
        p + "wq_b.scale": torch.full((1, cfg.q_lora_rank // 128), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu),
    }


def test_synthetic_v4_checkpoint_loads_by_its_real_names_and_runs_end_to_end(tmp_path):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    tensors = {**_v4_layer_tensors(V4_TINY, 2, gen), **_v4_layer_tensors(V4_TINY, 4, gen)}
    save_file(tensors, str(tmp_path / "model-00001-of-00002.safetensors"))
    indexer = Indexer.from_safetensors(tmp_path, layer=4, config=V4_TINY)
    p = "layers.4.attn.indexer."
    assert indexer.wq_b_is_block_fp8
    scale = 2.0 ** (tensors[p + "wq_b.scale"].view(torch.uint8).double() - 127)  # UE8M0: 2 ** (byte - 127)
    dequant = tensors[p + "wq_b.weight"].double() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(indexer.wq_b.dequantize().double(), dequant)
    assert torch.equal(indexer.compressor.ape, tensors[p + "compressor.ape"])
    assert torch.equal(indexer.compressor.wkv.weight, tensors[p + "compressor.wkv.weight"].float())

    length = 97
    x = _bf16((length, V4_TINY.hidden_size), gen)
    q_lora = _bf16((length, V4_TINY.q_lora_rank), gen)
    table = torch.tensor([[1]], dtype=torch.int32)
    cache, state = IndexKCache.allocate(2), CompressorState.allocate(1, V4_TINY)
    pb = PrefillBatch.build([0], [length], table, compress_ratio=4)
    got = indexer(x, q_lora, pb.positions, pb, cache, compressor_state=state)
    entries = v4_oracle.compress(x, tensors[p + "compressor.wkv.weight"], tensors[p + "compressor.wgate.weight"],
                                 tensors[p + "compressor.ape"], tensors[p + "compressor.norm.weight"])
    logits = v4_oracle.c4_logits(q_lora, x, dequant, tensors[p + "weights_proj.weight"], entries, V4_TINY.n_heads,
                                 v4_oracle.yarn_inv_freqs())
    agree = sum(len(set(got[t].tolist()) & set(v4_oracle.topk_of_row(logits[t], (t + 1) // 4, 8)))
                for t in range(31, length))
    assert agree / (8 * (length - 31)) >= 0.85


def test_v4_checkpoint_errors_name_the_key(tmp_path):
    gen = torch.Generator().manual_seed(1)
    tensors = _v4_layer_tensors(V4_TINY, 2, gen)
    del tensors["layers.2.attn.indexer.compressor.ape"]
    save_file(tensors, str(tmp_path / "a.safetensors"))
    with pytest.raises(KeyError, match="layers.2.attn.indexer.compressor.ape"):
        Indexer.from_safetensors(tmp_path / "a.safetensors", layer=2, config=V4_TINY)
    tensors = _v4_layer_tensors(V4_TINY, 2, gen)
    tensors["layers.2.attn.indexer.wq_b.scale"] = tensors["layers.2.attn.indexer.wq_b.scale"][:1]
    save_file(tensors, str(tmp_path / "b.safetensors"))
    with pytest.raises(ValueError, match=r"wq_b.scale has shape \[1, 2\], expected \[4, 2\]"):
        Indexer.from_safetensors(tmp_path / "b.safetensors", layer=2, config=V4_TINY)


def test_full_size_v4_checkpoint_is_recognized_without_a_config(tmp_path):
    cfg = IndexerConfig.deepseek_v4_flash()
    save_file(_v4_layer_tensors(cfg, 2, torch.Generator().manual_seed(3)), str(tmp_path / "m.safetensors"))
    indexer = Indexer.from_safetensors(tmp_path, layer=2)
    assert indexer.config.name == "deepseek-v4-flash" and indexer.compressor is not None
    assert tuple(indexer.wq_b.weight.shape) == (8192, 1024) and tuple(indexer.compressor.wkv.weight.shape) == (256, 4096)


@pytest.mark.parametrize("change, name", [
    (lambda a: a.update(proj=a["proj"].double()), "proj"),
    (lambda a: a.update(state=a["state"][:, :4]), "state"),
    (lambda a: a.update(ape=a["ape"][:, :128]), "proj"),
    (lambda a: a.update(rows=torch.tensor([9])), "rows"),
    (lambda a: a.update(state_slot=torch.tensor([0, 0, 0, 5])), "state_slot"),
    (lambda a: a.update(positions=torch.arange(3)), "positions"),
], ids=["proj-float64", "state-window-4", "ape-narrow", "rows-out-of-range", "state_slot-out-of-range",
        "positions-short"])
def test_c4_compress_pool_bad_input_names_the_argument(change, name):
    from dsa_indexer import ops

    args = dict(proj=torch.randn(4, 512), state=torch.randn(3, 8, 512), ape=torch.randn(4, 256),
                positions=torch.arange(4), row_request=torch.zeros(4, dtype=torch.int32),
                state_slot=torch.zeros(4, dtype=torch.int64), rows=torch.tensor([3]))
    change(args)
    with pytest.raises(IndexerInputError, match=name):
        ops.c4_compress_pool(**args)


def test_prime_state_rebuilds_a_slot_after_a_prefix_cache_hit():
    """A request whose prefix keys are cached but whose state slot is fresh: priming the slot with the prefix's last
    8 tokens makes the next steps store exactly what an unbroken run stores."""
    seed = fresh_seed()
    indexer = Indexer(V4_TINY).init_random(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(45, V4_TINY.hidden_size, generator=gen).to(torch.bfloat16)
    table = torch.tensor([[2]], dtype=torch.int32)
    caches, states = [IndexKCache.allocate(3) for _ in range(2)], [CompressorState.allocate(1, V4_TINY)
                                                                   for _ in range(2)]
    prefix = 30  # not a multiple of 4: the window of the next entry starts inside the prefix
    for cache, state in zip(caches, states):
        indexer.store_keys(x[:prefix], PrefillBatch.build([0], [prefix], table, compress_ratio=4), cache,
                           compressor_state=state)
    states[1] = CompressorState.allocate(1, V4_TINY)  # the hit: keys cached, state lost
    indexer.compressor.prime_state(states[1], 0, x[prefix - 11:prefix], prefix - 11)
    for cache, state in zip(caches, states):
        indexer.store_keys(x[prefix:], PrefillBatch.build([prefix], [45 - prefix], table, compress_ratio=4), cache,
                           compressor_state=state)
    assert torch.equal(caches[0].data, caches[1].data)
    lost = IndexKCache.allocate(3)  # without priming the entries that straddle the prefix differ
    lost.data.copy_(caches[0].data)
    indexer.store_keys(x[prefix:], PrefillBatch.build([prefix], [45 - prefix], table, compress_ratio=4), lost,
                       compressor_state=CompressorState.allocate(1, V4_TINY))
    assert not torch.equal(lost.data, caches[0].data)
