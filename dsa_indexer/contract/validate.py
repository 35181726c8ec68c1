"""Input checks shared by every public entry point: errors name the argument and say what was expected."""

from __future__ import annotations

import contextvars
import os

from typing import Iterable, NoReturn, Sequence

import numpy as np
import torch

from ..envflags import env_flag

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CHECK_RANGES_ENV = "DSA_INDEXER_CHECK_RANGES"
_compiling = torch.compiler.is_compiling  # the function itself (Dynamo knows it): one attribute lookup less per call
INT32_MAX = 2**31 - 1  # indices, slots and block-table entries are int32


class IndexerInputError(ValueError):
    """A public function got an argument of the wrong dtype, shape, device or range."""


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def tensor(name: str, value: object, *, dtype: torch.dtype | Sequence[torch.dtype] | None = None,
           ndim: int | None = None, shape: Sequence[int | None] | None = None, device: torch.device | None = None,
           contiguous: bool = False) -> torch.Tensor:
    """Check one tensor argument; ``None`` entries of ``shape`` match any size."""
    # Every public call runs this a few times (benchmarks/dispatch_overhead.py): the success path reads each tensor
    # property once and builds nothing; the messages are built only where a check fails (`_refuse_tensor`).
    if not isinstance(value, torch.Tensor):
        raise IndexerInputError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if dtype is not None:
        got = value.dtype  # dtypes are singletons: ``is`` is the equality test, a tuple of them never matches it
        if got is not dtype and (type(dtype) is torch.dtype or got not in dtype):
            _refuse_tensor(name, value, dtype=dtype)
    if ndim is not None and value.ndim != ndim:
        _refuse_tensor(name, value, ndim=ndim)
    # A torch.Size equals the tuple of its sizes: the exact comparison first, the wildcard one only where it fails.
    if shape is not None and value.shape != shape:
        if value.ndim != len(shape) or any(s is not None and s != v for s, v in zip(shape, value.shape)):
            _refuse_tensor(name, value, shape=shape)
    if device is not None and value.device != device:
        _refuse_tensor(name, value, device=device)
    if contiguous and not value.is_contiguous():
        _refuse_tensor(name, value, contiguous=True)
    return value


def _refuse_tensor(name: str, value: torch.Tensor, *, dtype: torch.dtype | Sequence[torch.dtype] | None = None,
                   ndim: int | None = None, shape: Sequence[int | None] | None = None,
                   device: torch.device | None = None, contiguous: bool = False) -> NoReturn:
    """`tensor`'s error for the one check that failed (the keyword given)."""
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        raise IndexerInputError(f"{name} must have dtype {_dtype_names(allowed)}, got "
                                f"{str(value.dtype).replace('torch.', '')}")
    if ndim is not None:
        raise IndexerInputError(f"{name} must have {ndim} dims, got shape {list(value.shape)}")
    if shape is not None:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise IndexerInputError(f"{name} must have shape {want}, got {list(value.shape)}")
    if device is not None:
        raise IndexerInputError(f"{name} is on {value.device} but the other inputs are on {device}")
    raise IndexerInputError(f"{name} must be contiguous")


def positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise IndexerInputError(f"{name} must be a positive int, got {value!r}")
    return value


def index_count(name: str, value: object) -> int:
    """A positive int that sizes an int32 index space (a top-k width): past ``INT32_MAX`` no index could name it."""
    if type(value) is int and 0 < value <= INT32_MAX:  # the usual k in one test (a bool's type is not int)
        return value
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


# Set by `dsa_indexer.testing.forbid_host_syncs`: CPU tensors then stand for device ones, so a CPU test sees the
# checks a GPU or NPU run would skip skipped too (and any host read left is one a device run would make).
CPU_AS_DEVICE: contextvars.ContextVar[bool] = contextvars.ContextVar("dsa_indexer_cpu_as_device", default=False)


def ranges_checked(t: torch.Tensor) -> bool:
    """Range checks read tensor values: free on the CPU, a host sync on a GPU (on only when asked), and
    impossible while torch.compile traces (values are symbolic there; the eager call checks them)."""
    if torch.compiler.is_compiling():
        return False
    if t.is_cpu and not CPU_AS_DEVICE.get():  # is_cpu: a flag read, where .device.type builds a device (0.3 us)
        return True
    # Unset (the serving default) answers without a call; a set value goes through the one parser (typos raise).
    return CHECK_RANGES_ENV in os.environ and env_flag(CHECK_RANGES_ENV)


def used_pages_in_range(name: str, block_table: torch.Tensor, keys: torch.Tensor, page_size: int, high: int,
                        what: str, table_rows: torch.Tensor | None = None) -> None:
    """The block-table entries a row actually uses (its first ``ceil(keys / page_size)`` pages; ``table_rows`` maps
    each row to its block-table row, default row r -> r) lie in ``[0, high)``: a -1 or stale page there would turn
    into negative or foreign slots, and one page used twice by a row would name one key at two positions
    (`check_page_sharing`). Entries past a row's keys are padding and may hold anything."""
    if block_table.numel() == 0 or keys.numel() == 0 or not ranges_checked(block_table):
        return
    table = block_table if table_rows is None else block_table[table_rows.long()]
    needed = (keys.long().clamp_min(0) + page_size - 1) // page_size
    used = torch.arange(table.shape[1], device=table.device)[None, :] < needed[:, None]
    in_range(name, table[used], 0, high, what)
    # A reader sees one key at two positions where a row uses one page twice; rows of one request read its
    # block-table row as far as the longest of them.
    longest = keys.long().clamp_min(0)
    if table_rows is not None:
        longest = torch.zeros(block_table.shape[0], dtype=torch.long, device=keys.device).scatter_reduce_(
            0, table_rows.long(), longest, "amax")
    check_page_sharing(name, block_table, longest, page_size)


def _appears_again(values: np.ndarray) -> np.ndarray | None:
    """Mask of the entries whose value occurs more than once in ``values`` (int64, 1-D), None when every value
    occurs once: a count per value where the values span little more than their number (the usual block table),
    else a sort."""
    low, high = int(values.min()), int(values.max())
    if high - low <= 4 * values.size + 4096:
        index = values - low if low else values
        counts = np.bincount(index)
        if counts.max() <= 1:
            return None
        return (counts > 1)[index]  # a gather from a bool per value: 8x less memory than from the counts
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    equal = ordered[1:] == ordered[:-1]
    again = np.zeros(values.size, dtype=bool)
    again[1:] |= equal
    again[:-1] |= equal
    if not again.any():
        return None
    mask = np.empty_like(again)
    mask[order] = again
    return mask


def check_page_sharing(name: str, block_table: torch.Tensor, total_keys: torch.Tensor, page_size: int,
                       cached_keys: torch.Tensor | None = None, unit: str = "keys") -> None:
    """One step's use of cache pages, row b of ``block_table`` being request b: it reads its first
    ``ceil(total_keys[b] / page_size)`` pages and writes those holding its keys ``[cached_keys[b], total_keys[b])``
    (``cached_keys`` None: a reader, which writes nothing). Refused, naming the row, the columns and the page:

    - a request using one cache page for two of its pages: two of its keys would share a slot, so the later store
      overwrites the earlier key and a reader sees one key at two positions;
    - a page one request writes that another request uses too: the writer would overwrite the keys the other
      stored or reads, and two writers each other's.

    Requests may share pages that no request writes in the step (the pages of a common cached prefix). Entries past a
    request's pages are padding. Reads the values on the host (a device caller copies them: a sync, which is why
    device callers run it only where their range checks run); the entries in use should be range-checked first."""
    table = block_table.detach().to("cpu", torch.int64).numpy()
    rows, columns = table.shape
    if rows == 0 or columns == 0:
        return
    total = total_keys.detach().to("cpu", torch.int64).numpy().clip(min=0)
    pages_read = np.minimum((total + page_size - 1) // page_size, columns)
    used = np.arange(columns)[None, :] < pages_read[:, None]
    pages = table[used]
    if pages.size < 2:
        return
    shared = _appears_again(pages)
    if shared is None:
        return  # every page in use by one request once: the common case, one count
    low = int(pages.min())
    column_index = np.arange(columns)[None, :]

    def keys_of(row: int, column: int, first: int = 0) -> str:
        start = max(column * page_size, first)
        return f"[{start}, {min(int(total[row]), (column + 1) * page_size)})"

    # Each row's pages sorted (columns it does not use turned into distinct values below every page): equal
    # neighbours are a request using a page twice. Row by row is ~5x faster than sorting (request, page) pairs.
    ordered = np.sort(np.where(used, table, low - 1 - column_index), axis=1)
    twice = np.flatnonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))
    if twice.size:
        b = int(twice[0])
        sorted_row = ordered[b]
        page = int(sorted_row[1:][sorted_row[1:] == sorted_row[:-1]][0])
        first, second = (int(c) for c in np.flatnonzero(table[b, :pages_read[b]] == page)[:2])
        raise IndexerInputError(
            f"{name} row {b} (request {b}) uses cache page {page} twice (columns {first} and {second}, its {unit} "
            f"{keys_of(b, first)} and {keys_of(b, second)}): each page of a request must be a distinct cache page, or "
            f"its later {unit} overwrite the earlier ones and a reader sees one key at two positions; give the "
            "request distinct pages")
    if cached_keys is None:
        return
    cached = cached_keys.detach().to("cpu", torch.int64).numpy().clip(min=0)
    # A shared page is used by other requests too (no request uses a page twice, as checked): written, it conflicts.
    written = (used & (column_index >= (cached // page_size)[:, None]) & (total > cached)[:, None])[used]
    conflicts = np.flatnonzero(written & shared)
    if not conflicts.size:
        return  # every shared page holds cached keys only: a shared prefix
    row_of, column_of = np.nonzero(used)  # row-major, as ``pages``
    i = int(conflicts[0])
    page, writer, column = int(pages[i]), int(row_of[i]), int(column_of[i])
    j = int(np.flatnonzero((pages == page) & (row_of != writer))[0])
    other, other_column = int(row_of[j]), int(column_of[j])
    how = "and by" if written[j] else "and read by"
    raise IndexerInputError(
        f"{name}: cache page {page} is written in this step by request {writer} (row {writer}, column {column}: its "
        f"new {unit} {keys_of(writer, column, int(cached[writer]))}) {how} request {other} (row {other}, column "
        f"{other_column}): a page a request writes must be its own in that step, or one request overwrites the "
        f"{unit} of the other; give each request its own pages for its new {unit} (requests may share only pages of "
        "cached keys that no request writes in the step, e.g. a common prefix)")


_FEW = 16  # elements up to which a CPU range check reads the values as Python numbers


def in_range(name: str, t: torch.Tensor, low: int, high: int, what: str) -> None:
    """Every element of ``t`` in ``[low, high)``; ``what`` says what the bound is."""
    # `ranges_checked`'s CPU case, inline (the per-call path of every op): a few host values are read as Python
    # numbers (0.5 us) rather than by two reductions (3 us), and compared one by one (faster than min and max for
    # so few; the range is computed for the message only). The flag reads come first, the compile test before the
    # context variable and the size: torch.compile traces neither (values are symbolic there).
    if t.is_cpu and t.ndim == 1 and not _compiling() and not CPU_AS_DEVICE.get():
        n = t.numel()
        if n == 1:  # one value (a decode step of one request): item() costs half of tolist()
            value = t.item()
            if value < low or value >= high:
                _refuse_range(name, value, value, low, high, what)
            return
        if n <= _FEW:
            values = t.tolist()
            for value in values:
                if value < low or value >= high:
                    _refuse_range(name, min(values), max(values), low, high, what)
            return
    if t.numel() == 0 or not ranges_checked(t):
        return
    lo, hi = (int(bound) for bound in torch.aminmax(t))  # one reduction for both bounds
    if lo < low or hi >= high:
        _refuse_range(name, lo, hi, low, high, what)


def _refuse_range(name: str, lo: int, hi: int, low: int, high: int, what: str) -> NoReturn:
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


def _address_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte addresses ``t``'s elements occupy (the strided extent, gaps included)."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def output_buffer(name: str, value: object, *, dtype: torch.dtype, shape: Sequence[int], device: torch.device,
                  inputs: Iterable[tuple[str, torch.Tensor | None]]) -> torch.Tensor:
    """A caller's buffer for an op's result (``out=``): ``dtype``, exactly ``shape``, on ``device``, contiguous (the
    kernels write row r at ``r * shape[-1]`` from its first element: a row slice ``buffer[:rows]`` of a persistent
    contiguous buffer is fine, a column slice or a transposed view is not), and sharing no memory with any of
    ``inputs`` (the op would read what it already overwrote). Memory is compared by address spans on real
    tensors; meta tensors and a trace (torch.compile's fake tensors) have no addresses to compare."""
    tensor(name, value, dtype=dtype, shape=shape, device=device)
    assert isinstance(value, torch.Tensor)
    if not value.is_contiguous():
        raise IndexerInputError(f"{name} must be contiguous (row-major, element stride 1, row stride {shape[-1]}): "
                                f"the kernels write into it in place; got strides {list(value.stride())}")
    if value.numel() == 0 or value.is_meta or torch.compiler.is_compiling():
        return value
    low, high = _address_span(value)
    for input_name, other in inputs:
        if other is None or other.numel() == 0:
            continue
        other_low, other_high = _address_span(other)
        if other_low < high and low < other_high:
            raise IndexerInputError(f"{name} shares memory with {input_name}: the op reads {input_name} while "
                                    f"writing {name}; pass a separate buffer")
    return value
