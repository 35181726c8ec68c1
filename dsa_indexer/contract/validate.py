"""Input checks shared by every public entry point: errors name the argument and say what was expected."""

from __future__ import annotations

import os

from typing import Iterable, Sequence

import torch

from ..envflags import env_flag

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CHECK_RANGES_ENV = "DSA_INDEXER_CHECK_RANGES"


class IndexerInputError(ValueError):
    """A public function got an argument of the wrong dtype, shape, device or range."""


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def tensor(name: str, value: object, *, dtype: torch.dtype | Sequence[torch.dtype] | None = None,
           ndim: int | None = None, shape: Sequence[int | None] | None = None, device: torch.device | None = None,
           contiguous: bool = False) -> torch.Tensor:
    """Check one tensor argument; ``None`` entries of ``shape`` match any size."""
    if not isinstance(value, torch.Tensor):
        raise IndexerInputError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if value.dtype not in allowed:
            raise IndexerInputError(f"{name} must have dtype {_dtype_names(allowed)}, got {str(value.dtype).replace('torch.', '')}")
    if ndim is not None and value.dim() != ndim:
        raise IndexerInputError(f"{name} must have {ndim} dims, got shape {list(value.shape)}")
    if shape is not None:
        if value.dim() != len(shape) or any(s is not None and s != v for s, v in zip(shape, value.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise IndexerInputError(f"{name} must have shape {want}, got {list(value.shape)}")
    if device is not None and value.device != device:
        raise IndexerInputError(f"{name} is on {value.device} but the other inputs are on {device}")
    if contiguous and not value.is_contiguous():
        raise IndexerInputError(f"{name} must be contiguous")
    return value


def positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise IndexerInputError(f"{name} must be a positive int, got {value!r}")
    return value


def finite_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
        raise IndexerInputError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def fp8_dtype(name: str, value: object) -> torch.dtype:
    if value not in FP8_DTYPES:
        raise IndexerInputError(f"{name} must be torch.float8_e4m3fn or torch.float8_e4m3fnuz, got {value!r}")
    return value  # type: ignore[return-value]


def ranges_checked(t: torch.Tensor) -> bool:
    """Range checks read tensor values: free on the CPU, a host sync on a GPU (on only when asked), and
    impossible while torch.compile traces (values are symbolic there; the eager call checks them)."""
    if torch.compiler.is_compiling():
        return False
    if t.device.type == "cpu":
        return True
    # Unset (the serving default) answers without a call; a set value goes through the one parser (typos raise).
    return CHECK_RANGES_ENV in os.environ and env_flag(CHECK_RANGES_ENV)


def used_pages_in_range(name: str, block_table: torch.Tensor, keys: torch.Tensor, page_size: int, high: int,
                        what: str, table_rows: torch.Tensor | None = None) -> None:
    """The block-table entries a row actually uses (its first ``ceil(keys / page_size)`` pages; ``table_rows`` maps
    each row to its block-table row, default row r -> r) lie in ``[0, high)``: a -1 or stale page there would turn
    into negative or foreign slots. Entries past a row's keys are padding and may hold anything."""
    if block_table.numel() == 0 or keys.numel() == 0 or not ranges_checked(block_table):
        return
    table = block_table if table_rows is None else block_table[table_rows.long()]
    needed = (keys.long().clamp_min(0) + page_size - 1) // page_size
    used = torch.arange(table.shape[1], device=table.device)[None, :] < needed[:, None]
    in_range(name, table[used], 0, high, what)


def in_range(name: str, t: torch.Tensor, low: int, high: int, what: str) -> None:
    """Every element of ``t`` in ``[low, high)``; ``what`` says what the bound is."""
    if t.numel() == 0 or not ranges_checked(t):
        return
    lo, hi = int(t.min()), int(t.max())
    if lo < low or hi >= high:
        raise IndexerInputError(f"{name} values must lie in [{low}, {high}) ({what}); got range [{lo}, {hi}]")
