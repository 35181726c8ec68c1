"""The README's two set-up commands are the ones CI runs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setup_commands():
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.strip().splitlines() if line.strip()]


def test_readme_starts_with_exactly_two_setup_commands():
    commands = _setup_commands()
    assert len(commands) == 2
    assert commands[0].endswith("dsa-indexer run")
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert _setup_commands()[1] in ci


def test_the_v4_guide_example_runs():
    """docs/v4.md's example is complete: run it as written (CPU here, the GPU where present)."""
    text = (ROOT / "docs" / "v4.md").read_text()
    code = text.split("```python", 1)[1].split("```", 1)[0]
    exec(compile(code, "docs/v4.md", "exec"), {})
