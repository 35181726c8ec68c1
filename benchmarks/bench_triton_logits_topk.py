"""Speed of the logits and top-k kernels next to the ceilings they are judged against: a thin caller of
``dsa-indexer bench --suite topk prefill`` (dsa_indexer/bench.py; the Triton kernels are among the implementations
it forces in turn, beside DeepGEMM, FlashInfer and the reference where those are accepted).

    python benchmarks/bench_triton_logits_topk.py --out DIR [--quick] [--repeats N] [--budget-s S]

Writes DIR/bench_triton_logits_topk.json (top-k per implementation vs torch.topk over the B x context sweep, ragged
causal prefill logits in TFLOP/s and as a fraction of the fp8 GEMM rate, the copy bandwidth, all from one run) and,
when matplotlib imports, PNG plots into DIR/bench_triton_logits_topk_plots/.
``benchmarks/results/triton_logits_topk.json`` came from the earlier, standalone version of this script (git
history), which also swept tile configurations.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsa_indexer.cli import script_main  # noqa: E402


def main(argv=None) -> int:
    return script_main("bench_triton_logits_topk", ["topk", "prefill"], argv, doc=__doc__,
                       quick=["--batch", "1", "64", "--context", "8192", "131072", "--prefill-shapes", "4096x4096"])


if __name__ == "__main__":
    sys.exit(main())
