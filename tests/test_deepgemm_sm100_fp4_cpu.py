"""DeepGEMM's sm100 layouts without a GPU: the packed ue8m0 scales the sm100 GEMM reads, and the FP4 e2m1 operands of
``fp8_fp4_mqa_logits`` (DeepGEMM at commit 54e2261: csrc/apis/gemm.hpp, attention.hpp, layout.hpp, smxx_layout.hpp).

`FakeDeepGemmSm100` below is a TEST DOUBLE, not DeepGEMM: plain Python functions with the real functions' names,
parameter lists and the argument checks DeepGEMM's C++ makes on sm100 (dtype, shape and strides of the scale
tensors, the recipe), which then decode the packed inputs with an unpacking written here, independently of the
adapter's packing, and compute with the reference kernels. They test how the adapters lay the data out for the
real API; they say nothing about DeepGEMM's kernels (no sm100 GPU was available to run them).
"""

import types

import pytest
import torch

from dsa_indexer.backends.cuda import deepgemm as dg
from dsa_indexer.backends.reference import kernels as ref
from dsa_indexer.contract.validate import IndexerInputError
from fp4_recipe import rotate_bf16

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# --- independent decoders -------------------------------------------------------------------------------------------
def unpack_ue8m0_words(words: torch.Tensor, groups: int) -> torch.Tensor:
    """int32 words of 4 ue8m0 bytes each -> fp32 scales [..., groups] (byte j of word w is group 4w + j)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = []
    for g in range(groups):
        byte = (w[..., g // 4] >> (8 * (g % 4))) & 0xFF
        out.append(torch.ldexp(torch.ones(byte.shape, dtype=torch.float64), byte - 127).float())
    return torch.stack(out, dim=-1)


def decode_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """int8 [..., D/2] packed FP4 -> fp32 [..., D]: low nibble first, bit 3 the sign, bits 0-2 index E2M1."""
    u = packed.view(torch.uint8).to(torch.int64)
    out = torch.empty(*u.shape[:-1], u.shape[-1] * 2)
    for part, nib in ((0, u & 0xF), (1, u >> 4)):
        mag = torch.tensor(E2M1)[nib & 7]
        out[..., part::2] = torch.where((nib & 8) != 0, -mag, mag)
    return out


def tma_mn(mn: int) -> int:
    return (mn + 3) // 4 * 4


def random_pow2(shape, gen, low=-20, high=4):
    return torch.exp2(torch.randint(low, high, shape, generator=gen).float())


# --- the test double --------------------------------------------------------------------------------------------------
class FakeDeepGemmSm100(types.ModuleType):
    """A stand-in for ``deep_gemm`` 2.x on an sm100 GPU (see the module docstring): argument checks as DeepGEMM's, then
    the math through the reference kernels on the independently decoded inputs."""

    def __init__(self):
        super().__init__("deep_gemm")
        self.__version__ = "0.0-fake-sm100"
        self.calls = []

    def fp8_fp4_gemm_nt(self, a, b, d, c=None, recipe=None, recipe_a=None, recipe_b=None, compiled_dims="nk",
                        disable_ue8m0_cast=False):
        (a_fp8, sfa), (b_fp8, sfb) = a, b
        self.calls.append(("fp8_fp4_gemm_nt", recipe))
        m, k = a_fp8.shape
        n = b_fp8.shape[0]
        # transform_sf_into_required_layout on sm100 with int scales: recipe (1, 1, gran_k) and check_sf_layout
        assert recipe == (1, 1, 128), recipe
        for sf, mn in ((sfa, m), (sfb, n)):
            assert sf.dtype == torch.int32
            assert sf.shape == (mn, -(-k // (128 * 4))), (sf.shape, mn, k)
            assert sf.stride(-2) == 1 or mn == 1
            assert sf.stride(-1) == tma_mn(mn)
        sa = unpack_ue8m0_words(sfa, k // 128)
        sb_rows = unpack_ue8m0_words(sfb, k // 128)
        # The per-row b scales must be the 128 x 128 block scales broadcast: take one row per block.
        blocks = sb_rows[::128]
        assert torch.equal(sb_rows, blocks.repeat_interleave(128, 0)[:n])
        d.copy_(ref.gemm_fp8_blockscale(a_fp8, sa, b_fp8, blocks, d.dtype))

    fp8_gemm_nt = fp8_fp4_gemm_nt

    def fp8_fp4_mqa_logits(self, q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=True,
                           max_seqlen_k=0, logits_dtype=torch.float32):
        (q_fp, q_sf), (kv_fp, kv_sf) = q, kv
        self.calls.append(("fp8_fp4_mqa_logits", q_sf is not None))
        assert q_sf is not None, "this double only takes the FP4 form"
        seq_len, heads, half = q_fp.shape
        assert q_fp.dtype == torch.int8 and q_fp.is_contiguous() and half * 2 in (64, 128)
        assert q_sf.dtype == torch.int32 and q_sf.shape == (seq_len, heads) and q_sf.is_contiguous()
        assert kv_fp.dtype == torch.int8 and kv_fp.shape[1] == half and kv_fp.is_contiguous()
        assert kv_sf.dtype == torch.int32 and kv_sf.shape == (kv_fp.shape[0],) and kv_sf.is_contiguous()
        assert weights.dtype == torch.float32 and weights.shape == (seq_len, heads) and weights.stride(1) == 1
        blocks = half * 2 // 32
        qv = decode_e2m1(q_fp) * unpack_ue8m0_words(q_sf[..., None], blocks).repeat_interleave(32, -1)
        kvv = decode_e2m1(kv_fp) * unpack_ue8m0_words(kv_sf[..., None], blocks).repeat_interleave(32, -1)
        # fp32 values (exact products of e2m1 and powers of two) through the fp8 reference with unit key scales
        ones = torch.ones(kv_fp.shape[0])
        return ref.ragged_mqa_logits(qv, kvv, ones, weights, cu_seq_len_k_start, cu_seq_len_k_end)


def _api(module):
    api = dg.detect_api(module)
    assert api.gemm_fn == "fp8_fp4_gemm_nt" and "recipe" in api.gemm_params
    return api


# --- packed ue8m0 -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mn, groups", [(1, 1), (3, 4), (64, 7), (130, 56)])
def test_pack_ue8m0_layout(mn, groups):
    gen = torch.Generator().manual_seed(mn * 100 + groups)
    scales = random_pow2((mn, groups), gen, -126, 127)
    packed = dg.pack_ue8m0(scales)
    words = -(-groups // 4)
    assert packed.dtype == torch.int32 and packed.shape == (mn, words) and packed.stride() == (1, tma_mn(mn))
    assert torch.equal(unpack_ue8m0_words(packed, groups), scales)
    if groups % 4:  # the bytes past the last group are zero
        last = (packed[:, -1].to(torch.int64) & 0xFFFFFFFF) >> (8 * (groups % 4))
        assert bool((last == 0).all())


def test_pack_ue8m0_rows_pads_with_one():
    gen = torch.Generator().manual_seed(4)
    scales = random_pow2((5, 3, 2), gen)
    packed = dg.pack_ue8m0_rows(scales)
    assert packed.shape == (5, 3) and packed.dtype == torch.int32
    got = unpack_ue8m0_words(packed[..., None], 4)
    assert torch.equal(got[..., :2], scales) and bool((got[..., 2:] == 1.0).all())


def test_sm100_gemm_packs_the_scales_and_matches_the_reference():
    gen = torch.Generator().manual_seed(0)
    m, n, k = 5, 200, 384  # M and N not multiples of 4 or 128: padding of the MN stride and of b's last block
    a = (torch.randn(m, k, generator=gen) * 4).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, generator=gen) * 4).to(torch.float8_e4m3fn)
    sa = random_pow2((m, k // 128), gen)
    sb = random_pow2((-(-n // 128), k // 128), gen)
    module = FakeDeepGemmSm100()
    gemm = dg.make_gemm_fp8_blockscale(module, _api(module), arch_major=10)
    got = gemm(a, sa, b, sb)
    assert module.calls == [("fp8_fp4_gemm_nt", (1, 1, 128))]
    assert torch.equal(got, ref.gemm_fp8_blockscale(a, sa, b, sb))
    assert torch.equal(gemm(a, sa, b, sb), got)  # the weight's packed scales come from the memo the second time


def test_sm100_gemm_refuses_scales_that_are_not_powers_of_two():
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(4, 256, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(128, 256, generator=gen).to(torch.float8_e4m3fn)
    module = FakeDeepGemmSm100()
    gemm = dg.make_gemm_fp8_blockscale(module, _api(module), arch_major=10)
    with pytest.raises(IndexerInputError, match="a_scales must be powers of two.*ue8m0"):
        gemm(a, torch.rand(4, 2, generator=gen) + 0.1, b, torch.ones(1, 2))
    with pytest.raises(IndexerInputError, match="b_scales must be powers of two"):
        gemm(a, torch.ones(4, 2), b, torch.full((1, 2), 0.3))
    assert module.calls == []


def test_sm90_gemm_keeps_fp32_scales():
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(4, 256, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(128, 256, generator=gen).to(torch.float8_e4m3fn)
    seen = {}

    def fp8_fp4_gemm_nt(a, b, d, c=None, recipe=None, recipe_a=None, recipe_b=None, compiled_dims="nk",
                        disable_ue8m0_cast=False):
        seen.update(recipe=recipe, sfa=a[1].dtype, sfb=b[1].dtype)
        d.copy_(ref.gemm_fp8_blockscale(a[0], a[1], b[0], b[1], d.dtype))

    module = types.ModuleType("deep_gemm")
    module.fp8_fp4_gemm_nt = fp8_fp4_gemm_nt
    sa, sb = torch.rand(4, 2, generator=gen) + 0.5, torch.rand(1, 2, generator=gen) + 0.5
    got = dg.make_gemm_fp8_blockscale(module, _api(module), arch_major=9)(a, sa, b, sb)
    assert seen == {"recipe": (1, 128, 128), "sfa": torch.float32, "sfb": torch.float32}
    assert torch.equal(got, ref.gemm_fp8_blockscale(a, sa, b, sb))


# --- FP4 e2m1 -------------------------------------------------------------------------------------------------------
def _fp4_rows(rows, seed):
    """Rows as the FP4 recipe stores them: rotated, e2m1 per 32 with power-of-two scales, folded into fp8."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 128, generator=gen) * torch.exp2(torch.randint(-4, 5, (rows, 4, 1), generator=gen).float()
                                                           ).repeat_interleave(32, 1)[..., 0]
    values, scales = ref.quant_fp4_e2m1(rotate_bf16(x), 32)
    folded, row_scale = ref.fold_fp4_to_fp8(values, scales, torch.float8_e4m3fn)
    return folded, row_scale, ref.dequant_fp4_e2m1(values, scales)


def test_pack_e2m1_round_trips_every_code():
    values = torch.tensor([E2M1 + [-v for v in E2M1]])  # -0.0 encodes as +0 (code 0)
    assert torch.equal(decode_e2m1(dg.pack_e2m1(values)), values.abs() * torch.where(values < 0, -1.0, 1.0))
    packed = dg.pack_e2m1(torch.tensor([[0.5, -6.0]]))
    assert packed.view(torch.uint8).item() == (0x1 | (0xF << 4))  # 0.5 = code 1 low, -6 = sign | code 7 high


def test_unfold_recovers_the_fp4_values_exactly():
    folded, row_scale, fp4 = _fp4_rows(300, seed=3)
    values, blocks = dg.unfold_fp4_rows(folded, row_scale)
    assert bool(torch.isin(values.abs(), torch.tensor(E2M1)).all())
    assert torch.equal(values * blocks.repeat_interleave(32, -1), fp4)
    assert torch.equal(decode_e2m1(dg.pack_e2m1(values)) * unpack_ue8m0_words(dg.pack_ue8m0_rows(blocks)[..., None], 4
                                                                            ).repeat_interleave(32, -1), fp4)


def test_unfold_refuses_rows_that_are_not_fp4():
    k_fp8, k_scale = ref.quant_fp8_groups(torch.randn(64, 128), 128, ue8m0=True)
    with pytest.raises(IndexerInputError, match="do not hold FP4 values"):
        dg.unfold_fp4_rows(k_fp8, k_scale.squeeze(-1))


def test_fp4_ragged_logits_adapter_matches_the_fp8_reference():
    seq, heads, n = 9, 64, 150
    q_fold, q_row, _ = _fp4_rows(seq * heads, seed=5)
    k_fold, k_row, _ = _fp4_rows(n, seed=6)
    q = q_fold.view(seq, heads, 128)
    weights = torch.randn(seq, heads) * q_row.view(seq, heads)  # the q row scale lives in the weights
    ks = torch.tensor([0, 0, 3, 10, 10, 40, 100, 0, 149], dtype=torch.int32)
    ke = torch.tensor([1, 50, 60, 11, 150, 41, 150, 0, 150], dtype=torch.int32)
    module = FakeDeepGemmSm100()
    api = dg.detect_api(module)
    assert api.ragged_fn == "fp8_fp4_mqa_logits"
    got = dg.make_fp4_ragged_mqa_logits(module, api)(q, k_fold, k_row, weights, ks, ke)
    want = ref.ragged_mqa_logits(q, k_fold, k_row, weights, ks, ke)
    assert module.calls == [("fp8_fp4_mqa_logits", True)]
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    visible = ~torch.isneginf(want)
    torch.testing.assert_close(got[visible], want[visible], rtol=1e-5, atol=1e-5)  # the same products, summed
    # in another order (the double scales values before the dot, the reference after)
