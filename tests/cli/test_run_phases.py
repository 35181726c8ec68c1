"""`dsa-indexer run`'s phases and report: the first-use compile / warm-up phase (untimed runs of every phase, kept
out of the timings), the decode step as a graph replay next to the eager one (checked on a CPU with a stand-in
that replays through the graph's own buffers: tests/gpu/test_run_gpu.py checks the captured CUDA graph), the pass
thresholds, the versions block, and the CPU's note that the reference-vs-reference line is not a check."""

import json
import time

import pytest

from dsa_indexer import runner
from dsa_indexer.backends.cuda import jit
from dsa_indexer.cli import main
from dsa_indexer.graphs import DecodeBuffers
from dsa_indexer.runner import EAGER_DECODE, FILL, GRAPH_DECODE, PREFILL, WARMUP, RunSettings, run_main_job

SMALL = ["--batch", "2", "--context", "2100", "--steps", "1", "--prefill-tokens", "32"]
# Rows score (logits + top-k) past top-k keys: 2048 tokens for V3.2, 4 x 2048 for V4's C4 indexer.
SIZES = {"deepseek-v3.2": dict(batch=2, context=2100, steps=2, prefill_tokens=32),
         "deepseek-v4-flash": dict(batch=2, context=8300, steps=2, prefill_tokens=32)}
QUICK = dict(batch=2, context=300, steps=2, prefill_tokens=32)  # no scoring: quick phases, for the timing tests


def test_run_prints_its_thresholds_and_says_the_cpu_reference_line_is_no_check(tmp_path, capsys):
    import sys

    import torch

    import dsa_indexer

    report = tmp_path / "run.json"
    assert main(["run", *SMALL, "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "(pass: each >= 99%) -> OK" in out and "(pass: >= 95%) -> OK" in out
    assert "compares the reference with itself: it is not a check; the float64 oracle line below is" in out
    data = json.loads(report.read_text())
    assert data["thresholds"] == {"reference_topk_agreement": 0.99, "float64_oracle_topk_agreement": 0.95}
    assert data["verification"]["reference_compared_with_itself"] is True
    assert list(data["timings_ms"]) == [FILL, EAGER_DECODE, PREFILL]  # a CPU compiles nothing: no warm-up phase
    assert data["timings_ms"][EAGER_DECODE]["count"] == 1
    assert data["warmup"]["ran"] is False and "CPU" in data["warmup"]["reason"]
    assert data["decode_graph"]["captured"] is False and "cpu" in data["decode_graph"]["reason"]
    assert "per step eager (no CUDA graph: CUDA graphs need a CUDA or ROCm device" in out

    versions = data["versions"]
    assert versions["torch"] == torch.__version__ and versions["dsa_indexer"] == dsa_indexer.__version__
    assert versions["python"] == sys.version.split()[0] and "triton" in versions
    importable = versions["importable"]
    assert {"triton", "deep_gemm", "aiter", "torch_npu"} <= set(importable)
    try:
        import triton
    except ImportError:
        assert importable["triton"] is None
    else:
        assert importable["triton"] == triton.__file__


def test_the_reference_line_is_a_check_when_another_implementation_ran():
    assert runner.reference_ran_itself({"topk_indices": ["topk_indices.reference.torch"],
                                        "lightning_indexer": ["lightning_indexer.generic.composed"]})
    assert not runner.reference_ran_itself({"topk_indices": ["topk_indices.reference.torch",
                                                             "topk_indices.triton.radix"]})


@pytest.fixture
def first_call_compiles(monkeypatch):
    """The first k_prologue_store a step runs sleeps, as a first-use JIT compile would (the fill, every decode
    step and the prefill store keys through it; every op of a step runs through its plan)."""
    from dsa_indexer.plan import StepPlan

    original, calls = StepPlan.run, []

    def slow_first(plan, role, op, *args, **kwargs):
        if op == "k_prologue_store":
            if not calls:
                time.sleep(COMPILE_S)
            calls.append(1)
        return original(plan, role, op, *args, **kwargs)

    monkeypatch.setattr(StepPlan, "run", slow_first)
    return calls


COMPILE_S = 2.0


def test_the_warm_up_phase_takes_first_use_compiles_out_of_the_timed_phases(first_call_compiles, capsys):
    report = run_main_job(RunSettings(**QUICK, warmup=True))
    out = capsys.readouterr().out
    timings = report["timings_ms"]
    assert first_call_compiles  # the stand-in compile ran
    assert list(timings) == [WARMUP, FILL, EAGER_DECODE, PREFILL] and timings[WARMUP]["count"] == 1
    assert timings[WARMUP]["median"] >= COMPILE_S * 1e3
    assert all(timings[name]["median"] < COMPILE_S * 1e3 for name in (FILL, EAGER_DECODE, PREFILL)), timings
    warmup = report["warmup"]
    assert warmup["ran"] and warmup["seconds"] >= COMPILE_S
    # Triton's (portable) first, then each platform's own: the CUDA platform's nvcc kernels and DeepGEMM's JIT
    assert [c["name"] for c in warmup["caches"]] == ["Triton", "dsa_indexer CUDA JIT (nvcc top-k)", "DeepGEMM JIT"]
    assert warmup["caches"][1]["path"] == str(jit.cache_dir()) and all("new_files" in c for c in warmup["caches"])
    assert f"{WARMUP}: {warmup['seconds']:.1f} s" in out
    assert report["q_lora_quant"] == {"reused": 3}  # the warm-up's own calls are not counted: 2 steps + prefill
    assert report["verified"] is True


def test_without_the_warm_up_the_first_phase_pays_for_the_compile(first_call_compiles, capsys):
    """The check above can fail: with the warm-up off, the compile lands in the fill."""
    report = run_main_job(RunSettings(**QUICK, warmup=False, verify=False))
    assert report["timings_ms"][FILL]["median"] >= COMPILE_S * 1e3 and WARMUP not in report["timings_ms"]


def test_the_warm_up_leaves_the_timed_run_as_it_was(capsys):
    """Same seed with and without the warm-up: the same inputs, cache and state, so the same verification."""
    sizes = dict(SIZES["deepseek-v3.2"], batch=1, steps=1)
    with_warmup = run_main_job(RunSettings(**sizes, warmup=True))["verification"]
    without = run_main_job(RunSettings(**sizes, warmup=False))["verification"]
    for result in (with_warmup, without):
        result.pop("seconds")
    assert with_warmup == without and with_warmup["decode_topk_agreement"] >= 0.99


class _ReplayThroughBuffers:
    """A stand-in for the captured `DecodeGraph` on a CPU: the same static buffers (`DecodeBuffers.load` checks
    what the runner hands in), the same on-device derivation of the batch and the same step `capture` records,
    run at replay time; ``corrupt`` swaps the requests' outputs (a wrong graph must fail the verification)."""

    def __init__(self, indexer, cache, state, batch, width, next_n, corrupt=False):
        self.indexer, self.cache, self.state, self.corrupt = indexer, cache, state, corrupt
        self.buffers = DecodeBuffers.allocate(indexer, batch, width, next_n, cache.device)
        if state is not None:
            self.buffers.num_state_slots = state.num_slots
        self.replays = 0

    def replay(self, x, q_lora, seq_lens, block_table):
        rows = self.buffers.load(x, q_lora, seq_lens, block_table)
        batch = self.buffers.derive()
        out = self.indexer.forward(self.buffers.x, self.buffers.q_lora, batch.positions, batch, self.cache,
                                   compressor_state=self.state)
        self.replays += 1
        return (out.flip(0) if self.corrupt else out)[:rows]


def _stand_in(monkeypatch, corrupt=False):
    made = []

    def capture(indexer, cache, state, batch, width, next_n):
        made.append(_ReplayThroughBuffers(indexer, cache, state, batch, width, next_n, corrupt))
        return made[-1], None

    monkeypatch.setattr(runner, "_capture_decode_graph", capture)
    return made


@pytest.mark.parametrize("model", ["deepseek-v3.2", "deepseek-v4-flash"])
def test_the_graph_decode_is_timed_per_step_next_to_eager_and_verified(model, monkeypatch, capsys):
    made = _stand_in(monkeypatch)
    sizes = SIZES[model]
    report = run_main_job(RunSettings(model=model, **sizes))
    out = capsys.readouterr().out
    assert made and made[0].replays == sizes["steps"]
    timings = report["timings_ms"]
    assert timings[GRAPH_DECODE]["count"] == timings[EAGER_DECODE]["count"] == sizes["steps"]
    graph = report["decode_graph"]
    assert graph["captured"] and graph["us_per_step"] == pytest.approx(timings[GRAPH_DECODE]["median"] * 1e3)
    assert graph["eager_us_per_step"] == pytest.approx(timings[EAGER_DECODE]["median"] * 1e3)
    assert graph["min_topk_agreement_with_eager"] >= 0.99
    assert report["verification"]["decode_graph_topk_agreement"] >= 0.99 and report["verified"] is True
    assert "per step replaying the CUDA graph" in out and "per step eager" in out


def test_a_wrong_graph_replay_fails_the_run(monkeypatch, capsys):
    _stand_in(monkeypatch, corrupt=True)
    report = run_main_job(RunSettings(**SIZES["deepseek-v3.2"]))
    assert report["verified"] is False
    assert report["verification"]["decode_graph_topk_agreement"] < runner.REFERENCE_THRESHOLD
    assert report["verification"]["decode_topk_agreement"] >= 0.99  # the eager step itself was right


def test_the_deep_gemm_install_hint_names_what_a_user_can_run():
    """The probe's message when deep_gemm does not import names a package and DeepGEMM's own instructions, not a
    script only this repository's developers had."""
    import importlib.util

    from dsa_indexer.backends.cuda import deepgemm, deepgemm_api

    hint = deepgemm_api.INSTALL_HINT
    assert "pip install sgl-deep-gemm" in hint and "github.com/deepseek-ai/DeepGEMM" in hint
    assert ".deps" not in hint and ".sh" not in hint
    if importlib.util.find_spec("deep_gemm") is None:
        assert deepgemm.LIBRARY.probe() == f"deep_gemm is not installed ({hint})"
