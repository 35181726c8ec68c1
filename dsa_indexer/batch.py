"""Batch metadata for one indexer step: decode (paged) and prefill / extend (ragged).

Builders validate lengths against the block table and the cache capacity on the host, once per step, so the
kernels can trust them (an out-of-range page id would otherwise read another request's keys or fault). They also
check how the step shares pages (`check_page_sharing`): request b reads the pages of its keys ``[0, total)`` and
writes those of ``[cached, total)``; no request may use one cache page twice, and a page a request writes is its
own in that step. Requests may share pages nobody writes in the step (a common cached prefix).
With ``compress_ratio=4`` (V4's C4 indexer) keys are compressed entries: a query at position t sees entries
``j < (t + 1) // 4``, and the block table maps entry indices to cache slots. A row whose position p completes an
entry ((p + 1) % 4 == 0) stores that entry j = p // 4: its ``slot_mapping`` is the entry's cache slot (-1 for the
other rows), it is listed in ``compress_rows``, and ``state_slot`` names the `CompressorState` slot of its request.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from math import isqrt

import numpy as np
import torch

from .contract.cache import PAGE_SIZE
from .contract.step import StepContext
from .contract.validate import IndexerInputError, check_page_sharing


def host_int_tensor(name: str, value, ndim: tuple[int, ...], per_request: bool = False) -> torch.Tensor:
    empty = (isinstance(value, (list, tuple)) and len(value) == 0
             or isinstance(value, torch.Tensor) and value.numel() == 0)
    if per_request and empty:
        raise IndexerInputError(f"{name} must name at least one request, got an empty {type(value).__name__} (an "
                                "idle rank has nothing to store or score: skip the indexer for that step; see "
                                "docs/troubleshooting.md)")
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":
            raise IndexerInputError(f"{name} is a meta tensor: batch metadata needs real values")
        t = value.detach().to("cpu")
    else:
        try:
            t = torch.tensor(value)
        except Exception as exc:
            raise IndexerInputError(f"{name} must be an int tensor or a list of ints: {exc}") from None
    if t.dtype not in (torch.int32, torch.int64, torch.int16, torch.uint8, torch.int8):
        raise IndexerInputError(f"{name} must hold integers, got dtype {t.dtype}")
    if t.dim() not in ndim:
        raise IndexerInputError(f"{name} must have {' or '.join(map(str, ndim))} dims, got shape {list(t.shape)}")
    return t.long()


def check_block_table(block_table: torch.Tensor, needed_pages: torch.Tensor, num_pages: int | None) -> int:
    """``needed_pages[b]`` pages of row b must exist in the table and point inside the cache; returns the largest
    page id in use (-1: none), which `Indexer.forward` checks against the cache it is given."""
    if block_table.dim() != 2 or block_table.shape[0] != needed_pages.shape[0]:
        raise IndexerInputError(f"block_table must be [num_requests={needed_pages.shape[0]}, max_pages], got shape "
                                f"{list(block_table.shape)}")
    too_long = needed_pages > block_table.shape[1]
    if bool(too_long.any()):
        b = int(too_long.nonzero()[0, 0])
        raise IndexerInputError(f"request {b} needs {int(needed_pages[b])} pages of {PAGE_SIZE} slots but block_table "
                                f"has only {block_table.shape[1]} columns")
    used = torch.arange(block_table.shape[1])[None, :] < needed_pages[:, None]
    entries = block_table[used]
    if entries.numel():
        low, high = int(entries.min()), int(entries.max())
        if low < 0 or (num_pages is not None and high >= num_pages):
            limit = f"[0, {num_pages})" if num_pages is not None else ">= 0"
            raise IndexerInputError(f"block_table entries in use must be cache pages in {limit}, got range [{low}, "
                                    f"{high}]")
        return high
    return -1


def _key_unit(compress_ratio: int) -> str:
    return "keys" if compress_ratio == 1 else "entries"


def check_decode_pages(seq_lens: torch.Tensor, block_table: torch.Tensor, next_n: int, compress_ratio: int,
                       num_cache_pages: int | None) -> int:
    """The block-table checks of a decode step, on host tensors (`DecodeBatch.build`, and `DecodeBuffers.load` for
    a graph's inputs): request b has ``seq_lens[b]`` tokens with its ``next_n`` new ones (0: a padding request,
    which uses no page), so it reads the pages of its keys ``[0, seq // ratio)`` and writes those of
    ``[(seq - next_n) // ratio, seq // ratio)``. Returns the largest page in use (-1: none)."""
    seq = seq_lens.long()
    total = seq // compress_ratio
    max_page = check_block_table(block_table, (total + PAGE_SIZE - 1) // PAGE_SIZE, num_cache_pages)
    check_page_sharing("block_table", block_table, total, PAGE_SIZE, (seq - next_n).clamp_min(0) // compress_ratio,
                       _key_unit(compress_ratio))
    return max_page


def _slots(block_table: torch.Tensor, request: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    return block_table[request, position // PAGE_SIZE] * PAGE_SIZE + position % PAGE_SIZE


def _key_slots(table: torch.Tensor, request: torch.Tensor, positions: torch.Tensor, compress_ratio: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache slot of the key each row stores, rows that complete a compressed entry). Ratio 1: every row stores
    its own key. Ratio 4: a row at position p stores entry p // 4 when (p + 1) % 4 == 0, else nothing (-1)."""
    if compress_ratio == 1:
        return _slots(table, request, positions), torch.zeros(0, dtype=torch.int64)
    completes = (positions + 1) % compress_ratio == 0
    entry = positions // compress_ratio
    slots = torch.where(completes, _slots(table, request, torch.where(completes, entry, 0)), -1)
    return slots, completes.reshape(-1).nonzero().reshape(-1)


def largest_position(positions: torch.Tensor, request: torch.Tensor) -> tuple[int, int]:
    """(largest position, its request) from the host tensors, for the RoPE-table check at forward."""
    row = int(positions.argmax())
    return int(positions[row]), int(request[row])


def request_state_slots(state_slots, num_requests: int) -> torch.Tensor:
    """The CompressorState slot of each request: ``state_slots`` if given, else the request's index."""
    if state_slots is None:
        return torch.arange(num_requests)
    slots = host_int_tensor("state_slots", state_slots, (1,))
    if slots.shape[0] != num_requests:
        raise IndexerInputError(f"state_slots must name one slot per request ({num_requests}), got {slots.shape[0]}")
    if bool((slots < 0).any()) or slots.unique().numel() != slots.numel():
        raise IndexerInputError("state_slots must be distinct and >= 0 (one CompressorState slot per request)")
    return slots


def _non_negative_int(name: str, value) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        raise IndexerInputError(f"{name} must be an int >= 0 (bytes), got {type(value).__name__} {value!r}") from None
    if number < 0:
        raise IndexerInputError(f"{name} must be an int >= 0 (bytes), got {number}")
    return number


def _host_ints(bound: torch.Tensor) -> memoryview:
    """Rows of a host int tensor as a memoryview: indexing it gives a Python int (~1.5x faster than
    ``ndarray.item``, and no numpy scalar), which the planner reads a few times per chunk."""
    return memoryview(bound.numpy())


def _plan_row_chunks(ks_rows: torch.Tensor, ke_rows: torch.Tensor, budget: int, row_bytes: int, key_bytes: int,
                     ratio: int) -> list[tuple[int, int, int, int]]:
    """`PrefillBatch.plan_chunks`' chunks for non-decreasing ``ks`` / ``ke``. The chunk from ``start`` with n rows
    costs ``cost(n) = n * ((ke[start + n - 1] - ks[start]) * key_bytes + row_bytes)``, which never decreases in n,
    so n is the largest one that fits exactly when ``cost(n) <= budget < cost(n + 1)`` (or n = 1, or the rows end).

    Within one request ke grows by one key per ``ratio`` rows, so n is estimated by solving the quadratic
    ``ratio * cost(n) ~= n * (ratio * (first row's bytes) + (n - 1) * key_bytes) <= ratio * budget`` in integers
    (exact for ratio 1, within a row or two for ratio 4) and then checked against ke by those two conditions: two
    adjacent reads. Where the estimate is off (the chunk reaches another request, or ke grows otherwise) a galloping
    search from it finds n; the estimate only decides how many reads that takes, never the answer."""
    ks, ke = _host_ints(ks_rows), _host_ints(ke_rows)
    rows = len(ks)
    plan: list[tuple[int, int, int, int]] = []
    if rows == 0:
        return plan
    if key_bytes == 0:
        # Every row costs row_bytes whatever its keys: chunks of one fixed length.
        length = rows if row_bytes == 0 else max(1, budget // row_bytes)
        return [(start, min(start + length, rows), ks[start], ke[min(start + length, rows) - 1])
                for start in range(0, rows, length)]
    append = plan.append
    # The estimate's quadratic n^2 * a + n * b <= c: a = key_bytes, b = b_per_key * ke[start] + b_rest (b_rest takes
    # the base and the row bytes), c = ratio * budget; floor((isqrt(b^2 + 4ac) - b) / 2a) is its integer root.
    b_per_key = ratio * key_bytes
    four_ac, twice_a = 4 * key_bytes * ratio * budget, 2 * key_bytes
    start, ke_start = 0, ke[0]
    base_until = 0  # ks[row] == base for start <= row < base_until
    while start < rows:
        if start >= base_until:
            # A read of a far row touches a cold page; ks is constant over a request, so it is read per request.
            base = ks[start]
            base_until = _run_end(ks, start, rows)
            offset = row_bytes - base * key_bytes  # a row's bytes = ke[row] * key_bytes + offset
            b_rest = ratio * offset - key_bytes
        b = b_per_key * ke_start + b_rest
        stop = start + (isqrt(b * b + four_ac) - b) // twice_a
        if stop >= rows:
            stop = rows
        elif stop <= start:
            stop = start + 1
        last = ke[stop - 1]
        if (stop - start) * (last * key_bytes + offset) > budget and stop - start > 1:
            stop = _search_stop(ke, start, offset, budget, key_bytes, rows, stop, fits=False)
            last, ke_start = ke[stop - 1], ke[stop]  # stop < the failed probe <= rows
        elif stop < rows:
            ke_start = ke[stop]
            if (stop + 1 - start) * (ke_start * key_bytes + offset) <= budget:
                stop = _search_stop(ke, start, offset, budget, key_bytes, rows, stop + 1, fits=True)
                last = ke[stop - 1]
                if stop < rows:
                    ke_start = ke[stop]
        append((start, stop, base, last))
        start = stop
    return plan


def _run_end(ks: memoryview, start: int, rows: int) -> int:
    """The first row after ``start`` whose ks differs from ``ks[start]`` (``rows`` if none). ks never decreases, so
    an equal read at a row proves every row before it equal: the last row first (one request), then a gallop."""
    base = ks[start]
    if ks[rows - 1] == base:
        return rows
    same, differs, step = start, rows - 1, 1
    while same + step < differs and ks[same + step] == base:
        same, step = same + step, step * 2
    differs = min(differs, same + step)
    while differs - same > 1:
        middle = (same + differs) // 2
        if ks[middle] == base:
            same = middle
        else:
            differs = middle
    return differs


def _search_stop(ke: memoryview, start: int, offset: int, budget: int, key_bytes: int, rows: int, probe: int,
                 fits: bool) -> int:
    """The largest stop in ``(start, rows]`` whose rows ``[start, stop)`` fit (``start + 1`` always does), given
    that ``probe``'s do (``fits``) or do not: gallop away from the probe in doubling steps until the answer is
    bracketed, then bisect. O(log |error|) reads, so a rough estimate costs little."""

    def fit(stop: int) -> bool:
        return stop - start == 1 or (stop - start) * (ke[stop - 1] * key_bytes + offset) <= budget

    step = 1
    if fits:
        good, bad = probe, rows + 1
        while good < rows:
            candidate = min(good + step, rows)
            if not fit(candidate):
                bad = candidate
                break
            good, step = candidate, step * 2
    else:
        good, bad = start + 1, probe
        while bad - 1 > start + 1:
            candidate = max(bad - step, start + 1)
            if fit(candidate):
                good = candidate
                break
            bad, step = candidate, step * 2
    while bad - good > 1:
        middle = (good + bad) // 2
        if fit(middle):
            good = middle
        else:
            bad = middle
    return good


@dataclass(frozen=True)
class DecodeBatch:
    """B requests x next_n query tokens (row = b * next_n + n). Tensors live on the compute device."""

    context_lens: torch.Tensor  # [B, next_n] int32: keys visible to each row
    block_table: torch.Tensor  # [B, max_pages] int32
    positions: torch.Tensor  # [B * next_n] int64: token position of each row
    slot_mapping: torch.Tensor  # [B * next_n] int64: cache slot of the key each row stores (-1: none)
    row_request: torch.Tensor  # [B * next_n] int32
    max_context_len: int
    next_n: int
    compress_ratio: int = 1
    compress_rows: torch.Tensor | None = None  # [E] int64 rows that complete a compressed entry (C4)
    state_slot: torch.Tensor | None = None  # [B * next_n] int64 CompressorState slot of each row (-1: padding)
    max_state_slot: int = -1  # host copy of state_slot.max(), checked against the state without a device sync
    max_page: int = -1  # the largest cache page the block table uses (host int; -1: unknown or none)
    last_position: tuple[int, int] = (-1, -1)  # (largest token position, its request), host ints; checked at forward
    # Host facts read on every call, taken once here. The batch is frozen: its host copies (max_page, last_position,
    # these) describe its tensors, and rebinding a tensor would leave them describing another batch.
    num_tokens: int = field(init=False, repr=False, compare=False)
    batch_size: int = field(init=False, repr=False, compare=False)
    # The step's context (`contract.step`), shared by every layer that runs this batch; made here, so a batch made
    # from another (`dataclasses.replace`) never inherits scratch that describes the other's tensors.
    context: StepContext = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_tokens", self.positions.shape[0])
        object.__setattr__(self, "batch_size", self.block_table.shape[0])
        object.__setattr__(self, "context", StepContext())

    def request_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(cu_seqlens_q [B + 1], seq_lens_k [B], block_table)`` for the plain-layout ragged indexer: request b
        owns rows ``[b * next_n, (b + 1) * next_n)`` and has ``positions[last row] + 1`` tokens (device ops only)."""
        b, n = self.batch_size, self.next_n
        device = self.positions.device
        cu = torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device=device)
        seq = (self.positions.view(b, n)[:, -1] + 1).to(torch.int32)
        return cu, seq, self.block_table

    @classmethod
    def build(cls, seq_lens, block_table, *, next_n: int = 1, num_cache_pages: int | None = None,
              device: torch.device | str = "cpu", compress_ratio: int = 1,
              max_context_len: int | None = None, state_slots=None) -> "DecodeBatch":
        """``seq_lens[b]``: tokens of request b including its next_n new ones. ``block_table[b]``: its pages
        (of compressed entries when compress_ratio is 4). ``max_context_len``: pad the logits width (default:
        the longest row, rounded up to a page), e.g. to keep a CUDA graph's shapes fixed. ``state_slots[b]``:
        the `CompressorState` slot of request b (C4; default b)."""
        if not isinstance(next_n, int) or next_n < 1:
            raise IndexerInputError(f"next_n must be an int >= 1, got {next_n!r}")
        if compress_ratio not in (1, 4):
            raise IndexerInputError(f"compress_ratio must be 1 or 4, got {compress_ratio}")
        seq = host_int_tensor("seq_lens", seq_lens, (1,), per_request=True)
        table = host_int_tensor("block_table", block_table, (2,))
        if seq.numel() == 0:
            raise IndexerInputError("seq_lens must name at least one request")
        if bool((seq < next_n).any()):
            raise IndexerInputError(f"every seq_lens entry must be >= next_n={next_n} (it includes the new tokens), "
                                    f"got min {int(seq.min())}")
        positions = seq[:, None] - next_n + torch.arange(next_n)[None, :]  # [B, next_n]
        keys = (positions + 1) // compress_ratio  # keys visible to each row
        max_page = check_decode_pages(seq, table, next_n, compress_ratio, num_cache_pages)
        longest = int(keys.max())
        width = max(PAGE_SIZE, -(-longest // PAGE_SIZE) * PAGE_SIZE) if max_context_len is None else max_context_len
        if width < longest:
            raise IndexerInputError(f"max_context_len {width} is shorter than the longest row ({longest} keys)")
        if width > table.shape[1] * PAGE_SIZE:
            if max_context_len is not None:
                raise IndexerInputError(f"max_context_len {width} exceeds the block table's capacity "
                                        f"{table.shape[1]} pages x {PAGE_SIZE}")
            width = table.shape[1] * PAGE_SIZE
        request = torch.arange(seq.shape[0])[:, None].expand(-1, next_n)
        slots, compress_rows = _key_slots(table, request, positions, compress_ratio)
        state = request_state_slots(state_slots, seq.shape[0])[request]
        return cls(keys.to(device, torch.int32).contiguous(), table.to(device, torch.int32).contiguous(),
                   positions.reshape(-1).to(device), slots.reshape(-1).to(device),
                   request.reshape(-1).to(device, torch.int32), width, next_n, compress_ratio,
                   compress_rows.to(device), state.reshape(-1).to(device), int(state.max()), max_page,
                   largest_position(positions.reshape(-1), request.reshape(-1)))


@dataclass(frozen=True)
class PrefillBatch:
    """Ragged prefill / extend: request b has prefix_lens[b] cached tokens and extend_lens[b] new ones.

    Keys of all requests are gathered request by request (``gather_slots``); query row i of request b sees
    gathered keys ``[ks, ke)`` = its request's keys up to and including its own position. Frozen, like
    `DecodeBatch`: what the step derives from it once (chunk plans, the plain layout's request rows) is kept in its
    step context (``context``), made with the batch, so a batch made from another (`dataclasses.replace`) starts
    with none of the other's.
    """

    ks: torch.Tensor  # [T] int32
    ke: torch.Tensor  # [T] int32
    gather_slots: torch.Tensor  # [total keys] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: cache slot of the key each row stores (-1: none)
    row_request: torch.Tensor  # [T] int32
    block_table: torch.Tensor  # [B, max_pages] int32
    max_keys_per_row: int
    compress_ratio: int = 1
    compress_rows: torch.Tensor | None = None  # [E] int64 rows that complete a compressed entry (C4)
    state_slot: torch.Tensor | None = None  # [T] int64 CompressorState slot of each row
    max_state_slot: int = -1  # host copy of state_slot.max()
    max_page: int = -1  # the largest cache page the block table uses (host int)
    last_position: tuple[int, int] = (-1, -1)  # (largest token position, its request), host ints
    host_bounds: tuple[torch.Tensor, torch.Tensor] | None = None  # (ks, ke) on the host, for planning chunks
    # (first row of each request [B + 1], its tokens prefix + extend [B]) on the host: the ragged query metadata of
    # the plain-layout indexer (`request_rows`), sliced per chunk without a device read.
    host_requests: tuple[torch.Tensor, torch.Tensor] | None = None
    context: StepContext = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "context", StepContext())

    def request_rows(self, start: int = 0, stop: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(cu_seqlens_q [B' + 1], seq_lens_k [B'], block_table [B', pages])`` on the device for rows
        ``[start, stop)``: the requests those rows belong to, their rows' offsets from ``start`` and each request's
        tokens up to its last row in the range (its rows are its last tokens there, so a causal kernel aligned at
        the bottom right sees exactly the keys each row sees). Built from host metadata once per range and step
        (shared by every layer)."""
        stop = self.num_tokens if stop is None else stop
        return self.context.memo(("request_rows", start, stop), lambda: self._request_rows(start, stop))

    def _request_rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.host_requests is None:
            raise IndexerInputError("this PrefillBatch has no request metadata: build it with PrefillBatch.build")
        first_row, tokens = self.host_requests
        first = int(torch.searchsorted(first_row, torch.tensor(start), right=True)) - 1
        last = int(torch.searchsorted(first_row, torch.tensor(stop - 1), right=True)) - 1
        bounds = first_row[first:last + 2].clamp(start, stop) - start
        lens = tokens[first:last + 1].clone()
        lens[-1] -= int(first_row[last + 1]) - stop  # the last request's rows end at ``stop``
        device = self.ks.device
        return (bounds.to(device, torch.int32), lens.to(device, torch.int32),
                self.block_table[first:last + 1].contiguous())

    def plan_chunks(self, budget_bytes: int, row_bytes: int = 0, key_bytes: int = 4) -> list[tuple[int, int, int, int]]:
        """Row chunks ``(start, stop, lo, hi)`` whose scoring memory, ``key_bytes`` per (row, key) of the chunk's
        ``[stop - start, hi - lo]`` window (4: its fp32 logits; 0 for a scorer that never holds them) plus
        ``row_bytes`` per row (the q path's intermediates, a fused scorer's candidates), fits ``budget_bytes`` (at
        least one row each): each chunk is the longest run of rows from its start that fits, with ``lo = ks[start]``
        and ``hi = ke[stop - 1]``. From the host copies of ks / ke: no device sync, no per-row Python (a closed-form
        estimate and two reads per chunk; ks and ke never decrease along the rows, as `build` makes them). Computed
        once per (budget, row bytes, key bytes) and step, and shared by every layer."""
        return self.context.memo(("chunks", budget_bytes, row_bytes, key_bytes),
                                 lambda: self._plan_chunks(budget_bytes, row_bytes, key_bytes))

    def _plan_chunks(self, budget_bytes, row_bytes, key_bytes) -> list[tuple[int, int, int, int]]:
        sizes = [_non_negative_int(name, value) for name, value in
                 (("budget_bytes", budget_bytes), ("row_bytes", row_bytes), ("key_bytes", key_bytes))]
        ks, ke = self.host_bounds if self.host_bounds is not None else self.context.memo(
            "host_bounds", lambda: (self.ks.cpu().long(), self.ke.cpu().long()))
        ratio = self.compress_ratio if isinstance(self.compress_ratio, int) and self.compress_ratio >= 1 else 1
        return _plan_row_chunks(ks, ke, *sizes, ratio)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @classmethod
    def build(cls, prefix_lens, extend_lens, block_table, *, num_cache_pages: int | None = None,
              device: torch.device | str = "cpu", compress_ratio: int = 1, state_slots=None) -> "PrefillBatch":
        """Request b: ``prefix_lens[b]`` tokens already cached, ``extend_lens[b]`` new ones in this step (rows in
        request order). ``state_slots[b]``: the `CompressorState` slot of request b (C4; default b)."""
        if compress_ratio not in (1, 4):
            raise IndexerInputError(f"compress_ratio must be 1 or 4, got {compress_ratio}")
        prefix = host_int_tensor("prefix_lens", prefix_lens, (1,), per_request=True)
        extend = host_int_tensor("extend_lens", extend_lens, (1,), per_request=True)
        table = host_int_tensor("block_table", block_table, (2,))
        if prefix.shape != extend.shape or prefix.numel() == 0:
            raise IndexerInputError(f"prefix_lens and extend_lens must be non-empty and of one length, got "
                                    f"{list(prefix.shape)} and {list(extend.shape)}")
        if bool((prefix < 0).any()) or bool((extend < 1).any()):
            raise IndexerInputError("prefix_lens must be >= 0 and extend_lens >= 1 for every request")
        total = prefix + extend
        keys_total = total // compress_ratio
        max_page = check_block_table(table, (keys_total + PAGE_SIZE - 1) // PAGE_SIZE, num_cache_pages)
        check_page_sharing("block_table", table, keys_total, PAGE_SIZE, prefix // compress_ratio,
                           _key_unit(compress_ratio))
        ks, ke, pos, req, gather = [], [], [], [], []
        offset = 0
        for b in range(prefix.shape[0]):
            p, e, n_keys = int(prefix[b]), int(extend[b]), int(keys_total[b])
            positions = torch.arange(p, p + e)
            pos.append(positions)
            ks.append(torch.full((e,), offset))
            ke.append(offset + (positions + 1) // compress_ratio)
            req.append(torch.full((e,), b))
            gather.append(_slots(table, torch.full((n_keys,), b), torch.arange(n_keys)))
            offset += n_keys
        positions = torch.cat(pos)
        request = torch.cat(req)
        ks_t, ke_t = torch.cat(ks), torch.cat(ke)
        slots, compress_rows = _key_slots(table, request, positions, compress_ratio)
        state = request_state_slots(state_slots, prefix.shape[0])[request]
        return cls(ks_t.to(device, torch.int32), ke_t.to(device, torch.int32), torch.cat(gather).to(device),
                   positions.to(device), slots.to(device), request.to(device, torch.int32),
                   table.to(device, torch.int32).contiguous(), int((ke_t - ks_t).max()), compress_ratio,
                   compress_rows.to(device), state.to(device), int(state.max()), max_page,
                   largest_position(positions, request), (ks_t.long(), ke_t.long()),
                   host_requests=(torch.cat([torch.zeros(1, dtype=torch.long), extend.cumsum(0)]), total.clone()))
