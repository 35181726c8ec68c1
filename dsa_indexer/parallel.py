"""Context-parallel prefill on ``torch.distributed``: the query rows of one prefill batch split over the ranks of a
process group (NCCL on GPUs, gloo on CPUs; no transport of our own).

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

import torch
import torch.distributed as dist

from .batch import PrefillBatch
from .contract.cache import IndexKCache, gather_rows, page_views
from .contract.validate import IndexerInputError


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
    import dataclasses

    rows_host = rows.cpu()
    ks, ke = batch.ks[rows], batch.ke[rows]
    host = (batch.host_bounds[0][rows_host], batch.host_bounds[1][rows_host]) if batch.host_bounds else None
    return dataclasses.replace(batch, ks=ks, ke=ke, positions=batch.positions[rows],
                               slot_mapping=batch.slot_mapping[rows], row_request=batch.row_request[rows],
                               max_keys_per_row=int((ke - ks).max()) if rows.numel() else 0, host_bounds=host,
                               _plans=None)
