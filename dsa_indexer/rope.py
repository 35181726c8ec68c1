"""Rotary position tables (cos | sin) with DeepSeek's YaRN frequency scaling."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class YarnScaling:
    """YaRN as configured in the DeepSeek-V3 family (``rope_scaling`` of the HF config)."""

    factor: float = 40.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0


def rope_frequencies(rope_dim: int, theta: float, yarn: YarnScaling | None, max_position: int) -> torch.Tensor:
    """Per-pair inverse frequencies [rope_dim / 2] in float64."""
    pair = torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim
    freqs = 1.0 / (theta ** pair)
    if yarn is None or max_position <= yarn.original_max_position:
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


def cos_sin_table(rope_dim: int, max_position: int, theta: float = 10000.0, yarn: YarnScaling | None = None,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """``[max_position, rope_dim]`` fp32: cos of every (position, pair) then sin, the layout the ops take."""
    freqs = rope_frequencies(rope_dim, theta, yarn, max_position)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), freqs)
    return torch.cat([angles.cos(), angles.sin()], dim=1).float().to(device)
