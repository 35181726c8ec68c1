"""The Triton FP4 q prologue (`backends/triton/prologue.q_prologue_fp4`) against V4's FP4 recipe written here from
its description (tests/fp4_recipe.py: RoPE rounded to q's dtype, the orthonormal Hadamard as the radix-2
butterfly transform times fp32(D^-0.5) rounded to bf16, the reference's e2m1 quant and fold).

Tolerance: none. Every step is a fixed sequence of correctly rounded fp32 operations, so the fp8 bytes and the
fp32 weights must be bit-identical (on the CPU interpreter here; tests/gpu/test_fp4_gpu.py checks the compiled
kernel on the H200). Without CUDA the kernel runs in the Triton CPU interpreter (TRITON_INTERPRET=1)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not importable")

from dsa_indexer.backends.reference import kernels as ref  # noqa: E402
from dsa_indexer.backends.triton import prologue as tprologue  # noqa: E402
from fp4_recipe import butterfly_hadamard, fp4_q_recipe, rotate_bf16  # noqa: E402

ROPES = {"v4_interleaved_last64": (64, 64, True), "v32_neox_first64": (0, 64, False), "neox_mid32": (32, 32, False),
         "interleaved_all": (0, 128, True)}


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(tokens, heads, rope_dim, seed, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    # Rows of very different magnitudes, so the four blocks of a row get different scales (the fold matters).
    q = torch.randn(tokens, heads, 128, generator=gen) * torch.rand(tokens, heads, 1, generator=gen) * 4
    q = q * torch.exp2(torch.randint(-3, 4, (tokens, heads, 4, 1), generator=gen).float()).repeat_interleave(32, 2)[
        ..., 0]
    positions = torch.randint(0, 300, (tokens,), generator=gen)
    angles = torch.rand(300, rope_dim // 2, generator=gen, dtype=torch.float64) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).float()
    head_weights = torch.randn(tokens, heads, generator=gen).to(torch.bfloat16)
    return q.to(dtype), positions, cos_sin, head_weights


def _same_bits(got, want):
    g8, w8 = got[0].view(torch.uint8).cpu(), want[0].view(torch.uint8)
    return torch.equal(g8, w8) and torch.equal(got[1].cpu().view(torch.int32), want[1].view(torch.int32))


def test_butterfly_is_the_orthonormal_hadamard():
    x = torch.randn(16, 128, dtype=torch.float64)
    got = butterfly_hadamard(x) * 128 ** -0.5
    torch.testing.assert_close(got, x @ ref.hadamard_matrix(128, torch.device("cpu")).double(), rtol=1e-6,
                               atol=1e-6)


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_fp4_prologue_is_bit_identical_to_the_recipe(device, rope, fp8_dtype):
    if device == "cuda" and fp8_dtype == torch.float8_e4m3fnuz and torch.version.hip is None:
        pytest.skip("e4m3fnuz compiles for AMD only")
    offset, rope_dim, interleaved = ROPES[rope]
    q, positions, cos_sin, head_weights = _inputs(6, 16, rope_dim, seed=3)
    want = fp4_q_recipe(q, positions, cos_sin, head_weights, 0.0883, offset, interleaved, 32, fp8_dtype)
    got = tprologue.q_prologue_fp4(q.to(device), positions.to(device), cos_sin.to(device),
                                   head_weights.to(device), 0.0883, offset, interleaved, 32, fp8_dtype)
    assert got[0].dtype == fp8_dtype and got[1].dtype == torch.float32
    assert _same_bits(got, want)


@pytest.mark.parametrize("block", [16, 64, 128])
def test_other_blocks_and_fp32_q(device, block):
    q, positions, cos_sin, head_weights = _inputs(3, 8, 64, seed=block, dtype=torch.float32)
    want = fp4_q_recipe(q, positions, cos_sin, head_weights, 1.0, 64, True, block, torch.float8_e4m3fn)
    got = tprologue.q_prologue_fp4(q.to(device), positions.to(device), cos_sin.to(device),
                                   head_weights.to(device), 1.0, 64, True, block)
    assert _same_bits(got, want)


def test_edge_rows_and_every_output_written(device):
    """Zero, -0.0, tiny (the amax floor and e4m3 subnormals after the fold), huge and one-hot rows; the outputs
    are handed in filled with NaN, so an element the kernel skips cannot match."""
    q, positions, cos_sin, head_weights = _inputs(5, 8, 64, seed=11, dtype=torch.float32)
    q[0, 0] = 0.0
    q[0, 1] = -0.0
    q[1, 2, :32] = 1e-30
    q[1, 3] *= 2.0 ** -100
    q[2, 4, :64] *= 2.0 ** -20  # blocks 2^20 apart: the fold keeps the small ones as e4m3 subnormals
    q[2, 5] *= 1e30
    q[3, 6] = 0.0
    q[3, 6, 7] = 3.0
    q = q.to(torch.bfloat16)
    want = fp4_q_recipe(q, positions, cos_sin, head_weights, 0.25, 64, True, 32, torch.float8_e4m3fn)
    q_fp8 = torch.full((5, 8, 128), float("nan"), device=device).to(torch.float8_e4m3fn)
    weights = torch.full((5, 8), float("nan"), device=device)
    tprologue.q_prologue_fp4_into(q.to(device), positions.to(device), cos_sin.to(device), head_weights.to(device),
                                  0.25, 64, True, 32, q_fp8, weights)
    assert _same_bits((q_fp8, weights), want)


def test_a_nan_row_stays_nan(device):
    q, positions, cos_sin, head_weights = _inputs(2, 8, 64, seed=5)
    q[1, 3, 5] = float("nan")
    _, weights = tprologue.q_prologue_fp4(q.to(device), positions.to(device), cos_sin.to(device),
                                          head_weights.to(device), 1.0, 64, True, 32)
    weights = weights.cpu()
    assert bool(torch.isnan(weights[1, 3])) and bool(torch.isfinite(weights[0]).all())


def test_a_different_rounding_would_be_caught():
    """The comparison can fail: DeepGEMM's test quantizer rounds e2m1 ties down (0.75 -> 0.5, 2.5 -> 2 stays, 5
    -> 4): ties exist in random bf16 data, and rounding them the other way changes the bytes."""
    q, positions, cos_sin, head_weights = _inputs(8, 16, 64, seed=2)
    want = fp4_q_recipe(q, positions, cos_sin, head_weights, 1.0, 64, True, 32, torch.float8_e4m3fn)
    roped = ref.apply_rope(q.float(), positions, cos_sin, 64, True).to(q.dtype)
    rotated = rotate_bf16(roped).float()
    values, scales = ref.quant_fp4_e2m1(rotated, 32)
    y = (rotated.reshape(8, 16, 4, 32) / scales[..., None]).clamp(-6, 6)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    ties_down = grid[(y.abs()[..., None] > (grid[1:] + grid[:-1]) / 2).sum(-1)] * y.sign()
    mutated = ref.fold_fp4_to_fp8(ties_down.reshape(8, 16, 128), scales, torch.float8_e4m3fn)
    assert not torch.equal(mutated[0].view(torch.uint8), want[0].view(torch.uint8))


def test_bad_shapes_raise():
    q = torch.zeros(2, 4, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        tprologue.q_prologue_fp4(q, torch.zeros(2, dtype=torch.int64), torch.zeros(4, 64), torch.zeros(2, 4), 1.0)
    q = torch.zeros(2, 4, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="FP4 block"):
        tprologue.q_prologue_fp4(q, torch.zeros(2, dtype=torch.int64), torch.zeros(4, 64), torch.zeros(2, 4), 1.0,
                                 block=48)


def test_the_registered_reference_is_the_recipe():
    """`ops.q_prologue_fp4`'s reference computes the same bits (its Hadamard is the butterfly transform too), so the
    Triton kernel is bit-identical to the reference it is registered beside."""
    q, positions, cos_sin, head_weights = _inputs(40, 16, 64, seed=9)
    want = fp4_q_recipe(q, positions, cos_sin, head_weights, 0.0883, 64, True, 32, torch.float8_e4m3fn)
    got = ref.q_prologue_fp4(q, positions, cos_sin, head_weights, 0.0883, 64, True, 32, torch.float8_e4m3fn)
    assert _same_bits(got, want)
    keys = ref.rotate_quant_fp4(q.reshape(-1, 128))  # the compressor's keys go through the same rotation
    assert torch.equal(keys[0].view(torch.uint8), ref.fold_fp4_to_fp8(
        *ref.quant_fp4_e2m1(rotate_bf16(q.reshape(-1, 128)), 32), torch.float8_e4m3fn)[0].view(torch.uint8))
