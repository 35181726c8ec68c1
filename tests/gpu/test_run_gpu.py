"""`dsa-indexer run` on the GPU: first-use compiles in their own named phase (with the cache folders), out of the
timed phases; the decode step replayed from its captured CUDA graph, timed per step next to the eager step, and
both checked against the reference backend (top-k set agreement >= 99%, the run's own threshold)."""

import json

import pytest

from dsa_indexer.cli import main
from dsa_indexer.runner import EAGER_DECODE, FILL, GRAPH_DECODE, PREFILL, WARMUP

pytestmark = pytest.mark.gpu  # skipped without a GPU by tests/conftest.py

# Contexts past top-k keys, so the decode rows score: 2048 tokens for V3.2, 4 x 2048 for V4's C4 indexer.
CONTEXT = {"deepseek-v3.2": 4608, "deepseek-v4-flash": 9000}


@pytest.mark.parametrize("model", sorted(CONTEXT))
def test_run_warms_up_then_times_the_graph_decode(model, tmp_path, capsys):
    path = tmp_path / "run.json"
    steps = 3
    code = main(["run", "--model", model, "--batch", "4", "--context", str(CONTEXT[model]), "--steps", str(steps),
                 "--prefill-tokens", "256", "--json", str(path)])
    out = capsys.readouterr().out
    report = json.loads(path.read_text())
    assert code == 0 and report["verified"] is True, report.get("verification")

    timings = report["timings_ms"]
    assert list(timings) == [WARMUP, FILL, GRAPH_DECODE, EAGER_DECODE, PREFILL], list(timings)  # replay, then eager
    assert timings[WARMUP]["count"] == 1 and timings[FILL]["count"] == 1 and timings[PREFILL]["count"] == 1
    assert timings[EAGER_DECODE]["count"] == timings[GRAPH_DECODE]["count"] == steps
    # Compiles happened in the warm-up: storing 5 x <= 9000 tokens' keys takes milliseconds on an H200, while one
    # first-use compile (nvcc, DeepGEMM's JIT, Triton) takes seconds.
    assert timings[FILL]["median"] < 3000, timings

    warmup = report["warmup"]
    assert warmup["ran"] and warmup["seconds"] * 1e3 == pytest.approx(timings[WARMUP]["median"])
    assert {c["name"] for c in warmup["caches"]} == {"dsa_indexer CUDA JIT (nvcc top-k)", "Triton", "DeepGEMM JIT"}
    assert all(isinstance(c["new_files"], int) and c["path"] for c in warmup["caches"])
    assert out.index(f"{WARMUP}: one untimed fill") < out.index("prefill: 256 new tokens")
    assert "Triton " in out.split(f"{WARMUP}: one untimed fill")[1].splitlines()[0]  # the cache folders, named

    graph = report["decode_graph"]
    assert graph["captured"] is True and graph["reason"] is None, graph
    assert 0 < graph["us_per_step"] < graph["eager_us_per_step"], graph  # a replay skips the eager launch overhead
    assert graph["min_topk_agreement_with_eager"] >= 0.99
    assert report["verification"]["decode_graph_topk_agreement"] >= 0.99
    assert report["verification"]["reference_compared_with_itself"] is False
    assert "per step replaying the CUDA graph" in out and "(pass: each >= 99%) -> OK" in out
    assert "deep_gemm" in report["versions"]["importable"]
