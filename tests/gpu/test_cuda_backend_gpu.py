"""The NVIDIA backend on the GPU: dual-stream vs single-stream, CUDA-graph replay vs eager, DeepGEMM adapters vs the
reference kernels, and resolution in the real environment. DeepSeek-V3.2 shapes (64 index heads x 128).

Tolerances and why:
- strategies and graphs: bit-identical top-k, q, weights and cache bytes. They run the same kernels on the same
  inputs; only streams and launch mechanics differ.
- DeepGEMM logits vs the fp32 reference: identical -inf pattern; visible entries within 2e-3 x max|ref| (the fp8
  tensor-core dot products keep ~14 mantissa bits before the fp32 head sum, ~1e-4 relative seen in DeepGEMM's own
  tests, and the sums run in another order).
- DeepGEMM GEMM vs the fp32 reference rounded to bf16: within 2 bf16 ulps (rtol 2**-7) plus 1e-3 x max|ref| for
  entries near zero (fp32 accumulation order differs, then one bf16 rounding each).
"""

import pytest
import torch

from dsa_indexer import DecodeBatch, Environment, IndexKCache, Indexer, IndexerConfig, Problem, default_registry, ops
from dsa_indexer.backends.cuda import deepgemm as dg_adapt
from dsa_indexer.backends.cuda import deepgemm_api as dg_api
from dsa_indexer.backends.cuda import dual_stream
from dsa_indexer.backends.reference import kernels as ref
from dsa_indexer.contract.cache import PAGE_SIZE
from dsa_indexer.dispatch.target import detect_target
from dsa_indexer.graphs import DecodeGraph
from dsa_indexer.pipeline import single_stream

pytestmark = pytest.mark.gpu  # skipped without a GPU by tests/conftest.py

SINGLE = "indexer_pipeline.generic.single_stream"
DUAL = dual_stream.IMPL_ID
MAX_CTX = 8192
PAGES_PER_REQ = MAX_CTX // PAGE_SIZE


@pytest.fixture
def forced():
    """Force implementations for one test; every force is lifted afterwards."""
    registry = default_registry()
    ops_forced = []

    def force(op, impl_id):
        registry.force(op, impl_id)
        ops_forced.append(op)

    yield force
    for op in ops_forced:
        registry.force(op, None)


@pytest.fixture(scope="module")
def indexer():
    return Indexer(IndexerConfig.deepseek_v32(max_position=2 * MAX_CTX), device="cuda").init_random(0)


def _filled_cache(indexer, batch: int, seed: int) -> IndexKCache:
    """A cache of ``batch`` requests x 128 pages, every slot holding a key made by the k prologue."""
    pages = batch * PAGES_PER_REQ
    cache = IndexKCache.allocate(pages, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    slots = torch.arange(pages * PAGE_SIZE, device="cuda")
    k = torch.randn(slots.shape[0], 128, device="cuda", generator=gen).to(torch.bfloat16)
    positions = slots % MAX_CTX
    ops.k_prologue_store(k, indexer.k_norm.weight, indexer.k_norm.bias, indexer.config.norm_eps, positions,
                         indexer.cos_sin, cache.data, slots, ue8m0=True)
    return cache


def _step_inputs(indexer, batch: int, next_n: int, seed: int, lo: int = 4096, hi: int = MAX_CTX):
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(lo, hi + 1, (batch,), generator=gen)
    table = torch.randperm(batch * PAGES_PER_REQ, generator=gen).to(torch.int32).view(batch, PAGES_PER_REQ)
    cfg = indexer.config
    x = torch.randn(batch * next_n, cfg.hidden_size, generator=gen).to(torch.bfloat16).cuda()
    q_lora = torch.randn(batch * next_n, cfg.q_lora_rank, generator=gen).to(torch.bfloat16).cuda()
    return x, q_lora, seq, table


def _eager(indexer, cache, x, q_lora, seq, table, next_n):
    batch = DecodeBatch.build(seq, table, next_n=next_n, max_context_len=MAX_CTX, device="cuda")
    return indexer(x, q_lora, batch.positions, batch, cache)


# --- dual stream ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [1, 32])
def test_dual_stream_is_bit_identical_to_single_stream_eager(indexer, forced, batch):
    x, q_lora, seq, table = _step_inputs(indexer, batch, 1, seed=batch)
    base = _filled_cache(indexer, batch, seed=batch)
    results = {}
    for impl in (SINGLE, DUAL):
        forced("indexer_pipeline", impl)
        cache = IndexKCache(base.data.clone())
        out = _eager(indexer, cache, x, q_lora, seq, table, 1)
        assert indexer.last_pipeline.chosen.impl_id == impl
        results[impl] = (out, cache.data)
    torch.cuda.synchronize()
    assert torch.equal(results[SINGLE][0], results[DUAL][0])
    assert torch.equal(results[SINGLE][1], results[DUAL][1])


def test_dual_stream_strategy_outputs_bitwise(indexer):
    x, q_lora, seq, table = _step_inputs(indexer, 32, 2, seed=3)
    batch = DecodeBatch.build(seq, table, next_n=2, max_context_len=MAX_CTX, device="cuda")
    caches = [torch.zeros(32 * PAGES_PER_REQ, PAGE_SIZE, 1, 132, dtype=torch.uint8, device="cuda") for _ in range(2)]
    plan = indexer.step_plan(batch.num_tokens, True, next_n=2)
    got = dual_stream.make_dual_stream()(plan, x, q_lora, batch.positions, batch.slot_mapping, caches[0], None)
    want = single_stream(plan, x, q_lora, batch.positions, batch.slot_mapping, caches[1], None)
    torch.cuda.synchronize()
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1])
    assert torch.equal(caches[0], caches[1])


# --- CUDA graphs ---------------------------------------------------------------------------------------------------
def _paged_impls():
    impls = ["paged_mqa_logits.triton.logits"]
    impls.append(pytest.param("paged_mqa_logits.cuda.deepgemm", marks=pytest.mark.deepgemm))
    return impls


def _require_deep_gemm():
    try:
        import deep_gemm  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"deep_gemm does not import ({type(exc).__name__}: {exc}); {dg_api.INSTALL_HINT}")
    reason = default_registry().environment.missing("deep_gemm")
    if reason is not None:
        pytest.fail(f"deep_gemm imports but the backend's probe rejects it: {reason}")


@pytest.mark.parametrize("paged_impl", _paged_impls())
@pytest.mark.parametrize("next_n", [1, 2])
def test_graph_replay_equals_eager(indexer, forced, paged_impl, next_n):
    if "deepgemm" in paged_impl:
        _require_deep_gemm()
    forced("paged_mqa_logits", paged_impl)
    forced("indexer_pipeline", SINGLE)
    batch = 32
    cache = _filled_cache(indexer, batch, seed=11)
    graph = DecodeGraph.capture(indexer, cache, batch, MAX_CTX, next_n=next_n)
    eager_cache = IndexKCache(cache.data.clone())
    for seed in (21, 22):  # two different inputs
        x, q_lora, seq, table = _step_inputs(indexer, batch, next_n, seed=seed)
        got = graph.replay(x, q_lora, seq, table).clone()
        want = _eager(indexer, eager_cache, x, q_lora, seq, table, next_n)
        torch.cuda.synchronize()
        assert got.shape == want.shape == (batch * next_n, indexer.config.topk)
        assert torch.equal(got, want), f"replay differs from eager for seq_lens {seq.tolist()[:4]}..."
        assert torch.equal(cache.data, eager_cache.data)
    # A padded step (20 live requests of 32) against the same padded shapes run eagerly: GEMM algorithms may
    # depend on M, so an eager 20-request batch is not a bitwise oracle for it.
    live = 20
    x, q_lora, seq, table = _step_inputs(indexer, live, next_n, seed=23)
    got = graph.replay(x, q_lora, seq, table).clone()
    derived = graph.buffers.derive()
    full = indexer(graph.buffers.x, graph.buffers.q_lora, derived.positions, derived, eager_cache)
    torch.cuda.synchronize()
    assert got.shape == (live * next_n, indexer.config.topk)
    assert torch.equal(got, full[: live * next_n])
    assert bool((graph.output[live * next_n:] == -1).all()), "padding requests must see no key"
    assert torch.equal(cache.data, eager_cache.data)  # padding requests stored nothing


def test_dual_stream_graph_replay_equals_single_stream_eager(indexer, forced):
    forced("indexer_pipeline", DUAL)
    batch = 32
    cache = _filled_cache(indexer, batch, seed=12)
    graphs = [DecodeGraph.capture(indexer, cache, batch, MAX_CTX), indexer.capture_decode(cache, 8, MAX_CTX)]
    assert indexer.last_pipeline.chosen.impl_id == DUAL
    # One side stream per device however many graphs were captured: each graph holds two streams.
    assert list(dual_stream.alt_streams()) == [torch.cuda.current_device()]
    forced("indexer_pipeline", SINGLE)
    eager_cache = IndexKCache(cache.data.clone())
    for seed in (31, 32):  # two different seq_lens inputs
        x, q_lora, seq, table = _step_inputs(indexer, batch, 1, seed=seed)
        got = graphs[0].replay(x, q_lora, seq, table).clone()
        want = _eager(indexer, eager_cache, x, q_lora, seq, table, 1)
        torch.cuda.synchronize()
        assert indexer.last_pipeline.chosen.impl_id == SINGLE
        assert torch.equal(got, want)
        assert torch.equal(cache.data, eager_cache.data)


def test_graph_replay_checks_its_inputs(indexer):
    cache = _filled_cache(indexer, 2, seed=13)
    graph = indexer.capture_decode(cache, 2, MAX_CTX, warmup=1)
    x, q_lora, seq, table = _step_inputs(indexer, 2, 1, seed=5)
    with pytest.raises(ValueError, match="x must have dtype bfloat16"):
        graph.replay(x.float(), q_lora, seq, table)
    with pytest.raises(ValueError, match="max_context_len=8192"):
        graph.replay(x, q_lora, torch.tensor([10, MAX_CTX + 1]), table)
    out = graph.replay(x, q_lora, seq.cuda().to(torch.int32), table.cuda())  # device inputs: trusted, no sync
    assert out.shape == (2, indexer.config.topk)


# --- DeepGEMM adapters vs the reference ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def deep_gemm_api():
    _require_deep_gemm()
    import deep_gemm

    return deep_gemm, dg_adapt.api_for(deep_gemm)


def _assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == torch.float32 and got.is_contiguous()
    hidden = torch.isneginf(want)
    assert torch.equal(torch.isneginf(got), hidden), "the -inf pattern differs from the reference"
    visible = ~hidden
    scale = want[visible].abs().max()
    diff = (got[visible] - want[visible]).abs().max()
    assert diff <= 2e-3 * scale, f"max |diff| {diff.item():.3g} > 2e-3 x max |ref| {scale.item():.3g}"


@pytest.mark.deepgemm
@pytest.mark.parametrize("width", [MAX_CTX, 5000], ids=["width8192", "width5000"])
@pytest.mark.parametrize("next_n", [1, 2])
def test_deepgemm_paged_logits_vs_reference(indexer, deep_gemm_api, next_n, width):
    module, api = deep_gemm_api
    batch = 8
    cache = _filled_cache(indexer, batch, seed=41)
    gen = torch.Generator().manual_seed(next_n)
    seq = torch.randint(100, width + 1, (batch,), generator=gen)
    table = torch.randperm(batch * PAGES_PER_REQ, generator=gen).to(torch.int32).view(batch, PAGES_PER_REQ)
    db = DecodeBatch.build(seq, table, next_n=next_n, max_context_len=width, device="cuda")
    q, _ = ref.quant_fp8_groups(torch.randn(batch, next_n, 64, 128, device="cuda"), 128)
    weights = torch.randn(batch * next_n, 64, device="cuda")
    args = (q, cache.data, weights, db.context_lens, db.block_table, width)
    _assert_logits_close(dg_adapt.make_paged_mqa_logits(module, api)(*args), ref.paged_mqa_logits(*args))


@pytest.mark.deepgemm
def test_deepgemm_ragged_causal_logits_vs_reference(deep_gemm_api):
    module, api = deep_gemm_api
    s, n = 1024, 3072  # two requests: 512 queries over keys [0, 1536) and [1536, 3072), causal within each
    q, _ = ref.quant_fp8_groups(torch.randn(s, 64, 128, device="cuda"), 128)
    k, k_scale = ref.quant_fp8_groups(torch.randn(n, 128, device="cuda"), 128)
    weights = torch.randn(s, 64, device="cuda")
    i = torch.arange(512, device="cuda")
    ks = torch.cat([torch.zeros(512, device="cuda"), torch.full((512,), 1536, device="cuda")]).to(torch.int32)
    ke = torch.cat([1024 + i + 1, 1536 + 1024 + i + 1]).to(torch.int32)
    args = (q, k, k_scale.squeeze(-1), weights, ks, ke)
    _assert_logits_close(dg_adapt.make_ragged_mqa_logits(module, api)(*args), ref.ragged_mqa_logits(*args))


@pytest.mark.deepgemm
@pytest.mark.parametrize("k", [64, 2048])
def test_prefill_scoring_on_the_padded_logits_equals_the_top_k_of_the_contiguous_ones(deep_gemm_api, k):
    """`ragged_mqa_topk.cuda.deepgemm_radix` (no contiguous copy): the same index sets, in the same order, as the
    reference top-k over DeepGEMM's own logits (exact: one set of logit values); every output written."""
    from dsa_indexer.backends.cuda import lightning
    from dsa_indexer.backends.cuda import topk as cuda_topk

    reason = cuda_topk.probe()
    if reason is not None:
        pytest.skip(reason)
    module, api = deep_gemm_api
    gen = torch.Generator(device="cuda").manual_seed(7)
    s, n = 1500, 5000  # three requests with windows (ks > 0) and causal ends, rows shorter and longer than k
    q, _ = ref.quant_fp8_groups(torch.randn(s, 64, 128, device="cuda", generator=gen), 128)
    keys, k_scale = ref.quant_fp8_groups(torch.randn(n, 128, device="cuda", generator=gen), 128)
    weights = torch.randn(s, 64, device="cuda", generator=gen)
    request = torch.arange(s, device="cuda") // 500
    ks = (request * 1500).to(torch.int32)
    ke = (ks + 1000 + torch.arange(s, device="cuda") % 500 + 1).to(torch.int32)
    args = (q, keys, k_scale.squeeze(-1), weights, ks, ke)
    logits = dg_adapt.make_ragged_mqa_logits(module, api)(*args)
    assert not logits.isnan().any()
    got = lightning.make_ragged_mqa_topk(module, api)(*args, k)
    want = ref.topk_indices(logits.cpu(), k, ke.cpu(), ks.cpu())
    assert got.shape == (s, k) and torch.equal(torch.sort(got.cpu(), dim=1).values, torch.sort(want, dim=1).values)


@pytest.mark.deepgemm
@pytest.mark.parametrize("m", [1, 64, 1000])
def test_deepgemm_gemm_vs_reference(indexer, deep_gemm_api, m):
    module, api = deep_gemm_api
    a, sa = ref.quant_fp8_groups(torch.randn(m, 1536, device="cuda").to(torch.bfloat16), 128)
    b, sb = indexer.wq_b.weight, indexer.wq_b.weight_scale_inv
    got = dg_adapt.make_gemm_fp8_blockscale(module, api)(a, sa, b, sb, torch.bfloat16)
    want = ref.gemm_fp8_blockscale(a, sa, b, sb, torch.bfloat16)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3 * want.float().abs().max().item())


@pytest.mark.deepgemm
def test_dual_stream_with_deepgemm_on_half_the_sms_is_bit_identical(indexer, deep_gemm_api, monkeypatch):
    res = default_registry().resolve("gemm_fp8_blockscale", detect_target("cuda"),
                                     Problem(n=8192, k=1536, out=str(torch.bfloat16), fp8="fn"))
    if res.chosen.impl_id != "gemm_fp8_blockscale.cuda.deepgemm":
        pytest.skip(f"the wq_b GEMM resolves to {res.chosen.impl_id} here")
    monkeypatch.setenv(dual_stream.GEMM_SMS_ENV, "half")
    limited = dual_stream.make_dual_stream(dual_stream._gemm_sm_limit())
    x, q_lora, seq, table = _step_inputs(indexer, 32, 1, seed=8)
    batch = DecodeBatch.build(seq, table, next_n=1, max_context_len=MAX_CTX, device="cuda")
    caches = [torch.zeros(32 * PAGES_PER_REQ, PAGE_SIZE, 1, 132, dtype=torch.uint8, device="cuda") for _ in range(2)]
    sms = deep_gemm_api[0].get_num_sms()
    plan = indexer.step_plan(batch.num_tokens, True)
    got = limited(plan, x, q_lora, batch.positions, batch.slot_mapping, caches[0], None)
    assert deep_gemm_api[0].get_num_sms() == sms  # restored
    want = single_stream(plan, x, q_lora, batch.positions, batch.slot_mapping, caches[1], None)
    torch.cuda.synchronize()
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1]) and torch.equal(caches[0], caches[1])


# --- resolution in the real environment ----------------------------------------------------------------------------
PAGED = Problem(heads=64, dim=128, next_n=1, fp8="fn")


def test_resolution_follows_the_real_environment():
    target = detect_target("cuda")
    if target.arch not in ("sm90", "sm100"):
        pytest.skip(f"DeepGEMM serves sm90 / sm100, this GPU is {target}")
    registry = default_registry()
    res = registry.resolve("paged_mqa_logits", target, PAGED)
    verdict = next(c for c in res.candidates if c.impl.impl_id == "paged_mqa_logits.cuda.deepgemm")
    reason = registry.environment.missing("deep_gemm")
    if reason is None:
        assert res.chosen.impl_id == "paged_mqa_logits.cuda.deepgemm"
        assert dg_adapt.detected_api() is not None and dg_adapt.detected_api().self_tested
    else:
        assert res.chosen.impl_id == "paged_mqa_logits.triton.logits"
        assert not verdict.accepted and "deep_gemm" in verdict.reason, verdict.reason
    without = Environment.simulated(gpu=True, triton=True, deep_gemm=False)
    assert registry.resolve("paged_mqa_logits", target, PAGED, environment=without).chosen.impl_id == \
        "paged_mqa_logits.triton.logits"
    if target.arch == "sm90":
        res = registry.resolve("paged_mqa_logits", target, Problem(heads=128, dim=128, next_n=1, fp8="fn"))
        assert res.chosen.impl_id != "paged_mqa_logits.cuda.deepgemm"
    pipeline = registry.resolve("indexer_pipeline", target, Problem(tokens=32, decode=True, q_lora_quant=False))
    assert pipeline.chosen.impl_id == DUAL


@pytest.mark.deepgemm
def test_deepgemm_is_chosen_with_deep_gemm_installed(deep_gemm_api):
    target = detect_target("cuda")
    res = default_registry().resolve("paged_mqa_logits", target, PAGED)
    assert res.chosen.impl_id == "paged_mqa_logits.cuda.deepgemm", res.explain()
    api = deep_gemm_api[1]
    assert api.self_tested and api.context_lens_2d is not None, api.describe()
