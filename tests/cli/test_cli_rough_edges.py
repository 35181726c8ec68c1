"""Issue 26: the rough edges a new user hit (output paths, --assume, info/explain JSON, one arch check, empty
batches, input errors by name, Registry.force and misspelled plugin hooks, one-line CLI warnings, the C4 pooling
precondition, benchmark scripts' --help). Bench statistics and `run`'s phases are tested in test_bench.py and
test_cli.py."""

from __future__ import annotations

import json
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from dsa_indexer import DecodeBatch, Indexer, IndexerConfig, IndexKCache, PrefillBatch, ops
from dsa_indexer.cli import main
from dsa_indexer.contract.validate import IndexerInputError
from dsa_indexer.dispatch.environment import Environment
from dsa_indexer.dispatch.plugins import default_registry, hookimpl, load_plugins
from dsa_indexer.dispatch.registry import Registry

ROOT = Path(__file__).parents[2]
TINY = IndexerConfig(name="tiny", hidden_size=256, q_lora_rank=256, n_heads=4, topk=16, max_position=1024,
                     yarn=None)


# --- 1, 2: output paths checked before any work; '-' means stdout everywhere -------------------------------------
@pytest.mark.parametrize("argv", [["run", "--json", "{dir}"], ["bench", "--json", "{dir}"],
                                  ["bench", "--plots", "/proc/forbidden"], ["run", "--json", "/proc/x/y.json"],
                                  ["info", "--json", "{dir}"], ["explain", "all", "--json", "{dir}"]])
def test_bad_output_paths_fail_before_any_work_with_exit_2(tmp_path, capsys, argv):
    argv = [a.format(dir=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument" in err and "Traceback" not in err
    assert ("is a folder" in err) or ("cannot write" in err) or ("does not exist" in err)


def test_run_json_dash_is_stdout(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = main(["run", "--json", "-", "--batch", "1", "--context", "256", "--steps", "1", "--prefill-tokens", "64",
                 "--no-verify"])
    assert code == 0
    out = capsys.readouterr().out
    report = json.loads(out)  # stdout holds the JSON only
    assert "verified" in report
    assert not (tmp_path / "-").exists()


# --- 3: --assume takes every required fact; info --assume/--json; explain --json; strict in info ----------------
def test_assume_accepts_every_fact_a_registration_requires(capsys):
    required = default_registry().required_facts()
    assert {"cuda_jit", "deep_gemm", "aiter", "torch_npu"} <= required
    facts = [f"{fact}=yes" for fact in sorted(required)]
    assert main(["explain", "topk_indices", "--target", "sm90", "--assume", *facts]) == 0
    text = capsys.readouterr().out
    assert "=> topk_indices.cuda." in text  # the H200's choice, simulated on a CPU
    assert main(["info", "--target", "sm90", "--assume", *facts]) == 0
    assert "topk_indices" in capsys.readouterr().out


def test_info_and_explain_write_json(capsys, tmp_path, monkeypatch):
    path = tmp_path / "info.json"
    assert main(["info", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["target"] == "cpu" and {r["op"] for r in report["resolutions"]} >= {"topk_indices", "q_prologue"}
    assert main(["explain", "paged_mqa_logits", "--target", "gfx950", "--assume", "gpu=yes", "triton=yes",
                 "aiter=yes", "--json", "-"]) == 0
    (res,) = json.loads(capsys.readouterr().out)["resolutions"]
    assert res["chosen"] == "paged_mqa_logits.rocm.aiter"
    assert any(c["impl"] == "paged_mqa_logits.reference.torch" and c["accepted"] for c in res["candidates"])


def test_info_says_strict_mode_and_aligns_columns(capsys, monkeypatch):
    monkeypatch.setenv("DSA_INDEXER_STRICT", "on")
    default_registry().clear_cache()
    try:
        assert main(["info", "--target", "sm90"]) == 0
    finally:
        monkeypatch.delenv("DSA_INDEXER_STRICT")
        default_registry().clear_cache()
    out = capsys.readouterr().out
    assert "strict mode: on" in out
    rows = [line for line in out.splitlines() if " -> " in line]
    assert len({line.index(" -> ") for line in rows}) == 1  # one column
    assert any("strict mode refuses it" in line for line in rows)


def test_info_lists_vendor_libraries_with_where_they_import_from(capsys, monkeypatch, tmp_path):
    fake = tmp_path / "deep_gemm"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = default_registry()
    saved = registry.environment
    registry.set_environment(Environment())  # a fresh probe: the fake module's verdict must not outlive the test
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "deep_gemm is installed but not usable"
            assert main(["info"]) == 0
    finally:
        registry.set_environment(saved)
    out = capsys.readouterr().out
    line = next(t for t in out.splitlines() if t.strip().startswith("deep_gemm:"))
    assert f"importable from {fake / '__init__.py'}" in line
    assert "not importable" in next(t for t in out.splitlines() if t.strip().startswith("torch_npu:"))


# --- 4: one arch check for every entry point ------------------------------------------------------------------------
@pytest.mark.parametrize("entry", ["indexer", "op"])
def test_an_unknown_arch_warns_from_every_entry_point(entry):
    from dsa_indexer.dispatch import target as target_module

    target_module._arch_warned.clear()
    with pytest.warns(RuntimeWarning, match=r"target= names sm42"):
        if entry == "indexer":
            Indexer(TINY, target="sm42")
        else:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*falls back.*")
                ops.quant_fp8_groups(torch.randn(2, 128), target="sm42")


def test_an_arch_a_plugin_registers_is_known():
    from dsa_indexer.dispatch import target as target_module

    default_registry()
    target_module._arch_warned.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        Indexer(TINY, target="sm103")  # the example plugin (installed in the test env) registers sm103


# --- 5: empty batches --------------------------------------------------------------------------------------------
def test_empty_batches_say_so():
    table = torch.zeros(0, 4, dtype=torch.int32)
    with pytest.raises(IndexerInputError, match="seq_lens must name at least one request"):
        DecodeBatch.build([], table)
    with pytest.raises(IndexerInputError, match="prefix_lens must name at least one request"):
        PrefillBatch.build([], [], table)


# --- 6: input errors name the argument or the variable --------------------------------------------------------------
def test_target_variable_garbage_is_named(monkeypatch, capsys):
    monkeypatch.setenv("DSA_INDEXER_TARGET", "garbage")
    default_registry().clear_cache()
    try:
        assert main(["info"]) == 2
        assert "DSA_INDEXER_TARGET: unknown target 'garbage'" in capsys.readouterr().err
    finally:
        monkeypatch.delenv("DSA_INDEXER_TARGET")
        default_registry().clear_cache()


def test_a_bf16_kv_cache_is_an_input_error():
    q = torch.randn(1, 1, 64, 128).to(torch.float8_e4m3fn)
    with pytest.raises(IndexerInputError, match="kv_cache must be uint8"):
        ops.paged_mqa_logits(q, torch.zeros(2, 64, 1, 132, dtype=torch.bfloat16), torch.randn(1, 64),
                             torch.tensor([[10]], dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32), 128)


def test_a_batch_on_another_device_names_the_batch():
    indexer = Indexer(TINY).init_random(0)
    batch = DecodeBatch.build([60], torch.arange(4, dtype=torch.int32).view(1, 4), num_cache_pages=4, device="meta")
    with pytest.raises(IndexerInputError, match="batch is on meta but x is on cpu"):
        indexer(torch.randn(1, 256, dtype=torch.bfloat16), torch.randn(1, 256, dtype=torch.bfloat16),
                torch.tensor([59]), batch, IndexKCache.allocate(4))


# --- 7: Registry.force checks names; a misspelled plugin hook is reported -----------------------------------------
def test_force_checks_names_when_called():
    reg = default_registry()
    with pytest.raises(ValueError, match="unknown op 'topk_indicse'"):
        reg.force("topk_indicse", "topk_indices.reference.torch")
    with pytest.raises(ValueError, match="'topk_indices.nvidia.fast' is not registered for 'topk_indices'"):
        reg.force("topk_indices", "topk_indices.nvidia.fast")


def test_a_plugin_with_a_misspelled_hook_is_reported_not_loaded(monkeypatch):
    misspelled = types.ModuleType("typo_plugin")

    @hookimpl
    def dsa_indexer_regster(registry):  # noqa: ARG001 - the typo under test
        raise AssertionError("never called")

    misspelled.dsa_indexer_regster = dsa_indexer_regster
    undecorated = types.ModuleType("plain_plugin")
    undecorated.dsa_indexer_register = lambda registry: None  # no @hookimpl: pluggy never calls it
    monkeypatch.setitem(sys.modules, "typo_plugin", misspelled)
    monkeypatch.setitem(sys.modules, "plain_plugin", undecorated)
    reg = Registry(environment=Environment.simulated())
    load_plugins(reg, builtins=("typo_plugin", "plain_plugin"), entry_points=False)
    assert reg.plugins_loaded == []
    failed = "\n".join(reg.plugins_failed)
    assert "typo_plugin: register failed" in failed and "dsa_indexer_regster" in failed
    assert "plain_plugin: register failed" in failed and "defines no dsa_indexer_register hook" in failed


# --- 8: warnings as one clean line ---------------------------------------------------------------------------------
def test_cli_warnings_are_one_line():
    out = subprocess.run([sys.executable, "-m", "dsa_indexer.cli", "info", "--target", "sm42"], capture_output=True,
                         text=True)
    assert out.returncode == 0
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines and all(line.startswith("warning: dsa_indexer: ") for line in lines), out.stderr


# --- 10: the C4 pooling precondition, benchmark scripts' --help --------------------------------------------------
def test_c4_compress_pool_checks_request_runs():
    t, d = 6, 8
    proj = torch.randn(t, 4 * d)
    state = torch.zeros(3, 8, 4 * d)
    ape = torch.randn(4, 2 * d)
    slot = torch.zeros(t, dtype=torch.int64)
    rows = torch.tensor([3], dtype=torch.int64)
    ok = dict(positions=torch.arange(t), row_request=torch.zeros(t, dtype=torch.int64), state_slot=slot)
    assert ops.c4_compress_pool(proj, state.clone(), ape, rows=rows, **ok).shape == (1, d)
    split = torch.tensor([0, 0, 1, 1, 0, 0])
    with pytest.raises(IndexerInputError, match="row_request: a request's rows must be consecutive"):
        ops.c4_compress_pool(proj, state.clone(), ape, torch.arange(t), split, torch.tensor([0, 0, 1, 1, 0, 0]),
                             rows)
    gap = torch.tensor([0, 1, 2, 4, 5, 6])
    with pytest.raises(IndexerInputError, match="request 0 has position 2 then 4"):
        ops.c4_compress_pool(proj, state.clone(), ape, gap, torch.zeros(t, dtype=torch.int64), slot, rows)


BENCHMARK_SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))
# Each script run as `python <script> --help` would run it (runpy, as __main__, with that argv), all in one child
# process: one torch import for them all instead of one each (~2 s apiece); the child reports per script.
_HELP_RUNNER = """
import contextlib, io, json, os, runpy, sys, traceback
results = {}
sys.path.insert(0, "")
for path in sys.argv[1:]:
    out, err = io.StringIO(), io.StringIO()
    code = 0
    sys.argv, sys.path[0] = [path, "--help"], os.path.dirname(path)  # what `python <path>` sees
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            code = "raised: " + traceback.format_exc()
    results[path] = [code, out.getvalue(), err.getvalue()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def benchmark_help() -> dict:
    paths = [str(ROOT / "benchmarks" / name) for name in BENCHMARK_SCRIPTS]
    out = subprocess.run([sys.executable, "-c", _HELP_RUNNER, *paths], capture_output=True, text=True, timeout=600,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return {Path(path).name: result for path, result in json.loads(out.stdout.splitlines()[-1]).items()}


@pytest.mark.parametrize("script", BENCHMARK_SCRIPTS)
def test_benchmark_scripts_honour_help(script, benchmark_help):
    code, stdout, stderr = benchmark_help[script]
    assert code == 0 and stdout.lstrip().startswith("usage:"), f"{code}\n{stdout[:300]}{stderr[-300:]}"
