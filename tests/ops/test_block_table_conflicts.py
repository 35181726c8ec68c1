"""Issue 34, items 1 and 2: block tables whose pages collide are refused, naming block_table, the row and the page.

The rule (`dsa_indexer.contract.validate.check_page_sharing`): in one step request b reads the pages holding its keys
``[0, total)`` and writes those holding ``[cached, total)``. A request may not use one cache page for two of its
pages (its later keys would overwrite its earlier ones, and a reader would see one key at two positions), and a page
a request writes may not be used by any other request. Requests may share pages that nobody writes in the step: a
cached prefix.

The property test draws random block tables (repeats, shared writers, shared read-only prefix pages, -1 and
out-of-range entries, garbage in unused columns) for prefill, decode and the CUDA-graph buffers' derivation (run on
CPU tensors): every input is refused with an error naming block_table, or the indexer's top-k (reference backend)
equals a float64 oracle computed here from the same queries and keys.
"""

from __future__ import annotations

import random

import pytest
import torch

from dsa_indexer import DecodeBatch, Indexer, IndexerConfig, IndexKCache, PrefillBatch, ops
from dsa_indexer.contract.validate import IndexerInputError
from dsa_indexer.graphs import DecodeBuffers
from dsa_indexer.testing import random_cache

PAGE = 64
TINY = IndexerConfig(name="tiny", hidden_size=256, q_lora_rank=256, n_heads=4, topk=16, max_position=1024,
                     yarn=None)
NUM_PAGES = 14
COLUMNS = 5
FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def indexer() -> Indexer:
    return Indexer(TINY).init_random(7)


# --- item 1: one request, one page twice ----------------------------------------------------------------------
def test_a_request_using_one_page_twice_is_refused_by_the_builders():
    # Before: accepted; keys 64-99 overwrote keys 0-35 and most top-k rows were wrong.
    with pytest.raises(IndexerInputError, match=r"block_table row 0 \(request 0\) uses cache page 0 twice \(columns 0 "
                                                r"and 1, its keys \[0, 64\) and \[64, 100\)\)"):
        PrefillBatch.build([0], [100], [[0, 0]])
    with pytest.raises(IndexerInputError, match=r"block_table row 1 .*cache page 3 twice \(columns 0 and 2"):
        PrefillBatch.build([0, 40], [10, 100], [[2, 9, 9], [3, 4, 3]])  # row 0's column 2 is unused padding
    # A repeat among pages the request only reads is refused too: two positions would name one key.
    with pytest.raises(IndexerInputError, match=r"block_table row 0 .*cache page 5 twice"):
        DecodeBatch.build([150], [[5, 5, 1]])
    with pytest.raises(IndexerInputError, match=r"block_table row 0 .*cache page 1 twice"):  # C4: pages of entries
        PrefillBatch.build([0], [400], [[1, 1]], compress_ratio=4)
    # Repeats in columns a request does not use are padding, as -1 is there.
    assert PrefillBatch.build([0], [60], [[4, 4, 4]]).slot_mapping[59] == 4 * PAGE + 59


def test_readers_refuse_a_row_that_uses_one_page_twice():
    """The ops that take a block table (the paged logits, the composed indexer, the slot transform, the plain-layout
    indexer) check it where they check its range: CPU tensors, or DSA_INDEXER_CHECK_RANGES=1."""
    gen = torch.Generator().manual_seed(11)
    cache = random_cache(4, "cpu", seed=3)
    q = torch.randn(1, 1, 4, 128, generator=gen).to(FP8)
    weights = torch.randn(1, 4, generator=gen)
    lens = torch.tensor([[100]], dtype=torch.int32)
    twice = torch.tensor([[2, 2]], dtype=torch.int32)
    with pytest.raises(IndexerInputError, match=r"block_table row 0 .*cache page 2 twice"):
        ops.paged_mqa_logits(q, cache.data, weights, lens, twice, 128)
    with pytest.raises(IndexerInputError, match=r"block_table row 0 .*cache page 2 twice"):
        ops.lightning_indexer(q, cache.data, weights, lens, twice, 128, 8)
    logits = torch.randn(2, 128, generator=gen)
    with pytest.raises(IndexerInputError, match=r"block_table row 0 .*cache page 2 twice"):
        ops.topk_indices(logits, 8, torch.tensor([100, 70], dtype=torch.int32), block_table=twice,
                         row_request=torch.tensor([0, 0], dtype=torch.int32))
    # Two requests reading one page is a shared prefix: fine for a reader.
    shared = torch.tensor([[2, 1], [2, 3]], dtype=torch.int32)
    out = ops.topk_indices(logits, 8, torch.tensor([100, 70], dtype=torch.int32), block_table=shared)
    assert bool((out // PAGE == 2).any())
    plain = IndexKCache.allocate(4, layout="paged64_bf16")
    with pytest.raises(IndexerInputError, match=r"block_table row 0 .*cache page 2 twice"):
        ops.lightning_indexer_ragged(torch.randn(1, 4, 128, generator=gen).to(torch.bfloat16), plain.scales_or_empty(),
                                     plain.data, plain.scales_or_empty(), weights,
                                     torch.tensor([0, 1], dtype=torch.int32), torch.tensor([100], dtype=torch.int32),
                                     twice, 8)


def test_page_ids_far_apart_are_checked_by_sorting():
    """Page ids spread over a huge cache (no count per page: a sort instead) follow the same rule."""
    far = [[3 * 10**7, 10**7], [10**7 + 1, 2 * 10**7]]
    PrefillBatch.build([64, 64], [10, 10], far)  # distinct: accepted
    with pytest.raises(IndexerInputError, match=r"block_table row 1 .*cache page 20000000 twice"):
        PrefillBatch.build([64, 64], [10, 10], [far[0], [2 * 10**7, 2 * 10**7]])
    with pytest.raises(IndexerInputError, match=r"cache page 10000000 is written in this step by request 0 \(row 0, "
                                                r"column 1: its new keys \[64, 74\)\) and read by request 1"):
        PrefillBatch.build([64, 64], [10, 10], [far[0], [10**7, 2 * 10**7]])
    PrefillBatch.build([64, 64], [10, 10], [far[0], [3 * 10**7, 2 * 10**7]])  # a shared prefix page: accepted


# --- item 2: two requests writing one page ---------------------------------------------------------------------
def test_two_requests_writing_one_page_are_refused():
    # Before: accepted; request 1's keys overwrote request 0's and 22-24 of 60 rows were wrong.
    with pytest.raises(IndexerInputError, match=r"block_table: cache page 0 is written in this step by request 0 "
                                                r"\(row 0, column 0: its new keys \[0, 30\)\) and by request 1"):
        PrefillBatch.build([0, 0], [30, 30], [[0], [0]])
    # The decode form: two rows of one step store into one slot (and two requests into one page).
    with pytest.raises(IndexerInputError, match=r"cache page 0 is written in this step by request 0 .* and by "
                                                r"request 1"):
        DecodeBatch.build([10, 10], [[0], [0]])
    with pytest.raises(IndexerInputError, match=r"cache page 7 is written .*request 0.* and by request 1"):
        DecodeBatch.build([70, 100], [[6, 7], [8, 7]], next_n=2)
    # A page one request writes and another only reads: the reader's cached keys would be overwritten.
    with pytest.raises(IndexerInputError, match=r"cache page 0 is written in this step by request 1 \(row 1, column "
                                                r"0: its new keys \[0, 30\)\) and read by request 0"):
        PrefillBatch.build([64, 0], [10, 30], [[0, 1], [0, -1]])
    # C4: a page holds entries; two requests completing entries into one page conflict.
    with pytest.raises(IndexerInputError, match=r"cache page 0 is written .*its new entries \[1, 2\)"):
        DecodeBatch.build([8, 12], [[0], [0]], compress_ratio=4)


def test_read_only_shared_prefix_pages_stay_legal():
    """Engines share the pages of a common prefix: pages holding only cached keys of every request using them."""
    batch = PrefillBatch.build([128, 70], [10, 20], [[5, 6, 1], [5, 2, -1]], num_cache_pages=8)
    assert batch.gather_slots[:64].tolist() == list(range(5 * PAGE, 6 * PAGE))
    assert batch.gather_slots[138:138 + 64].tolist() == list(range(5 * PAGE, 6 * PAGE))
    DecodeBatch.build([130, 140, 66], [[5, 6, 1], [5, 6, 2], [5, 3, -1]], next_n=2)  # 66: writes column 1
    # C4 decode steps that complete no entry write no page: two requests may read one partial page.
    assert DecodeBatch.build([5, 6], [[0], [0]], compress_ratio=4).slot_mapping.tolist() == [-1, -1]


def test_decode_graph_buffers_refuse_colliding_pages():
    """`DecodeBuffers.load` checks host inputs; the derivation (the `decode_metadata` op) checks CPU tensors (on a
    GPU only with DSA_INDEXER_CHECK_RANGES=1: a CUDA graph cannot read values)."""
    indexer = Indexer(TINY)
    buffers = DecodeBuffers.allocate(indexer, batch_size=3, max_context_len=256, next_n=1, device=torch.device("cpu"))
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    with pytest.raises(IndexerInputError, match=r"cache page 4 is written in this step by request 0 .* and by "
                                                r"request 1"):
        buffers.load(x, x, torch.tensor([10, 20]), torch.tensor([[4], [4]], dtype=torch.int32))
    with pytest.raises(IndexerInputError, match=r"block_table row 1 .*cache page 2 twice"):
        buffers.load(x, x, torch.tensor([10, 100]), torch.tensor([[4, 0], [2, 2]], dtype=torch.int32))
    # A padding request (seq_lens 0) uses no page.
    assert buffers.load(x, x, torch.tensor([10, 0]), torch.tensor([[4], [4]], dtype=torch.int32)) == 2
    # One check serves the replays of every layer with the same inputs, by content: a table rewritten in place
    # (here through numpy, which torch's version counter does not see) is checked again.
    seq, table = torch.tensor([10, 20]), torch.tensor([[4], [5]], dtype=torch.int32)
    for _layer in range(2):
        assert buffers.load(x, x, seq, table) == 2
    table.numpy()[1, 0] = 4
    with pytest.raises(IndexerInputError, match=r"cache page 4 is written"):
        buffers.load(x, x, seq, table)
    # What the buffers hold when a caller writes them without load (device tensors are trusted there).
    buffers.seq_lens[:2] = torch.tensor([10, 20], dtype=torch.int32)
    buffers.block_table[:2, 0] = 4
    with pytest.raises(IndexerInputError, match=r"block_table: cache page 4 is written"):
        buffers.derive()
    with pytest.raises(IndexerInputError, match=r"block_table: cache page 4 is written"):
        ops.decode_metadata(torch.tensor([10, 20]), torch.tensor([[4], [4]], dtype=torch.int32),
                            torch.tensor([0, 1]))


def test_decode_graph_buffers_refuse_pages_past_the_cache(indexer):
    """Before: a page past the cache reached the key store of the derived batch (an IndexError on the CPU, a write
    out of bounds on a GPU). `DecodeGraph.capture` gives the buffers its cache's page count; buffers without one
    leave the check to the forward, on CPU tensors (or with DSA_INDEXER_CHECK_RANGES=1)."""
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    table = torch.tensor([[1, 9], [3, 0]], dtype=torch.int32)  # request 0's second page is past the 8-page cache
    sized = DecodeBuffers.allocate(indexer, 2, 256, 1, torch.device("cpu"), num_cache_pages=8)
    with pytest.raises(IndexerInputError, match=r"block_table entries in use must be cache pages in \[0, 8\)"):
        sized.load(x, x, torch.tensor([100, 20]), table)
    unsized = DecodeBuffers.allocate(indexer, 2, 256, 1, torch.device("cpu"))
    unsized.load(x, x, torch.tensor([100, 20]), table)
    batch = unsized.derive()
    with pytest.raises(IndexerInputError, match=r"block_table values must lie in \[0, 8\)"):
        indexer(unsized.x, unsized.q_lora, batch.positions, batch, IndexKCache.allocate(8))
    with pytest.raises(IndexerInputError, match=r"block_table values must lie in \[0, 33554431\) .* got range "
                                                r"\[-1, "):
        ops.decode_metadata(torch.tensor([100, 20]), torch.tensor([[1, -1], [3, 0]], dtype=torch.int32),
                            torch.tensor([0, 1]))


# --- the property test -------------------------------------------------------------------------------------------
LEGAL = ("distinct", "unused_garbage", "shared_prefix")
ILLEGAL = ("repeat_in_row", "shared_writer", "minus_one", "out_of_range")


def _draw(seed: int):
    """A random step: ``(kind, decode, next_n, cached, total, table)``; ``kind`` names the mutation of a valid table
    and says whether the step is legal."""
    rnd = random.Random(seed)
    kind = (LEGAL + ILLEGAL)[seed % (len(LEGAL) + len(ILLEGAL))]
    decode = seed // len(LEGAL + ILLEGAL) % 2 == 1  # each kind in prefill and in decode
    requests = rnd.randint(2 if kind in ("shared_prefix", "shared_writer") else 1, 3)
    next_n = rnd.choice((1, 2)) if decode else None
    cached, total = [], []
    for _ in range(requests):
        low = 64 if kind == "shared_prefix" else 0  # a full cached page to share
        new = next_n if decode else rnd.randint(1, 60)
        start = rnd.randint(low, 4 * PAGE - new)
        cached.append(start)
        total.append(start + new)
    if kind == "repeat_in_row" and total[0] <= PAGE:  # two pages in use
        cached[0] += PAGE
        total[0] += PAGE
    perm = rnd.sample(range(NUM_PAGES), NUM_PAGES)
    used = [-(-t // PAGE) for t in total]
    table = []
    for b in range(requests):
        row = [perm.pop() for _ in range(used[b])]
        row += [rnd.choice((-1, 0, NUM_PAGES + 3, row[0])) for _ in range(COLUMNS - used[b])]
        table.append(row)
    if kind == "distinct":
        table = [row[:used[b]] + [-1] * (COLUMNS - used[b]) for b, row in enumerate(table)]
    elif kind == "unused_garbage":
        pass  # -1, out-of-range and repeated pages past each request's keys: padding
    elif kind == "shared_prefix":
        a, b = rnd.sample(range(requests), 2)
        shared = rnd.randint(1, min(cached[a], cached[b]) // PAGE)  # pages of cached keys of both
        table[b][:shared] = table[a][:shared]
    elif kind == "repeat_in_row":
        i, j = rnd.sample(range(used[0]), 2)
        table[0][j] = table[0][i]
    elif kind == "shared_writer":
        a, b = rnd.sample(range(requests), 2)
        written = list(range(cached[a] // PAGE, used[a]))
        table[b][rnd.randrange(used[b])] = table[a][rnd.choice(written)]
    else:
        b = rnd.randrange(requests)
        table[b][rnd.randrange(used[b])] = -1 if kind == "minus_one" else NUM_PAGES + rnd.randint(0, 5)
    return kind, decode, next_n, cached, total, table


def _read_keys(cache: IndexKCache, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys at ``slots`` from the page bytes as the spec lays them out (64 x 128 fp8 values, then 64 fp32 scales):
    ``(values [n, 128], scales [n])`` in float64."""
    pages = cache.data.reshape(cache.data.shape[0], -1)
    slot = torch.tensor(slots, dtype=torch.long)
    page, row = slot // PAGE, slot % PAGE
    values = pages[page[:, None], row[:, None] * 128 + torch.arange(128)[None, :]]
    scales = pages[page[:, None], PAGE * 128 + row[:, None] * 4 + torch.arange(4)[None, :]]
    return values.contiguous().view(FP8).double(), scales.contiguous().view(torch.float32).reshape(-1).double()


def _oracle_check(out, q_fp8, weights, rows: list[int], visible: list[int], values, scales, k: int) -> None:
    """``rows`` of one request, row i seeing its first ``visible[i]`` keys of ``values`` [n, 128] / ``scales`` [n]
    (float64). Logits ``scale * sum_h w * relu(q . k)`` in float64; the top-k must be the oracle's best k, a swap
    allowed only within 1e-5 of the row's largest sum of |terms| of the k-th value (the reference sums in fp32:
    ~1e-7 relative per op over 128 products and a few heads)."""
    q = q_fp8[rows].double()  # [r, heads, 128]
    dots = (q.reshape(-1, q.shape[-1]) @ values.T).reshape(q.shape[0], q.shape[1], -1).clamp_min(0)
    w = weights[rows].double()[:, :, None]
    all_logits = (w * dots).sum(1) * scales[None, :]
    all_mag = (w.abs() * dots).sum(1) * scales[None, :]
    for i, row in enumerate(rows):
        seen = visible[i]
        got = out[row].tolist()
        count = min(k, seen)
        assert got[count:] == [-1] * (k - count), f"row {row}: padding"
        chosen = got[:count]
        assert len(set(chosen)) == count and all(0 <= c < seen for c in chosen), f"row {row}: {chosen}"
        if seen <= k:
            assert sorted(chosen) == list(range(seen)), f"row {row}"
            continue
        logits = all_logits[i, :seen]
        tol = 1e-5 * float(all_mag[i, :seen].max())
        kth = float(logits.sort(descending=True).values[k - 1])
        picked = torch.zeros(seen, dtype=torch.bool)
        picked[chosen] = True
        assert bool((logits[picked] >= kth - tol).all()), f"row {row}: a chosen key is below the oracle's k-th"
        assert bool((logits[~picked] <= kth + tol).all()), f"row {row}: a better key was left out"


def _step_inputs(tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, TINY.hidden_size, generator=gen).to(torch.bfloat16)
    q_lora = torch.randn(tokens, TINY.q_lora_rank, generator=gen).to(torch.bfloat16)
    return x, q_lora


def _queries_and_new_keys(indexer, x, q_lora, positions, decode: bool, next_n: int):
    """The q path's fp8 queries and head weights, and each row's new key stored at scratch slot = row: the step's
    own prologues, with a slot mapping of this test's (not the batch's)."""
    tokens = x.shape[0]
    plan = indexer.step_plan(tokens, decode, next_n=next_n, dtype=x.dtype)
    scratch = IndexKCache.allocate(-(-tokens // PAGE))
    q_fp8, weights = plan.strategy(plan, x, q_lora, positions, torch.arange(tokens), scratch.data, None)
    return q_fp8, weights, scratch


def _run_and_check(indexer, seed, decode, next_n, cached, total, table, via_buffers=False) -> None:
    requests = len(total)
    first_row, positions = [], []
    for b in range(requests):
        first_row.append(len(positions))
        positions += list(range(cached[b], total[b]))
    x, q_lora = _step_inputs(len(positions), seed)
    cache = random_cache(NUM_PAGES, "cpu", seed=seed)  # the cached keys, as earlier steps stored them
    before = IndexKCache.allocate(NUM_PAGES)
    before.data.copy_(cache.data)
    if not decode:
        batch = PrefillBatch.build(cached, [t - c for c, t in zip(cached, total)], table, num_cache_pages=NUM_PAGES)
    elif not via_buffers:
        batch = DecodeBatch.build(total, table, next_n=next_n, num_cache_pages=NUM_PAGES)
    else:
        buffers = DecodeBuffers.allocate(indexer, batch_size=requests + 1, max_context_len=COLUMNS * PAGE,
                                         next_n=next_n, device=torch.device("cpu"), num_cache_pages=NUM_PAGES)
        buffers.load(x, q_lora, torch.tensor(total), torch.tensor(table, dtype=torch.int32))
        batch = buffers.derive()
        x, q_lora = buffers.x, buffers.q_lora  # the static buffers, one padding request past the live ones
    # The queries and new keys of exactly the rows the forward gets (a GEMM may round differently for other counts).
    q_fp8, weights, scratch = _queries_and_new_keys(indexer, x, q_lora, batch.positions, decode, next_n or 1)
    out = indexer(x, q_lora, batch.positions, batch, cache)

    # Request b's keys: its cached ones where its block table put them before the step, then its rows' new ones.
    for b in range(requests):
        cached_keys = _read_keys(before, [table[b][j // PAGE] * PAGE + j % PAGE for j in range(cached[b])])
        new_keys = _read_keys(scratch, list(range(first_row[b], first_row[b] + total[b] - cached[b])))
        rows = list(range(first_row[b], first_row[b] + total[b] - cached[b]))
        _oracle_check(out, q_fp8, weights, rows, [positions[r] + 1 for r in rows],
                      torch.cat([cached_keys[0], new_keys[0]]), torch.cat([cached_keys[1], new_keys[1]]), TINY.topk)


@pytest.mark.parametrize("seed", range(42))
def test_random_block_tables_are_refused_by_name_or_match_the_float64_oracle(indexer, seed):
    kind, decode, next_n, cached, total, table = _draw(seed)
    paths = (False, True) if decode else (False,)
    for via_buffers in paths:
        try:
            _run_and_check(indexer, seed, decode, next_n, cached, total, table, via_buffers)
        except IndexerInputError as exc:
            assert "block_table" in str(exc), str(exc)
            assert kind in ILLEGAL, f"{kind} step refused: {exc}"
        else:
            assert kind in LEGAL, f"{kind} step accepted: table {table}, cached {cached}, total {total}"


def test_the_oracle_sees_the_rows_a_colliding_table_gets_wrong(indexer, monkeypatch):
    """The property test's oracle can fail: with the page check switched off, the issue's two tables give rows
    that disagree with it."""
    import dsa_indexer.batch as batch_module

    monkeypatch.setattr(batch_module, "check_page_sharing", lambda *args, **kwargs: None)
    for cached, total, table in (([0], [100], [[0, 0]]), ([0, 0], [30, 30], [[0], [0]])):
        with pytest.raises(AssertionError):
            _run_and_check(indexer, 5, False, None, cached, total, table)
