"""The README's two set-up commands are the ones CI runs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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


def _python_blocks(path):
    text = path.read_text()
    return [block.split("```", 1)[0] for block in text.split("```python")[1:]]


def test_every_python_block_of_the_readme_and_docs_runs():
    """Each ```python block runs as written, top to bottom (a plugin block only defines its hook)."""
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    ran = 0
    for path in paths:
        for i, code in enumerate(_python_blocks(path)):
            exec(compile(code, f"{path.name} block {i + 1}", "exec"), {"__name__": f"doc_block_{i}"})
            ran += 1
    assert ran >= 3  # README's example and plugin, docs/v4.md's example


def test_the_troubleshooting_explain_example_is_what_explain_prints(capsys):
    """docs/troubleshooting.md quotes `dsa-indexer explain` verbatim: the command must still print exactly that."""
    from dsa_indexer.cli import main

    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    block = text.split("```\n$ ", 1)[1].split("```", 1)[0].strip().splitlines()
    command, expected = block[0].split(), block[1:]
    assert command[0] == "dsa-indexer" and main(command[1:]) == 0
    assert capsys.readouterr().out.strip().splitlines()[:len(expected)] == expected


def test_performance_tables_match_their_json():
    """The generated blocks of docs/performance.md are what benchmarks/render_performance_tables.py makes from the
    committed JSON (run it after committing new results)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "render_performance_tables.py"), "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
