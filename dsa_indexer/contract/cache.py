"""The index-K cache: fp8 keys with one fp32 scale each, in 64-token pages.

Layout ``paged64_fp8_e4m3`` (what DeepGEMM's and aiter's paged kernels read): one page is
64 x 128 fp8 bytes (token-major) followed by 64 fp32 scales = 8448 bytes, 132 bytes per token.
Scales are not interleaved per token. Slot ``s`` lives at page ``s // 64``, row ``s % 64``.
Kernels take the uint8 view ``[num_pages, 64, 1, 132]`` (same bytes, reinterpreted).
The layout tag lets other layouts be added beside this one. Two more are defined, for kernels that take a plain
paged key tensor ``[num_pages, 64, 1, 128]`` (torch_npu's ``PA_BSND`` layout, block size 64) instead of the
132-byte pages:

* ``paged64_bf16``: bf16 keys, no scales (RoPE'd, not rotated by the Hadamard: a rotation of both q and k does not
  change a dot product, and without fp8 there is nothing for it to spread).
* ``paged64_int8``: int8 keys (Hadamard-rotated, one symmetric scale per key) plus the fp16 scales
  ``[num_pages, 64, 1]``.

The ops that write and read these are ``k_prologue_store_plain`` and ``lightning_indexer_ragged``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .validate import IndexerInputError

PAGE_SIZE = 64
HEAD_DIM = 128
SCALE_BYTES = 4
BYTES_PER_TOKEN = HEAD_DIM + SCALE_BYTES  # 132
PAGE_BYTES = PAGE_SIZE * BYTES_PER_TOKEN  # 8448
LAYOUT_PAGED64 = "paged64_fp8_e4m3"
LAYOUT_PAGED64_BF16 = "paged64_bf16"
LAYOUT_PAGED64_INT8 = "paged64_int8"
# The key format each plain layout stores (the problem fact ``format`` of the plain-layout ops).
PLAIN_LAYOUT_FORMATS = {LAYOUT_PAGED64_BF16: "bf16", LAYOUT_PAGED64_INT8: "int8"}
LAYOUTS = (LAYOUT_PAGED64, *PLAIN_LAYOUT_FORMATS)


def check_kv_cache(kv_cache: torch.Tensor, name: str = "kv_cache") -> None:
    """Raise a clear error unless ``kv_cache`` is the uint8 ``[pages, 64, 1, 132]`` contiguous view."""
    if not isinstance(kv_cache, torch.Tensor):
        raise IndexerInputError(f"{name} must be a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dtype != torch.uint8:
        raise IndexerInputError(f"{name} must be uint8 (the 132-byte-per-token paged layout), got {kv_cache.dtype}")
    if kv_cache.dim() != 4 or tuple(kv_cache.shape[1:]) != (PAGE_SIZE, 1, BYTES_PER_TOKEN):
        raise IndexerInputError(f"{name} must have shape [num_pages, {PAGE_SIZE}, 1, {BYTES_PER_TOKEN}], got "
                                f"{list(kv_cache.shape)}")
    if not kv_cache.is_contiguous():
        raise IndexerInputError(f"{name} must be contiguous (pages are {PAGE_BYTES} consecutive bytes)")


def check_plain_cache(data: torch.Tensor, scales: torch.Tensor | None, layout: str, name: str = "key_cache") -> None:
    """Raise a clear error unless ``data`` (and ``scales``) are the plain paged tensors of ``layout``."""
    fmt = PLAIN_LAYOUT_FORMATS[layout]
    dtype = torch.bfloat16 if fmt == "bf16" else torch.int8
    if not isinstance(data, torch.Tensor) or data.dtype != dtype:
        got = data.dtype if isinstance(data, torch.Tensor) else type(data).__name__
        raise IndexerInputError(f"{name} of layout {layout} must be a {dtype} tensor, got {got}")
    if data.dim() != 4 or tuple(data.shape[1:]) != (PAGE_SIZE, 1, HEAD_DIM) or not data.is_contiguous():
        raise IndexerInputError(f"{name} of layout {layout} must be a contiguous "
                                f"[num_pages, {PAGE_SIZE}, 1, {HEAD_DIM}] tensor, got {list(data.shape)}")
    if fmt == "int8":
        if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float16 or \
                tuple(scales.shape) != (data.shape[0], PAGE_SIZE, 1) or scales.device != data.device:
            got = None if scales is None else (scales.dtype, list(scales.shape))
            raise IndexerInputError(f"{name} of layout {layout} needs fp16 scales [{data.shape[0]}, {PAGE_SIZE}, 1] "
                                    f"on {data.device}, got {got}")
    elif scales is not None and scales.numel():
        raise IndexerInputError(f"layout {layout} has no key scales: scales must be None or empty")


def page_views(kv_cache: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the cache bytes into (keys fp8 ``[pages, 64, 128]``, scales fp32 ``[pages, 64]``); both are views."""
    pages = kv_cache.view(-1, PAGE_BYTES)
    keys = pages[:, : PAGE_SIZE * HEAD_DIM].view(fp8_dtype).view(-1, PAGE_SIZE, HEAD_DIM)
    scales = pages[:, PAGE_SIZE * HEAD_DIM:].view(torch.float32)
    return keys, scales


def store_rows(kv_cache: torch.Tensor, slots: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor) -> None:
    """Write ``k_fp8[i]`` and ``k_scale[i]`` into slot ``slots[i]``; slots < 0 (padding tokens) are skipped."""
    keys, scales = page_views(kv_cache, k_fp8.dtype)
    keep = slots >= 0
    slots = slots[keep].long()
    keys[slots // PAGE_SIZE, slots % PAGE_SIZE] = k_fp8[keep]
    scales[slots // PAGE_SIZE, slots % PAGE_SIZE] = k_scale.reshape(-1)[keep].float()


def gather_rows(kv_cache: torch.Tensor, slots: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Read (fp8 ``[N, 128]``, fp32 ``[N]``) for the given slots."""
    keys, scales = page_views(kv_cache, fp8_dtype)
    slots = slots.long()
    return keys[slots // PAGE_SIZE, slots % PAGE_SIZE], scales[slots // PAGE_SIZE, slots % PAGE_SIZE]


def store_plain_rows(key_cache: torch.Tensor, key_scales: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor,
                     scales: torch.Tensor | None = None) -> None:
    """Write ``keys[i]`` (and ``scales[i]`` for int8) into slot ``slots[i]`` of a plain ``[pages, 64, 1, 128]``
    cache; slots < 0 (padding tokens) are skipped."""
    keep = slots >= 0
    rows = slots[keep].long()
    key_cache.view(-1, key_cache.shape[-1])[rows] = keys[keep].to(key_cache.dtype)
    if scales is not None:
        key_scales.view(-1)[rows] = scales.reshape(-1)[keep].to(key_scales.dtype)


def gather_plain_keys(key_cache: torch.Tensor, key_scales: torch.Tensor, block_table_row: torch.Tensor,
                      count: int) -> torch.Tensor:
    """The first ``count`` keys of one request (its block-table row) from a plain cache, dequantized to fp32."""
    pos = torch.arange(count, device=key_cache.device)
    slots = block_table_row.long()[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
    keys = key_cache.view(-1, key_cache.shape[-1])[slots].float()
    if key_cache.dtype == torch.int8:
        keys = keys * key_scales.view(-1)[slots].float()[:, None]
    return keys


def indices_to_slots(indices: torch.Tensor, block_table: torch.Tensor, row_request: torch.Tensor) -> torch.Tensor:
    """Request-local positions -> physical cache slots ``block_table[req, pos // 64] * 64 + pos % 64``; -1 stays.
    Part of the cache contract: every backend that returns slots computes exactly this."""
    valid = indices >= 0
    pos = indices.clamp_min(0).long()
    pages = block_table.long()[row_request.long()[:, None], pos // PAGE_SIZE]
    slots = pages * PAGE_SIZE + pos % PAGE_SIZE
    return torch.where(valid, slots, torch.full_like(slots, -1)).to(torch.int32)


def decode_row_requests(batch: int, next_n: int, device: torch.device) -> torch.Tensor:
    """The request of each decode row (row = b * next_n + n): int32 [batch * next_n]."""
    return torch.arange(batch, dtype=torch.int32, device=device).repeat_interleave(next_n)


def _check_fp8(fp8_dtype: torch.dtype) -> None:
    if fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        raise ValueError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e4m3fnuz, got {fp8_dtype}")


@dataclass(frozen=True)
class IndexKCache:
    """One layer's index-K cache. The library owns its allocation and its layout tag (`LAYOUTS`)."""

    data: torch.Tensor  # paged64_fp8_e4m3: uint8 [num_pages, 64, 1, 132]; plain layouts: [num_pages, 64, 1, 128]
    fp8_dtype: torch.dtype = torch.float8_e4m3fn  # the fp8 flavour of the fp8 layout (unused by the plain ones)
    layout: str = LAYOUT_PAGED64
    scales: torch.Tensor | None = None  # paged64_int8: fp16 [num_pages, 64, 1]; None otherwise
    # Host facts every call reads, taken once: the cache is frozen (its tensors are written in place, never rebound),
    # so they cannot go stale.
    num_pages: int = field(init=False, repr=False, compare=False)
    device: torch.device = field(init=False, repr=False, compare=False)
    is_plain: bool = field(init=False, repr=False, compare=False)

    @classmethod
    def allocate(cls, num_pages: int, device: torch.device | str = "cpu",
                 fp8_dtype: torch.dtype = torch.float8_e4m3fn, layout: str = LAYOUT_PAGED64) -> "IndexKCache":
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
        _check_fp8(fp8_dtype)
        if layout == LAYOUT_PAGED64:
            data = torch.zeros(num_pages, PAGE_SIZE, 1, BYTES_PER_TOKEN, dtype=torch.uint8, device=device)
            return cls(data, fp8_dtype)
        if layout == LAYOUT_PAGED64_BF16:
            return cls(torch.zeros(num_pages, PAGE_SIZE, 1, HEAD_DIM, dtype=torch.bfloat16, device=device),
                       fp8_dtype, layout)
        if layout == LAYOUT_PAGED64_INT8:
            return cls(torch.zeros(num_pages, PAGE_SIZE, 1, HEAD_DIM, dtype=torch.int8, device=device), fp8_dtype,
                       layout, torch.zeros(num_pages, PAGE_SIZE, 1, dtype=torch.float16, device=device))
        raise ValueError(f"layout {layout!r} is not supported; supported: {', '.join(LAYOUTS)}")

    def __post_init__(self) -> None:
        _check_fp8(self.fp8_dtype)
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r} is not supported; supported: {', '.join(LAYOUTS)}")
        object.__setattr__(self, "num_pages", self.data.shape[0])
        object.__setattr__(self, "device", self.data.device)
        object.__setattr__(self, "is_plain", self.layout in PLAIN_LAYOUT_FORMATS)
        if self.layout == LAYOUT_PAGED64:
            check_kv_cache(self.data, "IndexKCache.data")
            if self.scales is not None:
                raise ValueError(f"layout {LAYOUT_PAGED64} keeps its scales inside the pages: scales must be None")
            return
        check_plain_cache(self.data, self.scales, self.layout)

    def clone(self) -> "IndexKCache":
        """A copy of the keys (and scales) in the same layout."""
        return IndexKCache(self.data.clone(), self.fp8_dtype, self.layout,
                           None if self.scales is None else self.scales.clone())

    @property
    def key_format(self) -> str:
        """``"fp8"`` (the 132-byte pages), ``"bf16"`` or ``"int8"`` (the plain layouts)."""
        return PLAIN_LAYOUT_FORMATS.get(self.layout, "fp8")

    def scales_or_empty(self) -> torch.Tensor:
        """The int8 layout's scales, or an empty fp16 tensor (what the plain-layout ops take for bf16 keys)."""
        if self.scales is not None:
            return self.scales
        return self.data.new_empty(0, dtype=torch.float16)

    @property
    def capacity(self) -> int:
        """Token slots in the cache."""
        return self.num_pages * PAGE_SIZE

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.is_plain:
            raise ValueError(f"gather reads the {LAYOUT_PAGED64} layout; a {self.layout} cache is read in place by "
                             "lightning_indexer_ragged")
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.capacity):
            raise ValueError(f"slots must lie in [0, {self.capacity}), got range "
                             f"[{int(slots.min())}, {int(slots.max())}]")
        return gather_rows(self.data, slots, self.fp8_dtype)
