"""Progress on stderr: a rich or tqdm bar on a terminal when installed, else a line per item."""

from __future__ import annotations

import sys
import time
from typing import Callable

from .report import PROGRESS_STYLES


# --- progress ------------------------------------------------------------------------------------------------------
class PlainProgress:
    """One line per finished item on ``stream`` (stderr): what a log file or a pipe can read."""

    def __init__(self, total: int, stream=None) -> None:
        self.total, self.done, self.stream = total, 0, stream or sys.stderr
        self.start = time.perf_counter()

    def advance(self, label: str) -> None:
        self.done += 1
        print(f"bench {self.done}/{self.total}: {label} ({time.perf_counter() - self.start:.1f} s)",
              file=self.stream, flush=True)

    def close(self) -> None:
        pass


class _NoProgress(PlainProgress):
    def advance(self, label: str) -> None:
        self.done += 1


class _TqdmProgress:
    def __init__(self, total: int, stream=None) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="bench", unit="item", file=stream or sys.stderr, dynamic_ncols=True)

    def advance(self, label: str) -> None:
        self.bar.set_postfix_str(label, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class _RichProgress:
    def __init__(self, total: int, stream=None) -> None:
        from rich.console import Console
        from rich.progress import Progress

        self.progress = Progress(console=Console(file=stream or sys.stderr))
        self.progress.start()
        self.task = self.progress.add_task("bench", total=total)

    def advance(self, label: str) -> None:
        self.progress.update(self.task, advance=1, description=f"bench {label}")

    def close(self) -> None:
        self.progress.stop()


def importable(name: str) -> bool:
    """Whether ``import name`` works here (an optional library: rich, tqdm, matplotlib)."""
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def progress_factory(style: str = "auto", stream=None) -> Callable[[int], object]:
    """``factory(total)`` -> an object with ``advance(label)`` and ``close()``, all output on ``stream`` (stderr).

    ``auto``: a rich bar, else a tqdm bar, when ``stream`` is a terminal and the library imports; otherwise (a
    pipe, a log file, neither installed) one plain line per item. ``rich`` / ``tqdm`` insist (ImportError when
    missing), ``plain`` / ``none`` never use either."""
    if style not in PROGRESS_STYLES:
        raise ValueError(f"progress style must be one of {PROGRESS_STYLES}, got {style!r}")
    stream = stream or sys.stderr
    if style == "auto":
        tty = bool(getattr(stream, "isatty", lambda: False)())
        style = ("rich" if tty and importable("rich") else "tqdm" if tty and importable("tqdm") else "plain")
    if style in ("rich", "tqdm") and not importable(style):
        raise ImportError(f"progress style {style!r} needs {style}: pip install {style} (or use plain)")
    cls = {"rich": _RichProgress, "tqdm": _TqdmProgress, "plain": PlainProgress, "none": _NoProgress}[style]
    return lambda total: cls(total, stream)
