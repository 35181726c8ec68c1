"""Several ranks of a ``torch.distributed`` process group (NCCL on GPUs, gloo on CPUs; no transport of our own):

- `context_parallel_prefill`: the query rows of one V3.2 prefill batch split in zigzag halves, keys exchanged (below);
- `tensor_parallel_prefill`: ranks that each hold the whole cache score contiguous row shares of equal cost, and
  only the int32 top-k is exchanged;
- `context_parallel_decode`: the k cache sharded round robin over the ranks (`ShardedDecodeBatch`), each rank's
  top-k with its scores all-gathered as int64 candidates and merged exactly (V3.2 and V4's C4 entries alike).

``docs/ops.md`` (Several GPUs) shows how an engine calls them. Context-parallel prefill:

    topk = context_parallel_prefill(indexer, x, q_lora, positions, batch, cache, group=group)

Every rank calls it with the same batch and inputs and a cache holding the same prefix keys (as data- or
context-parallel attention keeps it). Then:

1. Rows are split in zigzag halves for causal balance: the rows are cut into 2 x world pieces and rank r takes
   pieces r and 2 x world - 1 - r (an early, cheap piece with a late, expensive one).
2. Each rank stores the keys of its own rows, then the ranks all-gather those key rows (132 bytes each: fp8 values
   and the scale) and store the others', so every rank's cache holds the whole batch's keys.
3. Each rank runs the q path, logits and top-k of its rows, under the indexer's memory budget.
4. The result is this rank's rows (``gather_output=False``: ``(row indices, top-k)``) or, by default, the whole
   ``[T, topk]`` all-gathered on every rank.

V3.2 layers only: a C4 compressor's windows cross the row split (a clear error says so).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import ops
from .batch import (DecodeBatch, PrefillBatch, host_int_tensor, check_block_table, largest_position,
                    request_state_slots)
from .contract.cache import PAGE_SIZE, IndexKCache, gather_rows, page_views
from .contract.validate import IndexerInputError, check_page_sharing, ranges_checked as check_values


def zigzag_rows(num_rows: int, rank: int, world: int) -> torch.Tensor:
    """The rows rank ``rank`` of ``world`` scores: pieces ``rank`` and ``2 world - 1 - rank`` of ``2 world`` near-equal
    pieces of ``range(num_rows)``."""
    bounds = torch.linspace(0, num_rows, 2 * world + 1).round().long().tolist()
    pieces = [range(bounds[i], bounds[i + 1]) for i in range(2 * world)]
    mine = list(pieces[rank]) + list(pieces[2 * world - 1 - rank])
    return torch.tensor(mine, dtype=torch.long)


def _all_gather_rows(local: torch.Tensor, group) -> list[torch.Tensor]:
    """all_gather of tensors whose first dim differs per rank (padded to the largest, then trimmed)."""
    world = dist.get_world_size(group)
    counts = torch.tensor([local.shape[0]], dtype=torch.long, device=local.device)
    all_counts = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(all_counts, counts, group=group)
    longest = int(max(c.item() for c in all_counts))
    padded = torch.zeros((longest, *local.shape[1:]), dtype=local.dtype, device=local.device)
    padded[: local.shape[0]] = local
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [g[: int(c.item())] for g, c in zip(gathered, all_counts)]


@torch.no_grad()
def context_parallel_prefill(indexer, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor,
                             batch: PrefillBatch, cache: IndexKCache, *, group=None, gather_output: bool = True,
                             q_lora_quant=None):
    """See the module docstring. Returns ``[T, topk]`` int32 (``gather_output``) or ``(rows, topk_of_rows)``."""
    if isinstance(cache, IndexKCache) and cache.is_plain:
        raise IndexerInputError(f"context-parallel prefill exchanges the fp8 132-byte key rows; a {cache.layout} cache "
                                "(the NPU's plain layout) is not supported: run the prefill on one device")
    if not dist.is_available() or not dist.is_initialized():
        raise IndexerInputError("context_parallel_prefill needs an initialized torch.distributed process group "
                                "(dist.init_process_group('nccl' on GPUs or 'gloo' on CPUs))")
    if not isinstance(batch, PrefillBatch):
        raise IndexerInputError(f"batch must be a PrefillBatch, got {type(batch).__name__}")
    if indexer.compressor is not None:
        raise IndexerInputError("context-parallel prefill takes V3.2 layers: a C4 compressor pools windows across "
                                "the row split (run C4 prefill on one device)")
    indexer.check_inputs(x, q_lora, positions, batch, cache, q_lora_quant)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    rows = zigzag_rows(batch.num_tokens, rank, world).to(x.device)
    # 2. this rank's keys, then everyone's: the key rows travel as the cache's own bytes (fp8 values + fp32 scale).
    slots = batch.slot_mapping[rows]
    plan = indexer.step_plan(rows.numel(), decode=False, dtype=x.dtype)
    plan.steps.k_path(plan, x[rows], positions[rows], slots, cache.data)
    keys, scales = gather_rows(cache.data, slots, cache.fp8_dtype)
    payload = torch.cat([keys.view(torch.uint8), scales.view(torch.uint8).view(-1, 4)], dim=1)
    all_slots = _all_gather_rows(slots, group)
    all_payload = _all_gather_rows(payload, group)
    values, scale_view = page_views(cache.data, cache.fp8_dtype)
    for other, (s, p) in enumerate(zip(all_slots, all_payload)):
        if other == rank or s.numel() == 0:
            continue
        s = s.long()
        values[s // 64, s % 64] = p[:, :128].contiguous().view(cache.fp8_dtype)
        scale_view[s // 64, s % 64] = p[:, 128:].contiguous().view(torch.float32).reshape(-1)
    # 3. q path, logits and top-k of this rank's rows (the indexer's own bounded prefill scoring).
    mine = _rows_batch(batch, rows)
    quant = q_lora_quant.select_rows(rows) if q_lora_quant is not None else None
    out = indexer.score_rows(x[rows], q_lora[rows], positions[rows], mine, cache, quant)
    if not gather_output:
        return rows, out
    # 4. the whole [T, topk] on every rank.
    full = torch.empty(batch.num_tokens, out.shape[1], dtype=out.dtype, device=out.device)
    for r, o in zip(_all_gather_rows(rows, group), _all_gather_rows(out, group)):
        full[r] = o
    return full


def _rows_batch(batch: PrefillBatch, rows: torch.Tensor) -> PrefillBatch:
    """The batch restricted to ``rows`` (their ks / ke into the same gathered keys; planning on the host)."""
    rows_host = rows.cpu()
    ks, ke = batch.ks[rows], batch.ke[rows]
    host = (batch.host_bounds[0][rows_host], batch.host_bounds[1][rows_host]) if batch.host_bounds else None
    return dataclasses.replace(batch, ks=ks, ke=ke, positions=batch.positions[rows],
                               slot_mapping=batch.slot_mapping[rows], row_request=batch.row_request[rows],
                               max_keys_per_row=int((ke - ks).max()) if rows.numel() else 0, host_bounds=host)


# --- Decode context parallelism: the k cache sharded over the ranks, an exact merge of the shards' top-k ---------

_INT32_MAX = 2**31 - 1
_NO_CANDIDATE = -(2**63)  # below the key of any real candidate, a -inf score included


def local_key_count(keys: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """How many of a request's first ``keys`` keys (positions ``0 .. keys - 1``) rank ``rank`` holds:
    ``ceil((keys - rank) / world)``, 0 when ``keys <= rank``."""
    return torch.div(keys + (world - 1 - rank), world, rounding_mode="floor")


def _shard_metadata(seq_lens: torch.Tensor, table: torch.Tensor, state_slots: torch.Tensor, rank: int, world: int,
                    next_n: int, ratio: int):
    """Device ops only (no host read, capturable): per row (b, n) of a decode step, its global and local visible
    key counts, its token position, the local cache slot of the key it stores when this rank holds that key (-1
    otherwise), and its compressor state slot. A request with ``seq_lens < next_n`` gives padding rows (no key,
    no store, state slot -1), as `decode_metadata` does."""
    offsets = torch.arange(next_n, dtype=torch.int64, device=seq_lens.device)
    pos = seq_lens.long()[:, None] - next_n + offsets[None, :]  # [B, N]
    valid = pos >= 0
    pos = pos.clamp_min(0)
    keys = torch.where(valid, (pos + 1) // ratio, torch.zeros_like(pos))  # keys row (b, n) sees (C4: entries)
    entry = pos // ratio  # the key (entry) this row stores: its own token, or C4's entry p // 4 when it completes it
    stores = valid & ((pos + 1) % ratio == 0) & (entry % world == rank)
    local_entry = entry // world
    page_col = (local_entry // PAGE_SIZE).clamp_max(table.shape[1] - 1)
    pages = torch.gather(table.long(), 1, page_col)
    slots = torch.where(stores, pages * PAGE_SIZE + local_entry % PAGE_SIZE, torch.full_like(pos, -1))
    request_slot = state_slots.long()[:, None].expand(-1, next_n)
    state_slot = torch.where(valid, request_slot, torch.full_like(request_slot, -1))
    return (keys.to(torch.int32), local_key_count(keys, rank, world).to(torch.int32), pos.reshape(-1),
            slots.reshape(-1), state_slot.reshape(-1))


@dataclass(frozen=True)
class ShardedDecodeBatch:
    """One decode step of B requests x next_n rows whose index-k cache is sharded over ``world`` ranks.

    Sharding: key ``p`` of a request (token p; for C4, compressed entry j, which pools tokens 4j..4j+3) lives on
    rank ``p % world`` at local position ``p // world`` of that rank's own paged cache (its own block table).
    Interleaved rather than blocked: decode appends keys one at a time, and round robin spreads every request's new
    keys, its pages and its scoring work evenly over the ranks at any length (a blocked split puts all of a growing
    request's new keys on the last rank and needs the final length up front). Each rank's shard is an ordinary
    cache: its local positions are contiguous, so the single-device decode ops score it unchanged.

    ``local``: the `DecodeBatch` of this rank's shard (local visible counts and block table, the rows' global
    positions for RoPE, the local slot of each key this rank stores, -1 where another rank stores it; C4: every row
    still goes through the compressor, whose small state every rank keeps whole). ``context_lens`` [B, next_n] and
    ``max_context_len``: the global visible counts and logits width (what a single-device batch would have)."""

    local: DecodeBatch
    context_lens: torch.Tensor  # [B, next_n] int32, global
    max_context_len: int  # global width (host int)
    rank: int
    world: int

    @property
    def num_tokens(self) -> int:
        return self.local.num_tokens

    @property
    def positions(self) -> torch.Tensor:
        return self.local.positions

    @classmethod
    def build(cls, seq_lens, block_table, *, rank: int, world: int, next_n: int = 1,
              num_cache_pages: int | None = None, device: torch.device | str = "cpu", compress_ratio: int = 1,
              max_context_len: int | None = None, state_slots=None) -> "ShardedDecodeBatch":
        """Host-built step (checked; as `DecodeBatch.build`): ``seq_lens[b]`` tokens of request b including its
        next_n new ones (the same on every rank), ``block_table`` [B, pages] this rank's pages of its shard
        (request b's local keys ``0 .. local_key_count(keys_b) - 1``), ``num_cache_pages`` this rank's cache size.
        ``max_context_len``: the global logits width (default: the longest row rounded up to a page); each shard's
        width is ``ceil(max_context_len / world)``."""
        rank, world = _check_rank(rank, world)
        if not isinstance(next_n, int) or isinstance(next_n, bool) or next_n < 1:
            raise IndexerInputError(f"next_n must be an int >= 1, got {next_n!r}")
        if compress_ratio not in (1, 4):
            raise IndexerInputError(f"compress_ratio must be 1 or 4, got {compress_ratio}")
        seq = host_int_tensor("seq_lens", seq_lens, (1,), per_request=True)
        table = host_int_tensor("block_table", block_table, (2,))
        if seq.numel() == 0:
            raise IndexerInputError("seq_lens must name at least one request")
        if table.shape[0] != seq.shape[0]:
            raise IndexerInputError(f"block_table needs one row per request ({seq.shape[0]}), got {list(table.shape)}")
        if bool((seq < next_n).any()):
            raise IndexerInputError(f"every seq_lens entry must be >= next_n={next_n} (it includes the new tokens), "
                                    f"got min {int(seq.min())}")
        total = seq // compress_ratio
        local_total = local_key_count(total, rank, world)
        max_page = check_block_table(table, (local_total + PAGE_SIZE - 1) // PAGE_SIZE, num_cache_pages)
        check_page_sharing("block_table", table, local_total, PAGE_SIZE,
                           local_key_count((seq - next_n) // compress_ratio, rank, world),
                           "compressed entries" if compress_ratio == 4 else "keys")
        longest = int(total.max())
        width = max(PAGE_SIZE, -(-longest // PAGE_SIZE) * PAGE_SIZE) if max_context_len is None else max_context_len
        if isinstance(width, bool) or not isinstance(width, int) or width < longest:
            raise IndexerInputError(f"max_context_len must be an int >= the longest row ({longest} keys), got "
                                    f"{max_context_len!r}")
        local_width = min(-(-width // world), table.shape[1] * PAGE_SIZE)
        slots_of_requests = request_state_slots(state_slots, seq.shape[0])
        glob, local, pos, slots, state = _shard_metadata(seq, table, slots_of_requests, rank, world, next_n,
                                                         compress_ratio)
        request = torch.arange(seq.shape[0])[:, None].expand(-1, next_n).reshape(-1)
        completes = ((pos + 1) % compress_ratio == 0).nonzero().reshape(-1) if compress_ratio > 1 else None
        to = dict(device=device)
        batch = DecodeBatch(local.to(**to).contiguous(), table.to(device, torch.int32).contiguous(), pos.to(**to),
                            slots.to(**to), request.to(device, torch.int32), local_width, next_n, compress_ratio,
                            completes.to(**to) if completes is not None else None, state.to(**to),
                            int(state.max()), max_page, largest_position(pos, request))
        return cls(batch, glob.to(**to).contiguous(), width, rank, world)

    @classmethod
    def derive(cls, seq_lens: torch.Tensor, block_table: torch.Tensor, *, rank: int, world: int,
               max_context_len: int, next_n: int = 1, compress_ratio: int = 1,
               state_slots: torch.Tensor | None = None, num_state_slots: int | None = None) -> "ShardedDecodeBatch":
        """The same step from device tensors with device ops only (capturable in a CUDA graph: fixed B, table
        width and ``max_context_len``; nothing is read on the host, so nothing is checked: check the host inputs
        once per step as `build` does). Requests with ``seq_lens < next_n`` (0: padding) see no key and store
        nothing. C4: every row goes through the compressor's window gather; ``num_state_slots`` bounds the state."""
        rank, world = _check_rank(rank, world)
        b = seq_lens.shape[0]
        slots_of_requests = (torch.arange(b, device=seq_lens.device) if state_slots is None else state_slots)
        glob, local, pos, slots, state = _shard_metadata(seq_lens, block_table, slots_of_requests, rank, world,
                                                         next_n, compress_ratio)
        request = torch.arange(b, device=seq_lens.device, dtype=torch.int32).repeat_interleave(next_n)
        local_width = min(-(-max_context_len // world), block_table.shape[1] * PAGE_SIZE)
        if compress_ratio == 1:
            batch = DecodeBatch(local, block_table, pos, slots, request, local_width, next_n, 1)
        else:
            batch = DecodeBatch(local, block_table, pos, slots, request, local_width, next_n, compress_ratio,
                                torch.arange(b * next_n, device=seq_lens.device), state,
                                (num_state_slots if num_state_slots is not None else b) - 1)
        return cls(batch, glob, max_context_len, rank, world)

    def local_slots(self, topk: torch.Tensor) -> torch.Tensor:
        """The cache slots, in this rank's own cache, of the keys of ``topk`` (global request-local positions, as
        `context_parallel_decode` returns) that this rank holds; -1 for the others and for padding. What a sparse
        attention over this rank's shard reads (each rank attends to its part of the top-k, then the partial results
        merge by their log-sum-exp, as decode context parallelism does for attention)."""
        mine = (topk >= 0) & (topk % self.world == self.rank)
        local = torch.where(mine, topk // self.world, torch.zeros_like(topk)).long()
        table = self.local.block_table.long()
        rows = self.local.row_request.long()[:, None]
        page_col = (local // PAGE_SIZE).clamp_max(table.shape[1] - 1)
        slots = table[rows, page_col] * PAGE_SIZE + local % PAGE_SIZE
        return torch.where(mine, slots, torch.full_like(slots, -1)).to(torch.int32)


def _check_rank(rank, world) -> tuple[int, int]:
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise IndexerInputError(f"world must be an int >= 1 (the ranks sharing the cache), got {world!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise IndexerInputError(f"rank must be an int in [0, world={world}), got {rank!r}")
    return rank, world


def _candidate_keys(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One int64 per candidate whose order is the library's ranking: a higher score first, on equal scores the
    lower position (the tie rule), and no candidate (position -1) last. The fp32 score is mapped to an int32 of the
    same order (the sign-magnitude bits flipped for negatives; -0.0 taken as +0.0 and NaN as -inf, as the top-k
    does) in the high half; ``INT32_MAX - position`` fills the low half. Positions are unique within a row, so no
    two keys are equal and one top-k over the keys is the exact merge."""
    scores = values.masked_fill(torch.isnan(values), float("-inf"))
    scores = torch.where(scores == 0, torch.zeros_like(scores), scores)
    bits = scores.contiguous().view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ _INT32_MAX).long()
    key = ordered * 2**32 + (_INT32_MAX - positions.long())
    return torch.where(positions >= 0, key, torch.full_like(key, _NO_CANDIDATE))


def shard_candidates(logits: torch.Tensor, local_lens: torch.Tensor, k: int, rank: int, world: int, *,
                     target=None) -> torch.Tensor:
    """This rank's top-k candidates as `_candidate_keys` int64 [R, k]: `topk_indices` over its shard's logits
    [R, width] (row r sees local keys ``< local_lens[r]``; ties to the lower local position, which on one rank is
    the lower global one), each with its score and its global position ``local * world + rank``. A shard no wider
    than k (short contexts over many ranks) has every visible key as a candidate, with no top-k launch."""
    width = logits.shape[1]
    if width <= k:
        slot = torch.arange(k, device=logits.device, dtype=torch.int32)
        local = torch.where(slot[None, :] < local_lens[:, None], slot[None, :], torch.full_like(slot, -1)[None, :])
        scores = logits.gather(1, local.clamp(0, max(width - 1, 0)).long()) if width else torch.zeros(
            local.shape, device=logits.device)
        return _candidate_keys(scores, torch.where(local >= 0, local * world + rank, torch.full_like(local, -1)))
    local = ops.topk_indices(logits, k, local_lens, target=target)
    scores = logits.gather(1, local.clamp_min(0).long())
    return _candidate_keys(scores, torch.where(local >= 0, local * world + rank, torch.full_like(local, -1)))


def merge_candidates(keys: torch.Tensor, k: int) -> torch.Tensor:
    """The exact top-k of a row's candidates from every rank (``keys`` [R, world * k], `_candidate_keys`): int32
    [R, k] global positions, best first, -1 padded."""
    best = torch.topk(keys, k, dim=1, sorted=True).values
    positions = _INT32_MAX - (best & 0xFFFFFFFF)
    return torch.where(best == _NO_CANDIDATE, torch.full_like(positions, -1), positions).to(torch.int32)


@torch.no_grad()
def context_parallel_decode(indexer, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor,
                            batch: ShardedDecodeBatch, cache: IndexKCache, *, group=None, q_lora_quant=None,
                            compressor_state=None) -> torch.Tensor:
    """One decode step over a sharded k cache: every rank of ``group`` calls it with the same x, q_lora and
    positions (the query is replicated) and its own shard (``batch`` for its rank, ``cache`` its pages).

    Each rank stores the keys it holds, scores its shard (`Indexer.decode_logits`: `paged_mqa_logits`), takes its
    local top-k (`topk_indices`, ties to the lower local position, which is the lower global one), encodes each
    candidate as one int64 (score, position), and one ``all_gather_into_tensor`` of ``[B * next_n, topk]`` int64
    per rank feeds the exact merge: the best k of ``world * topk`` candidates, which hold the global top-k.

    Returns int32 ``[B * next_n, topk]``, the same on every rank and the same as the single-device call: global
    request-local positions (C4: entry indices j), best first, ties to the lower position, -1 padded; a batch
    whose global width is <= topk returns every visible key in order, as the single-device call does.
    `ShardedDecodeBatch.local_slots` turns it into this rank's cache slots. No host read: capturable with NCCL
    (fixed shapes; `ShardedDecodeBatch.derive` for the batch; range checks off, see ``DSA_INDEXER_CHECK_RANGES``)."""
    _check_group(group, "context_parallel_decode")
    if not isinstance(batch, ShardedDecodeBatch):
        raise IndexerInputError(f"batch must be a ShardedDecodeBatch, got {type(batch).__name__}")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if (batch.rank, batch.world) != (rank, world):
        raise IndexerInputError(f"batch was built for rank {batch.rank} of {batch.world} but this process is rank "
                                f"{rank} of {world} in the group")
    k = indexer.config.topk
    if batch.max_context_len <= k:  # every visible key is the answer: store this rank's keys, no exchange needed
        indexer.check_inputs(x, q_lora, positions, batch.local, cache, q_lora_quant)
        indexer.store_keys(x, batch.local, cache, compressor_state=compressor_state)
        slot = torch.arange(k, device=x.device, dtype=torch.int32)
        counts = batch.context_lens.reshape(-1)
        return torch.where(slot[None, :] < counts[:, None], slot[None, :], torch.full_like(slot, -1)[None, :])
    logits = indexer.decode_logits(x, q_lora, positions, batch.local, cache, q_lora_quant=q_lora_quant,
                                   compressor_state=compressor_state)
    keys = shard_candidates(logits, batch.local.context_lens.reshape(-1), k, rank, world, target=indexer.target)
    gathered = _all_gather_stacked(keys, world, group)
    return merge_candidates(gathered.permute(1, 0, 2).reshape(keys.shape[0], world * k), k)


def _all_gather_stacked(local: torch.Tensor, world: int, group) -> torch.Tensor:
    """``[world, *local.shape]``: one all-gather of equal-shape tensors into one buffer (NCCL's allgather, one
    launch, capturable; no list of per-rank tensors). The buffer is flat along dim 0, the shape gloo and NCCL both
    take; torch >= 2.10 names the op ``all_gather_single``."""
    out = torch.empty((world * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local.contiguous(), group=group)
    return out.view(world, *local.shape)


def _check_group(group, caller: str) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise IndexerInputError(f"{caller} needs an initialized torch.distributed process group "
                                "(dist.init_process_group('nccl' on GPUs or 'gloo' on CPUs))")


def store_keys_sharded(indexer, x: torch.Tensor, batch: PrefillBatch, cache: IndexKCache, block_table, *,
                       rank: int, world: int, compressor_state=None) -> None:
    """Store the keys of a prefill batch's tokens ``x`` into this rank's shard (what fills a sharded cache before
    `context_parallel_decode`): every rank runs the k path of every token (C4: the compressor's step, so each
    rank's copy of the state rolls forward identically) and keeps the keys it holds, key p at local position
    ``p // world`` of ``block_table`` [B, pages] (this rank's pages per request)."""
    rank, world = _check_rank(rank, world)
    if not isinstance(batch, PrefillBatch):
        raise IndexerInputError(f"batch must be a PrefillBatch, got {type(batch).__name__}")
    host_table = host_int_tensor("block_table", block_table, (2,))
    max_page = int(host_table.max()) if host_table.numel() else -1
    if max_page >= cache.num_pages:
        raise IndexerInputError(f"block_table uses cache page {max_page} but this rank's cache has "
                                f"{cache.num_pages} pages")
    table = host_table.to(batch.slot_mapping.device)
    if table.shape[0] != batch.block_table.shape[0]:
        raise IndexerInputError(f"block_table needs one row per request of the batch ({batch.block_table.shape[0]}), "
                                f"got {list(table.shape)}")
    entry = batch.positions.long() // batch.compress_ratio
    local = entry // world
    if check_values(local) and local.numel():
        longest = int(local.max())
        if longest >= table.shape[1] * PAGE_SIZE:
            raise IndexerInputError(f"block_table maps {table.shape[1] * PAGE_SIZE} local keys per request but rank "
                                    f"{rank} holds local key {longest}")
    stores = (batch.slot_mapping >= 0) & (entry % world == rank)
    page_col = (local // PAGE_SIZE).clamp_max(table.shape[1] - 1)
    pages = table.long()[batch.row_request.long(), page_col]
    slots = torch.where(stores, pages * PAGE_SIZE + local % PAGE_SIZE, torch.full_like(local, -1))
    indexer.store_keys(x, dataclasses.replace(batch, slot_mapping=slots), cache, compressor_state=compressor_state)


# --- Tensor-parallel prefill: rows split by cost, only the int32 top-k exchanged ---------------------------------


def cost_split_rows(visible_keys: torch.Tensor, world: int) -> list[tuple[int, int]]:
    """Contiguous row ranges ``[(start, stop)] * world`` of near-equal cost, a row costing its visible keys (the
    logits it scores; at least 1 for its q path). Contiguous, so each rank's chunks gather one compact key range.
    Host planning (``visible_keys`` a host tensor); a rank may get no rows (fewer rows than ranks)."""
    cost = visible_keys.long().clamp_min(1).cumsum(0)
    total = int(cost[-1]) if cost.numel() else 0
    targets = torch.tensor([total * r // world for r in range(1, world)], dtype=torch.long)
    cuts = [0] + torch.searchsorted(cost, targets, right=True).tolist() + [int(cost.numel())]
    return [(cuts[r], max(cuts[r], cuts[r + 1])) for r in range(world)]


@torch.no_grad()
def tensor_parallel_prefill(indexer, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor,
                            batch: PrefillBatch, cache: IndexKCache, *, group=None, q_lora_quant=None,
                            compressor_state=None) -> torch.Tensor:
    """Prefill over tensor-parallel ranks that each hold the whole k cache (as TP attention does) and the same
    inputs: every rank stores every key (its own k path, nothing exchanged; C4: the compressor's step on each
    rank's copy of the state), scores the rows of its share (`cost_split_rows`: contiguous, by rows x visible
    keys), and one ``all_gather_into_tensor`` of the int32 top-k (padded to the largest share) gives every rank
    the whole ``[T, topk]``, 4 x topk bytes per row: the same as the single-device call up to the GEMM rounding
    of another row count in the q path."""
    _check_group(group, "tensor_parallel_prefill")
    if not isinstance(batch, PrefillBatch):
        raise IndexerInputError(f"batch must be a PrefillBatch, got {type(batch).__name__}")
    indexer.check_inputs(x, q_lora, positions, batch, cache, q_lora_quant)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    indexer.store_keys(x, batch, cache, compressor_state=compressor_state)
    ks, ke = batch.host_bounds if batch.host_bounds is not None else (batch.ks.cpu(), batch.ke.cpu())
    shares = cost_split_rows(ke - ks, world)
    start, stop = shares[rank]
    longest = max(b - a for a, b in shares)
    k = indexer.config.topk
    mine = torch.full((longest, k), -1, dtype=torch.int32, device=x.device)
    if stop > start:
        rows = torch.arange(start, stop, device=x.device)
        quant = q_lora_quant.select_rows(slice(start, stop)) if q_lora_quant is not None else None
        mine[: stop - start] = indexer.score_rows(x[start:stop], q_lora[start:stop], positions[start:stop],
                                                  _rows_batch(batch, rows), cache, quant)
    gathered = _all_gather_stacked(mine, world, group)
    return torch.cat([gathered[r, : b - a] for r, (a, b) in enumerate(shares)])
