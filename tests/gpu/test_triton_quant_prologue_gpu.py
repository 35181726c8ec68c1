"""The Triton quant / prologue / GEMM kernels against the pure-torch reference on the GPU, at model shapes.

DeepSeek-V3.2 sizes: index heads H=64, head dim 128, q_lora_rank 1536, hidden 7168; wq_b is 1536 -> 64*128.

Tolerances and why:
- quant_fp8_groups / rmsnorm_quant_fp8: bit-identical (no summation in the quant; the fused kernel's fp8 copy
  is compared with quant_fp8_groups of its own normed output, the normed output within 1 bf16 ulp).
- q_prologue / k_prologue_store: the Hadamard sums in another order than the reference's fp32 matmul, so a few
  pre-quant values cross an fp8 rounding boundary: payloads differ by at most 1 fp8 ulp in at most 0.1% of the
  elements; scales rtol 1e-5. ue8m0 scales are exactly equal, except in the rare group whose amax sits within
  a rounding error of a power-of-two boundary: the other summation order can put it on the other side, and the
  scales are then exactly a factor 2 apart (at most 1e-5 of the groups; their payloads are not compared).
- gemm_fp8_blockscale: relative Frobenius error < 1e-2 vs the fp32 reference for bf16 output (one bf16
  rounding: ~2e-3 expected), < 5e-4 for fp32 output (Hopper's fp8 MMA accumulates each 128-deep K block with
  reduced precision, ~1.3e-4 measured on the H200).
"""

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not importable")

from dsa_indexer.backends.reference import kernels as ref  # noqa: E402
from dsa_indexer.backends.triton import gemm as tgemm  # noqa: E402
from dsa_indexer.backends.triton import prologue as tprologue  # noqa: E402
from dsa_indexer.backends.triton import quant as tquant  # noqa: E402
from dsa_indexer.contract.cache import PAGE_SIZE, page_views  # noqa: E402

pytestmark = pytest.mark.gpu  # skipped without a GPU by tests/conftest.py

HEADS, DIM = 64, 128
TOKENS = [1, 7, 128, 4096]
ROPES = {"v32_neox_first64": (0, 64, False), "v4_interleaved_last64": (64, 64, True)}


@pytest.fixture
def device() -> str:
    return "cuda"


def _fp8_dtype() -> torch.dtype:
    if torch.version.hip and "gfx942" in torch.cuda.get_device_properties(0).gcnArchName:
        return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


# ----------------------------------------------------------------------------------------------------------------
# helpers
def _poison(*outputs: tuple[tuple[int, ...], torch.dtype], device: str = "cuda") -> None:
    """Allocate and free 0xFF-filled blocks of the output sizes: the caching allocator hands them back to the
    op's ``torch.empty`` calls, so unwritten elements show up as NaN / garbage in the full comparisons."""
    bait = [torch.full((torch.Size(shape).numel() * dtype.itemsize,), 255, dtype=torch.uint8, device=device)
            for shape, dtype in outputs]
    del bait


def _fp8_ordinal(x: torch.Tensor) -> torch.Tensor:
    bits = x.view(torch.uint8).to(torch.int32)
    mag = bits & 0x7F
    return torch.where(bits >= 0x80, -mag, mag)


def assert_fp8_close(got: torch.Tensor, want: torch.Tensor, max_frac: float = 1e-3) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not torch.isnan(got.float()).any(), "NaN in the fp8 output"
    step = (_fp8_ordinal(got) - _fp8_ordinal(want)).abs()
    if step.numel() == 0:
        return
    assert int(step.max()) <= 1, f"fp8 payload off by {int(step.max())} ulp"
    frac = step.count_nonzero().item() / step.numel()
    assert frac <= max_frac, f"{frac:.4%} of the fp8 payloads differ by 1 ulp (limit {max_frac:.2%})"


def check_scales(got: torch.Tensor, want: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    """Assert the scale tolerance; return the mask of groups whose payloads are comparable."""
    if not ue8m0:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
        return torch.ones_like(got, dtype=torch.bool)
    differ = got != want
    if differ.any():
        # Only an amax on a power-of-two boundary, moved across it by summation order: a factor 2, and rare.
        assert torch.equal(torch.maximum(got[differ], want[differ]), torch.minimum(got[differ], want[differ]) * 2), \
            "ue8m0 scales differ by more than one power of two"
        assert int(differ.sum()) <= max(2, int(1e-5 * got.numel())), f"{int(differ.sum())} ue8m0 scales differ"
    return ~differ


def _cos_sin(max_pos: int, rope_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim))
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=1).float().cuda()


# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32scale", "ue8m0"])
@pytest.mark.parametrize("width", [1536, 7168])
@pytest.mark.parametrize("tokens", TOKENS)
def test_quant_fp8_groups_gpu(tokens, width, ue8m0):
    fp8 = _fp8_dtype()
    x = (torch.randn(tokens, width, device="cuda") * 3).to(torch.bfloat16)
    _poison(((tokens, width), fp8), ((tokens, width // 128), torch.float32))
    q, s = tquant.quant_fp8_groups(x, 128, ue8m0, fp8)
    rq, rs = ref.quant_fp8_groups(x, 128, ue8m0, fp8)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s, rs)


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32scale", "ue8m0"])
@pytest.mark.parametrize("width", [1536, 7168])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rmsnorm_quant_fp8_gpu(tokens, width, ue8m0):
    fp8 = _fp8_dtype()
    x = (torch.randn(tokens, width, device="cuda") * 2 + 0.3).to(torch.bfloat16)
    weight = (torch.randn(width, device="cuda") * 0.5 + 1).to(torch.bfloat16)
    _poison(((tokens, width), torch.bfloat16), ((tokens, width), fp8), ((tokens, width // 128), torch.float32))
    normed, q, s = tquant.rmsnorm_quant_fp8(x, weight, 1e-6, 128, ue8m0, fp8)
    rnormed, _, _ = ref.rmsnorm_quant_fp8(x, weight, 1e-6, 128, ue8m0, fp8)
    q2, s2 = ref.quant_fp8_groups(normed, 128, ue8m0, fp8)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8))
    assert torch.equal(s, s2)
    ulp = torch.finfo(torch.bfloat16).eps * rnormed.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    assert bool(((normed.float() - rnormed.float()).abs() <= ulp * 1.001).all())


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32scale", "ue8m0"])
@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("tokens", TOKENS)
def test_q_prologue_gpu(tokens, rope, ue8m0):
    fp8 = _fp8_dtype()
    rope_offset, rope_dim, interleaved = ROPES[rope]
    q = torch.randn(tokens, HEADS, DIM, device="cuda").to(torch.bfloat16)
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    cos_sin = _cos_sin(8192, rope_dim)
    # Nonzero head weights: the q scales are recovered below as w / head_weights.
    sign = torch.randint(0, 2, (tokens, HEADS), device="cuda") * 2 - 1
    head_weights = ((torch.rand(tokens, HEADS, device="cuda") + 0.1) * sign).to(torch.bfloat16)
    weight_scale = HEADS ** -0.5 * DIM ** -0.5
    _poison(((tokens, HEADS, DIM), fp8), ((tokens, HEADS), torch.float32))
    q_fp8, w = tprologue.q_prologue(q, positions, cos_sin, head_weights, weight_scale, rope_offset, interleaved,
                                    ue8m0, fp8)
    rq_fp8, rw = ref.q_prologue(q, positions, cos_sin, head_weights, weight_scale, rope_offset, interleaved, ue8m0, fp8)
    # weights = head_weights * weight_scale * q_scale, so the q scales are w / (head_weights * weight_scale).
    base = head_weights.float() * weight_scale
    ok = check_scales(w / base, rw / base, ue8m0)
    if not ue8m0:
        torch.testing.assert_close(w, rw, rtol=1e-5, atol=0)
    assert_fp8_close(q_fp8[ok], rq_fp8[ok])


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32scale", "ue8m0"])
@pytest.mark.parametrize("norm,rope", [("layernorm", "v32_neox_first64"), ("none", "v4_interleaved_last64")])
@pytest.mark.parametrize("tokens", TOKENS)
def test_k_prologue_store_gpu(tokens, norm, rope, ue8m0):
    fp8 = _fp8_dtype()
    rope_offset, rope_dim, interleaved = ROPES[rope]
    pages = tokens * 3 // (2 * PAGE_SIZE) + 2
    k = (torch.randn(tokens, DIM, device="cuda") * 2 + 0.5).to(torch.bfloat16)
    norm_weight = (torch.randn(DIM, device="cuda") * 0.3 + 1).to(torch.bfloat16)
    norm_bias = (torch.randn(DIM, device="cuda") * 0.3).to(torch.bfloat16)
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    cos_sin = _cos_sin(8192, rope_dim)
    slots = torch.randperm(pages * PAGE_SIZE, device="cuda")[:tokens]
    slots[torch.rand(tokens, device="cuda") < 0.1] = -1
    cache = torch.randint(0, 256, (pages, PAGE_SIZE, 1, 132), dtype=torch.uint8, device="cuda")
    before, rcache = cache.clone(), cache.clone()
    tprologue.k_prologue_store(k, norm_weight, norm_bias, 1e-6, positions, cos_sin, cache, slots, rope_offset,
                               interleaved, ue8m0, fp8, norm)
    ref.k_prologue_store(k, norm_weight, norm_bias, 1e-6, positions, cos_sin, rcache, slots, rope_offset,
                         interleaved, ue8m0, fp8, norm)
    keys, scales = (t.reshape(-1, *t.shape[2:]) for t in page_views(cache, fp8))
    rkeys, rscales = (t.reshape(-1, *t.shape[2:]) for t in page_views(rcache, fp8))
    bkeys, bscales = (t.reshape(-1, *t.shape[2:]) for t in page_views(before, fp8))
    kept = slots[slots >= 0].long()
    untouched = torch.ones(pages * PAGE_SIZE, dtype=torch.bool, device="cuda")
    untouched[kept] = False
    assert torch.equal(keys[untouched].view(torch.uint8), bkeys[untouched].view(torch.uint8))
    assert torch.equal(scales[untouched].view(torch.int32), bscales[untouched].view(torch.int32))
    ok = check_scales(scales[kept], rscales[kept], ue8m0)
    assert_fp8_close(keys[kept][ok], rkeys[kept][ok])


def _block_quant_weight(w: torch.Tensor, fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 block fp8 quantization of a weight [N, K] (the checkpoint format of wq_b)."""
    n, k = w.shape
    blocks = w.float().reshape(n // 128, 128, k // 128, 128)
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-4) / tquant.fp8_max(fp8)
    fmax = tquant.fp8_max(fp8)
    q = (blocks / scale).clamp(-fmax, fmax).to(fp8).reshape(n, k)
    return q, scale.reshape(n // 128, k // 128)


@pytest.mark.parametrize("n,k", [(8192, 1536), (16384, 1024)])
@pytest.mark.parametrize("m", [1, 33, 512, 2048])
def test_gemm_fp8_blockscale_gpu(m, n, k):
    fp8 = _fp8_dtype()
    a, a_scales = ref.quant_fp8_groups(torch.randn(m, k, device="cuda").to(torch.bfloat16), 128, False, fp8)
    b, b_scales = _block_quant_weight(torch.randn(n, k, device="cuda") * 0.02, fp8)
    _poison(((m, n), torch.bfloat16))
    out = tgemm.gemm_fp8_blockscale(a, a_scales, b, b_scales)
    want = ref.gemm_fp8_blockscale(a, a_scales, b, b_scales, torch.float32)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    rel = ((out.float() - want).norm() / want.norm()).item()
    assert rel < 1e-2, rel
    out32 = tgemm.gemm_fp8_blockscale(a, a_scales, b, b_scales, torch.float32)
    rel32 = ((out32 - want).norm() / want.norm()).item()
    # Hopper's fp8 tensor-core MMA accumulates inside each 128-deep K block with a reduced-precision adder
    # (about 2**-13 relative, the reason DeepGEMM promotes partial sums to fp32 registers per block): 5e-4.
    assert rel32 < 5e-4, rel32
