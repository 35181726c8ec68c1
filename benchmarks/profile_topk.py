"""Launch the CUDA top-k a few times on randn rows of the given shapes, for `ncu` to profile (no timing here).

    ncu --clock-control none -k regex:topk --section SpeedOfLight python3 benchmarks/profile_topk.py 1x8192 128x131072
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsa_indexer.backends.cuda import topk as cuda_topk  # noqa: E402


def main(shapes: list[str]) -> None:
    for shape in shapes:
        batch, ctx = (int(v) for v in shape.split("x"))
        logits = torch.randn(batch, ctx, device="cuda")
        ends = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        for _ in range(2):
            cuda_topk.topk_indices(logits, 2048, ends)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
