"""The bench report: its rows, the table, the JSON (and reading a saved one back), and the suite constants."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from typing import Sequence

from .. import ops


SUITES = ("decode", "topk", "prefill", "ops")
GPU_BATCHES, GPU_CONTEXTS = (1, 32, 64, 128), (8192, 32768, 131072)  # the top-k issue's grid
CPU_BATCHES, CPU_CONTEXTS = (1, 4), (1024, 4096)
GPU_PREFILL = ((4096, 4096), (2048, 32768))
CPU_PREFILL = ((128, 1024),)
HEADS, DIM, TOPK = 64, 128, 2048
PIPELINE = ops.PIPELINE_OP  # one spelling: contract/specs.py
SINGLE_STREAM = f"{PIPELINE}.generic.single_stream"
REUSE = "+q_lora_reuse"
TORCH_TOPK = "torch.topk (baseline)"
PROGRESS_STYLES = ("auto", "rich", "tqdm", "plain", "none")
# On an accelerator the pure-torch reference takes seconds per call (and GBs of temporaries) at large sizes: above
# these it is skipped (listed in ``skipped``). Decode / top-k: B * context tokens; prefill: queries * keys.
REFERENCE_MAX_TOKENS, REFERENCE_MAX_PAIRS = 1 << 20, 1 << 24
CPU_NOTE = ("CPU run at small sizes with the implementations the CPU target accepts: these are CPU numbers, not GPU "
            "numbers")


@dataclass
class Row:
    suite: str
    op: str
    implementation: str
    shape: dict
    time_us: float
    throughput: float
    unit: str
    fraction_of_ceiling: float | None
    details: dict = field(default_factory=dict)
    # min, p10, median, p90, max (us) and count of the samples behind time_us; None in reports saved before it
    spread: dict | None = None


@dataclass
class BenchReport:
    device: str
    target: str
    note: str
    ceilings: dict
    rows: list[Row] = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    skipped_for_time: list[str] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)  # measurements that raised: recorded, the rest still run
    skipped: list[dict] = field(default_factory=list)  # implementations left out on purpose, with the reason
    # Per ceiling: the spread of its samples (as rates) and ``unstable`` when they vary UNSTABLE_RATIO-fold or more.
    ceiling_spread: dict = field(default_factory=dict)

    def unstable_ceilings(self) -> list[str]:
        return [name for name, spread in self.ceiling_spread.items() if spread.get("unstable")]

    def warnings(self) -> list[str]:
        out = []
        for name in self.unstable_ceilings():
            spread = self.ceiling_spread[name]
            out.append(f"ceiling {name} varied {spread['max_over_min']:.1f}x between its {spread['count']} samples "
                       f"(min {format_number(spread['min'])}, max {format_number(spread['max'])}): the fractions of "
                       "it are unreliable (a busy or throttled machine); re-run on an idle machine or with more "
                       "--repeats")
        return out

    def as_dict(self) -> dict:
        return {"device": self.device, "target": self.target, "note": self.note, "settings": self.settings,
                "ceilings": self.ceilings, "ceiling_spread": self.ceiling_spread, "warnings": self.warnings(),
                "rows": [asdict(r) for r in self.rows],
                "skipped_for_time": self.skipped_for_time, "skipped": self.skipped, "errors": self.errors}


def report_from_json(data: dict) -> BenchReport:
    """A saved report (``--json``) back as a `BenchReport`: its table and plots render again without measuring
    (a GPU machine without matplotlib saves the JSON; the plots are drawn elsewhere). Reports saved before the
    spread was recorded read too: their rows have ``spread`` None (the table prints ``-``)."""
    try:
        rows = [Row(**row) for row in data["rows"]]
        return BenchReport(device=data["device"], target=data["target"], note=data.get("note", ""),
                           ceilings=data.get("ceilings", {}), rows=rows, settings=data.get("settings", {}),
                           skipped_for_time=data.get("skipped_for_time", []), errors=data.get("errors", []),
                           skipped=data.get("skipped", []), ceiling_spread=data.get("ceiling_spread", {}))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a dsa-indexer bench report ({type(exc).__name__}: {exc})") from None


# --- output --------------------------------------------------------------------------------------------------------
def format_number(value: float | None) -> str:
    """Three significant digits (no more than one decimal place from 100 up): a CPU's 0.004 TFLOP/s prints as
    0.004, never as 0.0."""
    if value is None:
        return "-"
    size = abs(value)
    if size == 0 or size >= 100:
        return f"{value:.0f}"
    if size >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}" if size < 1 else f"{value:.2f}"


def ceiling_of(report: BenchReport, unit: str) -> str | None:
    """The ceiling a row of ``unit`` is judged against: copy bandwidth for GB/s, the matmul rate for TFLOP/s."""
    if unit == "GB/s":
        return "copy_GBps"
    if unit == "TFLOP/s":
        return next((name for name in ("fp8_matmul_TFLOPs", "fp32_matmul_TFLOPs") if report.ceilings.get(name)),
                    None)
    return None


def _ceiling_text(report: BenchReport, name: str, value) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return f"{name} {value}"
    spread = report.ceiling_spread.get(name) or {}
    if not spread.get("count"):
        return f"{name} {format_number(value)}"
    text = (f"{name} {format_number(value)} (min {format_number(spread['min'])}, max {format_number(spread['max'])},"
            f" n={spread['count']})")
    return text + (" UNSTABLE" if spread.get("unstable") else "")


def format_table(report: BenchReport) -> str:
    """The report as text: ceilings with their spread, then one row per measurement with the median time and the
    spread of its samples (min, p10-p90, count; ``-`` for reports saved before the spread was recorded), the
    throughput and the fraction of its ceiling (``*``: that ceiling is flagged unstable)."""
    unstable = set(report.unstable_ceilings())
    lines = [f"dsa-indexer bench on {report.device} (target {report.target})" +
             (f"\nnote: {report.note}" if report.note else ""),
             *([f"plugins failed: {'; '.join(report.settings['plugins_failed'])}"]
               if report.settings.get("plugins_failed") else []),
             "ceilings: " + ", ".join(_ceiling_text(report, k, v) for k, v in report.ceilings.items()),
             *(f"warning: {w}" for w in report.warnings()),
             f"{'suite':<8} {'op':<18} {'implementation':<40} {'shape':<24} {'median us':>10} {'min us':>9} "
             f"{'p10-p90 us':>17} {'n':>3} {'throughput':>16} {'of ceiling':>11}"]
    for r in report.rows:
        shape = " ".join(f"{k}={v}" for k, v in r.shape.items())
        frac = "-"
        if r.fraction_of_ceiling is not None:
            frac = f"{100 * r.fraction_of_ceiling:.3g}%" + ("*" if ceiling_of(report, r.unit) in unstable else "")
        spread = r.spread or {}
        low_high = (f"{format_number(spread['p10'])}-{format_number(spread['p90'])}" if spread else "-")
        lines.append(f"{r.suite:<8} {r.op:<18} {r.implementation:<40} {shape:<24} {format_number(r.time_us):>10} "
                     f"{format_number(spread.get('min')):>9} {low_high:>17} {spread.get('count', '-'):>3} "
                     f"{format_number(r.throughput):>10} {r.unit:<5} {frac:>11}")
    if any(ceiling_of(report, r.unit) in unstable and r.fraction_of_ceiling is not None for r in report.rows):
        lines.append("*: a fraction of an unstable ceiling (see the warning above)")
    if any(r.op == PIPELINE for r in report.rows):
        model = next(r.details.get("model") for r in report.rows if r.op == PIPELINE)
        lines.append(f"{PIPELINE}: one {model} indexer decode step per strategy; its floor is its weights + every "
                     f"context key once + its inputs and output; '{REUSE}': attention's fp8 q_lora handed in "
                     "(details.q_lora_quant in the JSON says whether it was reused)")
    if report.skipped_for_time:
        lines.append("skipped for time: " + ", ".join(report.skipped_for_time))
    for e in report.errors:
        shape = " ".join(f"{k}={v}" for k, v in e["shape"].items())
        lines.append(f"FAILED {e['op']} {e['implementation']} {shape}: {e['error']}")
    return "\n".join(lines)


def report_json(report: BenchReport, command: Sequence[str] | None = None) -> str:
    from ..versions import package_versions

    command = list(command) if command is not None else ["dsa-indexer", *sys.argv[1:]]
    return json.dumps({"command": " ".join(command), "versions": package_versions(), **report.as_dict()}, indent=2,
                      default=str)


def write_json(report: BenchReport, where: str, stream=None, command: Sequence[str] | None = None) -> None:
    """The report as JSON into the file ``where``, or onto ``stream`` (stdout) when ``where`` is ``-``."""
    text = report_json(report, command)
    if where == "-":
        print(text, file=stream or sys.stdout, flush=True)
    else:
        with open(where, "w") as handle:
            handle.write(text + "\n")
