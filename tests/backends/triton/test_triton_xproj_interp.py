"""The x projections kernel (`backends/triton/xproj.py`) against fp64 on random inputs (interpreter on CPU,
compiled on a GPU), and the op's resolution on a CPU.

Tolerances: head weights (fp32) within 1e-5 x the row norm of the fp64 result (fp32 sums of exact products, in
another order than torch's); k (bf16) within one bf16 rounding (2**-8 relative) plus 1e-3 x the row's largest
|value| (the fp32 sum in another order, then one rounding). Outputs are pre-filled with NaN: every one written."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not importable")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows, hidden, heads, dim, wp_dtype", [
    (1, 640, 64, 128, torch.float32),   # several K splits, a hidden size no split divides
    (5, 256, 20, 24, torch.float32),    # column tiles that straddle H and D
    (17, 384, 16, 32, torch.bfloat16),  # a bf16 weights_proj: head weights out in bf16
])
def test_x_projections_kernel_vs_fp64(rows, hidden, heads, dim, wp_dtype):
    from dsa_indexer.backends.triton import xproj

    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    x = torch.randn(rows, hidden, generator=g).to(DEVICE, torch.bfloat16)
    wp = torch.randn(heads, hidden, generator=g).to(DEVICE, wp_dtype)
    wk = torch.randn(dim, hidden, generator=g).to(DEVICE, torch.bfloat16)
    assert xproj.split_plan(rows, hidden, heads, dim, 24)[2] > 1  # the split path (on a CPU, 24 "SMs")
    hw = torch.full((rows, heads), float("nan"), dtype=wp_dtype, device=DEVICE)
    k = torch.full((rows, dim), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    xproj.x_projections(x, wp, wk, out=(hw, k))
    assert bool(torch.isfinite(hw).all()) and bool(torch.isfinite(k).all()), "an output was not written"
    hw64 = x.double() @ wp.double().T
    k64 = x.double() @ wk.double().T
    if wp_dtype == torch.float32:
        assert ((hw.double() - hw64).abs() / hw64.norm(dim=1, keepdim=True)).max().item() <= 1e-5
    else:
        assert bool(((hw.double() - hw64).abs() <= 2.0 ** -8 * hw64.abs() + 1e-3 * hw64.abs().amax(1, True)).all())
    assert bool(((k.double() - k64).abs() <= 2.0 ** -8 * k64.abs() + 1e-3 * k64.abs().amax(1, True)).all())


def test_the_step_keeps_torchs_gemms_where_no_kernel_serves():
    """On a CPU the op resolves to torch's two GEMMs (generic, not a fallback): the step's head weights and k are
    bitwise what the two F.linear calls give."""
    from dsa_indexer import Indexer, IndexerConfig, ops
    from dsa_indexer.pipeline import project_head_weights, project_k, project_x

    indexer = Indexer(IndexerConfig.deepseek_v32(), device="cpu").init_random(3)
    plan = indexer.step_plan(3, True)
    x = torch.randn(3, indexer.config.hidden_size).to(torch.bfloat16)
    head_weights, k = project_x(plan, x)
    assert head_weights.dtype == torch.float32 and k.dtype == torch.bfloat16
    assert torch.equal(head_weights, project_head_weights(plan, x)) and torch.equal(k, project_k(plan, x))
    problem = ops.x_projections.problem(x, plan.weights.weights_proj, plan.weights.wk)
    resolution = plan.registry.choose("x_projections", plan.target, problem)
    assert resolution.chosen.impl_id == "x_projections.generic.torch" and not resolution.is_fallback


@pytest.mark.parametrize("rows, hidden, heads, dim, wp_dtype", [
    (1, 640, 64, 128, torch.float32),
    (5, 256, 20, 24, torch.float32),
    (70, 384, 16, 32, torch.bfloat16),  # two row tiles of 64
])
def test_one_launch_equals_the_two_launches_bit_for_bit(rows, hidden, heads, dim, wp_dtype):
    """`x_projections_one_launch`: the last program of each tile to arrive sums the partials in the same split order,
    so the outputs equal the two-launch kernel's exactly; every output is written (NaN-filled buffers), and every
    arrival counter is back at 0 for the next launch (run twice: a counter left over would skip a reduce)."""
    from dsa_indexer.backends.triton import xproj

    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    x = torch.randn(rows, hidden, generator=g).to(DEVICE, torch.bfloat16)
    wp = torch.randn(heads, hidden, generator=g).to(DEVICE, wp_dtype)
    wk = torch.randn(dim, hidden, generator=g).to(DEVICE, torch.bfloat16)
    want_hw, want_k = xproj.x_projections(x, wp, wk)
    for _ in range(2):
        hw = torch.full((rows, heads), float("nan"), dtype=wp_dtype, device=DEVICE)
        k = torch.full((rows, dim), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        xproj.x_projections_one_launch(x, wp, wk, out=(hw, k))
        assert torch.equal(hw, want_hw) and torch.equal(k, want_k)
        counters = xproj._arrival_counters(torch.device(DEVICE), 1)
        assert int(counters.abs().sum()) == 0, "an arrival counter was not set back to 0"
