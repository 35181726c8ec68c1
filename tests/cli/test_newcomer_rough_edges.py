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


# --- the README's shell examples and its API example ---------------------------------------------------------------
def _readme_section(title: str) -> str:
    return (ROOT / "README.md").read_text().split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def _shell_examples() -> list[tuple[dict, list[str]]]:
    """The runnable `dsa-indexer` lines of "Which implementation runs" (those ending in `...` are patterns): each as
    (environment variables set before it, its arguments)."""
    block = _readme_section("Which implementation runs, and why").split("```bash", 1)[1].split("```", 1)[0]
    commands = []
    for line in block.strip().splitlines():
        words = shlex.split(line, comments=True)
        if words[-1] == "...":
            continue
        env = {}
        while "=" in words[0]:
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        assert words[0] == "dsa-indexer", line
        commands.append((env, words[1:]))
    return commands


def _paged_logits_choice(args: list[str], out: str) -> str:
    """What the command chose for paged_mqa_logits, from its text or JSON output."""
    if "--json" in args:
        import json

        return next(r["chosen"] for r in json.loads(out)["resolutions"] if r["op"] == "paged_mqa_logits")
    if args[0] == "explain":
        return next(line.split("=> ", 1)[1] for line in out.splitlines() if line.strip().startswith("=> "))
    line = next(line for line in out.splitlines() if line.strip().startswith("paged_mqa_logits "))
    return line.split("->", 1)[1].strip()


def test_the_readme_shell_examples_run_and_the_simulated_ones_show_native_choices(monkeypatch, capsys):
    """On a CPU machine too: a simulated target with `--assume` shows that target's own implementations, where the
    probes alone would see no GPU and print the reference fallbacks."""
    from dsa_indexer.dispatch.target import TARGET_ENV

    commands = _shell_examples()
    assert len(commands) == 4 and sum("--assume" in args for _, args in commands) == 3
    for env, args in commands:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        default_registry().clear_cache()  # re-reads DSA_INDEXER_TARGET
        try:
            code = main(args)
        finally:
            for name in env:
                monkeypatch.delenv(name)
            default_registry().clear_cache()
        out = capsys.readouterr().out
        assert code == 0, (env, args)
        if "--target" in args or TARGET_ENV in env:
            assert "--assume" in args, args
            chosen = _paged_logits_choice(args, out)
            assert ".reference." not in chosen and "fallback" not in chosen, (args, chosen)


def test_the_readme_api_example_runs_on_a_simulated_gfx942(monkeypatch):
    """The API example as written, with DSA_INDEXER_TARGET=gfx942 (an MI300's e4m3fnuz fp8): `allocate_cache`
    gives the cache that target's indexer writes, and attention's fp8 q_lora copy is reused there too."""
    import torch

    from dsa_indexer.dispatch.target import detect_target

    code = _readme_section("The API, as a complete example").split("```python", 1)[1].split("```", 1)[0]
    assert "indexer.allocate_cache(" in code and "IndexKCache.allocate(" not in code
    monkeypatch.setenv("DSA_INDEXER_TARGET", "gfx942")
    default_registry().clear_cache()
    try:
        assert detect_target("cpu").fp8_dtype == torch.float8_e4m3fnuz
        scope = {"__name__": "readme_api_on_gfx942"}
        with pytest.warns(RuntimeWarning, match="falls back to the slow reference"):  # no MI300 here
            exec(compile(code, "README.md API example", "exec"), scope)
    finally:
        monkeypatch.delenv("DSA_INDEXER_TARGET")
        default_registry().clear_cache()
    assert scope["cache"].fp8_dtype == torch.float8_e4m3fnuz and str(scope["indexer"].target) == "gfx942"


# --- bench_floor.png ------------------------------------------------------------------------------------------------
def test_the_bandwidth_plot_starts_at_zero_even_for_a_single_point(tmp_path, monkeypatch):
    """One row (a CPU run of one size): matplotlib alone would span 0.00001% around it; the axis runs from 0 to
    just above the highest point, in every panel."""
    plt = pytest.importorskip("matplotlib.pyplot")
    from dsa_indexer import bench

    report = bench.BenchReport("cpu", "cpu", bench.CPU_NOTE, {"copy_GBps": 10.0})
    shape = {"batch": 1, "context": 1024}
    report.rows += [
        bench.Row("decode", "lightning_indexer", "lightning_indexer.reference.torch", shape, 100.0, 0.4, "GB/s",
                  0.04),
        bench.Row("topk", "topk_indices", "topk_indices.reference.torch", shape, 50.0, 0.2, "GB/s", 0.02),
        bench.Row("topk", "topk_indices", "torch.topk (baseline)", shape, 40.0, 0.25, "GB/s", 0.025)]
    figures = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (figures.append(fig), close(fig)))
    paths = bench.write_plots(report, tmp_path)
    floor = {Path(p).name: fig for p, fig in zip(paths, figures)}["bench_floor.png"]
    limits = {ax.get_title().split(":", 1)[0]: ax.get_ylim() for ax in floor.axes}
    assert limits == {"lightning_indexer": pytest.approx((0.0, 4.4)), "topk_indices": pytest.approx((0.0, 2.75))}


# --- DSA_INDEXER_PLUGINS --------------------------------------------------------------------------------------------
def test_troubleshooting_says_what_the_plugin_allow_list_does(monkeypatch):
    """The allow-list selects among the third-party entry points; the built-in backends load whatever it names."""
    from dsa_indexer.dispatch import discovery
    from dsa_indexer.dispatch.environment import Environment
    from dsa_indexer.dispatch.plugins import ENTRY_POINT_GROUP, load_plugins
    from dsa_indexer.dispatch.registry import Registry

    text = " ".join((ROOT / "docs" / "troubleshooting.md").read_text().split())
    assert "loads only those entry points" not in text
    assert ("`DSA_INDEXER_PLUGINS=a,b` selects which third-party entry points load (the built-in backends always "
            "load)") in text
    monkeypatch.setenv("DSA_INDEXER_PLUGINS", "example")
    registry = Registry(environment=Environment.simulated())
    load_plugins(registry)
    builtin = [entry.name for entry in discovery.builtin_entries(ENTRY_POINT_GROUP)]
    assert registry.plugins_loaded == [*builtin, "example"] and registry.plugins_failed == []
    monkeypatch.setenv("DSA_INDEXER_PLUGINS", "not_installed")
    registry = Registry(environment=Environment.simulated())
    load_plugins(registry)
    assert registry.plugins_loaded == builtin
    assert registry.plugins_failed[0].startswith("not_installed: named in DSA_INDEXER_PLUGINS but no such entry")
