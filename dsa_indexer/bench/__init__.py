"""`dsa-indexer bench`: every implementation that resolution accepts on this device, side by side, with the device's
own ceilings measured in the same run.

Suites (``--suite``):

- ``decode``: a B x context sweep of the fused paged logits + top-k (``lightning_indexer``), and the whole indexer
  step: a DeepSeek-V3.2 `Indexer` (``init_random``) decode step per pipeline strategy (the registry op
  ``indexer_pipeline``: single stream, the CUDA dual stream where it is accepted), each without and with q_lora
  reuse (attention's fp8 ``q_lora`` handed in as ``q_lora_quant``: rows named ``<strategy>+q_lora_reuse``);
- ``topk``: top-k alone on real decode logits of that sweep (the V3.2 indexer's k and q paths, paged logits), with
  ``torch.topk`` as the baseline;
- ``prefill``: ragged causal logits, query x key lengths;
- ``ops``: ``lightning_indexer``, ``topk_indices`` and ``ragged_mqa_logits`` alone, at one size each.

For each op the registry's accepted candidates are forced in turn. Timing: on a GPU each measurement is captured
in a CUDA graph (warm-up first, on a side stream) and its replays are timed by CUDA events, L2 flushed (a 256 MiB
write) before every replay, the median of ``--repeats``; what cannot be captured is timed eagerly by CUDA events
(the row says which). On a CPU the sizes are small and the wall clock times eager calls: those are CPU numbers,
not GPU numbers. Every row keeps the spread of its samples next to the median (min, p10, p90, max, count: the
table's ``min us``, ``p10-p90 us`` and ``n``, the JSON's ``spread``). Throughput is reported with the fraction of
the measured ceiling: copy bandwidth for the memory bound ops (bytes read + written; for the step, the floor is its
weights + every context key once + its inputs and output), and the fp8 (GPU) or fp32 (CPU) matmul rate for
prefill. The ceilings keep their samples' spread too (``ceiling_spread``); one whose fastest sample is 10x its
slowest or more (a busy CPU) is flagged ``UNSTABLE`` in the table and ``unstable`` in the JSON, with a warning.

Output: a table, ``--json FILE`` (``-`` for stdout: then stdout holds the JSON only), and PNG plots with
``--plots DIR`` (matplotlib: the ``bench`` extra): latency vs context per implementation, bandwidth as a
percentage of the measured copy bandwidth, the pipeline strategies accepted here (with and without q_lora reuse),
top-k speedup over torch.topk, and prefill latency. Progress goes to stderr: a rich or tqdm bar on a terminal when
one is installed, else one line per measured item.

The package: `report` (rows, table, JSON), `timing` (graph replays, ceilings), `suites` (the measurements and
`run_bench`), `progress`, `plots`.
"""

from .report import (  # noqa: F401
    BenchReport, CPU_BATCHES, CPU_CONTEXTS, CPU_NOTE, CPU_PREFILL, DIM, GPU_BATCHES, GPU_CONTEXTS, GPU_PREFILL,
    HEADS, PIPELINE, PROGRESS_STYLES, REFERENCE_MAX_PAIRS, REFERENCE_MAX_TOKENS, REUSE, Row, SINGLE_STREAM,
    SUITES, TOPK, TORCH_TOPK, ceiling_of, format_number, format_table, report_from_json, report_json, write_json)
from .timing import (  # noqa: F401
    Timer, Timing, UNSTABLE_RATIO, capture, measure_ceilings, percentile, rate_spread, spread_of)
from .progress import (  # noqa: F401
    PlainProgress, importable, progress_factory)
from .suites import (  # noqa: F401
    bench_decode, bench_decode_step, bench_prefill, bench_topk, pipeline_variant, random_cache, run_bench,
    step_floor_bytes)
from .plots import (  # noqa: F401
    require_matplotlib, streams_title, topk_k_text, write_plots)
