"""Rotary position tables (cos | sin) with DeepSeek's YaRN frequency scaling, shared per (config, device).

The frequencies are a property of the model, not of how many rows a table holds: YaRN is applied whenever the
config has it (DeepSeek-V4's rule, ``original_seq_len > 0``; V3.2's published ``max_seq_len`` 163840 is past its
original 4096, so the rule gives V3.2 YaRN too). A table sized to a short demo must not change them.

Tables are shared: every `Indexer` of one config on one device reads the same tensor (`shared_cos_sin_table`).
V4-Flash's 1,048,576 positions x 64 fp32 are 256 MiB: one per layer would be 11 GiB over 43 layers.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class YarnScaling:
    """YaRN as configured in the DeepSeek family (``rope_scaling`` of the HF config; ``rope_factor``,
    ``original_seq_len``, ``beta_fast``, ``beta_slow`` of DeepSeek's inference config)."""

    factor: float = 40.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0


def rope_frequencies(rope_dim: int, theta: float, yarn: YarnScaling | None) -> torch.Tensor:
    """Per-pair inverse frequencies [rope_dim / 2] in float64, YaRN-scaled when ``yarn`` is given."""
    pair = torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim
    freqs = 1.0 / (theta ** pair)
    if yarn is None or yarn.original_max_position <= 0:
        return freqs

    def dim_for_rotations(rotations: float) -> float:
        # The pair index whose wavelength completes `rotations` turns over the original context.
        return rope_dim * math.log(yarn.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_for_rotations(yarn.beta_fast)), 0)
    high = min(math.ceil(dim_for_rotations(yarn.beta_slow)), rope_dim - 1)
    if high == low:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: high-frequency pairs keep their frequency; 0: fully interpolated
    return freqs / yarn.factor * (1 - keep) + freqs * keep


_ROWS_PER_CHUNK = 1 << 16  # bounds the float64 angles of a 1M-row table to 16 MiB at a time


def cos_sin_table(rope_dim: int, max_position: int, theta: float = 10000.0, yarn: YarnScaling | None = None,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """``[max_position, rope_dim]`` fp32: cos of every (position, pair) then sin, the layout the ops take.

    Angles are computed in float64 (position x frequency loses no bits below 2**53) and rounded once to fp32."""
    freqs = rope_frequencies(rope_dim, theta, yarn).to(device)
    table = torch.empty(max_position, rope_dim, dtype=torch.float32, device=device)
    half = rope_dim // 2
    for start in range(0, max_position, _ROWS_PER_CHUNK):
        stop = min(start + _ROWS_PER_CHUNK, max_position)
        angles = torch.outer(torch.arange(start, stop, dtype=torch.float64, device=device), freqs)
        table[start:stop, :half] = angles.cos()
        table[start:stop, half:] = angles.sin()
    return table


_SHARED: dict[tuple, torch.Tensor] = {}
_SHARED_LOCK = threading.Lock()


def _device_key(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        index = torch.cuda.current_device() if device.type == "cuda" else 0
        device = torch.device(device.type, index)
    return device


def shared_cos_sin_table(rope_dim: int, max_position: int, theta: float, yarn: YarnScaling | None,
                         device: torch.device | str) -> torch.Tensor:
    """The one table for these RoPE settings on ``device``, built on first use and then shared (read-only: the
    ops never write it). `clear_shared_tables` drops them (e.g. after moving a model off a GPU)."""
    key = (rope_dim, max_position, float(theta), yarn, _device_key(device))
    table = _SHARED.get(key)
    if table is None:
        with _SHARED_LOCK:
            table = _SHARED.get(key)
            if table is None:
                table = cos_sin_table(rope_dim, max_position, theta, yarn, key[-1])
                _SHARED[key] = table
    return table


def shared_table_count() -> int:
    """How many shared tables exist (tests and memory accounting)."""
    return len(_SHARED)


def clear_shared_tables() -> None:
    with _SHARED_LOCK:
        _SHARED.clear()
