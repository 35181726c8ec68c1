"""Input checks shared by every public entry point: errors name the argument and say what was expected."""

from __future__ import annotations

import os

from typing import Iterable, Sequence

import torch

from ..envflags import env_flag

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CHECK_RANGES_ENV = "DSA_INDEXER_CHECK_RANGES"
INT32_MAX = 2**31 - 1  # indices, slots and block-table entries are int32


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


def index_count(name: str, value: object) -> int:
    """A positive int that sizes an int32 index space (a top-k width): past ``INT32_MAX`` no index could name it."""
    positive_int(name, value)
    if value > INT32_MAX:
        raise IndexerInputError(f"{name}={value} is past the int32 index limit {INT32_MAX} (indices are int32)")
    return value


def boolean(name: str, value: object) -> bool:
    """A real bool: a string such as "no" is truthy and would turn a switch on silently."""
    if not isinstance(value, bool):
        raise IndexerInputError(f"{name} must be True or False, got {value!r}")
    return value


def integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise IndexerInputError(f"{name} must be an int, got {value!r}")
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


# --- sizes and devices: refused before an allocation, with the size needed -----------------------------------------
def human_bytes(n: int) -> str:
    """``n`` bytes as a short binary-prefixed size, e.g. "8.0 TiB" (exact below 1 KiB)."""
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        size /= 1024
        if size < 1024 or unit == "EiB":
            return f"{size:.1f} {unit}"
    raise AssertionError("unreachable")


def device_memory(device: torch.device | str) -> tuple[int, str] | None:
    """(bytes one allocation can get at most, what that limit is) where it is cheap to ask: a CUDA/ROCm device's free
    memory plus what torch's caching allocator holds unused (a driver query, no sync), the host's physical RAM for the
    CPU (a larger tensor cannot be filled without swapping the machine to a halt). None elsewhere (meta allocates
    nothing; other accelerators have no cheap query)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(index)
        unused_cache = torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
        return free + unused_cache, (f"the {human_bytes(free + unused_cache)} free on cuda:{index} (of "
                                     f"{human_bytes(total)})")
    if device.type == "cpu":
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name: no limit known
            return None
        return ram, f"this host's {human_bytes(ram)} of RAM"
    return None


def fits_in_memory(what: str, nbytes: int, device: torch.device | str, advice: str = "") -> None:
    """Refuse an allocation of ``nbytes`` for ``what`` that the device cannot hold, before torch's allocator tries."""
    limit = device_memory(device)
    if limit is not None and nbytes > limit[0]:
        raise IndexerInputError(f"{what} needs {human_bytes(nbytes)} ({nbytes} bytes), more than {limit[1]}"
                                + (f"; {advice}" if advice else ""))


def device_unavailable(device: torch.device) -> str | None:
    """Why this torch cannot allocate on ``device`` (no CUDA/ROCm GPU in a CPU-only build, an index past the GPUs it
    sees, an accelerator module that reports none), or None. Cheap: no allocation, no context beyond a device count."""
    if device.type in ("cpu", "meta"):
        return None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = ("a CPU-only build" if torch.version.cuda is None and torch.version.hip is None
                     else "built with GPU support")
            return f"this torch ({torch.__version__}, {build}) sees no CUDA/ROCm GPU"
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            return f"this torch sees {count} CUDA/ROCm GPU{'s' if count != 1 else ''} (cuda:0 to cuda:{count - 1})"
        return None
    module = getattr(torch, device.type, None)  # torch.xpu, torch.mps, torch.npu once torch_npu is imported
    is_available = getattr(module, "is_available", None)
    if callable(is_available) and not is_available():
        return f"this torch sees no {device.type} device"
    return None


def device_argument(name: str, value: object, advice: str = "") -> torch.device:
    """``value`` as a torch.device this torch can allocate on; errors name the argument (``name``)."""
    if isinstance(value, torch.device):
        device = value
    elif isinstance(value, (str, int)) and not isinstance(value, bool):
        try:
            device = torch.device(value)
        except (RuntimeError, ValueError) as exc:
            raise IndexerInputError(f"{name}={value!r} is not a torch device ({exc})") from None
    else:
        raise IndexerInputError(f"{name} must be a torch.device or a device name such as 'cpu' or 'cuda:0', got "
                                f"{type(value).__name__}")
    reason = device_unavailable(device)
    if reason is not None:
        raise IndexerInputError(f"{name}={str(device)!r}: {reason}" + (f"; {advice}" if advice else ""))
    return device
