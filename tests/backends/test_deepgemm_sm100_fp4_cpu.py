"""DeepGEMM's sm100 layouts without a GPU: the packed ue8m0 scales the sm100 GEMM reads, and the FP4 e2m1 operands of
DeepGEMM's FP4 logits (DeepGEMM at commit 54e2261: csrc/apis/gemm.hpp, attention.hpp, layout.hpp, smxx_layout.hpp).

`FakeDeepGemmSm100` (tests/doubles/deep_gemm_sm100.py) is a TEST DOUBLE, not DeepGEMM: see that file for what it
checks and what it does not say.
"""

import types

import pytest
import torch

from dsa_indexer.backends.cuda import deepgemm as dg
from dsa_indexer.backends.reference import kernels as ref
from dsa_indexer.contract.validate import IndexerInputError
from doubles.deep_gemm_sm100 import (E2M1, FakeDeepGemmSm100, decode_e2m1, random_pow2, tma_mn,
                                      unpack_ue8m0_words)
from fp4_recipe import rotate_bf16

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
    got = gemm(a, sa, b, sb, torch.bfloat16, "ue8m0")
    assert module.calls == [("fp8_fp4_gemm_nt", (1, 1, 128))]
    assert torch.equal(got, ref.gemm_fp8_blockscale(a, sa, b, sb))
    assert torch.equal(gemm(a, sa, b, sb, torch.bfloat16, "ue8m0"), got)  # the weight's packed scales come from the memo the second time


def test_sm100_gemm_refuses_scales_that_are_not_powers_of_two():
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(4, 256, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(128, 256, generator=gen).to(torch.float8_e4m3fn)
    module = FakeDeepGemmSm100()
    gemm = dg.make_gemm_fp8_blockscale(module, _api(module), arch_major=10)
    with pytest.raises(IndexerInputError, match="a_scales must be powers of two.*ue8m0"):
        gemm(a, torch.rand(4, 2, generator=gen) + 0.1, b, torch.ones(1, 2), torch.bfloat16, "ue8m0")
    with pytest.raises(IndexerInputError, match="b_scales must be powers of two"):
        gemm(a, torch.ones(4, 2), b, torch.full((1, 2), 0.3), torch.bfloat16, "ue8m0")
    with pytest.raises(IndexerInputError, match="scale_fmt='fp32'.*sm100"):  # the fact itself: no value read
        gemm(a, torch.ones(4, 2), b, torch.ones(1, 2), torch.bfloat16, "fp32")
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
    values, blocks = dg.unfold_fp4_rows(folded)  # the row scale stays outside (q's lives in the head weights)
    assert bool(torch.isin(values.abs(), torch.tensor(E2M1)).all())
    assert torch.equal(values * blocks.repeat_interleave(32, -1), folded.float())
    assert torch.equal(values * blocks.repeat_interleave(32, -1) * row_scale[:, None], fp4)
    words = dg.pack_ue8m0_rows(blocks)
    assert torch.equal(decode_e2m1(dg.pack_e2m1(values)) * unpack_ue8m0_words(words[..., None], 4
                                                                            ).repeat_interleave(32, -1), folded.float())


def test_unfold_refuses_rows_that_are_not_fp4():
    k_fp8, _ = ref.quant_fp8_groups(torch.randn(64, 128), 128, ue8m0=True)
    with pytest.raises(IndexerInputError, match="do not hold FP4 values"):
        dg.unfold_fp4_rows(k_fp8)


# The ragged FP4 logits adapter: tests/backends/test_deepgemm_fp4_ragged_cpu.py.
