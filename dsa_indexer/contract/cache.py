"""The index-K cache: fp8 keys with one fp32 scale each, in 64-token pages.

Layout ``paged64_fp8_e4m3`` (what DeepGEMM's and aiter's paged kernels read): one page is
64 x 128 fp8 bytes (token-major) followed by 64 fp32 scales = 8448 bytes, 132 bytes per token.
Scales are not interleaved per token. Slot ``s`` lives at page ``s // 64``, row ``s % 64``.
Kernels take the uint8 view ``[num_pages, 64, 1, 132]`` (same bytes, reinterpreted).
The layout tag lets other layouts (page size 1, aiter's preshuffled tiles) be added beside this one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAGE_SIZE = 64
HEAD_DIM = 128
SCALE_BYTES = 4
BYTES_PER_TOKEN = HEAD_DIM + SCALE_BYTES  # 132
PAGE_BYTES = PAGE_SIZE * BYTES_PER_TOKEN  # 8448
LAYOUT_PAGED64 = "paged64_fp8_e4m3"


def check_kv_cache(kv_cache: torch.Tensor, name: str = "kv_cache") -> None:
    """Raise a clear error unless ``kv_cache`` is the uint8 ``[pages, 64, 1, 132]`` contiguous view."""
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dtype != torch.uint8:
        raise TypeError(f"{name} must be uint8 (the 132-byte-per-token paged layout), got {kv_cache.dtype}")
    if kv_cache.dim() != 4 or tuple(kv_cache.shape[1:]) != (PAGE_SIZE, 1, BYTES_PER_TOKEN):
        raise ValueError(f"{name} must have shape [num_pages, {PAGE_SIZE}, 1, {BYTES_PER_TOKEN}], got {list(kv_cache.shape)}")
    if not kv_cache.is_contiguous():
        raise ValueError(f"{name} must be contiguous (pages are {PAGE_BYTES} consecutive bytes)")


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


@dataclass
class IndexKCache:
    """One layer's index-K cache. The library owns its allocation and its layout tag."""

    data: torch.Tensor  # uint8 [num_pages, 64, 1, 132]
    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    layout: str = LAYOUT_PAGED64

    @classmethod
    def allocate(cls, num_pages: int, device: torch.device | str = "cpu",
                 fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> "IndexKCache":
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
        _check_fp8(fp8_dtype)
        data = torch.zeros(num_pages, PAGE_SIZE, 1, BYTES_PER_TOKEN, dtype=torch.uint8, device=device)
        return cls(data, fp8_dtype)

    def __post_init__(self) -> None:
        check_kv_cache(self.data, "IndexKCache.data")
        _check_fp8(self.fp8_dtype)
        if self.layout != LAYOUT_PAGED64:
            raise ValueError(f"layout {self.layout!r} is not supported; supported: {LAYOUT_PAGED64}")

    @property
    def num_pages(self) -> int:
        return self.data.shape[0]

    @property
    def capacity(self) -> int:
        """Token slots in the cache."""
        return self.num_pages * PAGE_SIZE

    @property
    def device(self) -> torch.device:
        return self.data.device

    def kernel_view(self) -> torch.Tensor:
        """The uint8 ``[num_pages, 64, 1, 132]`` tensor that kernels take."""
        return self.data

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.capacity):
            raise ValueError(f"slots must lie in [0, {self.capacity}), got range "
                             f"[{int(slots.min())}, {int(slots.max())}]")
        return gather_rows(self.data, slots, self.fp8_dtype)
