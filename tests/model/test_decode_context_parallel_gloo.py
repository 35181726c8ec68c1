"""Decode context parallelism over gloo CPU ranks (2 and 4 processes, the reference backend): the k cache sharded
round robin over the ranks, each rank scoring its shard, one all-gather of its top-k candidates and the exact merge.
Every rank must return exactly the single-device decode's top-k (same indices, same order, ties, -1 padding) over
several steps of ragged batches: requests shorter than topk, requests some ranks hold no key of, MTP rows
(next_n = 2), and V4's C4 indexer (entries dealt round robin, completed during the steps). Tensor-parallel
prefill (rows split by cost, the int32 top-k exchanged) is checked against the one-device prefill, including
ranks that get no rows. NCCL on GPUs runs the same functions (not run here: no multi-GPU machine)."""

import dataclasses
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsa_indexer import ops
from dsa_indexer import (CompressorState, DecodeBatch, IndexerConfig, IndexerInputError, IndexKCache, Indexer,
                         PrefillBatch)
from dsa_indexer.contract.cache import gather_rows
from dsa_indexer.parallel import (ShardedDecodeBatch, context_parallel_decode, cost_split_rows, local_key_count,
                                  merge_candidates, shard_candidates, store_keys_sharded, tensor_parallel_prefill, _candidate_keys)

V32 = IndexerConfig(name="tiny", hidden_size=256, q_lora_rank=256, n_heads=4, topk=16, max_position=8192)
C4 = dataclasses.replace(IndexerConfig.deepseek_v4_flash(), name="tiny-c4", hidden_size=256, q_lora_rank=256,
                         n_heads=4, topk=8, max_position=8192)
# (config, prefix lengths, next_n, decode steps). Request 0 of the first starts empty: at its first step only rank 0
# holds a key of it; requests shorter than topk get -1 padding; C4's prefixes end mid-window so entries complete
# during the steps.
DECODE_CASES = {
    "v32": (V32, [0, 2, 149, 699, 64], 1, 4),
    "v32_mtp": (V32, [1, 300, 17], 2, 2),
    "c4": (C4, [5, 6, 202, 1001], 1, 4),
    "short": (dataclasses.replace(V32, topk=64), [3, 40], 1, 1),  # width 64 <= topk: every visible key, in order
}
PREFILL_CASES = {  # (config, prefix lengths, extend lengths): a batch wide enough for every rank, one row for them all
    "ragged": (V32, [100, 0, 400], [200, 300, 90]),
    "one_row": (V32, [30], [1]),
    "c4": (C4, [8, 0, 600], [300, 250, 41]),
}


def _pages(keys: int) -> int:
    return max(1, -(-keys // 64))


def _decode_run(name: str, rank: int | None = None, world: int = 1, group=None) -> dict:
    """The case's decode steps on one device (rank None) or on this rank's shard; every run draws the same inputs."""
    cfg, prefix, next_n, steps = DECODE_CASES[name]
    gen = torch.Generator().manual_seed(2024)
    indexer = Indexer(cfg).init_random(7)
    ratio, batch_size = cfg.compress_ratio, len(prefix)
    longest = (max(prefix) + steps * next_n) // ratio
    per_request = _pages(longest if rank is None else int(local_key_count(torch.tensor(longest), 0, world)))
    table = torch.arange(batch_size * per_request, dtype=torch.int32).view(batch_size, per_request)
    global_layout = torch.arange(batch_size * _pages(longest), dtype=torch.int32).view(batch_size, -1)
    cache = IndexKCache.allocate(table.numel())
    state = CompressorState.allocate(batch_size, cfg) if ratio == 4 else None
    for b, p in enumerate(prefix):
        x = torch.randn(p, cfg.hidden_size, generator=gen).to(torch.bfloat16)
        if not p:
            continue
        pb = PrefillBatch.build([0], [p], global_layout[b:b + 1], compress_ratio=ratio, state_slots=[b])
        if rank is None:
            indexer.store_keys(x, PrefillBatch.build([0], [p], table[b:b + 1], compress_ratio=ratio, state_slots=[b]),
                               cache, compressor_state=state)
        else:
            store_keys_sharded(indexer, x, pb, cache, table[b:b + 1], rank=rank, world=world, compressor_state=state)
    outs, held, derived = [], None, []
    for step in range(steps):
        seq = [p + (step + 1) * next_n for p in prefix]
        x = torch.randn(batch_size * next_n, cfg.hidden_size, generator=gen).to(torch.bfloat16)
        q_lora = torch.randn(batch_size * next_n, cfg.q_lora_rank, generator=gen).to(torch.bfloat16)
        if rank is None:
            db = DecodeBatch.build(seq, table, next_n=next_n, num_cache_pages=cache.num_pages, compress_ratio=ratio)
            out = indexer(x, q_lora, db.positions, db, cache, compressor_state=state)
            slots = indexer.to_physical_slots(out, db)
        else:
            sb = ShardedDecodeBatch.build(seq, table, rank=rank, world=world, next_n=next_n,
                                          num_cache_pages=cache.num_pages, compress_ratio=ratio)
            before = (cache.data.clone(), state.window.clone() if state is not None else None)
            out = context_parallel_decode(indexer, x, q_lora, sb.positions, sb, cache, group=group,
                                          compressor_state=state)
            slots = sb.local_slots(out)
            # The same step again from the batch a CUDA graph derives on the device, from the same cache and state.
            after = (cache.data.clone(), state.window.clone() if state is not None else None)
            cache.data.copy_(before[0])
            if state is not None:
                state.window.copy_(before[1])
            db = ShardedDecodeBatch.derive(torch.tensor(seq, dtype=torch.int32), table, rank=rank, world=world,
                                           max_context_len=sb.max_context_len, next_n=next_n, compress_ratio=ratio)
            derived.append((context_parallel_decode(indexer, x, q_lora, db.positions, db, cache, group=group,
                                                    compressor_state=state),
                            torch.equal(cache.data, after[0]),
                            state is None or torch.equal(state.window, after[1])))
        outs.append(out)
        valid = slots >= 0  # the key bytes of the chosen keys this process holds (all of them on one device)
        keys, scales = gather_rows(cache.data, slots[valid])
        held = (valid, keys.view(torch.uint8), scales)
    return {"topk": outs, "held": held, "derived": derived}


def _prefill_problem(name: str):
    cfg, prefix, extend = PREFILL_CASES[name]
    gen = torch.Generator().manual_seed(99)
    indexer = Indexer(cfg).init_random(5)
    ratio = cfg.compress_ratio
    per_request = _pages(max(p + e for p, e in zip(prefix, extend)) // ratio)
    table = torch.arange(len(prefix) * per_request, dtype=torch.int32).view(len(prefix), per_request)
    cache = IndexKCache.allocate(table.numel())
    state = CompressorState.allocate(len(prefix), cfg) if ratio == 4 else None
    for b, p in enumerate(prefix):
        if p:
            indexer.store_keys(torch.randn(p, 256, generator=gen).to(torch.bfloat16),
                               PrefillBatch.build([0], [p], table[b:b + 1], compress_ratio=ratio, state_slots=[b]),
                               cache, compressor_state=state)
    batch = PrefillBatch.build(prefix, extend, table, num_cache_pages=cache.num_pages, compress_ratio=ratio)
    x = torch.randn(batch.num_tokens, 256, generator=gen).to(torch.bfloat16)
    q_lora = torch.randn(batch.num_tokens, 256, generator=gen).to(torch.bfloat16)
    return indexer, cache, batch, x, q_lora, state


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    # One thread per rank: 4 ranks with a thread per core each would spin against each other in every collective on
    # a small CI machine (7 s of work instead of 0.8 s on 2 cores).
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = {name: _decode_run(name, rank, world) for name in DECODE_CASES}
        for name in PREFILL_CASES:
            indexer, cache, batch, x, q_lora, state = _prefill_problem(name)
            result[f"prefill_{name}"] = tensor_parallel_prefill(indexer, x, q_lora, batch.positions, batch, cache,
                                                                compressor_state=state)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _spawn(world: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        # Forked, not spawned: the ranks inherit the imported torch and library instead of importing them again
        # (seconds per process); the parent has run no collective, and each child sets its own thread count.
        mp.start_processes(_worker, args=(world, init, tmp), nprocs=world, join=True, start_method="fork")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_decode_and_tp_prefill_over_gloo_equal_one_device(world):
    # The one-device runs first: the forked ranks then inherit the resolved ops instead of each resolving them.
    wants = {name: _decode_run(name) for name in DECODE_CASES}
    ranks = _spawn(world)
    for name, want in wants.items():
        assert (want["topk"][0] == -1).any()  # every case exercises the -1 padding
        for rank, result in enumerate(ranks):
            for step, (got, expected) in enumerate(zip(result[name]["topk"], want["topk"])):
                assert torch.equal(got, expected), (name, rank, step)
                derived, same_cache, same_state = result[name]["derived"][step]
                assert torch.equal(derived, expected) and same_cache and same_state, (name, rank, step)
        # The chosen keys' bytes, read through each rank's local slots, are the one-device cache's bytes.
        valid, keys, scales = want["held"]
        out = want["topk"][-1]
        for rank, result in enumerate(ranks):
            mine = result[name]["held"][0]
            assert torch.equal(mine, valid & (out % world == rank))
            assert torch.equal(result[name]["held"][1], keys[mine[valid]])
            assert torch.equal(result[name]["held"][2], scales[mine[valid]])
    for name in PREFILL_CASES:
        indexer, cache, batch, x, q_lora, state = _prefill_problem(name)
        plain = indexer(x, q_lora, batch.positions, batch, cache, compressor_state=state)
        for result in ranks:
            assert torch.equal(result[f"prefill_{name}"], plain), name


def test_candidate_merge_ranks_by_score_then_lower_position():
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(6, 40, generator=gen).round()  # rounded: many equal scores, the tie rule decides
    values[0, :5] = -0.0  # -0.0 and +0.0 are one score
    values[1, 3] = float("nan")  # ranks as -inf
    values[2, :] = float("-inf")
    positions = torch.randperm(1000, generator=gen)[:240].view(6, 40).to(torch.int32)
    positions[3, 10:] = -1  # fewer candidates than k: -1 padding at the end
    positions[4, :] = -1
    got = merge_candidates(_candidate_keys(values, positions), 16)
    for row in range(6):  # against a plain sort: score descending, then position ascending
        score = [float("-inf") if v != v else (0.0 if v == 0 else v) for v in values[row].tolist()]
        pairs = sorted((-s, p) for s, p in zip(score, positions[row].tolist()) if p >= 0)
        want = [p for _, p in pairs[:16]] + [-1] * max(0, 16 - len(pairs))
        assert got[row].tolist() == want, row


def test_cost_split_rows_are_contiguous_balanced_and_may_be_empty():
    keys = torch.arange(1, 1001)  # a causal request: row i sees i + 1 keys
    for world in (1, 2, 3, 4):
        shares = cost_split_rows(keys, world)
        assert shares[0][0] == 0 and shares[-1][1] == 1000
        assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
        work = [int(keys[a:b].sum()) for a, b in shares]
        assert max(work) / min(work) < 1.01
    assert sum(b - a for a, b in cost_split_rows(torch.tensor([5]), 4)) == 1
    assert [b - a for a, b in cost_split_rows(torch.tensor([5]), 4)].count(0) == 3


def test_sharded_batch_deals_keys_round_robin_and_derive_matches_build():
    seq, table = [1, 130, 7], torch.tensor([[3, 4], [5, 6], [7, 8]], dtype=torch.int32)
    built = ShardedDecodeBatch.build(seq, table, rank=1, world=2, next_n=1)
    assert built.context_lens.reshape(-1).tolist() == [1, 130, 7]
    assert built.local.context_lens.reshape(-1).tolist() == [0, 65, 3]  # odd positions of each request
    # Row 1 stores token 129 (odd: rank 1's local key 64, the second page); rows 0 and 2 store on rank 0.
    assert built.local.slot_mapping.tolist() == [-1, 6 * 64 + 0, -1]
    derived = ShardedDecodeBatch.derive(torch.tensor(seq, dtype=torch.int32), table, rank=1, world=2,
                                        max_context_len=built.max_context_len)
    for field in ("context_lens", "positions", "slot_mapping", "row_request"):
        assert torch.equal(getattr(derived.local, field), getattr(built.local, field)), field
    assert derived.local.max_context_len == built.local.max_context_len
    assert torch.equal(derived.context_lens, built.context_lens)


def test_sharded_inputs_are_checked():
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(IndexerInputError, match="rank must be an int in \\[0, world=2\\)"):
        ShardedDecodeBatch.build([5], table, rank=2, world=2)
    with pytest.raises(IndexerInputError, match="world must be an int >= 1"):
        ShardedDecodeBatch.build([5], table, rank=0, world=0)
    with pytest.raises(IndexerInputError, match="block_table needs one row per request"):
        ShardedDecodeBatch.build([5, 6], table, rank=0, world=2)
    indexer = Indexer(V32).init_random(1)
    batch = ShardedDecodeBatch.build([5], table, rank=0, world=2)
    x = torch.randn(1, 256).to(torch.bfloat16)
    with pytest.raises(IndexerInputError, match="context_parallel_decode needs an initialized torch.distributed"):
        context_parallel_decode(indexer, x, x, batch.positions, batch, IndexKCache.allocate(1))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("k", [16, 64])
def test_shard_top_k_then_merge_equals_one_device_top_k_under_ties(world, k):
    """The decode step's composition without a transport: logits rounded to a few values (ties everywhere, +0.0 and
    -0.0 among them), dealt round robin to the shards; each shard's top-k, then the merge, must give exactly the
    one-device `topk_indices` (order, ties to the lower position, -1 padding of rows shorter than k). k = 64 over 4
    ranks gives shards of 50 columns, narrower than k: every visible key is a candidate."""
    gen = torch.Generator().manual_seed(world)
    width = 200
    logits = (torch.randn(7, width, generator=gen) * 2).round() * torch.randn(7, 1, generator=gen).sign()
    lens = torch.tensor([200, 0, 1, 5, 17, 16, 123], dtype=torch.int32)
    col = torch.arange(width)
    logits = torch.where(col[None, :] < lens[:, None], logits, torch.full_like(logits, float("-inf")))
    want = ops.topk_indices(logits, k, lens)
    shards = []
    for rank in range(world):
        own = logits[:, rank::world]  # rank's local positions 0, 1, ... are global rank, rank + world, ...
        local_lens = local_key_count(lens.long(), rank, world).to(torch.int32)
        shards.append(shard_candidates(own.contiguous(), local_lens, k, rank, world))
    got = merge_candidates(torch.cat(shards, dim=1), k)
    assert torch.equal(got, want)
    assert logits[0].eq(0).sum() > 1 and logits[0].unique().numel() < 20  # the long row is mostly ties


def test_decode_logits_are_the_decode_step_up_to_its_top_k():
    gen = torch.Generator().manual_seed(8)
    indexer = Indexer(V32).init_random(2)
    table = torch.arange(6, dtype=torch.int32).view(2, 3)
    caches = [IndexKCache.allocate(6), IndexKCache.allocate(6)]
    prefix_x = torch.randn(150, 256, generator=gen).to(torch.bfloat16)
    for cache in caches:
        indexer.store_keys(prefix_x, PrefillBatch.build([0], [150], table[:1]), cache)
    batch = DecodeBatch.build([151, 9], table, num_cache_pages=6)
    x, q_lora = (torch.randn(2, 256, generator=gen).to(torch.bfloat16) for _ in range(2))
    want = indexer(x, q_lora, batch.positions, batch, caches[0])
    logits = indexer.decode_logits(x, q_lora, batch.positions, batch, caches[1])
    assert logits.shape == (2, batch.max_context_len) and torch.isinf(logits[1, 9:]).all()
    assert torch.equal(caches[1].data, caches[0].data)  # it stored the step's keys as forward does
    assert torch.equal(ops.topk_indices(logits, V32.topk, batch.context_lens.reshape(-1)), want)
    with pytest.raises(IndexerInputError, match="batch must be a DecodeBatch, got PrefillBatch"):
        indexer.decode_logits(x[:1], q_lora[:1], torch.tensor([150]), PrefillBatch.build([150], [1], table[:1]),
                              caches[1])
    plain = IndexKCache.allocate(6, layout="paged64_bf16")
    with pytest.raises(IndexerInputError, match="paged64_bf16 cache .* is scored by the fused"):
        indexer.decode_logits(x, q_lora, batch.positions, batch, plain)


def test_parallel_entry_points_check_their_arguments():
    indexer, cache, batch, x, q_lora, _ = _prefill_problem("one_row")
    with pytest.raises(IndexerInputError, match="tensor_parallel_prefill needs an initialized torch.distributed"):
        tensor_parallel_prefill(indexer, x, q_lora, batch.positions, batch, cache)
    with pytest.raises(IndexerInputError, match="block_table needs one row per request of the batch \\(1\\)"):
        store_keys_sharded(indexer, x, batch, cache, torch.zeros(2, 1, dtype=torch.int32), rank=0, world=2)
    with pytest.raises(IndexerInputError, match="block_table uses cache page 9 but this rank's cache has 1 pages"):
        store_keys_sharded(indexer, x, batch, cache, torch.full((1, 1), 9, dtype=torch.int32), rank=0, world=2)
    with pytest.raises(IndexerInputError, match="batch must be a PrefillBatch, got DecodeBatch"):
        store_keys_sharded(indexer, x, DecodeBatch.build([31], [[0]]), cache, [[0]], rank=0, world=2)
