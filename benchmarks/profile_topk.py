"""Launch the CUDA top-k a few times on randn rows of the given shapes, for `ncu` to profile (no timing here).

    ncu --clock-control none -k regex:topk --section SpeedOfLight python3 benchmarks/profile_topk.py 1x8192 128x131072
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsa_indexer.backends.cuda import topk as cuda_topk  # noqa: E402


def _shape(text: str) -> tuple[int, int]:
    batch, sep, ctx = text.lower().partition("x")
    if not sep or not batch.isdigit() or not ctx.isdigit():
        raise argparse.ArgumentTypeError(f"expected BATCHxCOLUMNS such as 128x131072, got {text!r}")
    return int(batch), int(ctx)


def main(shapes: list[tuple[int, int]]) -> None:
    for batch, ctx in shapes:
        logits = torch.randn(batch, ctx, device="cuda")
        ends = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        for _ in range(2):
            cuda_topk.topk_indices(logits, 2048, ends)
        torch.cuda.synchronize()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", type=_shape, nargs="+", metavar="BxC", help="row count x columns, e.g. 1x8192")
    main(parser.parse_args().shapes)
