"""Render the tables of docs/performance.md from the committed JSON, so the doc cannot drift from its data.

    python benchmarks/render_performance_tables.py          # rewrite the generated blocks in place
    python benchmarks/render_performance_tables.py --check  # exit 1 if the doc differs (tests/test_readme.py)

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
    rows = [("the implementation called directly", per_call["direct implementation call"], None),
            ("`Registry.call` (cache lookup + call)", per_call["registry.call (lookup + call)"],
             overhead["registry lookup"]),
            ("op body: target + problem + lookup (what the custom op runs)",
             per_call["op body (target + problem + lookup)"], overhead["dispatch (target+problem+lookup)"]),
            ("public op: argument validation + dispatch, CPU tensors", per_call["public op (validation + dispatch)"],
             overhead["public op incl. validation"])]
    lines = [f"`{data['command']}` ({data['op']}; Python {data['python']}, torch {data['torch']}, "
             f"{data['threads']} thread):", "",
             "| path (topk_indices, forced to an implementation that returns at once) | us per call | overhead |",
             "|---|---|---|"]
    for name, us, extra in rows:
        lines.append(f"| {name} | {us:.2f} | {'-' if extra is None else f'{extra:.2f}'} |")
    lines.append(f"\nGoal: the op body's overhead below {data['target_us']:.0f} us.")
    return "\n".join(lines)


def q_lora_reuse() -> str:
    data = json.loads((RESULTS / "q_lora_reuse.json").read_text())
    lines = [f"`{data['command']}` ({data['gpu']}, torch {data['torch']}, {data['model']}):", "",
             "| B | without reuse us | with reuse us | saved us |", "|---|---|---|---|"]
    for row in data["rows"]:
        lines.append(f"| {row['batch']} | {row['without_reuse_us']:.1f} | {row['with_reuse_us']:.1f} | "
                     f"{row['saved_us']:.1f} |")
    return "\n".join(lines)


RENDERERS = {"dispatch_overhead": dispatch_overhead, "q_lora_reuse": q_lora_reuse}
BLOCK = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(\n<!-- end generated -->)", re.S)


def render(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + RENDERERS[m.group(2)]() + m.group(4), text)


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
