"""The decode step and its top-k: a thin caller of ``dsa-indexer bench --suite decode topk`` (dsa_indexer/bench.py).

    python benchmarks/bench_decode_topk.py --out DIR [--quick] [--only decode|topk] [--repeats N] [--budget-s S]

Writes DIR/bench_decode_topk.json (the command's JSON: every accepted lightning_indexer and top-k implementation
beside torch.topk over the B x context sweep, and the whole V3.2 indexer step per pipeline strategy, single / dual
stream, with and without q_lora reuse, with the copy bandwidth and fp8 GEMM rate measured in the same run) and,
when matplotlib imports, PNG plots into DIR/bench_decode_topk_plots/. Runs on a CPU too (small sizes, CPU numbers).
``benchmarks/results/decode_topk*.json`` came from the earlier, standalone version of this script (git history).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsa_indexer.cli import script_main  # noqa: E402


def main(argv=None) -> int:
    return script_main("bench_decode_topk", ["decode", "topk"], argv, doc=__doc__, only=("decode", "topk"),
                       quick=["--batch", "1", "32", "--context", "8192", "32768"])


if __name__ == "__main__":
    sys.exit(main())
