"""The command line: info, explain for every target, and a small run of the main job."""

import json

import pytest

from dsa_indexer import ops
from dsa_indexer.cli import main


def test_info_lists_every_op(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "plugins loaded:" in out and "paged_mqa_logits" in out and "indexer_pipeline" in out


@pytest.mark.parametrize("target", ["sm90", "sm100", "gfx942", "gfx950", "gfx1250", "npu", "cpu"])
def test_explain_all_ops_on_every_target(target, capsys):
    assert main(["explain", "all", "--target", target]) == 0
    out = capsys.readouterr().out
    assert out.count("=> ") == len(ops.OPS) + 1  # every op and the pipeline strategy


def test_explain_with_a_simulated_machine(capsys):
    assert main(["explain", "paged_mqa_logits", "--target", "sm90", "--assume", "gpu=yes", "triton=yes",
                 "--problem", "heads=64"]) == 0
    out = capsys.readouterr().out
    assert "=> paged_mqa_logits.triton.logits" in out and "deep_gemm" in out


def test_explain_unknown_op_fails(capsys):
    assert main(["explain", "nope"]) == 2
    assert "unknown op" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["deepseek-v3.2", "deepseek-v4-flash"])
def test_run_small_main_job_verifies(model, tmp_path, capsys):
    report = tmp_path / "report.json"
    code = main(["run", "--model", model, "--batch", "2", "--context", "2300", "--steps", "1", "--prefill-tokens",
                 "32", "--json", str(report)])
    assert code == 0
    data = json.loads(report.read_text())
    assert data["verified"] is True and data["q_lora_quant"]["reused"] == 2
    assert "verification against the reference backend" in capsys.readouterr().out


def test_explain_rejects_a_problem_key_the_op_does_not_have(capsys):
    assert main(["explain", "paged_mqa_logits", "--problem", "foo=1"]) == 2
    err = capsys.readouterr().err
    assert "problem keys ('heads', 'dim', 'next_n', 'fp8', 'keys', 'pages')" in err and "foo" in err


def test_run_with_a_simulated_target_leaves_the_environment_alone(tmp_path, monkeypatch):
    """`run --target` passes the target down (Indexer, ops); it never writes DSA_INDEXER_TARGET."""
    import os

    monkeypatch.delenv("DSA_INDEXER_TARGET", raising=False)
    report = tmp_path / "r.json"
    main(["run", "--target", "sm90", "--batch", "2", "--context", "300", "--steps", "1", "--prefill-tokens", "64",
          "--json", str(report)])
    assert "DSA_INDEXER_TARGET" not in os.environ
    assert json.loads(report.read_text())["target"] == "sm90"


@pytest.mark.parametrize("args, message", [
    (["--batch", "0"], "--batch: must be a positive integer, got 0"),
    (["--steps", "0"], "--steps: must be a positive integer, got 0"),
    (["--context", "-5"], "--context: must be a positive integer, got -5"),
    (["--prefill-tokens", "0"], "--prefill-tokens: must be a positive integer"),
    (["--next-n", "x"], "--next-n: expected a positive integer, got 'x'"),
    (["--json", "/no/such/folder/report.json"], "--json: the folder '/no/such/folder' does not exist"),
])
def test_run_rejects_bad_arguments_before_running(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("field, value", [("topk", 0), ("topk", -1), ("n_heads", 0), ("hidden_size", 1.5),
                                          ("norm_eps", 0.0)])
def test_indexer_config_validates_its_fields_by_name(field, value):
    from dsa_indexer import IndexerConfig

    with pytest.raises(ValueError, match=f"IndexerConfig.{field} must be"):
        IndexerConfig.deepseek_v32(**{field: value})


def test_explain_rejects_an_unknown_assumed_fact(capsys):
    assert main(["explain", "topk_indices", "--assume", "cuda=yes"]) == 2  # a usage error, as argparse's own
    assert ("--assume: unknown fact 'cuda'; known facts: aiter, cuda_jit, deep_gemm, flashinfer, gpu, torch_npu, "
            "triton") in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["sm91", "gfx9500"])
def test_a_simulated_arch_no_platform_lists_warns(arch, capsys):
    with pytest.warns(RuntimeWarning, match=f"--target names {arch}, which the .* platform does not list"):
        assert main(["explain", "topk_indices", "--target", arch]) == 0


def test_explain_rejects_a_non_integer_problem_fact(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["explain", "paged_mqa_logits", "--problem", "heads=abc"])
    assert exc.value.code == 2  # a usage error, as argparse's own
    assert "argument --problem: heads must be a positive integer, got 'abc'" in capsys.readouterr().err


def test_a_misspelled_forced_op_warns_and_info_shows_what_is_forced(monkeypatch, capsys):
    from dsa_indexer.dispatch.plugins import default_registry

    monkeypatch.setenv("DSA_INDEXER_FORCE", "topk_indicse=topk_indices.reference.torch")
    default_registry().clear_cache()
    try:
        with pytest.warns(RuntimeWarning, match="DSA_INDEXER_FORCE names unknown op.*topk_indicse"):
            assert main(["info"]) == 0
        assert "forced: topk_indicse=topk_indices.reference.torch" in capsys.readouterr().out
    finally:
        monkeypatch.delenv("DSA_INDEXER_FORCE")
        default_registry().clear_cache()


def test_the_strict_hint_appears_only_when_strict_mode_refused():
    from dsa_indexer.dispatch import Environment, Problem, Registry, load_plugins, parse_target
    from dsa_indexer.dispatch.registry import NoImplementationError

    reg = Registry(environment=Environment.simulated(gpu=True))
    load_plugins(reg, entry_points=False)
    reg.force("topk_indices", "topk_indices.triton.topk")  # cannot run: no triton in this environment
    with pytest.raises(NoImplementationError, match="cannot run here") as exc:
        reg.choose("topk_indices", parse_target("sm90"), Problem())
    assert "unsetting DSA_INDEXER_STRICT" not in str(exc.value)


def test_run_on_a_missing_gpu_says_so(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main(["run", "--device", "cuda"]) == 2
    assert "sees no CUDA/ROCm GPU; run without --device" in capsys.readouterr().err


def test_run_says_when_decode_rows_need_no_scoring(capsys):
    assert main(["run", "--batch", "2", "--context", "1000", "--steps", "1", "--prefill-tokens", "64"]) == 0
    assert "the decode steps run no logits or top-k" in capsys.readouterr().out


def test_run_shows_progress_of_the_long_phases(capsys):
    assert main(["run", "--batch", "2", "--context", "300", "--steps", "1", "--prefill-tokens", "64"]) == 0
    captured = capsys.readouterr()
    assert "fill context keys: 3/3" in captured.err and "prefill: 64 new tokens" in captured.out
    assert "verification took" in captured.out


@pytest.mark.parametrize("model", ["deepseek-v3.2", "deepseek-v4-flash"])
def test_run_checks_against_an_independent_float64_oracle(model, tmp_path):
    report = tmp_path / "r.json"
    assert main(["run", "--model", model, "--batch", "2", "--context", "3000", "--steps", "1", "--prefill-tokens",
                 "64", "--json", str(report)]) == 0
    verification = json.loads(report.read_text())["verification"]
    assert verification["float64_oracle_rows"] == 2 and verification["float64_oracle_topk_agreement"] >= 0.95


def test_the_float64_oracle_check_fails_on_wrong_indices():
    """The oracle must be able to fail: the right step's inputs with another step's top-k agree far less."""
    import torch

    from dsa_indexer import DecodeBatch, IndexerConfig, IndexKCache, Indexer, PrefillBatch, ops
    from dsa_indexer.runner import _float64_oracle_agreement

    cfg = IndexerConfig(name="tiny", hidden_size=256, q_lora_rank=256, n_heads=4, topk=16, max_position=4096)
    indexer = Indexer(cfg).init_random(1)
    cache = IndexKCache.allocate(8)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    gen = torch.Generator().manual_seed(2)
    for b in range(2):
        pb = PrefillBatch.build([0], [200], table[b:b + 1])
        indexer.store_keys(torch.randn(200, 256, generator=gen).to(torch.bfloat16), pb, cache)
    db = DecodeBatch.build([201, 201], table)
    x = torch.randn(2, 256, generator=gen).to(torch.bfloat16)
    q_lora, quant = ops.rmsnorm_quant_fp8(torch.randn(2, 256, generator=gen).to(torch.bfloat16),
                                          torch.ones(256, dtype=torch.bfloat16))
    out = indexer(x, q_lora, db.positions, db, cache, q_lora_quant=quant)
    good, rows = _float64_oracle_agreement(indexer, cache, (x, q_lora, quant, db), out)
    bad, _ = _float64_oracle_agreement(indexer, cache, (x, q_lora, quant, db), out.flip(0))  # rows swapped
    assert rows == 2 and good >= 0.95 and bad < 0.5, (good, bad)


def test_bench_runs_on_a_cpu_and_writes_json(tmp_path, capsys):
    report = tmp_path / "bench.json"
    assert main(["bench", "--suite", "ops", "--device", "cpu", "--repeats", "2", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "CPU numbers, not GPU numbers" in out and "torch.topk (baseline)" in out
    data = json.loads(report.read_text())
    assert data["command"].startswith("dsa-indexer") and data["ceilings"]["copy_GBps"] > 0
    suites = {r["suite"] for r in data["rows"]}
    assert suites == {"decode", "topk", "prefill"}
    # --suite's help says what `ops` runs: these three ops, one size each, labelled by their suites
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    said = help_text.split("ops (those suites' three ops at one size each: ", 1)[1].split(";", 1)[0]
    assert said == "lightning_indexer, topk_indices, ragged_mqa_logits, in rows labelled decode, topk, prefill"
    assert {(r["suite"], r["op"]) for r in data["rows"]} == {
        ("decode", "lightning_indexer"), ("topk", "topk_indices"), ("prefill", "ragged_mqa_logits")}
    assert len({(r["suite"], tuple(r["shape"].items())) for r in data["rows"]}) == 3  # one size per suite
    impls = {r["implementation"] for r in data["rows"]}
    assert {"lightning_indexer.reference.torch", "lightning_indexer.generic.composed",
            "ragged_mqa_logits.reference.torch", "torch.topk (baseline)"} <= impls
    assert all(r["time_us"] > 0 and r["throughput"] > 0 for r in data["rows"])


def test_bench_json_to_stdout_is_json_only(capsys):
    assert main(["bench", "--suite", "topk", "--repeats", "1", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {r["suite"] for r in data["rows"]} == {"topk"}


def test_bench_plots_need_matplotlib_or_say_so(tmp_path, capsys):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert main(["bench", "--suite", "topk", "--repeats", "1", "--plots", str(tmp_path)]) == 2
        assert "pip install 'dsa-indexer[bench]'" in capsys.readouterr().err
    else:
        assert main(["bench", "--suite", "topk", "--repeats", "1", "--plots", str(tmp_path)]) == 0
        assert (tmp_path / "bench_topk.png").exists()
