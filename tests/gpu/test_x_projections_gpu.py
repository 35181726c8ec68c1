"""The Triton x projections (`backends/triton/xproj.py`) on the GPU, V3.2 shapes: fp32 weights_proj + bf16 wk.

Tolerances and why:
- head weights (fp32) vs an fp64 reference of the same fp32 math: within 1e-5 x the row's norm (the brief's
  bound for "fp32-accurate"; the kernel sums exact products in IEEE fp32 in another order than cuBLAS, ~1e-7
  seen). Also stated against torch's fp32 F.linear (the unchanged path) with the same bound.
- k (bf16) vs the fp64 reference: within one bf16 rounding (2**-8 relative) plus 1e-3 x the row's largest
  |value| for entries near zero (fp32 accumulation in another order, then one rounding to bf16).
- every output written: the outputs are pre-filled with NaN.
- the decode step's top-k with the kernel equals the top-k with the unchanged path (x_projections forced to the
  reference: F.linear twice) on the bench's inputs (testing.decode_step).
"""

import pytest
import torch

from dsa_indexer import Indexer, IndexerConfig, default_registry
from dsa_indexer.backends.reference import kernels as ref
from dsa_indexer.backends.triton import xproj
from dsa_indexer.testing import decode_step

pytestmark = pytest.mark.gpu  # skipped without a GPU by tests/conftest.py

HIDDEN, HEADS, DIM = 7168, 64, 128
REFERENCE = "x_projections.reference.torch"
TRITON = "x_projections.triton.xproj"


def _inputs(rows: int, seed: int, wp_dtype=torch.float32):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    wp = (torch.randn(HEADS, HIDDEN, device="cuda", generator=gen) * HIDDEN ** -0.5).to(wp_dtype)
    wk = (torch.randn(DIM, HIDDEN, device="cuda", generator=gen) * HIDDEN ** -0.5).to(torch.bfloat16)
    return x, wp, wk


@pytest.mark.parametrize("rows", [1, 7, 32, 64, 100, 128, 256])
def test_x_projections_vs_fp64_reference(rows):
    x, wp, wk = _inputs(rows, seed=rows)
    hw = torch.full((rows, HEADS), float("nan"), device="cuda")
    k = torch.full((rows, DIM), float("nan"), device="cuda", dtype=torch.bfloat16)
    xproj.x_projections(x, wp, wk, out=(hw, k))
    torch.cuda.synchronize()
    assert bool(torch.isfinite(hw).all()) and bool(torch.isfinite(k).all()), "an output was not written"
    hw64 = x.double() @ wp.double().T
    row_norm = hw64.norm(dim=1, keepdim=True)
    err = ((hw.double() - hw64).abs() / row_norm).max().item()
    assert err <= 1e-5, f"head weights off by {err:.2e} of the row norm"
    torch_fp32 = ref.x_projections(x, wp, wk)[0]
    err_torch = ((hw - torch_fp32).double().abs() / row_norm).max().item()
    assert err_torch <= 1e-5, f"head weights differ from torch's fp32 GEMM by {err_torch:.2e} of the row norm"
    k64 = x.double() @ wk.double().T
    bound = 2.0 ** -8 * k64.abs() + 1e-3 * k64.abs().amax(dim=1, keepdim=True)
    assert bool(((k.double() - k64).abs() <= bound).all())
    print(f"rows {rows}: head weights err {err:.2e} (vs fp64), {err_torch:.2e} (vs torch fp32) of the row norm; "
          f"k differs from torch's bf16 GEMM in {(k != ref.x_projections(x, wp, wk)[1]).sum().item()} of "
          f"{k.numel()} entries")


def test_bf16_weights_proj_and_determinism():
    x, wp, wk = _inputs(32, seed=5, wp_dtype=torch.bfloat16)
    hw, k = xproj.x_projections(x, wp, wk)
    hw2, k2 = xproj.x_projections(x, wp, wk)
    torch.cuda.synchronize()
    assert hw.dtype == torch.bfloat16 and torch.equal(hw, hw2) and torch.equal(k, k2)
    hw64 = x.double() @ wp.double().T
    assert bool(((hw.double() - hw64).abs() <= 2.0 ** -8 * hw64.abs() + 1e-3 * hw64.abs().amax()).all())


def test_prefill_rows_run_torch_unchanged():
    x, wp, wk = _inputs(xproj.MAX_SPLIT_ROWS + 44, seed=9)
    got = xproj.x_projections(x, wp, wk)
    want = ref.x_projections(x, wp, wk)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_step_runs_the_triton_kernel_on_the_gpu():
    from dsa_indexer.pipeline import project_x

    x, _wp, _wk = _inputs(4, seed=2)
    indexer = Indexer(IndexerConfig.deepseek_v32(), device="cuda").init_random(0)
    plan = indexer.step_plan(4, True)
    project_x(plan, x)
    assert plan.kernels["x_projections"].fn.__module__ == xproj.__name__


def _decode_steps(impls: tuple[str, ...], batch: int, seed: int) -> dict:
    """One V3.2 decode step on the bench's inputs per x_projections implementation (forced): impl -> (top-k, the
    cache's bytes after the step)."""
    registry = default_registry()
    indexer = Indexer(IndexerConfig.deepseek_v32(), device="cuda").init_random(0)
    x, q_lora, _quant, db, cache, _ = decode_step(indexer.config, indexer, batch, 8192, "cuda", seed=seed)
    results = {}
    try:
        for impl in impls:
            registry.force("x_projections", impl)
            step_cache = type(cache)(cache.data.clone())
            results[impl] = (indexer(x, q_lora, db.positions, db, step_cache), step_cache.data)
    finally:
        registry.force("x_projections", None)
    torch.cuda.synchronize()
    return results


@pytest.mark.parametrize("batch", [1, 32])
def test_decode_topk_unchanged_on_the_bench_inputs(batch):
    results = _decode_steps((REFERENCE, TRITON), batch, seed=1)
    assert torch.equal(results[REFERENCE][0], results[TRITON][0])
    changed = (results[REFERENCE][1] != results[TRITON][1]).any(dim=-1).sum().item()
    print(f"batch {batch}: top-k identical; cache tokens whose stored bytes differ: {changed} of {batch}")


ONE_LAUNCH = "x_projections.triton.one_launch"


@pytest.mark.parametrize("rows", [1, 7, 32, 100, 256])
def test_one_launch_is_bit_identical_to_two_launches(rows):
    """`x_projections_one_launch` (the last split program of each tile reduces it) against the two launches: the same
    bits, every output written (NaN-filled), three launches in a row (the arrival counters go back to 0)."""
    x, wp, wk = _inputs(rows, seed=100 + rows)
    want = xproj.x_projections(x, wp, wk)
    for _ in range(3):
        hw = torch.full((rows, HEADS), float("nan"), device="cuda")
        k = torch.full((rows, DIM), float("nan"), device="cuda", dtype=torch.bfloat16)
        xproj.x_projections_one_launch(x, wp, wk, out=(hw, k))
        torch.cuda.synchronize()
        assert torch.equal(hw, want[0]) and torch.equal(k, want[1])


def test_one_launch_on_two_streams_at_once_and_in_a_graph():
    """Two streams launching at the same time each count on their own counters, and a captured graph replays it:
    every result equals the two-launch kernel's."""
    inputs = [_inputs(32, seed=200 + i) for i in range(2)]
    want = [xproj.x_projections(*args) for args in inputs]
    streams = [torch.cuda.Stream() for _ in inputs]
    outs = [[] for _ in inputs]
    torch.cuda.synchronize()
    for _ in range(20):
        for stream, args, got in zip(streams, inputs, outs):
            with torch.cuda.stream(stream):
                got.append(xproj.x_projections_one_launch(*args))
    torch.cuda.synchronize()
    for got, expected in zip(outs, want):
        assert all(torch.equal(hw, expected[0]) and torch.equal(k, expected[1]) for hw, k in got)
    x, wp, wk = inputs[0]
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        xproj.x_projections_one_launch(x, wp, wk)  # warm-up (compile) outside the capture
        with torch.cuda.graph(graph, stream=side):
            captured = xproj.x_projections_one_launch(x, wp, wk)
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured[0], want[0][0]) and torch.equal(captured[1], want[0][1])


@pytest.mark.parametrize("batch", [1, 32])
def test_decode_step_with_the_one_launch_projections_is_unchanged(batch):
    results = _decode_steps((TRITON, ONE_LAUNCH), batch, seed=3)
    assert torch.equal(results[TRITON][0], results[ONE_LAUNCH][0])
    assert torch.equal(results[TRITON][1], results[ONE_LAUNCH][1])
