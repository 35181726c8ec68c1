"""CUDA-graph decode: capture one indexer step for a fixed batch shape, then replay it with new inputs.

    graph = DecodeGraph.capture(indexer, cache, batch_size=32, max_context_len=8192)   # or indexer.capture_decode
    topk = graph.replay(x, q_lora, seq_lens, block_table)   # int32 [b * next_n, topk], request-local, -1 padded

Vendor-neutral: `torch.cuda.CUDAGraph` is also HIP graphs on ROCm. What is static and what is derived:
- static input buffers: ``x`` [B*N, hidden], ``q_lora`` [B*N, q_lora_rank], ``seq_lens`` [B] int32 (tokens of each
  request including its N new ones) and ``block_table`` [B, max_pages] int32;
- derived INSIDE the graph (no host sync, no ``.item()``): positions, context_lens, slot_mapping, state slots
  (`DecodeBuffers.derive`, the `decode_metadata` op: one Triton launch on a GPU). It is part of the replay, so each
  replay sees its own lengths.
- V4 C4: the layer's `CompressorState` is given at capture; ``state_slots`` [B] (default 0..B-1) is a static
  buffer too. Every row goes through the compressor's window gather (the graph cannot know which rows complete an
  entry); rows that complete none store nothing.
- the logits width ``max_context_len`` is fixed at capture (a host int), like the shapes.

Padding: ``replay`` takes b <= B requests; requests b..B-1 get ``seq_lens = 0``, which the derivation turns into
rows that see no key (context length 0, top-k all -1) and store nothing (slot -1). Any row whose position would
be negative (``seq_lens[b] < next_n``) is treated the same way. Capture runs with all-padding inputs, so the
warm-up steps never write into the cache.

What is checked where: nothing inside the graph (a replay reads no value on the host). ``replay`` /
`DecodeBuffers.load` checks host ``seq_lens`` and ``block_table`` before copying them in: lengths, pages in use
inside the cache, and the page rule of `DecodeBatch.build` (no request uses a page twice; a page a request writes
belongs to it alone; read-only prefix pages may be shared), once per step for the graphs of all layers. Device
inputs are trusted unless ``DSA_INDEXER_CHECK_RANGES=1`` (then they are read back: a sync per replay). On CPU
tensors the `decode_metadata` op and `Indexer.forward` check the derived batch too.

Rules: the first resolution of every op must happen before capture (the warm-up steps do it; DeepGEMM's probe
runs its self-test then). ``DSA_INDEXER_CHECK_RANGES=1`` reads values on the host and cannot be captured.
The returned tensor is the graph's static output: the next replay overwrites it (clone it to keep it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from . import ops
from .dispatch.bind import Bound, bind
from .dispatch.target import Target, detect_target
from .batch import DecodeBatch, check_decode_pages
from .contract.cache import PAGE_SIZE, IndexKCache
from .config import IndexerConfig
from .contract.validate import IndexerInputError, ranges_checked, tensor as check_tensor

INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass
class DecodeBuffers:
    """The static inputs of a decode graph and the on-device derivation of its batch metadata.

    Device-agnostic (it also runs on CPU tensors, which is how CPU tests check the derivation)."""

    x: torch.Tensor  # [B*N, hidden]
    q_lora: torch.Tensor  # [B*N, q_lora_rank]
    seq_lens: torch.Tensor  # [B] int32, 0 = padding request
    block_table: torch.Tensor  # [B, max_pages] int32
    row_request: torch.Tensor  # [B*N] int32
    all_rows: torch.Tensor  # [B*N] int64: 0..B*N-1, the C4 compressor's rows (every row, see the module docstring)
    state_slots: torch.Tensor  # [B] int64 CompressorState slot of each request (C4), -1 for padding requests
    num_state_slots: int  # slots of the captured CompressorState (C4)
    max_context_len: int
    next_n: int
    compress_ratio: int
    max_position: int
    num_cache_pages: int | None = None  # pages of the graph's cache, for the block-table check of `load`
    # `decode_metadata` bound for the buffers' target and problem (bound again when the registry changes).
    _metadata: Bound | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def allocate(cls, indexer, batch_size: int, max_context_len: int, next_n: int,
                 device: torch.device, num_cache_pages: int | None = None) -> "DecodeBuffers":
        cfg = indexer.config
        rows = batch_size * next_n
        max_pages = -(-max_context_len // PAGE_SIZE)
        return cls(
            x=torch.zeros(rows, cfg.hidden_size, dtype=indexer.dtype, device=device),
            q_lora=torch.zeros(rows, cfg.q_lora_rank, dtype=indexer.dtype, device=device),
            seq_lens=torch.zeros(batch_size, dtype=torch.int32, device=device),
            block_table=torch.zeros(batch_size, max_pages, dtype=torch.int32, device=device),
            row_request=torch.arange(batch_size, dtype=torch.int32, device=device).repeat_interleave(next_n),
            all_rows=torch.arange(rows, dtype=torch.int64, device=device),
            state_slots=torch.arange(batch_size, dtype=torch.int64, device=device), num_state_slots=batch_size,
            max_context_len=max_context_len, next_n=next_n, compress_ratio=cfg.compress_ratio,
            max_position=cfg.max_position, num_cache_pages=num_cache_pages)

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def max_pages(self) -> int:
        return self.block_table.shape[1]

    def derive(self, target=None) -> DecodeBatch:
        """The DecodeBatch of the current buffer contents, computed with device ops only (capturable): the
        `decode_metadata` op (one Triton launch on a GPU, torch ops elsewhere). ``target``: where it resolves
        (default: the buffers' device).

        Same values as `DecodeBatch.build` for valid requests; rows with a negative position are padding."""
        n, ratio = self.next_n, self.compress_ratio
        declared = ops.OPERATORS["decode_metadata"]
        # The op's checks (they read values on CPU tensors only, or with DSA_INDEXER_CHECK_RANGES=1), then its kernel,
        # bound once for these buffers: no registry call per step.
        args = declared.arguments(self.seq_lens, self.block_table, self.state_slots, next_n=n, compress_ratio=ratio,
                                  target=target)
        bound = self._metadata
        if bound is None or not bound.current or (target is not None and bound.target != target):
            problem = declared.problem(*args)
            resolved = detect_target(self.seq_lens.device, target) if not isinstance(target, Target) else target
            bound = self._metadata = bind("decode_metadata", resolved, problem)
        context_lens, positions, slots, state_slot = bound.fn(*args)
        if ratio == 1:
            return DecodeBatch(context_lens, self.block_table, positions, slots, self.row_request,
                               self.max_context_len, n, ratio)
        # C4: every row goes through the compressor's window gather (rows that complete no entry store nothing).
        return DecodeBatch(context_lens, self.block_table, positions, slots, self.row_request,
                           self.max_context_len, n, ratio, self.all_rows, state_slot, self.num_state_slots - 1)

    def load(self, x: torch.Tensor, q_lora: torch.Tensor, seq_lens: torch.Tensor,
             block_table: torch.Tensor, state_slots: torch.Tensor | None = None) -> int:
        """Validate the inputs and copy them into the buffers; returns the number of live rows (b * next_n).
        ``state_slots`` [b]: each request's CompressorState slot (C4; default 0..b-1)."""
        batch, n = self.batch_size, self.next_n
        check_tensor("seq_lens", seq_lens, dtype=INDEX_DTYPES, ndim=1)
        b = seq_lens.shape[0]
        if not 1 <= b <= batch:
            raise IndexerInputError(f"seq_lens must name 1..{batch} requests (the captured batch size), got {b}")
        rows = b * n
        check_tensor("x", x, dtype=self.x.dtype, shape=(rows, self.x.shape[1]), device=self.x.device)
        check_tensor("q_lora", q_lora, dtype=self.q_lora.dtype, shape=(rows, self.q_lora.shape[1]),
                     device=self.x.device)
        check_tensor("block_table", block_table, dtype=INDEX_DTYPES, ndim=2)
        if block_table.shape[0] != b or block_table.shape[1] > self.max_pages:
            raise IndexerInputError(f"block_table must be [{b}, <= {self.max_pages}] (one row per request, at most "
                                    f"the captured {self.max_pages} pages), got {list(block_table.shape)}")
        if ranges_checked(seq_lens):  # host inputs; device ones only under DSA_INDEXER_CHECK_RANGES=1 (a sync)
            seq = seq_lens.cpu()
            self._check_host_lengths(seq, block_table)
            if ranges_checked(block_table):
                # The derivation in the graph trusts the table: pages in the cache, none shared with a writer.
                _check_pages_once(seq, block_table.cpu(), n, self.compress_ratio, self.num_cache_pages)
        self.x[:rows].copy_(x)
        self.q_lora[:rows].copy_(q_lora)
        self.seq_lens[:b].copy_(seq_lens, non_blocking=True)
        if b < batch:
            self.seq_lens[b:].zero_()
        self.block_table[:b, : block_table.shape[1]].copy_(block_table, non_blocking=True)
        if self.compress_ratio > 1:
            self._load_state_slots(b, state_slots)
        return rows

    def _load_state_slots(self, b: int, state_slots: torch.Tensor | None) -> None:
        if state_slots is None:
            self.state_slots[:b].copy_(torch.arange(b, device=self.state_slots.device))
        else:
            check_tensor("state_slots", state_slots, dtype=INDEX_DTYPES, shape=(b,))
            if state_slots.device.type == "cpu":
                bad = (state_slots < 0) | (state_slots >= self.num_state_slots)
                if bool(bad.any()) or state_slots.unique().numel() != b:
                    raise IndexerInputError(f"state_slots must be {b} distinct slots in [0, {self.num_state_slots}) "
                                            f"(the captured compressor state's slots), got {state_slots.tolist()}")
            self.state_slots[:b].copy_(state_slots, non_blocking=True)
        self.state_slots[b:].fill_(-1)

    def _check_host_lengths(self, seq_lens: torch.Tensor, block_table: torch.Tensor) -> None:
        seq = seq_lens.long()
        n, ratio = self.next_n, self.compress_ratio
        bad = (seq != 0) & (seq < n)
        if bool(bad.any()):
            raise IndexerInputError(f"seq_lens entries must be 0 (padding) or >= next_n={n}, got "
                                    f"{int(seq[bad][0])} at request {int(bad.nonzero()[0, 0])}")
        if bool((seq > self.max_position).any()):
            raise IndexerInputError(f"seq_lens must be <= max_position={self.max_position}, got max {int(seq.max())}")
        keys = seq // ratio
        if bool((keys > self.max_context_len).any()):
            raise IndexerInputError(f"seq_lens exceed the captured max_context_len={self.max_context_len} keys "
                                    f"(longest request: {int(keys.max())} keys)")
        pages = (keys + PAGE_SIZE - 1) // PAGE_SIZE
        if bool((pages > block_table.shape[1]).any()):
            raise IndexerInputError(f"block_table has {block_table.shape[1]} pages per request but a request needs "
                                    f"{int(pages.max())}")


# The last host (seq_lens, block_table) `DecodeBuffers.load` checked, with the facts checked against: the graphs of
# all layers replay one step with the same inputs, so the O(requests x pages) page check runs once per step and the
# other layers pay a comparison (content, not identity: an engine may rewrite its host tensors through numpy).
_last_checked: list[tuple[torch.Tensor, torch.Tensor, tuple]] = []


def _check_pages_once(seq_lens: torch.Tensor, block_table: torch.Tensor, next_n: int, compress_ratio: int,
                      num_cache_pages: int | None) -> None:
    facts = (next_n, compress_ratio, num_cache_pages, seq_lens.dtype, block_table.dtype)
    if _last_checked:
        seen_seq, seen_table, seen_facts = _last_checked[0]
        if seen_facts == facts and torch.equal(seen_seq, seq_lens) and torch.equal(seen_table, block_table):
            return
    check_decode_pages(seq_lens, block_table, next_n, compress_ratio, num_cache_pages)
    _last_checked[:] = [(seq_lens.clone(), block_table.clone(), facts)]


class DecodeGraph:
    """One captured decode step of one indexer layer (see the module docstring). Build it with `capture`."""

    def __init__(self, indexer, cache: IndexKCache, buffers: DecodeBuffers, graph: "torch.cuda.CUDAGraph",
                 output: torch.Tensor) -> None:
        self.indexer = indexer
        self.cache = cache
        self.buffers = buffers
        self.graph = graph
        self.output = output

    @classmethod
    def capture(cls, indexer, cache: IndexKCache, batch_size: int, max_context_len: int, next_n: int = 1,
                warmup: int = 2, *, pool=None, compressor_state=None) -> "DecodeGraph":
        """Warm up ``warmup`` (>= 1) eager steps on a side stream, then capture one step into a CUDA graph.

        ``max_context_len``: the logits width (keys), fixed for the graph's life; the block table gets
        ``ceil(max_context_len / 64)`` pages per request. ``pool``: a `torch.cuda.graph_pool_handle()` to share
        memory with other graphs. ``compressor_state``: the layer's `CompressorState` (C4 indexers only)."""
        if not isinstance(getattr(indexer, "config", None), IndexerConfig) or not callable(indexer):
            raise IndexerInputError(f"indexer must be an Indexer, got {type(indexer).__name__}")
        if not isinstance(cache, IndexKCache):
            raise IndexerInputError(f"cache must be an IndexKCache, got {type(cache).__name__}")
        if cache.is_plain:
            raise IndexerInputError(f"CUDA-graph decode captures the fp8-page path; a {cache.layout} cache (the NPU's "
                                    "plain layout) is not captured: call the indexer eagerly")
        for name, value, low in (("batch_size", batch_size, 1), ("max_context_len", max_context_len, 1),
                                 ("next_n", next_n, 1), ("warmup", warmup, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise IndexerInputError(f"{name} must be an int >= {low}, got {value!r}")
        device = cache.device
        if device.type != "cuda" or not torch.cuda.is_available():
            raise IndexerInputError(f"CUDA-graph capture needs the cache on a CUDA (or ROCm) device, got {device}")
        if indexer.cos_sin.device != device:
            raise IndexerInputError(f"the indexer's weights are on {indexer.cos_sin.device}, the cache on {device}")
        buffers = DecodeBuffers.allocate(indexer, batch_size, max_context_len, next_n, device,
                                         num_cache_pages=cache.num_pages)
        if indexer.compressor is not None:
            indexer.compression_step(buffers.derive(indexer.target), compressor_state)  # the same checks, before capture
            buffers.num_state_slots = compressor_state.num_slots
        elif compressor_state is not None:
            raise IndexerInputError("compressor_state is only for C4 indexers (compress_ratio 4)")

        def step() -> torch.Tensor:
            batch = buffers.derive(indexer.target)
            return indexer.forward(buffers.x, buffers.q_lora, batch.positions, batch, cache,
                                   compressor_state=compressor_state)

        with torch.cuda.device(device):
            graph, output = capture_graph(step, warmup, pool)
        return cls(indexer, cache, buffers, graph, output)

    @property
    def batch_size(self) -> int:
        return self.buffers.batch_size

    @property
    def next_n(self) -> int:
        return self.buffers.next_n

    @property
    def max_context_len(self) -> int:
        return self.buffers.max_context_len

    def replay(self, x: torch.Tensor, q_lora: torch.Tensor, seq_lens: torch.Tensor,
               block_table: torch.Tensor, state_slots: torch.Tensor | None = None) -> torch.Tensor:
        """Copy the inputs into the static buffers and replay: int32 [b * next_n, topk] request-local positions,
        -1 padded (a view of the static output). ``seq_lens`` and ``block_table`` on the host are validated there
        (no device sync: lengths, pages, page sharing); on the device they are trusted unless
        ``DSA_INDEXER_CHECK_RANGES=1``. ``state_slots`` [b]: C4 compressor state slot of each request
        (default 0..b-1)."""
        rows = self.buffers.load(x, q_lora, seq_lens, block_table, state_slots)
        self.graph.replay()
        return self.output[:rows]


def capture_graph(fn: Callable[[], object], warmup: int = 2, pool=None):
    """Capture ``fn()`` into a CUDA graph after ``warmup`` eager calls on a side stream (the pattern torch.cuda.graphs
    documents: first resolutions, probes, Triton / DeepGEMM JIT compiles and allocator growth stay outside the
    capture); returns ``(graph, the captured call's output)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out
