"""Issue 40 items 1 and 2 on the CPU, through operators under op-plugin's published schemas (tests/doubles/torch_npu.py)
whose kernels follow each release's documented dtypes per Ascend product (`release_rules`: 7.3.0 b3065ed3, 26.0.0
6ffd6e22, 26.1.0 09024aa9, master 517f2e7d, `docs/zh/custom_APIs/torch_npu/torch_npu-npu_(quant_)lightning_indexer.md`).
Not Ascend hardware: these prove the calls the adapters make and the registry's decisions, not the kernels' numerics.

1. Ascend 950PR / 950DT: ``lightning_indexer.npu.torch_npu_fp8`` reads the library's fp8 132-byte pages in place
   (strided views, no copy) through npu_quant_lightning_indexer's float8_e4m3fn path; elsewhere it is refused with
   the reason, and on a release without that path (26.0.0: same schema) its one-time device check fails and the
   registry falls back, saying why.
2. Atlas A2 / A3: the bf16 npu_lightning_indexer gets fp32 weights where the release takes them (26.0.0 on), so no
   bf16 rounding of the weights; 7.3.0 and 950 keep the query's dtype.

Near-tie rule against the reference: the double and the reference sum the same fp32 products in different orders,
so a top-k set may differ only in keys within 1e-4 (of the row's largest |score|) of the row's k-th score.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from doubles.torch_npu import install_schema_ops
from dsa_indexer import ops
from dsa_indexer.backends import npu as npu_backend
from dsa_indexer.backends.npu.lightning import check_fp8_adapter, make_lightning_indexer_fp8
from dsa_indexer.backends.reference import kernels as ref
from dsa_indexer.contract.cache import IndexKCache, PAGE_BYTES, page_views
from dsa_indexer.dispatch.environment import Environment
from dsa_indexer.dispatch.plugins import default_registry
from dsa_indexer.dispatch.problem import Problem
from dsa_indexer.dispatch.target import parse_target as resolve_target

FP8_IMPL = "lightning_indexer.npu.torch_npu_fp8"
A2, A3, A950 = "Ascend910B3", "Ascend910_9382", "Ascend950PR_9579"


@pytest.fixture
def npu(monkeypatch):
    """install(release, device_name) -> the schema-op torch_npu on that product, probed in a fresh environment."""
    reg = default_registry()
    previous = reg.environment

    def install(release="op-plugin master", device_name=A950):
        module = install_schema_ops(monkeypatch, release, device_name=device_name)
        monkeypatch.setattr(npu_backend.LIBRARY, "detected", None)
        env = Environment()
        env.add_probe("torch_npu", npu_backend.torch_npu_probe)
        reg.set_environment(env)
        reg.clear_cache()
        # the fp8 adapter's device check runs in its factory, once per process (one torch_npu per process); each
        # test installs another, so the built adapter is forgotten
        reg._factories.pop(FP8_IMPL, None)
        assert npu_backend.torch_npu_probe() is None
        return module

    yield install
    reg.set_environment(previous)
    reg.clear_cache()
    reg._factories.pop(FP8_IMPL, None)


def _fp8_decode(seed, heads=64, next_n=2):
    """A decode problem over a random fp8 cache: 3 requests (one padding row of length 0), a shuffled table."""
    gen = torch.Generator().manual_seed(seed)
    pool, width = 24, 7
    cache = IndexKCache.allocate(pool, "cpu", torch.float8_e4m3fn).data
    keys, scales = page_views(cache)
    keys.copy_((torch.randn(keys.shape, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn))
    scales.copy_(torch.rand(scales.shape, generator=gen) * 1e-2 + 1e-3)
    table = torch.randperm(pool, generator=gen)[: 3 * width].to(torch.int32).view(3, width)
    lens = torch.tensor([[0, 65], [200, 201], [400, 401]], dtype=torch.int32)[:, 2 - next_n:]  # row (0, 0): padding
    q = (torch.randn(3, next_n, heads, 128, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    weights = torch.randn(3 * next_n, heads, generator=gen)  # both signs: the sign / |w| split must hold
    return q, cache, weights, lens, table, width * 64


def _same_sets_up_to_near_ties(got, want, logits):
    for row in range(got.shape[0]):
        a, b = ({i for i in t[row].tolist() if i >= 0} for t in (got, want))
        assert len(a) == len(b), row
        if a != b:
            kth = logits[row, sorted(b)].min()
            band = 1e-4 * float(logits[row][torch.isfinite(logits[row])].abs().max())
            assert all(abs(float(logits[row, i] - kth)) <= band for i in a ^ b), row


# --- item 1: the fp8 pages on Ascend 950 --------------------------------------------------------------------------
def test_fp8_pages_are_read_in_place_on_950_and_match_the_reference(npu):
    module = npu("op-plugin master", A950)
    q, cache, weights, lens, table, max_len = _fp8_decode(1)
    got = ops.lightning_indexer(q, cache, weights, lens, table, max_len, 48, target="npu")
    res = default_registry().resolve("lightning_indexer", resolve_target("npu"),
                                     ops.OPERATORS["lightning_indexer"].problem(q, cache, weights, lens, table,
                                                                                max_len, 48, False))
    assert res.chosen.impl_id == FP8_IMPL
    call = [c for c in module.calls if c[0] == "npu_quant_lightning_indexer"][-1][1]
    key, key_scale = call["key"], call["key_dequant_scale"]
    # the cache itself, as two strided views (no copy): keys [pages, 64, 1, 128], scales [pages, 64, 1] fp32
    assert key.dtype == torch.float8_e4m3fn and tuple(key.shape) == (24, 64, 1, 128)
    assert key.stride() == (PAGE_BYTES, 128, 128, 1) and key.data_ptr() == cache.data_ptr()
    assert key_scale.dtype == torch.float32 and key_scale.stride() == (PAGE_BYTES // 4, 1, 1)
    assert key_scale.data_ptr() == cache.data_ptr() + 64 * 128
    # weights split into an exact sign (bf16) and the magnitude (fp32): sign * |w| is w, no rounding
    assert call["weights"].dtype == torch.bfloat16 and call["query_dequant_scale"].dtype == torch.float32
    assert torch.equal(call["weights"].float() * call["query_dequant_scale"], weights)
    assert call["actual_seq_lengths_key"].tolist() == lens.flatten().tolist()  # each row its own request
    want = ref.lightning_indexer(q, cache, weights, lens, table, max_len, 48)
    _same_sets_up_to_near_ties(got, want, ref.paged_mqa_logits(q, cache, weights, lens, table, max_len))
    assert (got[0] == -1).all()  # the padding row (length 0) selects nothing
    slots = ops.lightning_indexer(q, cache, weights, lens, table, max_len, 48, return_slots=True, target="npu")
    rows = torch.arange(3).repeat_interleave(2)
    assert torch.equal(slots, ref.indices_to_slots(got, table, rows))


def test_out_is_filled_with_a_copy_of_what_the_fp8_npu_indexer_returns(npu):
    """No writes_out at this registration (npu_quant_lightning_indexer returns its own tensors): ``out=`` is filled
    by one copy of the NPU result, positions and slots alike."""
    module = npu("op-plugin master", A950)
    args = _fp8_decode(3)
    for slots in (False, True):
        want = ops.lightning_indexer(*args, 48, return_slots=slots, target="npu")
        out = torch.full(want.shape, -7, dtype=torch.int32)  # -7: neither an index nor the -1 padding
        assert ops.lightning_indexer(*args, 48, return_slots=slots, target="npu", out=out) is out
        assert torch.equal(out, want) and bool((out == -1).any())  # the padding row
    assert len([c for c in module.calls if c[0] == "npu_quant_lightning_indexer"]) >= 4  # the NPU op served


@pytest.mark.parametrize("heads", [16, 32])
def test_fp8_adapter_takes_the_950_head_counts(npu, heads):
    npu("op-plugin 26.1.0", A950)
    q, cache, weights, lens, table, max_len = _fp8_decode(2, heads=heads, next_n=1)
    got = make_lightning_indexer_fp8(npu_backend.detected_api)(q, cache, weights, lens, table, max_len, 32)
    want = ref.lightning_indexer(q, cache, weights, lens, table, max_len, 32)
    _same_sets_up_to_near_ties(got, want, ref.paged_mqa_logits(q, cache, weights, lens, table, max_len))


def test_fp8_pages_are_refused_off_950_with_the_reason(npu):
    npu("op-plugin master", A2)
    target = resolve_target("npu")
    res = default_registry().resolve("lightning_indexer", target, Problem(heads=64, dim=128, fp8="fn", keys="fp8"))
    cand = next(c for c in res.candidates if c.impl.impl_id == FP8_IMPL)
    assert not cand.accepted and "on Atlas A2 npu_quant_lightning_indexer takes int8 keys only" in cand.reason
    npu("op-plugin master", A950)
    for problem, words in ((Problem(heads=128), "heads=128"), (Problem(keys="fp4"), "FP4 pages"),
                           (Problem(fp8="fnuz"), "float8_e4m3fn"), (Problem(k=4096), "k=4096")):
        res = default_registry().resolve("lightning_indexer", target, problem)
        assert words in next(c for c in res.candidates if c.impl.impl_id == FP8_IMPL).reason


def test_a_release_without_the_fp8_path_fails_its_device_check_and_falls_back(npu):
    """26.0.0 has master's quant-indexer schema (query_dtype / key_dtype included) but its docs take no fp8: the
    schema cannot tell, the one-time check on the device does, and the registry says why."""
    npu("op-plugin 26.0.0", A950)
    q, cache, weights, lens, table, max_len = _fp8_decode(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "could not be built, falling back" (once per process)
        got = ops.lightning_indexer(q, cache, weights, lens, table, max_len, 48, target="npu")
    assert torch.equal(got, ops.lightning_indexer(q, cache, weights, lens, table, max_len, 48, target="cpu"))
    broken = default_registry().failed_implementations()
    assert "fp8 check failed" in broken[FP8_IMPL] and "26.1.0" in broken[FP8_IMPL]


def test_the_fp8_check_catches_a_wrong_adapter(npu):
    npu("op-plugin master", A950)
    right = make_lightning_indexer_fp8(npu_backend.detected_api)
    check_fp8_adapter(right, torch.device("cpu"))

    def signs_lost(q, cache, weights, *rest):  # an adapter passing |w| whole: the negative heads' terms flip
        return right(q, cache, weights.abs(), *rest)

    with pytest.raises(AssertionError, match="differ from the reference"):
        check_fp8_adapter(signs_lost, torch.device("cpu"))


# --- item 2: fp32 weights on A2 / A3 -------------------------------------------------------------------------------
def _bf16_call(module, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 64, 128, generator=gen).to(torch.bfloat16)
    cache = torch.randn(4, 64, 1, 128, generator=gen).to(torch.bfloat16)
    weights = torch.randn(3, 64, generator=gen) * (1 + 2**-10)  # not representable in bf16
    args = (q, torch.empty(0, dtype=torch.float16), cache, torch.empty(0, dtype=torch.float16), weights,
            torch.tensor([0, 3], dtype=torch.int32), torch.tensor([250], dtype=torch.int32),
            torch.tensor([[2, 0, 3, 1]], dtype=torch.int32), 32)
    got = ops.lightning_indexer_ragged(*args, target="npu")
    real = [c[1] for c in module.calls if c[0] == "npu_lightning_indexer" and c[1]["sparse_count"] == 32]
    return got, real[-1], args


@pytest.mark.parametrize("release,device,dtype", [
    ("op-plugin 7.3.0", A2, torch.bfloat16),     # its docs: the query's dtype only
    ("op-plugin 26.0.0", A2, torch.float32),
    ("op-plugin 26.1.0", A3, torch.float32),
    ("op-plugin master", A2, torch.float32),
    ("op-plugin master", A950, torch.bfloat16),  # 950 refuses fp32 weights (its docs): not even tried
])
def test_bf16_indexer_weights_dtype_per_release_and_product(npu, release, device, dtype):
    module = npu(release, device)
    default_registry().force("lightning_indexer_ragged", "lightning_indexer_ragged.npu.torch_npu")
    try:
        got, call, args = _bf16_call(module, seed=5)
    finally:
        default_registry().force("lightning_indexer_ragged", None)
    assert call["weights"].dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(call["weights"], args[4])  # the weights as given: no rounding
    checks = [c for c in module.calls if c[0] == "npu_lightning_indexer" and c[1]["sparse_count"] == 8]
    assert len(checks) == (0 if device == A950 else 1)  # one check per device, none on 950
    assert got.shape == (3, 32) and got.dtype == torch.int32


def test_fp32_weights_change_what_bf16_rounding_would_select(npu):
    """Two keys whose scores differ by less than the weights' bf16 rounding: with fp32 weights (A2, master) the
    indexer keeps key 1, which the fp32 weights rank higher, as the reference does; bf16 weights tie the two and the
    lower position (key 0) would be kept."""
    module = npu("op-plugin master", A2)
    q = torch.zeros(1, 64, 128, dtype=torch.bfloat16)
    q[0, 0, 0], q[0, 1, 1] = 1, 1
    cache = torch.zeros(1, 64, 1, 128, dtype=torch.bfloat16)
    cache[0, 0, 0, 0] = 1  # key 0 scores w[0]
    cache[0, 1, 0, 1] = 1  # key 1 scores w[1]
    weights = torch.zeros(1, 64)
    weights[0, 0], weights[0, 1] = 1 + 2**-10, 1 + 2**-9  # w1 > w0; both round to 1.0 in bf16: a tie, lower wins
    weights[0, 2:] = 0.5
    args = (q, torch.empty(0, dtype=torch.float16), cache, torch.empty(0, dtype=torch.float16), weights,
            torch.tensor([0, 1], dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
            torch.tensor([[0]], dtype=torch.int32), 1)
    default_registry().force("lightning_indexer_ragged", "lightning_indexer_ragged.npu.torch_npu")
    try:
        got = ops.lightning_indexer_ragged(*args, target="npu")
    finally:
        default_registry().force("lightning_indexer_ragged", None)
    assert got.tolist() == [[1]] == ref.lightning_indexer_ragged(*args).tolist()
    assert [c for c in module.calls if c[0] == "npu_lightning_indexer"][-1][1]["weights"].dtype == torch.float32
