"""`dsa-indexer bench` reports how much its samples varied: per-row spread (min, p10, median, p90, max, count) in the
table and the JSON, ceilings whose samples vary 10x flagged, small rates printed with their digits, plot texts that
say what is drawn, and saved reports from before the spread still render."""

import json
from pathlib import Path

import pytest
import torch

from dsa_indexer import bench
from dsa_indexer.cli import main

SAVED_H200 = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "bench_h200.json"
SMALL = ["--device", "cpu", "--batch", "1", "--context", "256", "--progress", "none"]


def _json_run(capsys, *args) -> dict:
    assert main(["bench", *args, "--json", "-"]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_row_and_ceiling_carries_the_spread_of_its_samples(capsys):
    data = _json_run(capsys, "--suite", "topk", "prefill", *SMALL, "--repeats", "4", "--prefill-shapes", "8x128")
    assert data["rows"] and data["errors"] == []
    for row in data["rows"]:
        spread = row["spread"]
        assert spread["count"] == 4, row
        assert spread["min"] <= spread["p10"] <= spread["median"] <= spread["p90"] <= spread["max"], row
        assert spread["median"] == pytest.approx(row["time_us"])
    for name in ("copy_GBps", "fp32_matmul_TFLOPs"):
        spread = data["ceiling_spread"][name]
        assert spread["count"] == 4 and spread["min"] <= data["ceilings"][name] <= spread["max"]
        assert spread["max_over_min"] == pytest.approx(spread["max"] / spread["min"])
        assert spread["unstable"] is (spread["max_over_min"] >= 10)


def test_the_table_prints_min_p10_p90_and_count(capsys):
    assert main(["bench", "--suite", "topk", *SMALL, "--repeats", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("suite "))
    assert "median us" in header and "min us" in header and "p10-p90 us" in header and " n " in header
    baseline = next(line for line in lines if "torch.topk (baseline)" in line)
    assert " 3 " in baseline and "-" in baseline.split("batch=1 context=256")[1]  # count, and the p10-p90 pair
    assert "(min " in next(line for line in lines if line.startswith("ceilings: "))


def test_spread_percentiles_interpolate_between_samples():
    timing = bench.Timing([5.0, 1.0, 3.0, 2.0, 4.0])
    assert timing == 3.0 and timing.samples == (5.0, 1.0, 3.0, 2.0, 4.0)
    assert timing.spread == {"min": 1.0, "p10": pytest.approx(1.4), "median": 3.0, "p90": pytest.approx(4.6),
                             "max": 5.0, "count": 5}
    assert bench.Timing([7.0]).spread["p10"] == 7.0 == bench.Timing([7.0]).spread["p90"]
    with pytest.raises(ValueError):
        bench.Timing([])


class _FakeTimer:
    """Returns the given samples (us) for every call, as a Timer would have measured them."""

    mode = "fake"

    def __init__(self, samples):
        self.samples = samples

    def __call__(self, fn):
        return bench.Timing(self.samples)


def _report_with(ceilings, spread) -> bench.BenchReport:
    report = bench.BenchReport("cpu", "cpu", bench.CPU_NOTE, ceilings, ceiling_spread=spread)
    rate = ceilings["copy_GBps"] / 4
    report.rows.append(bench.Row("topk", "topk_indices", "topk_indices.reference.torch", {"batch": 1, "context": 256},
                                 12.5, rate, "GB/s", rate / ceilings["copy_GBps"], {},
                                 bench.spread_of([10.0, 12.5, 30.0])))
    return report


def test_a_ceiling_whose_samples_vary_10x_is_flagged_in_the_table_and_the_json():
    ceilings, spread = bench.measure_ceilings(torch.device("cpu"), _FakeTimer([100.0, 150.0, 2000.0]))
    assert spread["copy_GBps"]["unstable"] and spread["fp32_matmul_TFLOPs"]["unstable"]
    assert spread["copy_GBps"]["max_over_min"] == pytest.approx(20.0)
    report = _report_with(ceilings, spread)
    table = bench.format_table(report)
    assert "UNSTABLE" in table.splitlines()[2]
    assert "warning: ceiling copy_GBps varied 20.0x between its 3 samples" in table
    assert "25%*" in table and "*: a fraction of an unstable ceiling" in table
    data = json.loads(bench.report_json(report, ["dsa-indexer", "bench"]))
    assert data["ceiling_spread"]["copy_GBps"]["unstable"] is True
    assert any(w.startswith("ceiling copy_GBps varied 20.0x") for w in data["warnings"])

    steady_ceilings, steady = bench.measure_ceilings(torch.device("cpu"), _FakeTimer([100.0, 110.0, 120.0]))
    assert not steady["copy_GBps"]["unstable"]
    steady_table = bench.format_table(_report_with(steady_ceilings, steady))
    assert "UNSTABLE" not in steady_table and "warning" not in steady_table and "25%*" not in steady_table


def test_small_rates_print_with_their_digits_never_as_zero():
    assert [bench.format_number(v) for v in (0.0004, 0.0169, 0.5, 3.14159, 42.42, 4138.4)] == \
        ["0.0004", "0.0169", "0.5", "3.14", "42.4", "4138"]
    report = bench.BenchReport("cpu", "cpu", bench.CPU_NOTE, {"copy_GBps": 8.4, "fp32_matmul_TFLOPs": 0.0169})
    report.rows.append(bench.Row("prefill", "ragged_mqa_logits", "ragged_mqa_logits.reference.torch",
                                 {"queries": 8, "keys": 128}, 850.0, 0.00123, "TFLOP/s", 0.00123 / 0.0169))
    table = bench.format_table(report)
    assert "fp32_matmul_TFLOPs 0.0169" in table and "0.00123 TFLOP/s" in table and "7.28%" in table
    assert " 0.0 " not in table and "0.00 TFLOP/s" not in table


def test_a_report_saved_before_the_spread_renders_and_a_new_one_round_trips(tmp_path, capsys):
    old = json.loads(SAVED_H200.read_text())
    assert "spread" not in old["rows"][0] and "ceiling_spread" not in old  # the file is still of the old kind
    report = bench.report_from_json(old)
    assert report.rows and all(r.spread is None for r in report.rows) and report.ceiling_spread == {}
    assert main(["bench", "--from-json", str(SAVED_H200)]) == 0
    out = capsys.readouterr().out
    fused = next(line for line in out.splitlines() if "lightning_indexer.cuda.deepgemm_radix" in line)
    assert "20.4" in fused and " - " in fused  # the median, and no spread to show
    assert "ceilings: copy_GBps 4138, fp8_matmul_TFLOPs 1489" in out

    saved = tmp_path / "new.json"
    assert main(["bench", "--suite", "topk", *SMALL, "--repeats", "2", "--json", str(saved)]) == 0
    capsys.readouterr()
    again = bench.report_from_json(json.loads(saved.read_text()))
    assert again.rows and all(r.spread["count"] == 2 for r in again.rows)
    assert again.ceiling_spread["copy_GBps"]["count"] == 2
    assert main(["bench", "--from-json", str(saved)]) == 0
    assert "(min " in capsys.readouterr().out


def test_plot_titles_name_what_is_drawn():
    cpu_variants = ["single_stream", "single_stream+q_lora_reuse"]
    title = bench.streams_title(cpu_variants, annotated=False)
    assert "dual" not in title and "single_stream" in title and "without / with q_lora reuse" in title
    assert "relative to single stream" not in title
    gpu = bench.streams_title(["dual_stream", "single_stream", "dual_stream+q_lora_reuse"], annotated=True)
    assert gpu.startswith("indexer decode step: dual_stream vs single_stream") and "relative to single" in gpu
    assert bench.topk_k_text([256, 1024]) == "k=min(2048, context)" and bench.topk_k_text([8192]) == "k=2048"


def test_drawn_plots_match_their_labels(tmp_path, monkeypatch):
    """With matplotlib: the figures' titles and axis labels, read back from the drawn figures."""
    plt = pytest.importorskip("matplotlib.pyplot")
    report = bench.report_from_json(json.loads(bench.report_json(_cpu_report(), ["dsa-indexer", "bench"])))
    figures = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (figures.append(fig), close(fig)))
    paths = bench.write_plots(report, tmp_path)
    by_name = {Path(p).name: fig for p, fig in zip(paths, figures)}
    streams = by_name["bench_streams.png"].axes[0]
    assert "dual" not in streams.get_title() and {t.get_text() for t in streams.get_legend().get_texts()} == \
        {"single_stream", "single_stream+q_lora_reuse"}
    floor = by_name["bench_floor.png"].axes
    assert all(ax.get_ylabel() == "bytes / time, % of the measured copy bandwidth" for ax in floor)
    assert "UNSTABLE" in by_name["bench_floor.png"]._suptitle.get_text()
    decode = by_name["bench_decode.png"].axes[0]
    assert decode.get_ylabel() == "time (us): median, bars p10-p90"
    assert "k=min(2048, context)" in by_name["bench_topk.png"].axes[0].get_title()


def _cpu_report() -> bench.BenchReport:
    """A report as a CPU run makes it (every row with its spread), with an unstable copy ceiling."""
    ceilings, spread = bench.measure_ceilings(torch.device("cpu"), _FakeTimer([100.0, 150.0, 2000.0]))
    report = bench.BenchReport("cpu", "cpu", bench.CPU_NOTE, ceilings, ceiling_spread=spread)
    stats = bench.spread_of([90.0, 100.0, 130.0])
    for context in (256, 1024):
        shape = {"batch": 1, "context": context}
        report.rows += [
            bench.Row("decode", "lightning_indexer", "lightning_indexer.reference.torch", shape, 100.0, 1.0, "GB/s",
                      0.1, {}, stats),
            bench.Row("decode", "indexer_pipeline", "single_stream", shape, 100.0, 1.0, "GB/s", 0.1,
                      {"impl_id": bench.SINGLE_STREAM, "model": "deepseek-v3.2"}, stats),
            bench.Row("decode", "indexer_pipeline", "single_stream+q_lora_reuse", shape, 90.0, 1.1, "GB/s", 0.11,
                      {"impl_id": bench.SINGLE_STREAM, "model": "deepseek-v3.2"}, stats),
            bench.Row("topk", "topk_indices", "topk_indices.reference.torch", shape, 50.0, 1.0, "GB/s", 0.1,
                      {"speedup_vs_torch_topk": 0.5}, stats)]
    return report
