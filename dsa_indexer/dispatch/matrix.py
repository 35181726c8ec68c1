"""The arch matrix: every op on every arch, what resolution picks there and how far that pick was checked.

`build_matrix` resolves each (op, arch) cell with the registry, in a simulated environment (by default every fact
a registration requires assumed present: the vendor libraries as if installed), for the op's default problem. A
cell is ``native`` (an implementation of that arch runs), ``fallback`` (the pure-torch reference on an
accelerator) or ``refused`` (nothing can run); candidates that serve the arch but said no are listed with their
reasons; the chosen implementation's `Verified` record for the arch says how that cell was verified.
`dsa-indexer matrix` prints it as text, JSON (`SCHEMA`) or Markdown (docs/matrix.md is that output).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from .environment import Environment
from .problem import Problem
from .registry import Registry, Resolution
from .target import Target
from .verification import LEVELS, Level, Verified

SCHEMA = "dsa-indexer-matrix/1"
NATIVE, FALLBACK, REFUSED = "native", "fallback", "refused"
STATUSES = (NATIVE, FALLBACK, REFUSED)
REGENERATE = "dsa-indexer matrix --markdown > docs/matrix.md"


@dataclass(frozen=True)
class Cell:
    op: str
    target: Target
    resolution: Resolution
    status: str
    reason: str  # why it is a fallback or refused; "" for a native cell
    refusals: tuple[tuple[str, str], ...]  # (impl_id, reason) of each candidate that serves the arch and said no
    verification: Verified | None  # the chosen implementation's evidence on this arch; None when refused

    @property
    def chosen(self) -> str | None:
        return self.resolution.chosen.impl_id if self.resolution.chosen else None

    def to_dict(self) -> dict:
        return {"op": self.op, "arch": str(self.target), "vendor": self.target.vendor, "status": self.status,
                "chosen": self.chosen, "reason": self.reason,
                "refused": [{"impl": impl, "reason": why} for impl, why in self.refusals],
                "verification": self.verification.to_dict() if self.verification else None}


@dataclass(frozen=True)
class Matrix:
    ops: tuple[str, ...]
    targets: tuple[Target, ...]
    environment: Environment
    assumed: Mapping[str, bool]
    cells: tuple[Cell, ...]
    forced: Mapping[str, str]  # Registry.force / DSA_INDEXER_FORCE entries, which resolution honours here too

    def cell(self, op: str, arch: str) -> Cell:
        for cell in self.cells:
            if cell.op == op and str(cell.target) == arch:
                return cell
        raise KeyError(f"no cell for op {op!r} on {arch!r}")

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "environment": self.environment.name, "assumed": dict(self.assumed),
                "forced": dict(self.forced),
                "archs": [str(t) for t in self.targets], "ops": list(self.ops),
                "statuses": list(STATUSES), "levels": [level.value for level in LEVELS],
                "cells": [cell.to_dict() for cell in self.cells]}


def _cell(op: str, target: Target, res: Resolution) -> Cell:
    refusals = tuple((c.impl.impl_id, c.reason) for c in res.candidates if c.impl.serves(target) and not c.accepted)
    if res.chosen is None:
        reason = "; ".join(f"{impl}: {why}" for impl, why in refusals) or f"no implementation serves {target}"
        return Cell(op, target, res, REFUSED, reason, refusals, None)
    status, reason = (FALLBACK, res.fallback_reasons()) if res.is_fallback else (NATIVE, "")
    return Cell(op, target, res, status, reason, refusals, res.chosen.verification(target))


def build_matrix(registry: Registry, targets: Sequence[Target], problem_for: Callable[[str, Target], Problem],
                 assumed: Mapping[str, bool]) -> Matrix:
    """Resolve every op of ``registry`` on every target, with the facts ``assumed`` (fact -> present) and no others."""
    environment = Environment.simulated(**assumed)
    ops = tuple(registry.ops())
    cells = tuple(_cell(op, target, registry.resolve(op, target, problem_for(op, target), environment=environment))
                  for target in targets for op in ops)
    return Matrix(ops, tuple(targets), environment, dict(assumed), cells, registry.forced())


# --- rendering -------------------------------------------------------------------------------------------------------
LEVEL_MARKS = {Level.HARDWARE: "HW", Level.INTERPRETER: "interp", Level.VENDOR_SCHEMA: "schema",
               Level.DOUBLE: "double", Level.READ: "read"}
_LEGEND = {Level.HARDWARE: "ran on hardware of that arch (the commit that recorded the run, its date)",
           Level.INTERPRETER: "the kernel's source ran in Triton's CPU interpreter (CI), on no device of that arch",
           Level.VENDOR_SCHEMA: "called through operators registered under the vendor's published schemas (CI)",
           Level.DOUBLE: "called against a test double of the vendor library (CI)",
           Level.READ: "only read: nothing ran for that arch"}


def _short(cell: Cell) -> str:
    if cell.chosen is None:
        return "**refused**"
    variant = cell.chosen.split(".", 1)[1]
    mark = LEVEL_MARKS[cell.verification.level]
    return f"`{variant}` {mark}" + (" (fallback)" if cell.status == FALLBACK else "")


def _assumed_line(matrix: Matrix) -> str:
    present = sorted(f for f, yes in matrix.assumed.items() if yes)
    absent = sorted(f for f, yes in matrix.assumed.items() if not yes)
    return (f"assumed present: {', '.join(present) or '-'}; absent: {', '.join(absent) or 'every other fact'}")


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(matrix: Matrix) -> str:
    archs = [str(t) for t in matrix.targets]
    lines = ["# The arch matrix", "",
             f"Generated by `{REGENERATE}`; do not edit by hand (a test fails when this file is stale).", "",
             "Every op on every arch: the implementation resolution picks for the op's default problem (the V3.2 "
             "decode shape, `dsa-indexer explain`'s defaults), with the vendor libraries assumed installed, and how "
             "that pick was verified on that arch. The levels are data in the registrations "
             "(`verified=` records, `dsa_indexer/dispatch/verification.py`).", "",
             f"Environment: {_assumed_line(matrix)}.", ""]
    if matrix.forced:
        lines += [f"Forced: {', '.join(f'{op}={impl}' for op, impl in sorted(matrix.forced.items()))}.", ""]
    lines += ["Levels, strongest first:", ""]
    lines += [f"- {LEVEL_MARKS[level]} (`{level.value}`): {_LEGEND[level]}" for level in LEVELS]
    lines += ["", "A cell reads `<vendor>.<variant> <level>`; (fallback): the pure-torch reference on an accelerator; "
              "**refused**: nothing can run.", "",
              "| op | " + " | ".join(archs) + " |", "|---|" + "---|" * len(archs)]
    for op in matrix.ops:
        lines.append(f"| {op} | " + " | ".join(_short(matrix.cell(op, arch)) for arch in archs) + " |")
    for target in matrix.targets:
        lines += ["", f"## {target} ({target.vendor})", "", "| op | chosen | status | verified | refused here |",
                  "|---|---|---|---|---|"]
        for op in matrix.ops:
            cell = matrix.cell(op, str(target))
            verified = cell.verification.describe() if cell.verification else "-"
            refused = "<br>".join(f"`{impl}`: {_md(why)}" for impl, why in cell.refusals) or "-"
            # A reason the refusals column does not already give (no candidate of the arch at all, say).
            status = f"{cell.status}: {_md(cell.reason)}" if cell.reason and not cell.refusals else cell.status
            lines.append(f"| {op} | `{cell.chosen or '-'}` | {status} | {_md(verified)} | {refused} |")
    return "\n".join(lines) + "\n"


def to_text(matrix: Matrix) -> str:
    lines = [f"environment: {_assumed_line(matrix)}"]
    if matrix.forced:
        lines.append(f"forced: {', '.join(f'{op}={impl}' for op, impl in sorted(matrix.forced.items()))}")
    width = max(len(op) for op in matrix.ops)
    for target in matrix.targets:
        lines += ["", f"{target} ({target.vendor}):"]
        for op in matrix.ops:
            cell = matrix.cell(op, str(target))
            verified = cell.verification.describe() if cell.verification else "-"
            lines.append(f"  {op:<{width}} -> {cell.chosen or 'NONE'} [{cell.status}] {verified}")
            for impl, why in cell.refusals:
                lines.append(f"  {'':<{width}}    refused: {impl}: {why}")
    return "\n".join(lines)
