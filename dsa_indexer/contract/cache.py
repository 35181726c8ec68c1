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

Layout ``paged64_fp4_e2m1`` (V4's FP4 keys, ``key_quant="fp4_e2m1"``; DeepGEMM's paged FP4 cache of
``fp8_fp4_paged_mqa_logits`` exactly): uint8 ``[num_pages, 64, 1, 68]``, 68 bytes per token. One page is the 64 x 64
packed value bytes (token-major; byte i of a token holds element 2i in its low nibble and 2i + 1 in its high one; a
nibble is ``sign << 3 | code``, codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6; zero is always code 0) followed by 64 int32
scale words, one per token: the four ue8m0 bytes of its blocks of 32 (block b in byte b, little-endian; byte e is
``2^(e - 127)``, 255 is NaN). The same 128 values as the fp8 pages, in half the bytes (68 vs 132).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .validate import INT32_MAX, IndexerInputError, device_argument, fits_in_memory, human_bytes, ranges_checked

PAGE_SIZE = 64
HEAD_DIM = 128
SCALE_BYTES = 4
BYTES_PER_TOKEN = HEAD_DIM + SCALE_BYTES  # 132
PAGE_BYTES = PAGE_SIZE * BYTES_PER_TOKEN  # 8448
MAX_PAGES = INT32_MAX // PAGE_SIZE  # a page past this has slots beyond int32 (block tables, top-k slots are int32)
LAYOUT_PAGED64 = "paged64_fp8_e4m3"
LAYOUT_PAGED64_BF16 = "paged64_bf16"
LAYOUT_PAGED64_INT8 = "paged64_int8"
LAYOUT_PAGED64_FP4 = "paged64_fp4_e2m1"
# The key format each plain layout stores (the problem fact ``format`` of the plain-layout ops).
PLAIN_LAYOUT_FORMATS = {LAYOUT_PAGED64_BF16: "bf16", LAYOUT_PAGED64_INT8: "int8"}
LAYOUTS = (LAYOUT_PAGED64, LAYOUT_PAGED64_FP4, *PLAIN_LAYOUT_FORMATS)

# paged64_fp4_e2m1: e2m1 values two per byte, one int32 of four ue8m0 block scales per token.
FP4_BLOCK = 32
FP4_VALUE_BYTES = HEAD_DIM // 2  # 64
FP4_BYTES_PER_TOKEN = FP4_VALUE_BYTES + SCALE_BYTES  # 68
FP4_PAGE_BYTES = PAGE_SIZE * FP4_BYTES_PER_TOKEN  # 4352
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitude of e2m1 code c (bits 0-2); bit 3 is the sign
# Bytes of one page of each layout, keys and scales (int8: an fp16 scale per key): what `IndexKCache.allocate` checks
# against the device before allocating.
LAYOUT_PAGE_BYTES = {LAYOUT_PAGED64: PAGE_BYTES, LAYOUT_PAGED64_FP4: FP4_PAGE_BYTES,
                     LAYOUT_PAGED64_BF16: PAGE_SIZE * HEAD_DIM * 2, LAYOUT_PAGED64_INT8: PAGE_SIZE * (HEAD_DIM + 2)}
# The key format of each paged layout that the paged ops read (their problem fact ``keys``), by bytes per token.
PAGED_KEY_FORMATS = {BYTES_PER_TOKEN: "fp8", FP4_BYTES_PER_TOKEN: "fp4"}


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


def check_paged_cache(kv_cache: torch.Tensor, name: str = "kv_cache") -> None:
    """What the paged ops (`paged_mqa_logits`, `lightning_indexer`) read: the fp8 pages ``[pages, 64, 1, 132]`` or
    the FP4 pages ``[pages, 64, 1, 68]`` (``paged64_fp4_e2m1``), uint8 and contiguous."""
    if isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 4 and kv_cache.shape[-1] == FP4_BYTES_PER_TOKEN:
        check_fp4_cache(kv_cache, name)
    else:
        check_kv_cache(kv_cache, name)


def check_fp4_cache(kv_cache: torch.Tensor, name: str = "kv_cache") -> None:
    """Raise a clear error unless ``kv_cache`` is the uint8 ``[pages, 64, 1, 68]`` contiguous FP4 pages."""
    if not isinstance(kv_cache, torch.Tensor):
        raise IndexerInputError(f"{name} must be a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dtype != torch.uint8:
        raise IndexerInputError(f"{name} of layout {LAYOUT_PAGED64_FP4} must be uint8, got {kv_cache.dtype}")
    if kv_cache.dim() != 4 or tuple(kv_cache.shape[1:]) != (PAGE_SIZE, 1, FP4_BYTES_PER_TOKEN):
        raise IndexerInputError(f"{name} of layout {LAYOUT_PAGED64_FP4} must have shape [num_pages, {PAGE_SIZE}, 1, "
                                f"{FP4_BYTES_PER_TOKEN}], got {list(kv_cache.shape)}")
    if not kv_cache.is_contiguous():
        raise IndexerInputError(f"{name} must be contiguous (pages are {FP4_PAGE_BYTES} consecutive bytes)")


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


def without_padding(slots: torch.Tensor, rows: Sequence[torch.Tensor],
                    current: Callable[[torch.Tensor], Sequence[torch.Tensor]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(slots, rows)`` ready for one scatter in which the padding tokens (slot < 0) change nothing, with no host
    sync (a boolean-mask selection would make one: its size depends on the values). Each padding row becomes a copy
    of the last kept row, slot and values, so the scatter writes those bytes again (the same bytes whatever order it
    takes duplicates in; the last kept row, so where kept rows share a slot, an in-order scatter still leaves the
    last one's bytes, as the selection did); with no row kept, slot 0 is rewritten with what it holds
    (``current(slot [1])`` returns each row tensor's entry [1, ...] at that slot). ``slots`` non-empty; every row
    tensor is [N, ...]."""
    keep = slots >= 0
    last = (keep.numel() - 1 - keep.flip(0).to(torch.int32).argmax()).view(1)  # the last kept row (N - 1 if none)
    any_kept = keep.any()
    slots = slots.long()
    anchor = torch.where(any_kept, slots.index_select(0, last), torch.zeros_like(last))
    out = []
    for row, now in zip(rows, current(anchor)):
        anchor_row = torch.where(any_kept, row.index_select(0, last), now.to(row.dtype))
        out.append(torch.where(keep.view(-1, *([1] * (row.dim() - 1))), row, anchor_row))
    return torch.where(keep, slots, anchor), out


def store_rows(kv_cache: torch.Tensor, slots: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor) -> None:
    """Write ``k_fp8[i]`` and ``k_scale[i]`` into slot ``slots[i]``; slots < 0 (padding tokens) are skipped."""
    if not slots.numel():
        return
    keys, scales = page_views(kv_cache, k_fp8.dtype)
    slots, (k_fp8, k_scale) = without_padding(
        slots, (k_fp8, k_scale.reshape(-1).float()),
        lambda at: (keys[at // PAGE_SIZE, at % PAGE_SIZE], scales[at // PAGE_SIZE, at % PAGE_SIZE]))
    keys[slots // PAGE_SIZE, slots % PAGE_SIZE] = k_fp8
    scales[slots // PAGE_SIZE, slots % PAGE_SIZE] = k_scale


def gather_rows(kv_cache: torch.Tensor, slots: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Read (fp8 ``[N, 128]``, fp32 ``[N]``) for the given slots."""
    keys, scales = page_views(kv_cache, fp8_dtype)
    slots = slots.long()
    return keys[slots // PAGE_SIZE, slots % PAGE_SIZE], scales[slots // PAGE_SIZE, slots % PAGE_SIZE]


# --- paged64_fp4_e2m1 -----------------------------------------------------------------------------------------------
# Code of 2 * |value| for the e2m1 magnitudes (2 * 6 = 12 is the largest); -1: not on the grid.
_CODE_OF_TWICE = (0, 1, 2, 3, 4, -1, 5, -1, 6, -1, -1, -1, 7)


def fp4_page_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the FP4 pages into (packed values uint8 ``[pages, 64, 64]``, scale bytes uint8 ``[pages, 64, 4]``, byte b
    = block b's ue8m0 exponent; the int32 word of a token is its four bytes little-endian); both are views."""
    pages = kv_cache.view(-1, FP4_PAGE_BYTES)
    values = pages[:, : PAGE_SIZE * FP4_VALUE_BYTES].view(-1, PAGE_SIZE, FP4_VALUE_BYTES)
    scales = pages[:, PAGE_SIZE * FP4_VALUE_BYTES:].view(-1, PAGE_SIZE, SCALE_BYTES)
    return values, scales


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """fp32 values on the e2m1 grid [..., D] (D even) packed two per byte, uint8 [..., D / 2]: element 2i in the low
    nibble, 2i + 1 in the high one; a nibble is ``sign << 3 | code``, zero always code 0 (no negative zero). A value
    off the grid (or NaN) raises where ranges are checked; NaN values are written as 0 (their block's scale is NaN)."""
    twice = (values.float().abs() * 2).nan_to_num(0.0, 0.0, 0.0)
    table = torch.tensor(_CODE_OF_TWICE, dtype=torch.int16, device=values.device)
    index = twice.clamp_max(12).to(torch.int64)
    code = table[index]
    if ranges_checked(values) and bool(((code < 0) | (index.float() != twice)).any()):
        raise IndexerInputError("pack_e2m1: values must lie on the e2m1 grid (+-0, 0.5, 1, 1.5, 2, 3, 4, 6)")
    code = code.clamp_min(0).to(torch.uint8)
    code = code | (((values < 0) & (code != 0)).to(torch.uint8) << 3)
    return code[..., 0::2] | (code[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_e2m1`: uint8 (or int8) [..., D / 2] -> fp32 [..., D] e2m1 values."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=packed.device)
    signed = torch.cat([grid, -grid])
    u = packed.view(torch.uint8).to(torch.int64)
    return torch.stack([signed[u & 0xF], signed[u >> 4]], dim=-1).flatten(-2)


def ue8m0_bytes(scales: torch.Tensor) -> torch.Tensor:
    """The ue8m0 byte of each power-of-two fp32 scale: its biased exponent (uint8, same shape; NaN gives 255)."""
    return ((scales.float().contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def ue8m0_values(scale_bytes: torch.Tensor) -> torch.Tensor:
    """ue8m0 bytes -> fp32 ``2^(byte - 127)`` (255: NaN)."""
    e = scale_bytes.to(torch.int32)
    out = torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=e.device), e - 127)
    return torch.where(e == 255, torch.full_like(out, float("nan")), out)


def _check_fp4_rows(values: torch.Tensor, scales: torch.Tensor) -> None:
    if values.dim() != 2 or values.shape[1] != HEAD_DIM:
        raise IndexerInputError(f"values must be [N, {HEAD_DIM}] e2m1 values, got {list(values.shape)}")
    if tuple(scales.shape) != (values.shape[0], HEAD_DIM // FP4_BLOCK):
        raise IndexerInputError(f"scales must be [N, {HEAD_DIM // FP4_BLOCK}] (one power of two per block of "
                                f"{FP4_BLOCK}), got {list(scales.shape)}")


def store_fp4_rows(kv_cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> None:
    """Write FP4 keys (``values`` [N, 128] on the e2m1 grid, ``scales`` [N, 4] powers of two per block of 32, what
    `quant_fp4_e2m1` returns) into slot ``slots[i]`` of the ``paged64_fp4_e2m1`` pages; slots < 0 are skipped."""
    _check_fp4_rows(values, scales)
    packed, scale_bytes = fp4_page_views(kv_cache)
    keep = slots >= 0
    slots = slots[keep].long()
    packed[slots // PAGE_SIZE, slots % PAGE_SIZE] = pack_e2m1(values[keep])
    scale_bytes[slots // PAGE_SIZE, slots % PAGE_SIZE] = ue8m0_bytes(scales[keep])


def gather_fp4_rows(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Read (e2m1 values fp32 ``[N, 128]``, block scales fp32 ``[N, 4]``) for the given slots of the FP4 pages."""
    packed, scale_bytes = fp4_page_views(kv_cache)
    slots = slots.long()
    page, row = slots // PAGE_SIZE, slots % PAGE_SIZE
    return unpack_e2m1(packed[page, row]), ue8m0_values(scale_bytes[page, row])


def gather_packed_fp4_rows(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored bytes of the given slots of the FP4 pages: (packed e2m1 uint8 ``[N, 64]``, ue8m0 block-scale bytes
    uint8 ``[N, 4]``), contiguous; what the ragged logits take as FP4 keys (``keys="fp4"``)."""
    packed, scale_bytes = fp4_page_views(kv_cache)
    slots = slots.long()
    page, row = slots // PAGE_SIZE, slots % PAGE_SIZE
    return packed[page, row], scale_bytes[page, row]


def dequant_fp4_rows(packed: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """FP4 keys as stored (packed uint8 ``[..., 64]``, ue8m0 bytes ``[..., 4]``) dequantized: fp32 ``[..., 128]``,
    exact (an e2m1 value times a power of two)."""
    values = unpack_e2m1(packed).reshape(*packed.shape[:-1], -1, FP4_BLOCK)
    return (values * ue8m0_values(scale_bytes)[..., None]).reshape(*packed.shape[:-1], HEAD_DIM)


def dequant_fp4_pages(kv_cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """The keys of whole FP4 pages (``pages`` [P] page indices) dequantized: fp32 ``[P * 64, 128]`` (exact)."""
    packed, scale_bytes = fp4_page_views(kv_cache)
    return dequant_fp4_rows(packed[pages.long()], scale_bytes[pages.long()]).reshape(-1, HEAD_DIM)


def fold_fp4_rows(values: torch.Tensor, scales: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    """FP4 rows ([N, 128] e2m1, [N, 4] block scales) as fp8 with one power-of-two row scale, the arithmetic of
    ``reference.kernels.fold_fp4_to_fp8`` (which the contract cannot import: the reference imports the contract),
    so a gathered FP4 key equals the fold path's stored one in value (a test checks that; a -0 reads back +0).
    Row scale = largest block scale * 2^-6 (e4m3fnuz: 2^-5); exact unless a block lies more than 2^14 below the
    row's largest."""
    shift = 5 if fp8_dtype == torch.float8_e4m3fnuz else 6
    row = scales.amax(dim=-1, keepdim=True) * 2.0 ** -shift
    folded = values.float().reshape(*scales.shape, -1) * (scales / row)[..., None]
    return folded.reshape(values.shape).to(fp8_dtype), row.squeeze(-1)


def store_plain_rows(key_cache: torch.Tensor, key_scales: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor,
                     scales: torch.Tensor | None = None) -> None:
    """Write ``keys[i]`` (and ``scales[i]`` for int8) into slot ``slots[i]`` of a plain ``[pages, 64, 1, 128]``
    cache; slots < 0 (padding tokens) are skipped."""
    if not slots.numel():
        return
    flat = key_cache.view(-1, key_cache.shape[-1])
    if scales is None:
        rows, (keys,) = without_padding(slots, (keys.to(key_cache.dtype),), lambda at: (flat[at],))
    else:
        flat_scales = key_scales.view(-1)
        rows, (keys, scales) = without_padding(slots, (keys.to(key_cache.dtype), scales.reshape(-1).to(key_scales.dtype)),
                                               lambda at: (flat[at], flat_scales[at]))
        flat_scales[rows] = scales
    flat[rows] = keys


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

    # paged64_fp8_e4m3: uint8 [num_pages, 64, 1, 132]; paged64_fp4_e2m1: uint8 [num_pages, 64, 1, 68];
    # plain layouts: [num_pages, 64, 1, 128]
    data: torch.Tensor
    # The fp8 flavour of the fp8 layout, and of q and the gathered (folded) keys for the FP4 one; unused by the plain
    fp8_dtype: torch.dtype = torch.float8_e4m3fn
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
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r} is not supported; supported: {', '.join(LAYOUTS)}")
        if num_pages > MAX_PAGES:
            raise IndexerInputError(f"num_pages={num_pages} is past the int32 slot limit: slots are int32 "
                                    f"(slot = page * {PAGE_SIZE} + row), so a cache holds at most MAX_PAGES = "
                                    f"{MAX_PAGES} pages ({MAX_PAGES * PAGE_SIZE} tokens)")
        device = device_argument("device", device)
        page_bytes = LAYOUT_PAGE_BYTES[layout]
        fits_in_memory(f"IndexKCache.allocate(num_pages={num_pages}, layout={layout!r}) at "
                       f"{human_bytes(page_bytes)} a page", num_pages * page_bytes, device,
                       "allocate fewer pages")
        if layout == LAYOUT_PAGED64:
            data = torch.zeros(num_pages, PAGE_SIZE, 1, BYTES_PER_TOKEN, dtype=torch.uint8, device=device)
            return cls(data, fp8_dtype)
        if layout == LAYOUT_PAGED64_FP4:
            data = torch.zeros(num_pages, PAGE_SIZE, 1, FP4_BYTES_PER_TOKEN, dtype=torch.uint8, device=device)
            return cls(data, fp8_dtype, layout)
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
        if self.layout in (LAYOUT_PAGED64, LAYOUT_PAGED64_FP4):
            (check_kv_cache if self.layout == LAYOUT_PAGED64 else check_fp4_cache)(self.data, "IndexKCache.data")
            if self.scales is not None:
                raise ValueError(f"layout {self.layout} keeps its scales inside the pages: scales must be None")
            return
        check_plain_cache(self.data, self.scales, self.layout)

    def clone(self) -> "IndexKCache":
        """A copy of the keys (and scales) in the same layout."""
        return IndexKCache(self.data.clone(), self.fp8_dtype, self.layout,
                           None if self.scales is None else self.scales.clone())

    @property
    def key_format(self) -> str:
        """``"fp8"`` (the 132-byte pages), ``"fp4"`` (the 68-byte pages), ``"bf16"`` or ``"int8"`` (the plain
        layouts)."""
        if self.layout == LAYOUT_PAGED64_FP4:
            return "fp4"
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

    def _check_slots(self, slots: torch.Tensor) -> None:
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.capacity):
            raise ValueError(f"slots must lie in [0, {self.capacity}), got range "
                             f"[{int(slots.min())}, {int(slots.max())}]")

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp8 ``[N, 128]``, fp32 ``[N]``) keys of ``slots``, what the ragged (prefill) logits read. The FP4 layout
        gives its keys folded into fp8 with one power-of-two row scale (`fold_fp4_rows`): the same values, exactly
        (the fold's one limit aside), so the fp8 ragged kernels score FP4 keys unchanged."""
        if self.is_plain:
            raise ValueError(f"gather reads the {LAYOUT_PAGED64} and {LAYOUT_PAGED64_FP4} layouts; a {self.layout} "
                             "cache is read in place by lightning_indexer_ragged")
        self._check_slots(slots)
        if self.layout == LAYOUT_PAGED64_FP4:
            return fold_fp4_rows(*gather_fp4_rows(self.data, slots), self.fp8_dtype)
        return gather_rows(self.data, slots, self.fp8_dtype)

    def gather_packed(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP4 layout's keys of ``slots`` in their stored bytes (packed e2m1 uint8 ``[N, 64]``, ue8m0 uint8
        ``[N, 4]``): the ragged logits' FP4 keys, half the bytes of `gather`'s fold and every block's own scale."""
        if self.layout != LAYOUT_PAGED64_FP4:
            raise ValueError(f"gather_packed reads the {LAYOUT_PAGED64_FP4} layout, this cache is {self.layout}: "
                             "use gather")
        self._check_slots(slots)
        return gather_packed_fp4_rows(self.data, slots)

    def gather_fp4(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP4 layout's keys as stored: (e2m1 values fp32 ``[N, 128]``, block scales fp32 ``[N, 4]``)."""
        if self.layout != LAYOUT_PAGED64_FP4:
            raise ValueError(f"gather_fp4 reads the {LAYOUT_PAGED64_FP4} layout, this cache is {self.layout}: use "
                             "gather")
        self._check_slots(slots)
        return gather_fp4_rows(self.data, slots)
