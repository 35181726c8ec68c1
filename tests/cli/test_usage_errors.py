"""Issue 34 item 14: the CLI's usage errors exit 2 naming the option and what it takes, before any work."""

from __future__ import annotations

import pytest

from dsa_indexer.cli import main
from dsa_indexer.dispatch import parse_target


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        return exc.code


@pytest.mark.parametrize("argv, says", [
    (["--problem", "k=abc"], "argument --problem: k must be a positive integer, got 'abc'"),
    (["--problem", "k=-5"], "argument --problem: k must be a positive integer, got '-5'"),
    (["--problem", "k=0"], "argument --problem: k must be a positive integer, got '0'"),
    (["--problem", "heads=1.5"], "argument --problem: heads must be a positive integer, got '1.5'"),
    (["--problem", "slots=maybe"], "argument --problem: slots must be true or false, got 'maybe'"),
    (["--problem", "fp8=e4m3"], "argument --problem: fp8 must be one of fn, fnuz, got 'e4m3'"),
    (["--problem", "k"], "argument --problem: expected KEY=VALUE such as heads=32, got 'k'"),
    (["--problem", "k=4", "k=8"], "--problem names k twice (4 and 8); give each fact once"),
    (["--assume", "gpu=maybe"], "argument --assume: entries must read FACT=yes|no"),
    (["--target", "npu:banana"], "--target: unknown target 'npu:banana': expected"),
    (["--target", "gfx942:banana"], "--target: unknown target 'gfx942:banana': expected"),
])
def test_explain_usage_errors_exit_2_naming_the_option(capsys, argv, says):
    assert _exit_code(["explain", "topk_indices", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_the_target_error_says_which_soc_names_parse(capsys):
    assert _exit_code(["explain", "topk_indices", "--target", "npu:banana"]) == 2
    assert "'npu:<SoC>', the SoC as torch_npu names it: Ascend910B3" in capsys.readouterr().err
    for name in ("npu", "npu:Ascend910B3", "npu/Ascend910_9392", "npu:ascend310P3"):
        assert parse_target(name).vendor == "npu"
    assert parse_target("gfx942:sramecc+:xnack-").arch == "gfx942"


def test_run_refuses_a_forced_entry_for_an_op_it_never_reaches(monkeypatch, capsys):
    # q_prologue_plain never runs on the CPU's fp8 cache: the misspelled implementation would go unnoticed.
    monkeypatch.setenv("DSA_INDEXER_FORCE", "q_prologue_plain=q_prologue_plain.npu.torchnpu")
    assert main(["run", "--batch", "1", "--context", "128", "--steps", "1", "--prefill-tokens", "64",
                 "--no-verify"]) == 2
    captured = capsys.readouterr()
    assert ("dsa-indexer run: error: DSA_INDEXER_FORCE names 'q_prologue_plain.npu.torchnpu' for 'q_prologue_plain', "
            "which is not registered; registered: q_prologue_plain.npu.torch_npu, q_prologue_plain.reference.torch"
            ) in captured.err
    assert "decode" not in captured.out  # refused before any work


def test_bench_refuses_a_forced_op_that_does_not_exist(monkeypatch, capsys):
    monkeypatch.setenv("DSA_INDEXER_FORCE", "topk_indicse=topk_indices.reference.torch")
    assert main(["bench", "--suite", "topk", "--repeats", "1"]) == 2
    assert "DSA_INDEXER_FORCE names unknown op 'topk_indicse'" in capsys.readouterr().err
