"""The Ascend backend end to end on the CPU, through operators registered with torch.library under torch_npu's
published schemas (tests/doubles/torch_npu.py ``install_schema_ops``: real OpOverloadPackets, as torch_npu's ops are, whose
CPU kernels run the documented semantics in plain torch; it is not torch_npu and proves nothing about the real
kernels' numerics or speed).

What runs here for real: schema-based detection, the NPU registrations and their problem checks, the adapters'
calls bound by the published schemas (TND queries, PA_BSND keys, cumulative int32 query lengths, token key lengths),
the plain cache layouts and their store, `Indexer.forward` for prefill (with a prefix, bounded into chunks), decode
and speculative decode, V4 on npu (its C4 indexer refused, its prologues on the NPU ops), and
`dsa-indexer run --target npu`. tests/backends/test_npu_schemas.py covers each release's schemas, refusals, the RoPE limits
and the NaN rule.

Near-tie rule for comparing with the reference: the double and the reference compute the same fp32 scores from the
same bf16 / int8 values but sum in different orders, so a set may differ only in keys whose reference score lies
within 1e-4 (relative to the row's largest score) of the row's k-th score.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from doubles.torch_npu import install, install_schema_ops
from dsa_indexer import DecodeBatch, Indexer, IndexerConfig, PrefillBatch, ops
from dsa_indexer.backends import npu as npu_backend
from dsa_indexer.backends.reference import kernels as ref
from dsa_indexer.compressor import CompressorState
from dsa_indexer.contract.cache import IndexKCache
from dsa_indexer.contract.validate import IndexerInputError
from dsa_indexer.dispatch.environment import Environment
from dsa_indexer.dispatch.plugins import default_registry
from dsa_indexer.dispatch.registry import NoImplementationError
from dsa_indexer.pipeline import PIPELINE_OP

# 64 heads and dim 128: the shapes torch_npu's kernels take; small hidden sizes keep the CPU run short.
V32_SMALL = IndexerConfig(name="v32-small", hidden_size=256, q_lora_rank=256, n_heads=64, topk=48, max_position=4096)
V4_SMALL = IndexerConfig.deepseek_v4_flash()
V4_SMALL = IndexerConfig(**{**V4_SMALL.__dict__, "name": "v4-small", "hidden_size": 256, "q_lora_rank": 256,
                            "topk": 32, "max_position": 4096, "yarn": None})
NPU_IMPLS = {"lightning_indexer_ragged": "lightning_indexer_ragged.npu.torch_npu",
             "k_prologue_store_plain": "k_prologue_store_plain.npu.torch_npu",
             "q_prologue_plain": "q_prologue_plain.npu.torch_npu",
             PIPELINE_OP: f"{PIPELINE_OP}.npu.two_stream"}
REFERENCE_IMPLS = {"lightning_indexer_ragged": "lightning_indexer_ragged.reference.torch",
                   "k_prologue_store_plain": "k_prologue_store_plain.reference.torch",
                   "q_prologue_plain": "q_prologue_plain.reference.torch",
                   PIPELINE_OP: f"{PIPELINE_OP}.generic.plain_single_stream"}


@pytest.fixture
def npu(monkeypatch):
    """The schema operators installed as torch_npu, the probe re-run against them, the registry's environment fresh."""
    double = install_schema_ops(monkeypatch)
    monkeypatch.setattr(npu_backend.LIBRARY, "detected", None)
    reg = default_registry()
    previous = reg.environment
    env = Environment()
    env.add_probe("torch_npu", npu_backend.torch_npu_probe)
    reg.set_environment(env)
    yield double
    reg.set_environment(previous)


@contextlib.contextmanager
def forced(impls: dict):
    reg = default_registry()
    try:
        for op, impl in impls.items():
            reg.force(op, impl)
        yield
    finally:
        for op in impls:
            reg.force(op, None)


def _rows(n, width, gen):
    return torch.randn(n, width, generator=gen).to(torch.bfloat16)


def _assert_same_sets_up_to_near_ties(got, want, scores_of):
    """Row sets equal, except keys whose reference score is within the near-tie band of the k-th score."""
    for row in range(got.shape[0]):
        a = {i for i in got[row].tolist() if i >= 0}
        b = {i for i in want[row].tolist() if i >= 0}
        if a == b:
            continue
        scores = scores_of(row)
        kth = scores[[i for i in want[row].tolist() if i >= 0]].min()
        band = 1e-4 * float(scores.abs().max())
        for i in a ^ b:
            assert abs(float(scores[i] - kth)) <= band, (row, i, float(scores[i]), float(kth))
        assert len(a) == len(b), row


def _plain_scores(cache: IndexKCache, q, q_scales, weights, block_table_row, count):
    keys = ref.gather_plain_keys(cache.data, cache.scales_or_empty(), block_table_row, count)
    qf = q.float() if q.dtype != torch.int8 else q.float() * q_scales.float()[..., None]
    return ref._weighted_relu_scores(qf[None], keys, weights.float()[None])[0]


def test_explain_shows_the_npu_pipeline_and_ops_with_reasons(capsys):
    from dsa_indexer.cli import main

    assert main(["explain", "all", "--target", "npu", "--assume", "torch_npu=yes"]) in (0, None)
    out = capsys.readouterr().out
    for impl in NPU_IMPLS.values():
        assert f"=> {impl}" in out
    assert "problem (cache=paged64_bf16" in out  # the layout allocate_cache picks on npu
    assert main(["explain", "lightning_indexer_ragged", "--target", "npu", "--problem", "heads=16",
                 "--assume", "torch_npu=yes"]) in (0, None)
    assert "heads=16: torch_npu's lightning indexer takes 64" in capsys.readouterr().out


def test_strict_mode_raises_on_npu_without_torch_npu(monkeypatch):
    monkeypatch.setenv("DSA_INDEXER_STRICT", "1")
    reg = default_registry()
    previous = reg.environment
    reg.set_environment(Environment.simulated(torch_npu=False))
    try:
        idx = Indexer(V32_SMALL, target="npu").init_random(0)
        cache = idx.allocate_cache(2)
        gen = torch.Generator().manual_seed(0)
        batch = PrefillBatch.build([0], [60], [[0]], num_cache_pages=2)
        with pytest.raises(NoImplementationError, match="strict mode"):
            idx(_rows(60, 256, gen), _rows(60, 256, gen), batch.positions, batch, cache)
    finally:
        reg.set_environment(previous)
        monkeypatch.delenv("DSA_INDEXER_STRICT")
        reg.clear_cache()


def test_allocate_cache_picks_the_npu_layouts():
    assert Indexer(V32_SMALL, target="npu").allocate_cache(3).layout == "paged64_bf16"
    c4 = Indexer(V4_SMALL, target="npu").allocate_cache(3)
    assert c4.layout == "paged64_int8" and c4.scales.shape == (3, 64, 1) and c4.scales.dtype == torch.float16
    assert Indexer(V32_SMALL, target="sm90").allocate_cache(3).layout == "paged64_fp8_e4m3"
    with pytest.raises(ValueError, match="layout 'paged32' is not supported"):
        IndexKCache.allocate(2, layout="paged32")
    with pytest.raises(ValueError, match="needs fp16 scales"):
        IndexKCache(torch.zeros(2, 64, 1, 128, dtype=torch.int8), layout="paged64_int8")
    with pytest.raises(IndexerInputError, match="must be a torch.bfloat16 tensor"):
        IndexKCache(torch.zeros(2, 64, 1, 128, dtype=torch.float16), layout="paged64_bf16")


def _v32_steps(idx: Indexer, cache: IndexKCache, seed: int):
    """A prefill of two requests (one with a 150-token cached prefix), then a decode step and a next_n = 2 step."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.tensor([[3, 0, 5, 7], [1, 4, 2, 6]], dtype=torch.int32)
    outs = []
    prefix = PrefillBatch.build([0], [150], table[1:], num_cache_pages=8)
    idx.store_keys(_rows(150, 256, gen), prefix, cache)
    pb = PrefillBatch.build([0, 150], [90, 40], table, num_cache_pages=8)
    x, q_lora = _rows(130, 256, gen), _rows(130, 256, gen)
    outs.append((idx(x, q_lora, pb.positions, pb, cache), pb, x, q_lora))
    for seq, next_n in (([91, 191], 1), ([93, 193], 2)):
        db = DecodeBatch.build(seq, table, next_n=next_n, num_cache_pages=8)
        x, q_lora = _rows(db.num_tokens, 256, gen), _rows(db.num_tokens, 256, gen)
        outs.append((idx(x, q_lora, db.positions, db, cache), db, x, q_lora))
    return outs


def test_v32_prefill_decode_and_speculative_through_the_npu_path(npu):
    idx = Indexer(V32_SMALL, target="npu").init_random(1)
    cache = idx.allocate_cache(8)
    npu_outs = _v32_steps(idx, cache, seed=2)
    assert idx.last_pipeline.chosen.impl_id == NPU_IMPLS[PIPELINE_OP]
    check, *calls = [c for c in npu.calls if c[0] == "npu_lightning_indexer"]
    # first the one-time check that this release reads fp32 weights (an A2 device name, master's docs: it does)
    assert check[1]["sparse_count"] == 8 and check[1]["weights"].dtype == torch.float32
    assert len(calls) == 3 and any(c[0] == "npu_scatter_nd_update_" for c in npu.calls)
    prefill_call = calls[0][1]
    assert (prefill_call["layout_query"], prefill_call["layout_key"], prefill_call["sparse_mode"],
            prefill_call["sparse_count"]) == ("TND", "PA_BSND", 3, V32_SMALL.topk)
    assert prefill_call["actual_seq_lengths_query"].tolist() == [90, 130]  # cumulative ends, no leading 0
    assert prefill_call["actual_seq_lengths_key"].tolist() == [90, 190]  # tokens, the prefix included
    assert prefill_call["weights"].dtype == torch.float32 and prefill_call["key"].dtype == torch.bfloat16
    spec_call = calls[2][1]
    assert spec_call["actual_seq_lengths_query"].tolist() == [2, 4]
    assert spec_call["actual_seq_lengths_key"].tolist() == [93, 193]

    ref_cache = idx.allocate_cache(8)
    with forced(REFERENCE_IMPLS):
        ref_outs = _v32_steps(idx, ref_cache, seed=2)
    assert torch.equal(cache.data, ref_cache.data)  # the scatter store wrote exactly the reference's keys
    for (got, batch, x, q_lora), (want, *_) in zip(npu_outs, ref_outs):
        assert got.shape == (batch.num_tokens, V32_SMALL.topk) and got.dtype == torch.int32
        with forced(REFERENCE_IMPLS):
            plan = idx.step_plan(batch.num_tokens, False, cache_layout=cache.layout)
            q, q_scales, weights = plan.steps.q_path_plain(plan, x, q_lora, batch.positions, None, "bf16")
        cu, seq, table = batch.request_rows()
        request_of = torch.repeat_interleave(torch.arange(len(seq)), (cu[1:] - cu[:-1]).long())

        def scores_of(row):
            b = int(request_of[row])
            return _plain_scores(cache, q[row], q_scales, weights[row], table[b], int(seq[b]))

        _assert_same_sets_up_to_near_ties(got, want, scores_of)
        # -1 exactly where a row sees fewer than k keys
        visible = (seq[request_of] - (cu[1:] - cu[:-1])[request_of] + 1 +
                   torch.arange(batch.num_tokens) - cu[:-1][request_of])
        assert torch.equal((got >= 0).sum(1), visible.clamp(max=V32_SMALL.topk).to(torch.int64))


def test_bounded_prefill_on_the_npu_path_matches_one_pass(npu):
    idx = Indexer(V32_SMALL, target="npu").init_random(4)
    gen = torch.Generator().manual_seed(5)
    x, q_lora = _rows(300, 256, gen), _rows(300, 256, gen)
    table = torch.tensor([[2, 0, 4], [1, 3, 5]], dtype=torch.int32)
    pb = PrefillBatch.build([0, 0], [180, 120], table, num_cache_pages=6)
    one_pass = idx(x, q_lora, pb.positions, pb, idx.allocate_cache(6))
    idx.logits_budget_bytes = 2 << 20  # a few dozen rows per chunk
    assert len(pb.plan_chunks(idx.logits_budget_bytes, idx.q_path_bytes_per_row())) > 2
    before = len(npu.calls)
    chunked = idx(x, q_lora, pb.positions, pb, idx.allocate_cache(6))
    assert torch.equal(one_pass, chunked)
    assert sum(c[0] == "npu_lightning_indexer" for c in npu.calls[before:]) > 2


def test_v4_on_npu_refuses_the_c4_indexer_and_runs_its_prologues_on_the_npu_ops(npu):
    """No released torch_npu indexer takes compressed keys: V4's C4 scoring falls back to the reference (with the
    reason), while its interleaved RoPE, int8 quant and store run on the NPU operators."""
    idx = Indexer(V4_SMALL, target="npu").init_random(6)
    cache = idx.allocate_cache(4)
    assert cache.layout == "paged64_int8"
    state = CompressorState.allocate(2, V4_SMALL)
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)

    def steps(cache, state):
        pb = PrefillBatch.build([0, 0], [230, 170], table, num_cache_pages=4, compress_ratio=4)
        g = torch.Generator().manual_seed(8)
        x, q_lora = _rows(400, 256, g), _rows(400, 256, g)
        out = [idx(x, q_lora, pb.positions, pb, cache, compressor_state=state)]
        db = DecodeBatch.build([232, 172], table, next_n=2, num_cache_pages=4, compress_ratio=4)
        x, q_lora = _rows(4, 256, g), _rows(4, 256, g)
        out.append(idx(x, q_lora, db.positions, db, cache, compressor_state=state))
        return out

    with pytest.warns(RuntimeWarning, match="ratio=4: torch_npu's lightning indexer takes 1 \\(uncompressed keys: "
                                            "no released torch_npu indexer"):
        got = steps(cache, state)
    names = [c[0] for c in npu.calls]
    assert "npu_quant_lightning_indexer" not in names and "npu_lightning_indexer" not in names
    rotary = [c[1] for c in npu.calls if c[0] == "npu_rotary_mul"]
    assert rotary and all(c["rotary_mode"] == "interleave" for c in rotary)
    assert all(c["self"].shape[0] == 1 and c["r1"].shape == (1, c["self"].shape[1], 1, c["self"].shape[3])
               for c in rotary)  # [1, T, N, R] with 1S1D cos / sin
    assert "npu_dynamic_quant" in names and "npu_scatter_nd_update_" in names
    res = default_registry().resolve("lightning_indexer_ragged", idx.target, ops.problem(
        "lightning_indexer_ragged", heads=64, dim=128, k=32, format="int8", ratio=4))
    cand = [c for c in res.candidates if c.impl.impl_id == NPU_IMPLS["lightning_indexer_ragged"]][0]
    assert "no released torch_npu indexer takes a compression ratio" in cand.reason
    ref_cache, ref_state = idx.allocate_cache(4), CompressorState.allocate(2, V4_SMALL)
    with forced(REFERENCE_IMPLS):
        want = steps(ref_cache, ref_state)
    # npu_dynamic_quant quantizes the bf16-rounded keys (it takes fp16 / bf16) with an fp32 scale, kept in fp16; the
    # reference quantizes the fp32 keys with the fp16-rounded scale. bf16 rounding moves a value by up to
    # 127 * 2^-9 ~ 0.25 of a step, the rounding choice by one more: at most ~1.5 int8 steps apart.
    deq = cache.data.float() * cache.scales.float()[..., None]
    deq_ref = ref_cache.data.float() * ref_cache.scales.float()[..., None]
    step = torch.maximum(cache.scales, ref_cache.scales).float()[..., None]
    assert bool(((deq - deq_ref).abs() <= 1.6 * step + 1e-6).all())
    assert (cache.data == ref_cache.data).float().mean() > 0.9
    for a, b in zip(got, want):
        overlap = sum(len(set(r1) & set(r2) - {-1}) for r1, r2 in zip(a.tolist(), b.tolist()))
        total = sum(len(set(r) - {-1}) for r in b.tolist())
        assert overlap >= 0.99 * total
        assert torch.equal((a >= 0).sum(1), (b >= 0).sum(1))
    assert int((got[0][229] >= 0).sum()) == min(V4_SMALL.topk, 230 // 4)  # entries j < (p + 1) // 4


def _int8_indexer_inputs(seed):
    """Two requests (a 3-row prefill over 150 keys, a decode row over 70) on an int8 cache with random pages."""
    gen = torch.Generator().manual_seed(seed)
    pages = 6
    cache = torch.randint(-127, 128, (pages, 64, 1, 128), generator=gen, dtype=torch.int8)
    scales = (torch.rand(pages, 64, 1, generator=gen) * 0.02 + 0.001).half()
    q = torch.randint(-127, 128, (4, 64, 128), generator=gen, dtype=torch.int8)
    q_scales = (torch.rand(4, 64, generator=gen) * 0.02 + 0.001).half()
    weights = torch.randn(4, 64, generator=gen)
    cu = torch.tensor([0, 3, 4], dtype=torch.int32)
    seq = torch.tensor([150, 70], dtype=torch.int32)
    table = torch.tensor([[4, 1, 5], [2, 0, 3]], dtype=torch.int32)
    return q, q_scales, cache, scales, weights, cu, seq, table


def test_int8_keys_through_the_quant_indexer_schema(npu):
    q, q_scales, cache, scales, weights, cu, seq, table = _int8_indexer_inputs(10)
    with forced({"lightning_indexer_ragged": NPU_IMPLS["lightning_indexer_ragged"]}):
        got = ops.lightning_indexer_ragged(q, q_scales, cache, scales, weights, cu, seq, table, 40, target="npu")
    (name, call), = [c for c in npu.calls if c[0] == "npu_quant_lightning_indexer"]
    assert (call["query_quant_mode"], call["key_quant_mode"], call["layout_query"], call["layout_key"],
            call["sparse_count"], call["sparse_mode"]) == (0, 0, "TND", "PA_BSND", 40, 3)
    assert call["weights"].dtype == torch.float16 and call["query_dequant_scale"].dtype == torch.float16
    assert call["actual_seq_lengths_query"].tolist() == [3, 4] and call["actual_seq_lengths_key"].tolist() == [150, 70]
    with forced({"lightning_indexer_ragged": REFERENCE_IMPLS["lightning_indexer_ragged"]}):
        want = ops.lightning_indexer_ragged(q, q_scales, cache, scales, weights, cu, seq, table, 40, target="npu")
    plain = IndexKCache(cache, layout="paged64_int8", scales=scales)
    request_of = [0, 0, 0, 1]

    def scores_of(row):
        b = request_of[row]
        return _plain_scores(plain, q[row], q_scales[row], weights[row], table[b], int(seq[b]))

    # the kernel takes fp16 weights (the reference fp32): near ties may swap
    _assert_same_sets_up_to_near_ties(got, want, scores_of)
    assert torch.equal((got >= 0).sum(1), (want >= 0).sum(1))


def test_out_is_filled_with_a_copy_of_what_the_npu_indexer_returns(npu):
    """torch_npu's indexers return tensors of their own (no output argument), so the registration declares no
    writes_out: a caller's ``out=`` gets one copy of the NPU result, every element, and is returned."""
    args = (*_int8_indexer_inputs(12), 100)
    with forced({"lightning_indexer_ragged": NPU_IMPLS["lightning_indexer_ragged"]}):
        want = ops.lightning_indexer_ragged(*args, target="npu")
        out = torch.full(want.shape, 12345, dtype=torch.int32)  # no entry index here: one left unwritten shows
        assert ops.lightning_indexer_ragged(*args, target="npu", out=out) is out
    assert torch.equal(out, want) and bool((out == -1).any())  # the decode row sees 70 keys, fewer than k
    assert len([c for c in npu.calls if c[0] == "npu_quant_lightning_indexer"]) == 2  # the NPU op served both


def test_the_plain_python_double_still_drives_the_adapter(monkeypatch):
    """The extra form: plain functions (Python signatures, no types) are detected and called the same way."""
    double = install(monkeypatch)
    monkeypatch.setattr(npu_backend.LIBRARY, "detected", None)
    assert npu_backend.torch_npu_probe() is None
    api = npu_backend.LIBRARY.detected_api()
    assert api.indexer is not None and api.signatures["npu_lightning_indexer"].source == "python signature"
    from dsa_indexer.backends.npu.lightning import make_lightning_indexer_ragged

    adapter = make_lightning_indexer_ragged(npu_backend.detected_api)
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(3, 64, 128, generator=gen).to(torch.bfloat16)
    cache = torch.randn(2, 64, 1, 128, generator=gen).to(torch.bfloat16)
    out = adapter(q, torch.empty(0, dtype=torch.float16), cache, torch.empty(0, dtype=torch.float16),
                  torch.randn(3, 64, generator=gen), torch.tensor([0, 3], dtype=torch.int32),
                  torch.tensor([100], dtype=torch.int32), torch.tensor([[1, 0]], dtype=torch.int32), 16)
    assert out.shape == (3, 16) and bool((out[:, 0] >= 0).all())
    name, kwargs = double.calls[-1]
    assert name == "npu_lightning_indexer" and kwargs["sparse_count"] == 16


def test_constraints_are_problem_checks_with_reasons(npu):
    reg = default_registry()
    target = Indexer(V32_SMALL, target="npu").target
    refusals = ((dict(heads=16), "heads=16"), (dict(k=4096), "k=4096: torch_npu's lightning indexer takes 1..2048"),
                (dict(dim=64), "head dim 64"))
    for facts, words in refusals:
        problem = ops.problem("lightning_indexer_ragged", **{"heads": 64, "dim": 128, "k": 2048, "format": "bf16",
                                                             "ratio": 1, **facts})
        res = reg.resolve("lightning_indexer_ragged", target, problem)
        cand = [c for c in res.candidates if c.impl.impl_id == NPU_IMPLS["lightning_indexer_ragged"]][0]
        assert words in cand.reason and res.chosen.vendor == "reference"


def test_q_lora_quant_is_dropped_with_its_reason_on_the_plain_path(npu):
    idx = Indexer(V32_SMALL, target="npu").init_random(3)
    gen = torch.Generator().manual_seed(3)
    x, q_lora = _rows(80, 256, gen), _rows(80, 256, gen)
    q_lora2, quant = ops.rmsnorm_quant_fp8(q_lora, torch.ones(256, dtype=torch.bfloat16), 1e-6, target="cpu")
    pb = PrefillBatch.build([0], [80], [[0, 1]], num_cache_pages=2)
    idx(x, q_lora2, pb.positions, pb, idx.allocate_cache(2), q_lora_quant=quant)
    assert idx.reuse_stats["dropped"] == 1
    assert any("plain layout" in key for key in idx.reuse_stats)


def test_dsa_indexer_run_target_npu(npu, capsys):
    from dsa_indexer.cli import main

    code = main(["run", "--target", "npu", "--device", "cpu", "--batch", "1", "--context", "2200", "--steps", "1",
                 "--prefill-tokens", "64"])
    out = capsys.readouterr().out
    assert code in (0, None), out
    assert "lightning_indexer_ragged.npu.torch_npu" in out and "indexer_pipeline.npu.two_stream" in out
    assert "MISMATCH" not in out and "-> OK" in out


def test_bench_times_the_npu_step_on_its_own_cache_layout(npu, monkeypatch, capsys):
    import json

    from dsa_indexer.cli import main

    monkeypatch.setenv("DSA_INDEXER_TARGET", "npu")
    default_registry().clear_cache()
    try:
        code = main(["bench", "--suite", "decode", "--device", "cpu", "--batch", "1", "--context", "2304",
                     "--repeats", "1", "--json", "-", "--progress", "none"])
        data = json.loads(capsys.readouterr().out)
    finally:
        monkeypatch.delenv("DSA_INDEXER_TARGET")
        default_registry().clear_cache()
    assert code == 0, data.get("errors")
    steps = [r for r in data["rows"] if r["op"] == "indexer_pipeline"]
    assert {r["details"]["impl_id"] for r in steps} == {NPU_IMPLS[PIPELINE_OP], REFERENCE_IMPLS[PIPELINE_OP]}
    assert all("plain layout" in r["details"].get("q_lora_quant", "plain layout") for r in steps)
    assert any(c[0] == "npu_lightning_indexer" for c in npu.calls)  # the step scored through the plain layout


def test_graph_decode_refuses_a_plain_layout_cache():
    from dsa_indexer.contract.validate import IndexerInputError

    idx = Indexer(V32_SMALL).init_random(0)
    with pytest.raises(IndexerInputError, match="paged64_bf16 cache .* is not captured"):
        idx.capture_decode(idx.allocate_cache(2, "paged64_bf16"), batch_size=1, max_context_len=64)
