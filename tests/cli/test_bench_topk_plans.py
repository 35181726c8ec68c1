"""benchmarks/bench_topk_engines.py's list of our launches (issue 35): what `--plans` and `--variant` put side by side
decides which plan becomes the default, so the list is checked here on the CPU (nothing is launched: only the
labels, and that each alternative forces the plan it names)."""

import importlib.util
import types
from pathlib import Path

import torch

from dsa_indexer.backends.cuda import topk as cuda_topk

ROOT = Path(__file__).resolve().parents[2]
SMS = 132  # an H100 / H200


def _bench():
    spec = importlib.util.spec_from_file_location("bench_topk_engines", ROOT / "benchmarks" / "bench_topk_engines.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _labels(rows, width, length, plans=True, variants=()):
    args = types.SimpleNamespace(plans=plans, variant=list(variants))
    logits = torch.randn(rows, width)
    ends = torch.full((rows,), length, dtype=torch.int32)
    return _bench().ours(cuda_topk, args, logits, ends, 2048, width, SMS)


def test_without_plans_only_the_planned_launch_and_its_variants():
    impls = _labels(32, 8192, 8192, plans=False, variants=["v=DSA_X=1"])
    assert list(impls) == ["cuda.radix", "cuda.radix [v]"]


def test_the_prefill_kernel_is_forced_where_there_are_rows_for_every_sm():
    assert "cuda.radix prefill" in _labels(1024, 8192, 8192)  # planned on the register kernel
    assert "cuda.radix prefill" not in _labels(1024, 32768, 32768)  # planned on the prefill kernel itself
    assert "cuda.radix prefill" not in _labels(32, 32768, 32768)


def test_a_variant_retimes_every_launch_a_build_can_change(monkeypatch):
    impls = _labels(32, 163840, 8192, variants=["rk=DSA_TOPK_ROW_KPT=0"])
    ours = [name for name in impls if "[" not in name]
    for name in ours:
        rebuilt = f"{name} [rk]" in impls
        assert rebuilt == ("grid" not in name and "trimmed" not in name), name
    # each forced alternative runs the plan it names, from the variant's build while it runs
    seen = []
    monkeypatch.setattr(cuda_topk, "run_plan", lambda *a: seen.append((a[-1], cuda_topk.REGISTER_DEFINES)))
    monkeypatch.setattr(cuda_topk, "_registers_library", types.SimpleNamespace(cache_clear=lambda: None))
    monkeypatch.setattr(cuda_topk, "_prefill_blocks_per_sm", types.SimpleNamespace(cache_clear=lambda: None))
    monkeypatch.setattr(cuda_topk, "_stream_active_clusters", types.SimpleNamespace(cache_clear=lambda: None))
    impls["cuda.radix stream x2 [rk]"]()
    impls["cuda.radix stream x2"]()
    assert seen == [(cuda_topk.Plan("stream", 2, 0), ("DSA_TOPK_ROW_KPT=0",)),
                    (cuda_topk.Plan("stream", 2, 0), ())]
    assert cuda_topk.REGISTER_DEFINES == ()  # the shipped build again after the variant's call
