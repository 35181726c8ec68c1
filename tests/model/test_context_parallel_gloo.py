"""Context-parallel prefill over gloo CPU ranks (2 and 4 processes, the reference backend): every rank ends with the
same [T, topk] as a one-process run of the same code, for a causal batch of several requests with prefixes. This
checks the row split, the key exchange and the gathering; NCCL on GPUs is issue 14 (not run here)."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsa_indexer import IndexerConfig, IndexerInputError, IndexKCache, Indexer, PrefillBatch
from dsa_indexer.parallel import context_parallel_prefill, zigzag_rows

CFG = IndexerConfig(name="tiny", hidden_size=256, q_lora_rank=256, n_heads=4, topk=16, max_position=8192)
PREFIX, EXTEND = [300, 0, 1000], [700, 900, 411]


def _problem(seed: int):
    gen = torch.Generator().manual_seed(seed)
    indexer = Indexer(CFG).init_random(seed)
    table = torch.arange(3 * 24, dtype=torch.int32).view(3, 24)
    cache = IndexKCache.allocate(72)
    for b, p in enumerate(PREFIX):  # the cached prefixes, identical on every rank
        if p:
            indexer.store_keys(torch.randn(p, 256, generator=gen).to(torch.bfloat16),
                               PrefillBatch.build([0], [p], table[b:b + 1]), cache)
    batch = PrefillBatch.build(PREFIX, EXTEND, table, num_cache_pages=72)
    x = torch.randn(batch.num_tokens, 256, generator=gen).to(torch.bfloat16)
    q_lora = torch.randn(batch.num_tokens, 256, generator=gen).to(torch.bfloat16)
    return indexer, cache, batch, x, q_lora


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        indexer, cache, batch, x, q_lora = _problem(11)
        full = context_parallel_prefill(indexer, x, q_lora, batch.positions, batch, cache)
        torch.save(full, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run(world: int) -> list[torch.Tensor]:
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(world, init, tmp), nprocs=world, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]


def test_zigzag_rows_cover_every_row_once_and_balance_causal_work():
    for world in (1, 2, 4):
        rows = [zigzag_rows(1000, r, world) for r in range(world)]
        assert torch.equal(torch.sort(torch.cat(rows)).values, torch.arange(1000))
        work = [int((r + 1).sum()) for r in rows]  # a causal row i costs ~ i + 1 keys
        assert max(work) / min(work) < 1.02


@pytest.fixture(scope="module")
def one_process() -> torch.Tensor:
    """The one-rank run of the same code, which every world size must equal (spawned once for both)."""
    return _run(1)[0]


def test_the_one_process_run_is_the_indexers_own_prefill(one_process):
    """Up to GEMM rounding of another row count."""
    indexer, cache, batch, x, q_lora = _problem(11)
    plain = indexer(x, q_lora, batch.positions, batch, cache)
    agree = sum(len({i for i in a if i >= 0} & {i for i in b if i >= 0})
                for a, b in zip(plain.tolist(), one_process.tolist()))
    assert agree / int((plain >= 0).sum()) >= 0.99


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_prefill_over_gloo_equals_one_process(world, one_process):
    for got in _run(world):
        assert torch.equal(got, one_process)


def test_context_parallel_prefill_needs_a_process_group():
    indexer, cache, batch, x, q_lora = _problem(1)
    with pytest.raises(IndexerInputError, match="initialized torch.distributed process group"):
        context_parallel_prefill(indexer, x, q_lora, batch.positions, batch, cache)


def test_context_parallel_prefill_refuses_a_plain_layout_cache():
    indexer, _, batch, x, q_lora = _problem(1)
    plain = IndexKCache.allocate(batch.block_table.numel(), layout="paged64_bf16")
    with pytest.raises(IndexerInputError, match="paged64_bf16 cache .* is not supported"):
        context_parallel_prefill(indexer, x, q_lora, batch.positions, batch, plain)
