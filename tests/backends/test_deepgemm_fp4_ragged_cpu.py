"""DeepGEMM's FP4 ragged logits adapter (`backends/cuda/deepgemm_fp4.py`, ``ragged_mqa_logits`` with FP4 keys), without
a GPU: against `FakeDeepGemmSm100.fp8_fp4_mqa_logits` (tests/doubles/deep_gemm_sm100.py), a TEST DOUBLE that follows
DeepGEMM's documented signature and argument checks and decodes the packed q and key bytes itself (it says nothing
about DeepGEMM's kernels: no sm100 GPU was available), and its resolution (sm100 + deep_gemm for ``keys="fp4"``)."""

import pytest
import torch

from dsa_indexer import ops
from dsa_indexer.backends.cuda import deepgemm as dg
from dsa_indexer.backends.reference import kernels as ref
from dsa_indexer.contract.cache import pack_e2m1, ue8m0_bytes
from dsa_indexer.contract.validate import IndexerInputError
from dsa_indexer.dispatch.environment import Environment
from dsa_indexer.dispatch.plugins import default_registry
from dsa_indexer.dispatch.problem import Problem
from dsa_indexer.dispatch.target import Target
from doubles.deep_gemm_sm100 import FakeDeepGemmSm100

FP4_ID = "ragged_mqa_logits.cuda.deepgemm_fp4"
SIM = dict(gpu=True, triton=True, deep_gemm=True)


def _case(seq: int, n: int, heads: int, seed: int):
    """Random FP4 keys in the op's FP4 form (the pages' bytes), their exact fp32 values, the library's folded FP4 q
    with its weights (row scale folded in), and windows: random ones, plus a full row, an empty one, a one-key one."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 128, generator=gen)
    x = x * torch.exp2(torch.randint(-6, 5, (n, 4, 1), generator=gen).float()).repeat_interleave(32, 1)[..., 0]
    values, scales = ref.quant_fp4_e2m1(x, 32)
    k, k_scales = pack_e2m1(values), ue8m0_bytes(scales)
    exact_keys = ref.dequant_fp4_e2m1(values, scales)
    q, row_scale = ref.rotate_quant_fp4(torch.randn(seq, heads, 128, generator=gen) * 3, 32)
    weights = torch.randn(seq, heads, generator=gen) * row_scale
    ks = torch.randint(0, n + 1, (seq,), generator=gen)
    ke = ks + (torch.rand(seq, generator=gen) * (n + 1 - ks)).long()
    for row, (start, end) in enumerate([(0, n), (n // 2, n // 2), (n - 1, n)][:seq]):
        ks[row], ke[row] = start, end
    return q, k, k_scales, weights, ks.to(torch.int32), ke.to(torch.int32), exact_keys


def _float64_logits(q, exact_keys, weights, ks, ke):
    """L[s, n] = sum_h w[s, h] * relu(q[s, h] . k[n]) in float64 over the keys' exact values, -inf outside [ks, ke)."""
    scores = torch.einsum("shd,nd->shn", q.double(), exact_keys.double()).clamp_min(0)
    logits = (scores * weights.double()[..., None]).sum(1)
    cols = torch.arange(exact_keys.shape[0])
    visible = (cols >= ks.long()[:, None]) & (cols < ke.long()[:, None])
    return torch.where(visible, logits, float("-inf")), visible


def _adapter():
    module = FakeDeepGemmSm100()
    api = dg.detect_api(module)
    assert api.ragged_fn == "fp8_fp4_mqa_logits"
    return module, dg.make_fp4_ragged_mqa_logits(module, api)


@pytest.mark.parametrize("seq, n, heads", [(1, 1, 32), (3, 64, 64), (9, 150, 64), (33, 700, 32), (5, 256, 64)])
def test_fp4_ragged_adapter_matches_a_float64_decode(seq, n, heads):
    q, k, k_scales, weights, ks, ke, exact_keys = _case(seq, n, heads, seed=seq * 1000 + n + heads)
    module, adapter = _adapter()
    got = adapter(q, k, k_scales, weights, ks, ke)
    assert module.calls == [("fp8_fp4_mqa_logits", True)]
    assert got.shape == (seq, n) and got.dtype == torch.float32 and got.is_contiguous()
    want, visible = _float64_logits(q, exact_keys, weights, ks, ke)
    assert torch.equal(torch.isneginf(got), ~visible)  # -inf exactly outside the windows, every visible one written
    assert bool(torch.isfinite(got[visible]).all())
    # The double sums the same exact products in float64 and rounds once to fp32: agreement to fp32 rounding.
    scale = float(want[visible].abs().max()) if bool(visible.any()) else 1.0
    torch.testing.assert_close(got[visible].double(), want[visible], rtol=1e-6, atol=1e-6 * scale)
    # The reference with the op's FP4 form (fp32 sums in another order): what the factory's self-test compares to.
    reference = ref.ragged_mqa_logits(q, k, k_scales, weights, ks, ke)
    assert torch.equal(torch.isneginf(reference), ~visible)
    torch.testing.assert_close(got[visible], reference[visible], rtol=1e-5, atol=1e-5 * scale)


def test_fp4_ragged_adapter_passes_the_key_bytes_through_unchanged():
    q, k, k_scales, weights, ks, ke, _ = _case(4, 96, 64, seed=7)
    seen = {}
    module = FakeDeepGemmSm100()
    real = module.fp8_fp4_mqa_logits

    def spy(q_arg, kv, *args, **kwargs):
        seen["kv"] = kv
        return real(q_arg, kv, *args, **kwargs)

    module.fp8_fp4_mqa_logits = spy
    dg.make_fp4_ragged_mqa_logits(module, dg.detect_api(module))(q, k, k_scales, weights, ks, ke)
    kv_values, kv_words = seen["kv"]
    assert torch.equal(kv_values.view(torch.uint8), k)
    words = kv_words.to(torch.int64) & 0xFFFFFFFF
    for block in range(4):  # block b's ue8m0 byte in byte b of the row's int32, little-endian
        assert torch.equal((words >> (8 * block)) & 0xFF, k_scales[:, block].to(torch.int64))


def test_fp4_ragged_adapter_refuses_what_it_cannot_read():
    q, k, k_scales, weights, ks, ke, exact_keys = _case(3, 80, 64, seed=11)
    module, adapter = _adapter()
    fp8_k = exact_keys.to(torch.float8_e4m3fn)
    with pytest.raises(IndexerInputError, match=r"k must be FP4 keys, uint8 \[N, 64\].*float8_e4m3fn \[80, 128\]"):
        adapter(q, fp8_k, torch.ones(80), weights, ks, ke)
    with pytest.raises(IndexerInputError, match=r"k must be FP4 keys.*uint8 \[80, 128\]"):
        adapter(q, torch.zeros(80, 128, dtype=torch.uint8), k_scales, weights, ks, ke)
    with pytest.raises(IndexerInputError, match=r"k_scales must be uint8 \[80, 4\].*float32 \[80\]"):
        adapter(q, k, torch.ones(80), weights, ks, ke)
    with pytest.raises(IndexerInputError, match=r"k_scales must be uint8 \[80, 4\].*uint8 \[79, 4\]"):
        adapter(q, k, k_scales[:79], weights, ks, ke)
    with pytest.raises(IndexerInputError, match="head dim 128.*got 64"):
        adapter(q[..., :64].contiguous(), k, k_scales, weights, ks, ke)
    plain_q, _ = ref.quant_fp8_groups(torch.randn(3, 64, 128), 128, ue8m0=True)
    with pytest.raises(IndexerInputError, match="do not hold FP4 values"):
        adapter(plain_q, k, k_scales, weights, ks, ke)
    assert module.calls == []  # every refusal before DeepGEMM is called
    legacy = dg.DeepGemmApi(version="x", ragged_fn="fp8_mqa_logits")
    with pytest.raises(RuntimeError, match="no FP4 ragged logits"):
        dg.make_fp4_ragged_mqa_logits(module, legacy)


def test_the_factory_self_test_passes_on_the_double_and_catches_a_layout_mistake():
    module, adapter = _adapter()
    dg.check_fp4_ragged_adapter(adapter, "cpu")
    assert module.calls == [("fp8_fp4_mqa_logits", True)]

    def scale_bytes_reversed(q, k, k_scales, weights, ks, ke):  # a plausible mistake: big-endian scale words
        return adapter(q, k, k_scales.flip(-1), weights, ks, ke)

    with pytest.raises(RuntimeError, match="FP4 ragged logits differ from the reference"):
        dg.check_fp4_ragged_adapter(scale_bytes_reversed, "cpu")
    assert dg.FP4_ADAPTERS["ragged_mqa_logits"] == (dg.make_fp4_ragged_mqa_logits, dg.check_fp4_ragged_adapter)


# --- resolution -----------------------------------------------------------------------------------------------------
def _resolve(op: str, arch: str, problem: Problem, **env):
    return default_registry().resolve(op, Target("cuda", arch), problem, environment=Environment.simulated(**env))


def _reasons(resolution):
    return {c.impl.impl_id: c.reason for c in resolution.candidates}


def test_sm100_with_deep_gemm_picks_the_fp4_adapter_for_fp4_keys_only():
    fp4 = ops.problem("ragged_mqa_logits", heads=64, dim=128, fp8="fn", keys="fp4")
    assert _resolve("ragged_mqa_logits", "sm100", fp4, **SIM).chosen.impl_id == FP4_ID
    heads16 = ops.problem("ragged_mqa_logits", heads=16, dim=128, fp8="fn", keys="fp4")
    assert _resolve("ragged_mqa_logits", "sm100", heads16, **SIM).chosen.impl_id == FP4_ID
    fp8 = _resolve("ragged_mqa_logits", "sm100", ops.problem("ragged_mqa_logits", heads=64, dim=128, fp8="fn",
                                                              keys="fp8"), **SIM)
    assert fp8.chosen.impl_id == "ragged_mqa_logits.cuda.deepgemm"
    assert "keys=fp8: DeepGEMM FP4 ragged logits takes fp4" in _reasons(fp8)[FP4_ID]
    assert "keys=fp4" in _reasons(_resolve("ragged_mqa_logits", "sm100", fp4, **SIM))["ragged_mqa_logits.cuda.deepgemm"]
    # A problem that does not say its keys never gets the FP4 adapter (16 heads: the fp8 adapter takes 32 and 64).
    coarse = _resolve("ragged_mqa_logits", "sm100", Problem(heads=16, dim=128, fp8="fn"), **SIM)
    assert coarse.chosen.impl_id != FP4_ID and "does not say its keys" in _reasons(coarse)[FP4_ID]


def test_sm90_and_no_deep_gemm_do_not_get_it():
    fp4 = ops.problem("ragged_mqa_logits", heads=64, dim=128, fp8="fn", keys="fp4")
    sm90 = _resolve("ragged_mqa_logits", "sm90", fp4, **SIM)
    assert sm90.chosen is None or sm90.chosen.impl_id != FP4_ID
    assert "sm100" in _reasons(sm90)[FP4_ID]
    without = _resolve("ragged_mqa_logits", "sm100", fp4, gpu=True, triton=True)
    assert without.chosen is None or without.chosen.impl_id != FP4_ID
    assert "deep_gemm" in _reasons(without)[FP4_ID]


def test_the_fp8_ragged_topk_refuses_fp4_keys():
    radix = "ragged_mqa_topk.cuda.deepgemm_radix"
    env = dict(cuda_jit=True, **SIM)
    fp8 = _resolve("ragged_mqa_topk", "sm100", ops.problem("ragged_mqa_topk", heads=64, dim=128, fp8="fn", k=2048,
                                                           keys="fp8"), **env)
    assert fp8.chosen.impl_id == radix
    fp4 = _resolve("ragged_mqa_topk", "sm100", ops.problem("ragged_mqa_topk", heads=64, dim=128, fp8="fn", k=2048,
                                                           keys="fp4"), **env)
    assert fp4.chosen is None or fp4.chosen.impl_id != radix
    assert "keys=fp4" in _reasons(fp4)[radix]


def test_a_detected_api_without_the_fp4_ragged_function_is_refused(monkeypatch):
    from dsa_indexer.backends import cuda

    available = cuda._fp4_available("ragged_mqa_logits")
    env = Environment.simulated(gpu=True, deep_gemm=True)
    legacy = dg.DeepGemmApi(version="9.9-legacy", paged_fn="fp8_paged_mqa_logits", ragged_fn="fp8_mqa_logits")
    monkeypatch.setattr(dg, "detected_api", lambda: legacy)
    reason = available(Target("cuda", "sm100"), env)
    assert reason is not None and "has no fp8_fp4_mqa_logits" in reason and "FP4 ragged logits" in reason
    monkeypatch.setattr(dg, "detected_api", lambda: dg.detect_api(FakeDeepGemmSm100()))
    assert available(Target("cuda", "sm100"), env) is None
