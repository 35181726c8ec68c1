"""Per-layer decode time of the indexer, single vs dual stream, and prefill logits: a thin caller of
``dsa-indexer bench --suite decode prefill`` (dsa_indexer/bench.py).

    python benchmarks/bench_pipeline.py --out DIR [--quick] [--repeats N] [--budget-s S]

Writes DIR/bench_pipeline.json (the command's JSON: the whole V3.2 indexer decode step per pipeline strategy with
and without q_lora reuse, lightning_indexer per implementation, ragged prefill logits per implementation, with the
ceilings measured in the same run) and, when matplotlib imports, PNG plots into DIR/bench_pipeline_plots/.
``benchmarks/results/pipeline.json`` came from the earlier, standalone version of this script (git history).
``capture`` stays importable from here (bench_q_lora_reuse.py and bench_v4_compressor.py use it).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsa_indexer.bench import capture  # noqa: E402,F401 - re-exported for the other scripts
from dsa_indexer.cli import script_main  # noqa: E402


def main(argv=None) -> int:
    return script_main("bench_pipeline", ["decode", "prefill"], argv, doc=__doc__,
                       quick=["--batch", "1", "32", "--context", "8192", "--prefill-shapes", "4096x4096"])


if __name__ == "__main__":
    sys.exit(main())
