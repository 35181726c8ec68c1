"""Per-call overhead of the dispatched op against calling the chosen implementation directly (CPU).

    python benchmarks/dispatch_overhead.py [--out benchmarks/results]

To isolate the dispatch from the kernel, the benchmark registers (in this process only) a top-k implementation
that returns at once, forces it, and times the same call four ways: the implementation directly, through
`Registry.call`, through the op body (target + problem + lookup), and through the public op (which also validates).
Medians of many timed loops, one thread; the machine's load average is recorded with them (a loaded machine
slows every row alike: compare rows measured in one run, or two trees measured back to back).
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

# The tree this script is in, not an installed copy of the package: a timing is of the code beside it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dsa_indexer import ops  # noqa: E402
from dsa_indexer.dispatch.plugins import default_registry  # noqa: E402
from dsa_indexer.dispatch.problem import Problem  # noqa: E402
from dsa_indexer.dispatch.target import target_of_tensor  # noqa: E402


def per_call_us(fn, loops=2000, repeats=15) -> float:
    for _ in range(200):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(loops):
            fn()
        samples.append((time.perf_counter_ns() - start) / loops / 1e3)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a dispatch_overhead_cpu.json this script wrote for another tree just before, kept in "
                             "this run's JSON as the comparison measured under the same load")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    logits = torch.randn(1, 8)
    ends = torch.tensor([8], dtype=torch.int32)
    registry = default_registry()
    target = target_of_tensor(logits)
    problem = Problem(k=4, slots=False, starts=False)
    sentinel = torch.zeros(1, 4, dtype=torch.int32)

    def returns_at_once(logits, k, ends, starts, block_table, row_request):
        return sentinel

    # Registered as if built in, so the registry does not wrap it with the result check it puts on plugins'
    # implementations (`dispatch/results.py`): what is timed is the dispatch, not that check.
    registry.builtin_origins.add("benchmark")
    registry.implementation("topk_indices", impl_id="topk_indices.bench.noop", targets=("cpu",), priority=10_000,
                            description="benchmark only: measures dispatch, not a kernel",
                            origin="benchmark")(lambda: returns_at_once)
    registry.force("topk_indices", "topk_indices.bench.noop")
    impl = registry.function("topk_indices", target, problem)
    assert impl is returns_at_once

    direct = per_call_us(lambda: impl(logits, 4, ends, None, None, None))
    via_registry = per_call_us(lambda: registry.call("topk_indices", target, problem, logits, 4, ends, None, None,
                                                     None))
    via_custom_op_body = per_call_us(lambda: ops.topk_indices.run(logits, 4, ends, None, None, None))
    via_public = per_call_us(lambda: ops.topk_indices(logits, 4, ends))
    rows = {
        "direct implementation call": direct,
        "registry.call (lookup + call)": via_registry,
        "op body (target + problem + lookup)": via_custom_op_body,
        "public op (validation + dispatch)": via_public,
    }
    result = {
        "command": " ".join(["python"] + sys.argv),
        "machine": platform.processor() or platform.machine(), "python": platform.python_version(),
        "torch": torch.__version__, "threads": 1, "op": "topk_indices (1 x 8, k=4, CPU)",
        "per_call_us": rows,
        "overhead_us": {"registry lookup": via_registry - direct, "dispatch (target+problem+lookup)":
                        via_custom_op_body - direct, "public op incl. validation": via_public - direct},
        "target_us": 3.0,
        # Other processes on the machine slow every row alike: the 1-minute load average and the cores it shares.
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)], "cpus": os.cpu_count(),
    }
    if args.baseline:
        before = json.loads(args.baseline.read_text())
        result["baseline"] = {key: before[key] for key in ("per_call_us", "overhead_us", "load_average")
                              if key in before}
    print(f"{'path':<40}{'us/call':>10}{'overhead':>10}")
    for name, value in rows.items():
        print(f"{name:<40}{value:10.2f}{value - direct:10.2f}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "dispatch_overhead_cpu.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
