"""`dsa-indexer matrix`: every op x every arch, the implementation chosen there as the registry resolves it, native /
fallback / refused with the reasons, how each cell was verified (data in the registrations), the JSON schema, and
docs/matrix.md kept equal to the --markdown output."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from dsa_indexer.cli import _problem_for, build_arch_matrix, main, matrix_registry
from dsa_indexer.dispatch import Environment, Registry, parse_target
from dsa_indexer.dispatch.matrix import FALLBACK, NATIVE, REFUSED, REGENERATE, SCHEMA, build_matrix, to_markdown
from dsa_indexer.dispatch.registry import Implementation
from dsa_indexer.dispatch.verification import LEVELS, Level, Verified, ran_on

ROOT = Path(__file__).parents[2]
ISSUE_ARCHS = {"sm90", "sm100", "gfx942", "gfx950", "gfx1250", "npu", "cpu"}  # issue 39's list; sm120 comes too


@pytest.fixture(scope="module")
def matrix():
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("DSA_INDEXER_FORCE", raising=False)  # a user's forced entries would show in the cells
        return build_arch_matrix()


@pytest.fixture(autouse=True)
def _no_forced(monkeypatch):
    monkeypatch.delenv("DSA_INDEXER_FORCE", raising=False)


def test_every_op_on_every_arch_has_exactly_one_cell(matrix):
    archs = {str(t) for t in matrix.targets}
    assert ISSUE_ARCHS <= archs
    ops = set(matrix_registry(False).ops())
    cells = [(cell.op, str(cell.target)) for cell in matrix.cells]
    assert len(cells) == len(set(cells)) == len(ops) * len(archs)
    assert set(cells) == {(op, arch) for op in ops for arch in archs}


def test_each_cell_is_what_the_registry_resolves_in_that_simulated_environment(matrix):
    # A registry of its own and the environment rebuilt from the facts: the matrix must not pick by another path.
    registry = matrix_registry(False)
    env = Environment.simulated(**{fact: True for fact in registry.required_facts()})
    for cell in matrix.cells:
        res = registry.resolve(cell.op, cell.target, _problem_for(cell.op, cell.target, {}), environment=env)
        assert res.chosen is not None and cell.chosen == res.chosen.impl_id, (cell.op, str(cell.target))
        assert cell.status == (FALLBACK if res.is_fallback else NATIVE)


@pytest.mark.parametrize("op, arch, chosen", [
    # Written by hand from the registrations' priorities and docs/backends*.md, with every library assumed.
    ("topk_indices", "sm90", "topk_indices.cuda.radix"),
    ("topk_indices", "gfx950", "topk_indices.rocm.aiter_stable"),
    ("topk_indices", "gfx1250", "topk_indices.triton.topk"),
    ("paged_mqa_logits", "sm100", "paged_mqa_logits.cuda.deepgemm"),
    ("gemm_fp8_blockscale", "gfx1250", "gemm_fp8_blockscale.triton.gemm"),
    ("rmsnorm_quant_fp8", "gfx942", "rmsnorm_quant_fp8.triton.quant"),
    ("lightning_indexer_ragged", "npu", "lightning_indexer_ragged.npu.torch_npu"),
    ("indexer_pipeline", "npu", "indexer_pipeline.npu.two_stream"),
    ("indexer_pipeline", "sm120", "indexer_pipeline.cuda.dual_stream"),
    ("q_prologue", "npu", "q_prologue.reference.torch"),
    ("x_projections", "gfx942", "x_projections.generic.torch"),
])
def test_chosen_implementations_match_the_design(matrix, op, arch, chosen):
    assert matrix.cell(op, arch).chosen == chosen


def test_statuses_native_on_the_cpu_fallback_for_the_reference_on_accelerators(matrix):
    for cell in matrix.cells:
        reference = cell.chosen.split(".")[1] == "reference"
        if str(cell.target) == "cpu" or not reference:
            assert cell.status == NATIVE and cell.reason == "", (cell.op, str(cell.target))
        else:
            assert cell.status == FALLBACK and cell.reason, (cell.op, str(cell.target))
    assert matrix.cell("q_prologue", "npu").reason == "no accelerated implementation serves target npu"


def test_refusals_carry_their_reasons(matrix):
    gemm = dict(matrix.cell("gemm_fp8_blockscale", "gfx1250").refusals)
    assert "not verified there" in gemm["gemm_fp8_blockscale.rocm.aiter"]
    quant = dict(matrix.cell("rmsnorm_quant_fp8", "gfx942").refusals)
    assert "fnuz" in quant["rmsnorm_quant_fp8.rocm.aiter"]
    # Without DeepGEMM, its candidates are refused naming the missing library, and Triton serves.
    without = build_arch_matrix([("gpu", True), ("triton", True)])
    cell = without.cell("paged_mqa_logits", "sm90")
    assert cell.chosen == "paged_mqa_logits.triton.logits"
    assert "deep_gemm" in dict(cell.refusals)["paged_mqa_logits.cuda.deepgemm"]
    assert all(why for _, why in cell.refusals)


def test_a_cell_no_implementation_serves_is_refused_with_the_reason():
    registry = Registry(environment=Environment.simulated())
    registry.register(Implementation("topk_indices", "topk_indices.acme.only", ("sm90",), 10, lambda: print,
                                     requires=("gpu",)))
    targets = (parse_target("sm90"), parse_target("gfx942"))
    result = build_matrix(registry, targets, lambda op, target: _problem_for(op, target, {}), {"gpu": False})
    for arch, why in (("sm90", "'gpu' is absent"), ("gfx942", "no implementation serves gfx942")):
        cell = result.cell("topk_indices", arch)
        assert cell.status == REFUSED and cell.chosen is None and cell.verification is None
        assert why in cell.reason, cell.reason


def test_the_level_is_the_registrations_data_and_read_where_none_is_recorded():
    registry = Registry(environment=Environment.simulated())
    record = Verified(Level.INTERPRETER, ("gfx942",), "tests/somewhere.py")
    registry.register(Implementation("topk_indices", "topk_indices.acme.kernel", ("rocm",), 10, lambda: print,
                                     verified=(record,)))
    targets = (parse_target("gfx942"), parse_target("gfx950"))
    result = build_matrix(registry, targets, lambda op, target: _problem_for(op, target, {}), {})
    assert result.cell("topk_indices", "gfx942").verification is record
    assert result.cell("topk_indices", "gfx950").verification.level is Level.READ


def test_hardware_cells_name_commit_and_date_and_every_cell_has_a_level(matrix):
    for cell in matrix.cells:
        verified = cell.verification
        assert verified.level in LEVELS
        if verified.level is Level.HARDWARE:
            assert verified.every_commit or (re.fullmatch(r"[0-9a-f]{7,40}", verified.commit)
                                             and re.fullmatch(r"\d{4}-\d{2}-\d{2}", verified.date))
    # No AMD or Ascend device was ever available: no cell of theirs may claim hardware.
    assert not [c for c in matrix.cells
                if c.target.vendor in ("rocm", "npu") and c.verification.level is Level.HARDWARE]
    assert matrix.cell("topk_indices", "sm90").verification.level is Level.HARDWARE
    assert matrix.cell("lightning_indexer_ragged", "npu").verification.level is Level.VENDOR_SCHEMA
    assert matrix.cell("topk_indices", "sm100").verification.level is Level.READ


@pytest.mark.parametrize("kwargs, says", [
    (dict(level=Level.HARDWARE, commit=None, date=None), "names the commit"),
    (dict(level=Level.HARDWARE, commit="xyz", date="2026-12-01"), "git hash"),
    (dict(level=Level.HARDWARE, commit="abcdef1", date="1 Dec"), "YYYY-MM-DD"),
    (dict(level=Level.DOUBLE, commit="abcdef1", date="2026-12-01"), "belong to hardware runs"),
])
def test_a_record_that_claims_too_little_or_the_wrong_thing_is_refused(kwargs, says):
    with pytest.raises(ValueError, match=says):
        Verified(archs=("sm90",), evidence="tests/x.py", **kwargs)
    with pytest.raises(TypeError, match="Verified records"):
        Implementation("topk_indices", "topk_indices.acme.x", ("sm90",), 1, lambda: print, verified=("hardware",))


def _all_records():
    registry = matrix_registry(False)
    return [(impl.impl_id, record) for op in registry.ops() for impl in registry.implementations(op)
            for record in impl.verified]


def test_every_file_named_as_evidence_exists():
    missing = []
    for impl_id, record in _all_records():
        folder = ""
        for name in re.findall(r"[\w./-]+\.(?:py|json)", record.evidence):
            if "/" in name:
                folder = name.rsplit("/", 1)[0]
            path = name if "/" in name else f"{folder}/{name}"
            if not (ROOT / path).is_file():
                missing.append(f"{impl_id}: {path}")
    assert not missing, missing


def test_every_hardware_commit_is_in_the_history():
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"], capture_output=True,
                         text=True)
    if git.returncode != 0 or git.stdout.strip() != "false":
        pytest.skip("needs the git history (the CI workflow checks out with fetch-depth: 0)")
    unknown = [f"{impl_id}: {record.commit}" for impl_id, record in _all_records()
               if record.commit and subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e",
                                                    f"{record.commit}^{{commit}}"]).returncode != 0]
    assert not unknown, unknown


def test_json_schema(capsys):
    assert main(["matrix", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["schema"] == SCHEMA
    assert set(report) >= {"dsa_indexer", "environment", "assumed", "forced", "archs", "ops", "statuses", "levels",
                           "cells"}
    assert report["levels"] == ["hardware", "interpreter", "vendor-schema", "double", "read"]
    assert all(report["assumed"].values()) and {"gpu", "triton", "deep_gemm", "aiter", "torch_npu"} <= set(
        report["assumed"])
    assert len(report["cells"]) == len(report["ops"]) * len(report["archs"])
    for cell in report["cells"]:
        assert set(cell) == {"op", "arch", "vendor", "status", "chosen", "reason", "refused", "verification"}
        assert cell["op"] in report["ops"] and cell["arch"] in report["archs"]
        assert cell["status"] in report["statuses"] and isinstance(cell["chosen"], str)
        assert all(set(r) == {"impl", "reason"} and r["reason"] for r in cell["refused"])
        verification = cell["verification"]
        assert set(verification) == {"level", "archs", "evidence", "commit", "date", "every_commit"}
        assert verification["level"] in report["levels"] and verification["evidence"]


def test_text_and_markdown_outputs_name_every_arch(capsys):
    assert main(["matrix"]) == 0
    text = capsys.readouterr().out
    assert "sm90 (cuda):" in text and "npu (npu):" in text and "refused: gemm_fp8_blockscale.rocm.aiter" in text
    assert main(["matrix", "--markdown"]) == 0
    markdown = capsys.readouterr().out
    assert markdown.startswith("# The arch matrix") and "## gfx1250 (rocm)" in markdown


def test_unknown_assumed_fact_is_a_usage_error(capsys):
    assert main(["matrix", "--assume", "deepgem=yes"]) == 2
    assert "unknown fact 'deepgem'" in capsys.readouterr().err


def test_docs_matrix_md_is_the_generated_output(matrix):
    """docs/matrix.md must be regenerated whenever a registration, a priority or a verification record changes."""
    current = (ROOT / "docs" / "matrix.md").read_text()
    assert current == to_markdown(matrix), f"docs/matrix.md is stale: regenerate it with `{REGENERATE}`"


def test_a_hardware_run_record_reads_with_its_commit():
    record = ran_on("sm90", "abcdef1", "2026-12-01", "tests/gpu/x.py")
    assert record.describe() == "hardware (abcdef1, 2026-12-01): tests/gpu/x.py"
