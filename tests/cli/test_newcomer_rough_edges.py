"""The rough edges a newcomer hit (issue 39, item 4), each pinned: the words `explain` prints, the README's shell
examples, `bench --suite ops`'s help, the bandwidth plot's axis and what troubleshooting.md says
`DSA_INDEXER_PLUGINS` does."""

import re
import shlex
from pathlib import Path

import pytest

from dsa_indexer.cli import main, matrix_registry, matrix_targets
from dsa_indexer.dispatch.plugins import default_registry

ROOT = Path(__file__).resolve().parents[2]
# A word said twice in a row ("width width <= 16384"), any case ("k K a multiple"); "64, 64" is not a word.
DOUBLED = re.compile(r"\b([A-Za-z_]\w*)\s+\1\b", re.IGNORECASE)
# A plural subject with a singular verb ("the Triton logits kernels takes fp8").
PLURAL_TAKES = re.compile(r"\bkernels takes\b")


# Facts outside most declarations, so that the rejections' reasons print too (each op takes the ones it knows).
ODD_FACTS = {"heads": 16, "next_n": 2, "width": 20000, "dim": 64, "k": 100, "n": 100, "keys": "fp4",
             "group_size": 16}


def _explain(capsys, op, *args) -> str:
    assert main(["explain", op, *args]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def _wording_faults(text: str) -> list[str]:
    return sorted({m.group(0) + " | " + line.strip()[:160] for line in text.splitlines()
                   for m in [*DOUBLED.finditer(line), *PLURAL_TAKES.finditer(line)]})


def test_explain_says_no_word_twice_for_any_op_on_any_arch(capsys):
    """Every op on every arch, with the vendor libraries assumed (the native choices print their `takes:` line)
    and with none, at the default problem and at one outside most declarations (so the rejections' reasons print)."""
    from dsa_indexer import ops

    registry = matrix_registry(False)
    facts = sorted(registry.required_facts())
    out = []
    for target in matrix_targets(False):
        for assume in ([f"{fact}=yes" for fact in facts], []):
            args = ["--target", str(target), "--assume", *assume] if assume else ["--target", str(target)]
            out.append(_explain(capsys, "all", *args))
            for op in registry.ops():
                odd = [f"{key}={value}" for key, value in ODD_FACTS.items() if key in ops.PROBLEM_KEYS.get(op, ())]
                if odd:
                    out.append(_explain(capsys, op, *args, "--problem", *odd))
    text = "\n".join(out)
    assert "takes: " in text and "heads=16: " in text  # both kinds of text were printed, and are scanned
    assert _wording_faults(text) == []


def test_every_declared_capability_reads_without_a_doubled_word():
    """The `takes:` line of every implementation that declares capabilities, chosen or not (explain prints only
    the chosen one's), rendered as explain renders it; and every owner reads as a singular subject of "takes"."""
    lines = []
    for op in default_registry().ops():
        for impl in default_registry().implementations(op):
            if impl.capabilities is not None:
                lines.append(f"{impl.impl_id} takes: " + impl.capabilities.takes_text())
                lines.append(f"{impl.capabilities.owner} takes")
    assert len(lines) > 20
    assert _wording_faults("\n".join(lines)) == []


def test_the_doubled_word_scan_catches_the_old_wording():
    """The scan itself: the three phrases of the issue are found, a repeated number is not."""
    old = ("takes: next_n next_n 1 (it derives ...)\nwidth width <= 16384\nkeys=fp4: the Triton logits kernels takes "
           "fp8\nk K a multiple of 128")
    assert len(_wording_faults(old)) == 4
    assert _wording_faults("heads 32, 64 or 128, group_size 32, 32\nop x, problem (dim=128)") == []
