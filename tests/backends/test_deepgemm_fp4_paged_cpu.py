"""DeepGEMM's FP4 paged logits adapter (`backends/cuda/deepgemm_fp4.py`) over V4's 68-byte FP4 pages, without a
GPU: against `FakeDeepGemmSm100.fp8_fp4_paged_mqa_logits` (tests/doubles/deep_gemm_sm100.py), a TEST DOUBLE that
follows DeepGEMM's documented signature and argument checks and decodes the packed q and cache bytes itself (it says
nothing about DeepGEMM's kernels: no sm100 GPU was available), and its resolution (sm100 + deep_gemm for fp4 keys)."""

import pytest
import torch

from dsa_indexer import ops
from dsa_indexer.backends.cuda import deepgemm as dg
from dsa_indexer.backends.reference import kernels as ref
from dsa_indexer.contract.cache import IndexKCache, store_fp4_rows
from dsa_indexer.contract.step import StepContext
from dsa_indexer.contract.validate import IndexerInputError
from dsa_indexer.dispatch.environment import Environment
from dsa_indexer.dispatch.plugins import default_registry
from dsa_indexer.dispatch.target import Target
from doubles.deep_gemm_sm100 import FakeDeepGemmSm100

FP4_ID = "paged_mqa_logits.cuda.deepgemm_fp4"


def _case(batch: int, next_n: int, heads: int, seed: int):
    """Random FP4 keys in the 68-byte pages and the library's folded FP4 q (row scale in the weights)."""
    gen = torch.Generator().manual_seed(seed)
    pages = 3 * batch
    x = torch.randn(pages * 64, 128, generator=gen)
    x = x * torch.exp2(torch.randint(-5, 4, (pages * 64, 4, 1), generator=gen).float()).repeat_interleave(32, 1)[..., 0]
    cache = IndexKCache.allocate(pages, layout="paged64_fp4_e2m1")
    store_fp4_rows(cache.data, torch.arange(pages * 64), *ref.quant_fp4_e2m1(x, 32))
    q, row_scale = ref.rotate_quant_fp4(torch.randn(batch, next_n, heads, 128, generator=gen) * 3, 32)
    weights = torch.randn(batch * next_n, heads, generator=gen) * row_scale.reshape(batch * next_n, heads)
    table = torch.randperm(pages, generator=gen).to(torch.int32).view(batch, 3)
    last = torch.tensor([0, 1, 64, 150, 192][:batch], dtype=torch.int32)
    lens = (last[:, None] - (next_n - 1 - torch.arange(next_n))).clamp_min(0).to(torch.int32)
    return q, cache.data, weights, lens, table


@pytest.mark.parametrize("next_n, heads", [(1, 64), (2, 64), (2, 16)])
def test_fp4_paged_adapter_matches_the_reference(next_n, heads):
    q, kv, weights, lens, table = _case(5, next_n, heads, seed=10 * next_n + heads)
    module = FakeDeepGemmSm100()
    api = dg.detect_api(module)
    assert api.paged_fn == "fp8_fp4_paged_mqa_logits" and api.context_lens_2d
    adapter = dg.make_fp4_paged_mqa_logits(module, api)
    got = adapter(q, kv, weights, lens, table, 200)  # 200: DeepGEMM's rows are padded to 256 columns
    want = ref.paged_mqa_logits(q, kv, weights, lens, table, 200)
    assert ("fp8_fp4_paged_mqa_logits", True, False) in module.calls
    assert got.shape == want.shape and got.is_contiguous()
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))  # the garbage tail masked, the empty rows too
    visible = ~torch.isneginf(want)
    # The double sums the exact products in float64, the reference in fp32: agreement to fp32 rounding.
    torch.testing.assert_close(got[visible], want[visible], rtol=1e-5, atol=1e-5 * float(want[visible].abs().max()))
    calls = len(module.calls)
    adapter(q, kv, weights, lens, table, 200)
    assert len(module.calls) == calls + 2  # no step context: the call computes its own schedule
    context = StepContext()
    adapter(q, kv, weights, lens, table, 200, context=context)
    calls = len(module.calls)
    adapter(q, kv, weights, lens, table, 200, context=context)
    assert len(module.calls) == calls + 1  # the schedule metadata came from the step's context the second time


def test_fp4_paged_adapter_refuses_what_it_cannot_read():
    q, kv, weights, lens, table = _case(2, 1, 64, seed=3)
    module = FakeDeepGemmSm100()
    adapter = dg.make_fp4_paged_mqa_logits(module, dg.detect_api(module))
    fp8_q, _ = ref.quant_fp8_groups(torch.randn(2, 1, 64, 128), 128, ue8m0=True)
    with pytest.raises(IndexerInputError, match="do not hold FP4 values"):
        adapter(fp8_q, kv, weights, lens, table, 192)
    with pytest.raises(IndexerInputError, match="reads the paged64_fp4_e2m1 pages"):
        adapter(q, IndexKCache.allocate(6).data, weights, lens, table, 192)
    with pytest.raises(IndexerInputError, match=r"context_lens\[b, j\] must be <= context_lens\[b, -1\]"):
        adapter(q.repeat(1, 2, 1, 1), kv, weights.repeat_interleave(2, 0), torch.tensor([[5, 4], [1, 1]],
                                                                                         dtype=torch.int32), table, 192)
    legacy = dg.DeepGemmApi(version="x", paged_fn="fp8_paged_mqa_logits")
    with pytest.raises(RuntimeError, match="no FP4 paged logits"):
        dg.make_fp4_paged_mqa_logits(module, legacy)


def _resolve(arch: str, keys: str, **env):
    problem = ops.problem("paged_mqa_logits", heads=64, dim=128, next_n=1, fp8="fn", keys=keys)
    return default_registry().resolve("paged_mqa_logits", Target("cuda", arch), problem,
                                      environment=Environment.simulated(**env))


def test_sm100_with_deep_gemm_picks_the_fp4_adapter_for_fp4_keys_only():
    env = dict(gpu=True, triton=True, deep_gemm=True)
    assert _resolve("sm100", "fp4", **env).chosen.impl_id == FP4_ID
    fp8 = _resolve("sm100", "fp8", **env)
    assert fp8.chosen.impl_id == "paged_mqa_logits.cuda.deepgemm"
    assert "keys=fp8: DeepGEMM FP4 paged logits takes fp4" in {c.impl.impl_id: c.reason for c in fp8.candidates}[FP4_ID]
    sm90 = _resolve("sm90", "fp4", **env)
    assert sm90.chosen.impl_id == "paged_mqa_logits.triton.logits_fp4"
    assert "sm100" in {c.impl.impl_id: c.reason for c in sm90.candidates}[FP4_ID]
    without = _resolve("sm100", "fp4", gpu=True, triton=True)
    assert without.chosen.impl_id == "paged_mqa_logits.triton.logits_fp4"
    assert "deep_gemm" in {c.impl.impl_id: c.reason for c in without.candidates}[FP4_ID]
    lightning = default_registry().resolve(
        "lightning_indexer", Target("cuda", "sm100"),
        ops.problem("lightning_indexer", heads=64, dim=128, next_n=1, fp8="fn", keys="fp4", k=512, slots=False),
        environment=Environment.simulated(cuda_jit=True, **env))
    assert lightning.chosen.impl_id == "lightning_indexer.generic.composed"  # whose logits resolve to FP4_ID


def test_a_detected_api_without_the_fp4_function_is_refused(monkeypatch):
    from dsa_indexer.backends import cuda

    legacy = dg.DeepGemmApi(version="9.9-legacy", paged_fn="fp8_paged_mqa_logits")
    monkeypatch.setattr(dg, "detected_api", lambda: legacy)
    available = cuda._fp4_available("paged_mqa_logits")
    reason = available(Target("cuda", "sm100"), Environment.simulated(gpu=True, deep_gemm=True))
    assert reason is not None and "has no fp8_fp4_paged_mqa_logits" in reason
    monkeypatch.setattr(dg, "detected_api", lambda: dg.detect_api(FakeDeepGemmSm100()))
    assert available(Target("cuda", "sm100"), Environment.simulated(gpu=True, deep_gemm=True)) is None


def test_the_factory_self_test_passes_on_the_double_and_catches_a_layout_mistake():
    module = FakeDeepGemmSm100()
    adapter = dg.make_fp4_paged_mqa_logits(module, dg.detect_api(module))
    dg.check_fp4_paged_adapter(adapter, "cpu")
    assert ("fp8_fp4_paged_mqa_logits", True, False) in module.calls

    def nibbles_swapped(q, kv_cache, weights, lens, table, max_context_len):
        return adapter(q, _swap_nibbles(kv_cache), weights, lens, table, max_context_len)

    with pytest.raises(RuntimeError, match="FP4 paged logits differ from the reference"):
        dg.check_fp4_paged_adapter(nibbles_swapped, "cpu")


def _swap_nibbles(kv_cache: torch.Tensor) -> torch.Tensor:
    """The pages with every value byte's two nibbles exchanged (a plausible layout mistake), scales kept."""
    pages = kv_cache.clone().view(kv_cache.shape[0], -1)
    values = pages[:, : 64 * 64]
    pages[:, : 64 * 64] = (values >> 4) | ((values & 0xF) << 4)
    return pages.view(kv_cache.shape)
