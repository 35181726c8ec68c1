"""Render the tables of docs/performance.md from the committed JSON, so the doc cannot drift from its data.

    python benchmarks/render_performance_tables.py          # rewrite the generated blocks in place
    python benchmarks/render_performance_tables.py --check  # exit 1 if the doc differs (tests/cli/test_readme.py)

A generated block sits between ``<!-- generated: NAME -->`` and ``<!-- end generated -->``; NAME picks the renderer.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "performance.md"


def dispatch_overhead() -> str:
    data = json.loads((RESULTS / "dispatch_overhead_cpu.json").read_text())
    per_call, overhead = data["per_call_us"], data["overhead_us"]
    before = data.get("baseline", {}).get("per_call_us")
    rows = [("the implementation called directly", "direct implementation call", None),
            ("`Registry.call` (cache lookup + call)", "registry.call (lookup + call)", "registry lookup"),
            ("op body: target + problem + bound lookup (what the custom op runs)",
             "op body (target + problem + lookup)", "dispatch (target+problem+lookup)"),
            ("public op: argument validation + dispatch, CPU tensors", "public op (validation + dispatch)",
             "public op incl. validation")]
    load = data.get("load_average")
    lines = [f"`{data['command']}` ({data['op']}; Python {data['python']}, torch {data['torch']}, "
             f"{data['threads']} thread" + (f"; load average {load[0]:.2f} on {data['cpus']} cores" if load else "")
             + "):", "",
             "| path (topk_indices, forced to an implementation that returns at once) | us per call | overhead |"
             + (" baseline us per call |" if before else ""),
             "|---|---|---|" + ("---|" if before else "")]
    for name, key, extra in rows:
        lines.append(f"| {name} | {per_call[key]:.2f} | {'-' if extra is None else f'{overhead[extra]:.2f}'} |"
                     + (f" {before[key]:.2f} |" if before else ""))
    lines.append(f"\nGoal: the public op's overhead at or below {data['target_us']:.0f} us.")
    return "\n".join(lines)


def q_lora_reuse() -> str:
    data = json.loads((RESULTS / "q_lora_reuse.json").read_text())
    lines = [f"`{data['command']}` ({data['gpu']}, torch {data['torch']}, {data['model']}):", "",
             "| B | without reuse us | with reuse us | saved us |", "|---|---|---|---|"]
    for row in data["rows"]:
        lines.append(f"| {row['batch']} | {row['without_reuse_us']:.1f} | {row['with_reuse_us']:.1f} | "
                     f"{row['saved_us']:.1f} |")
    return "\n".join(lines)


def _short(impl: str) -> str:
    return impl.split(".", 1)[1] if "." in impl else impl


def bench_h200() -> str:
    """The `dsa-indexer bench` run: the whole decode step per strategy, and the top-k against torch.topk."""
    data = json.loads((RESULTS / "bench_h200.json").read_text())
    ceil = data["ceilings"]
    lines = [f"`{data['command']}` ({data['device']}; copy {ceil.get('copy_GBps', 0):.0f} GB/s, fp8 GEMM "
             f"{ceil.get('fp8_matmul_TFLOPs', 0):.0f} TFLOP/s measured in the run). Plots: "
             "`docs/img/bench_*.png` (`dsa-indexer bench --from-json benchmarks/results/bench_h200.json --plots "
             "docs/img`).", "",
             "| B x context | single stream us | dual stream us | single + q_lora reuse us | dual + q_lora reuse us | "
             "lightning_indexer (fused paged logits + top-k) us |", "|---|---|---|---|---|---|"]
    steps: dict = {}
    fused: dict = {}
    for row in data["rows"]:
        key = (row["shape"].get("batch"), row["shape"].get("context"))
        if row["op"] == "indexer_pipeline":
            steps.setdefault(key, {})[row["implementation"]] = row["time_us"]
        elif row["op"] == "lightning_indexer" and row["implementation"] == "lightning_indexer.cuda.deepgemm_radix":
            fused[key] = row["time_us"]
    for key in sorted(steps):
        cells = [steps[key].get(name) for name in ("single_stream", "dual_stream", "single_stream+q_lora_reuse",
                                                   "dual_stream+q_lora_reuse")]
        text = " | ".join("-" if c is None else f"{c:.1f}" for c in cells + [fused.get(key)])
        lines.append(f"| {key[0]} x {key[1]} | {text} |")
    lines += ["", "| top-k: B x context | best implementation | us | torch.topk us | speedup |", "|---|---|---|---|---|"]
    topk: dict = {}
    for row in data["rows"]:
        if row["suite"] == "topk":
            topk.setdefault((row["shape"].get("batch"), row["shape"].get("context")), {})[row["implementation"]] = \
                row["time_us"]
    for key in sorted(topk):
        impls = topk[key]
        base = impls.get("torch.topk (baseline)")
        best = min((t, i) for i, t in impls.items() if i != "torch.topk (baseline)" and "reference" not in i)
        lines.append(f"| {key[0]} x {key[1]} | `{_short(best[1])}` | {best[0]:.1f} | {base:.1f} | {base / best[0]:.2f}x |")
    return "\n".join(lines)


def prefill_layer() -> str:
    data = json.loads((RESULTS / "prefill_layer_h200.json").read_text())
    lines = [f"`{data['command']}` ({data['device']}, torch {data['torch']}):", "",
             "| T | chunks | plan ms (first / cached) | layer ms: composed / fused | peak GiB: composed / fused "
             "(budget 2 + output) | scoring ms: logits alone / composed / fused | scoring / logits: composed / "
             "fused |", "|---|---|---|---|---|---|---|"]
    comp, fused = "ragged_mqa_topk.generic.composed", "ragged_mqa_topk.triton.fused_topk"
    for run in data["runs"]:
        scoring = run["scoring_ms"]
        if isinstance(scoring, dict):
            score = (f"{scoring['ragged_mqa_logits alone']:.1f} / {scoring[comp]:.1f} / {scoring[fused]:.1f}",
                     f"{run['scoring_over_logits'][comp]:.2f} / {run['scoring_over_logits'][fused]:.2f}")
        else:
            score = ("not measured (q of every row at once)", "-")
        lines.append(f"| {run['tokens']} | {run['chunks']} | {run['plan_ms']:.2f} / {run['plan_cached_ms']:.3f} | "
                     f"{run['layer_ms'][comp]:.1f} / {run['layer_ms'][fused]:.1f} | "
                     f"{run['layer_peak_GiB'][comp]:.2f} / {run['layer_peak_GiB'][fused]:.2f} "
                     f"(2 + {run['output_GiB']:.2f}) | {score[0]} | {score[1]} |")
    return "\n".join(lines)


RENDERERS = {"dispatch_overhead": dispatch_overhead, "q_lora_reuse": q_lora_reuse, "bench_h200": bench_h200,
             "prefill_layer": prefill_layer}
# A block's old content never crosses into the next block (an empty block must not swallow the text after it).
BLOCK = re.compile(r"(<!-- generated: (\w+) -->)\n(?:((?:(?!<!-- generated: ).)*?)\n)?(<!-- end generated -->)", re.S)


def render(text: str) -> str:
    return BLOCK.sub(lambda m: f"{m.group(1)}\n{RENDERERS[m.group(2)]()}\n{m.group(4)}", text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/performance.md is not up to date")
    args = parser.parse_args()
    text = DOC.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print("docs/performance.md differs from its JSON: run benchmarks/render_performance_tables.py")
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
