"""`dsa-indexer bench` on the CPU: the decode suite's pipeline variants, plots, progress, JSON on stdout, arguments,
and the benchmark scripts that call it."""

import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest
import torch

from dsa_indexer import bench
from dsa_indexer.cli import main
from dsa_indexer.dispatch.plugins import default_registry

ROOT = Path(__file__).resolve().parents[2]
CPU = ["--device", "cpu"]  # these tests are about the CPU run, also on a machine with a GPU
SMALL = [*CPU, "--batch", "1", "--context", "256", "--repeats", "1", "--progress", "none"]


def _json_run(capsys, *args) -> tuple[int, dict, str]:
    code = main(["bench", *args, "--json", "-"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err  # stdout must be the JSON and nothing else


def test_decode_suite_json_to_stdout_has_the_pipeline_variants(capsys):
    """The command as the issue writes it (CPU defaults: B 1, 4 x ctx 1024, 4096; one sample per median, which is
    all this test reads of the timing): valid JSON only on stdout, with the whole-step rows of every accepted
    pipeline strategy, without and with q_lora reuse."""
    code, data, err = _json_run(capsys, "--suite", "decode", *CPU, "--repeats", "1")
    assert code == 0, data["errors"]
    assert data["errors"] == [] and data["note"] == bench.CPU_NOTE and data["ceilings"]["copy_GBps"] > 0
    assert data["command"] == "dsa-indexer bench --suite decode --device cpu --repeats 1 --json -"
    steps = [r for r in data["rows"] if r["op"] == "indexer_pipeline"]
    shapes = {(b, c) for b in bench.CPU_BATCHES for c in bench.CPU_CONTEXTS}
    for variant in ("single_stream", "single_stream+q_lora_reuse"):
        assert {(r["shape"]["batch"], r["shape"]["context"]) for r in steps if r["implementation"] == variant} == shapes
    for r in steps:
        assert r["suite"] == "decode" and r["unit"] == "GB/s" and r["time_us"] > 0
        assert r["details"]["impl_id"] == "indexer_pipeline.generic.single_stream"
        assert r["details"]["model"] == "deepseek-v3.2" and r["details"]["timing"] == "wall clock, eager"
        assert 0 < r["fraction_of_ceiling"] < 1
    reused = [r for r in steps if r["implementation"].endswith("+q_lora_reuse")]
    assert all(r["details"]["q_lora_quant"] == "reused" and "saved_us_by_reuse" in r["details"] for r in reused)
    lightning = {r["implementation"] for r in data["rows"] if r["op"] == "lightning_indexer"}
    assert {"lightning_indexer.reference.torch", "lightning_indexer.generic.composed"} <= lightning
    assert "bench 8/8: decode indexer step B=4 ctx=4096" in err  # stderr is not a terminal: plain lines


def test_every_accepted_pipeline_strategy_is_forced_and_named(capsys):
    """A second strategy accepted on this target (a stand-in for the CUDA dual stream) gets its own rows, named
    from its id (the last segment clashes with indexer_pipeline.cuda.dual_stream, so the backend stays in it),
    each timed with that strategy forced, and compared with single stream."""
    registry = default_registry()
    single = next(i for i in registry.implementations("indexer_pipeline") if i.impl_id == bench.SINGLE_STREAM)
    calls = []

    def factory():
        strategy = single.factory()

        def dual_stand_in(*args):
            calls.append(1)
            return strategy(*args)

        return dual_stand_in

    registry.implementation("indexer_pipeline", impl_id="indexer_pipeline.test.dual_stream", targets=("cpu",),
                            priority=7, origin="tests/cli/test_bench.py")(factory)
    try:
        code, data, _ = _json_run(capsys, "--suite", "decode", *SMALL)
    finally:
        registry.unregister("indexer_pipeline.test.dual_stream")
    assert code == 0 and calls
    steps = {r["implementation"]: r for r in data["rows"] if r["op"] == "indexer_pipeline"}
    assert set(steps) == {"single_stream", "single_stream+q_lora_reuse", "test.dual_stream",
                          "test.dual_stream+q_lora_reuse"}
    assert steps["test.dual_stream"]["details"]["impl_id"] == "indexer_pipeline.test.dual_stream"
    assert steps["test.dual_stream"]["details"]["time_vs_single_stream"] > 0
    assert steps["test.dual_stream+q_lora_reuse"]["details"]["q_lora_quant"] == "reused"
    assert registry.forced() == {}  # forcing ended with each measurement


def test_pipeline_variant_names():
    registered = ["indexer_pipeline.cuda.dual_stream", "indexer_pipeline.generic.single_stream"]
    assert bench.pipeline_variant("indexer_pipeline.cuda.dual_stream", False, registered) == "dual_stream"
    assert bench.pipeline_variant("indexer_pipeline.generic.single_stream", True, registered) == \
        "single_stream+q_lora_reuse"
    clash = registered + ["indexer_pipeline.npu.dual_stream"]
    assert bench.pipeline_variant("indexer_pipeline.npu.dual_stream", True, clash) == "npu.dual_stream+q_lora_reuse"


def test_plots_are_written_and_returned(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    code = main(["bench", "--suite", "decode", "topk", "prefill", *SMALL, "--prefill-shapes", "16x256",
                 "--plots", str(tmp_path / "plots")])
    assert code == 0
    names = ["bench_decode.png", "bench_floor.png", "bench_streams.png", "bench_topk.png", "bench_prefill.png"]
    out = capsys.readouterr().out
    for name in names:
        path = tmp_path / "plots" / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot: {path}" in out
    report = bench.BenchReport("cpu", "cpu", "", {"copy_GBps": 1.0})
    assert bench.write_plots(report, tmp_path / "empty") == []  # no rows, no plots


def test_plots_without_matplotlib_fail_clearly_before_the_run(tmp_path, monkeypatch, capsys):
    for name in ("matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)  # `import matplotlib` now raises ImportError
    ran = []
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: ran.append(1))
    assert main(["bench", "--suite", "topk", "--plots", str(tmp_path)]) == 2
    assert "plots need matplotlib: pip install 'dsa-indexer[bench]'" in capsys.readouterr().err and not ran
    with pytest.raises(RuntimeError, match=r"pip install 'dsa-indexer\[bench\]'"):
        bench.write_plots(bench.BenchReport("cpu", "cpu", "", {}), tmp_path)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_falls_back_to_plain_lines(monkeypatch):
    for name in ("rich", "tqdm"):
        monkeypatch.setitem(sys.modules, name, None)
    stream = _Terminal()
    bar = bench.progress_factory("auto", stream)(2)
    assert isinstance(bar, bench.PlainProgress)
    bar.advance("decode B=1 ctx=256")
    bar.advance("topk B=1 ctx=256")
    bar.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("bench 1/2: decode B=1 ctx=256 (")
    with pytest.raises(ImportError, match="needs tqdm"):
        bench.progress_factory("tqdm", stream)


def test_progress_uses_a_bar_library_on_a_terminal_only():
    pytest.importorskip("tqdm")
    stream = _Terminal()
    bar = bench.progress_factory("tqdm", stream)(1)
    bar.advance("topk B=1 ctx=256")
    bar.close()
    assert "1/1" in stream.getvalue()
    if not bench.importable("rich"):
        assert type(bench.progress_factory("auto", _Terminal())(1)).__name__ == "_TqdmProgress"
    assert isinstance(bench.progress_factory("auto", io.StringIO())(1), bench.PlainProgress)  # a pipe: plain


def test_json_on_stdout_stays_json_when_something_prints(monkeypatch, capsys):
    original = bench.bench_topk

    def noisy(*args):
        print("a library printing on stdout")
        return original(*args)

    monkeypatch.setattr(bench.suites, "bench_topk", noisy)  # run_bench looks it up in its module
    code, data, err = _json_run(capsys, "--suite", "topk", *CPU, "--batch", "1", "--context", "256", "--repeats",
                                "1", "--progress", "plain")
    assert code == 0 and {r["suite"] for r in data["rows"]} == {"topk"}
    assert "a library printing on stdout" in err and "bench 1/4: topk B=1 ctx=256" in err
    rows = {r["implementation"]: r for r in data["rows"]}
    assert rows["topk_indices.reference.torch"]["details"]["rows_differing_from_torch_topk"] == 0
    assert rows["topk_indices.reference.torch"]["details"]["speedup_vs_torch_topk"] > 0


def test_a_failing_implementation_is_recorded_and_the_exit_code_says_so(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded\nsecond line")

    monkeypatch.setattr(bench.suites.ops, "ragged_mqa_logits", broken)  # the ops module the suites call
    code, data, _ = _json_run(capsys, "--suite", "prefill", "topk", *SMALL, "--prefill-shapes", "8x64")
    assert code == 1
    assert {r["suite"] for r in data["rows"]} == {"topk"}  # the others still ran
    assert data["errors"] and all(e["op"] == "ragged_mqa_logits" and e["error"] == "RuntimeError: kernel exploded"
                                  for e in data["errors"])
    assert default_registry().forced() == {}


def test_the_budget_skips_what_it_cannot_start(capsys):
    code, data, _ = _json_run(capsys, "--suite", "topk", *SMALL, "--budget-s", "1e-9")
    assert code == 0 and data["rows"] == []
    assert data["skipped_for_time"] == ["topk B=1 ctx=256", "topk padded B=1 len=256 width=1024 k=2048",
                                        "topk mixed B=2 len=153 (mixed) width=1024 k=2048",
                                        "topk v4 B=1 len=256 width=256 k=512"]


def test_the_topk_suite_has_the_engines_ways_of_calling_it(capsys):
    """--suite topk also times rows padded to a wider width, mixed lengths and V4's k = 512 (issue 35), each
    checked against torch.topk over the row's own columns."""
    code, data, _ = _json_run(capsys, "--suite", "topk", *CPU, "--batch", "1", "4", "--context", "256",
                              "--repeats", "1", "--progress", "none")
    assert code == 0 and not data["errors"]
    ours = [r for r in data["rows"] if r["implementation"] == "topk_indices.reference.torch"]
    families = {r["shape"].get("family", "grid"): r for r in ours}
    assert set(families) == {"grid", "padded", "mixed", "v4"}
    assert families["padded"]["shape"]["width"] == 1024 and families["v4"]["shape"]["k"] == 512
    mixed = families["mixed"]["shape"]
    assert mixed["batch"] == 8 and 128 <= mixed["context"] <= 256
    assert all(r["details"]["rows_differing_from_torch_topk"] == 0 for r in ours)


def test_an_engine_call_cell_catches_a_kernel_that_reads_past_the_rows_end(monkeypatch):
    """Columns past a row's end hold values above every real logit: a top-k that ignores ``ends`` selects them,
    and the cell's differing-rows count says so."""
    from dsa_indexer.bench import suites

    report = bench.BenchReport("cpu", "cpu", "", {"copy_GBps": 1.0})
    run = suites._Run(report, suites.detect_target(torch.device("cpu")), torch.device("cpu"),
                      bench.Timer(torch.device("cpu"), 1))
    real_topk = suites.ops.topk_indices

    def ignores_ends(logits, k, ends, *args, **kwargs):
        return real_topk(logits, k, torch.full_like(ends, logits.shape[1]))

    monkeypatch.setattr(suites.ops, "topk_indices", ignores_ends)
    suites.bench_topk_engine_call(run, "padded", [300, 200], 1024, 64)
    row = next(r for r in report.rows if r.implementation == "topk_indices.reference.torch")
    assert row.details["rows_differing_from_torch_topk"] == 2


@pytest.mark.parametrize("args, message", [
    (["--suite", "nope"], "argument --suite: invalid choice: 'nope'"),
    (["--repeats", "0"], "--repeats: must be a positive integer, got 0"),
    (["--batch", "0"], "--batch: must be a positive integer, got 0"),
    (["--context", "x"], "--context: expected a positive integer, got 'x'"),
    (["--prefill-shapes", "4096"], "--prefill-shapes: expected QUERIESxKEYS such as 4096x4096, got '4096'"),
    (["--prefill-shapes", "64x8"], "--prefill-shapes: need 1 <= queries <= keys (causal rows), got 64x8"),
    (["--budget-s", "-1"], "--budget-s: must be > 0, got -1"),
    (["--json", "/no/such/folder/b.json"], "--json: the folder '/no/such/folder' does not exist"),
    (["--progress", "fancy"], "--progress: invalid choice 'fancy'"),
    (["--suite"], "argument --suite: expected at least one argument"),
])
def test_bad_arguments_are_rejected_by_argparse(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_plots_into_a_file_and_a_missing_bar_library_are_rejected(tmp_path, monkeypatch, capsys):
    afile = tmp_path / "f.txt"
    afile.write_text("")
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--plots", str(afile)])
    assert exc.value.code == 2 and "exists and is not a folder" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "rich", None)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--progress", "rich"])
    assert exc.value.code == 2 and "--progress: rich is not installed" in capsys.readouterr().err


def test_runtime_limits_exit_2_with_the_reason(capsys):
    assert main(["bench", "--suite", "decode", *CPU, "--context", "200000", "--progress", "none"]) == 2
    assert "max_position=163840" in capsys.readouterr().err


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_scripts_are_thin_callers_of_the_command(tmp_path, monkeypatch, capsys):
    """benchmarks/bench_*.py --out DIR run the command with their suites and write DIR/<script>.json; capture stays
    importable from bench_pipeline (bench_q_lora_reuse.py and bench_v4_compressor.py take it from there)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the scripts run the GPU sizes here; this test is about the small CPU run")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # no plots: quicker, and the scripts say so
    assert _script("bench_pipeline").capture is bench.capture
    assert _script("bench_decode_topk").main(["--out", str(tmp_path), "--only", "topk", "--repeats", "1"]) == 0
    assert _script("bench_triton_logits_topk").main(["--out", str(tmp_path), "--repeats", "1", "--quick"]) == 0
    err = capsys.readouterr().err
    assert "no plots (pip install 'dsa-indexer[bench]')" in err
    decode_topk = json.loads((tmp_path / "bench_decode_topk.json").read_text())
    assert decode_topk["settings"]["suites"] == ["topk"] and decode_topk["errors"] == []
    assert decode_topk["command"].startswith("dsa-indexer bench --suite topk --repeats 1 --json ")
    logits_topk = json.loads((tmp_path / "bench_triton_logits_topk.json").read_text())
    assert {r["suite"] for r in logits_topk["rows"]} == {"topk", "prefill"}


def test_a_saved_report_renders_again_without_measuring(tmp_path, capsys):
    """--from-json: the committed H200 report gives its table (and plots where matplotlib is) with no measurement."""
    saved = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "bench_h200.json"
    assert main(["bench", "--from-json", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "topk_indices.cuda.radix" in out and "ragged_mqa_logits.cuda.deepgemm" in out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": [{"suite": "decode"}]}))
    assert main(["bench", "--from-json", str(bad)]) == 2  # a clear error, not a traceback
    assert "not a dsa-indexer bench report" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--from-json", str(tmp_path / "missing.json")])


def test_topk_set_agreement_counts_selected_indices_only():
    from dsa_indexer.bench.timing import topk_set_agreement

    want = torch.tensor([[3, 1, -1], [-1, -1, -1], [0, 2, 4]])
    assert topk_set_agreement(want.flip(1), want) == 1.0  # order inside a row does not count
    got = torch.tensor([[1, 5, -1], [7, -1, -1], [4, 2, 0]])
    assert topk_set_agreement(got, want) == 4 / 5  # the empty row adds nothing, its extra index neither
    assert topk_set_agreement(torch.full((2, 2), -1), torch.full((2, 2), -1)) == 1.0


@pytest.mark.parametrize("content, what", [
    (b"median 20.4 us\n", "is not valid JSON"),
    (b"\xff\xfe\x00binary", "is not a UTF-8 JSON text file"),
    (b'{"rows": [{"suite": "decode"}]}', "is not a dsa-indexer bench report"),
    (b"[1, 2, 3]", "holds a JSON list, not a dsa-indexer bench report"),
], ids=["text", "binary", "other-json", "json-list"])
def test_bench_from_json_of_a_wrong_file_names_the_file(tmp_path, capsys, content, what):
    path = tmp_path / "report.txt"
    path.write_bytes(content)
    assert main(["bench", "--from-json", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--from-json {path} {what}" in err and "Traceback" not in err


def test_a_forced_bench_row_restores_the_override_that_was_there(monkeypatch):
    """A bench row forces each implementation it times; after the row, a user's own `Registry.force` is back (it
    used to be reset to no override at all)."""
    from dsa_indexer.bench.suites import _Forced
    from dsa_indexer.dispatch import Environment, Problem, Registry, Target, plugins

    reg = Registry(environment=Environment.simulated(gpu=True))
    for impl_id, priority in (("op.reference.torch", 0), ("op.vendor.a", 100), ("op.vendor.b", 200)):
        reg.implementation("op", impl_id=impl_id, targets=("*",), priority=priority)(
            lambda impl_id=impl_id: (lambda: impl_id))
    monkeypatch.setattr(plugins, "_default", reg)
    sm90 = Target("cuda", "sm90")
    assert reg.force("op", "op.vendor.a") is None  # force returns the override it replaces
    with _Forced("op", "op.reference.torch"):
        assert reg.call("op", sm90, Problem()) == "op.reference.torch"
    assert reg.forced()["op"] == "op.vendor.a" and reg.call("op", sm90, Problem()) == "op.vendor.a"
    assert reg.force("op", None) == "op.vendor.a"
    with _Forced("op", "op.vendor.a"):
        assert reg.call("op", sm90, Problem()) == "op.vendor.a"
    assert "op" not in reg.forced() and reg.call("op", sm90, Problem()) == "op.vendor.b"


@pytest.mark.parametrize("inference", [False, True])
def test_inference_mode_runs_every_measurement_under_it_and_says_so(monkeypatch, capsys, inference):
    """Engines run their models under torch.inference_mode (issue 38 wants the numbers there too): with
    --inference-mode every item runs inside it, and the JSON's settings and command record it."""
    original = bench.suites.bench_topk
    seen = []

    def watched(*args):
        seen.append(torch.is_inference_mode_enabled())
        return original(*args)

    monkeypatch.setattr(bench.suites, "bench_topk", watched)
    flag = ["--inference-mode"] if inference else []
    code, data, _ = _json_run(capsys, "--suite", "topk", *CPU, "--batch", "1", "--context", "256", "--repeats", "1",
                              *flag)
    assert code == 0 and seen == [inference]
    assert data["settings"]["inference_mode"] is inference
    assert ("--inference-mode" in data["command"]) is inference
    assert not torch.is_inference_mode_enabled()  # left as it was
    rows = {r["implementation"]: r for r in data["rows"]}
    assert rows["topk_indices.reference.torch"]["details"]["rows_differing_from_torch_topk"] == 0
