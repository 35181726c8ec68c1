"""The torch_npu test double (`npu_double`) against a straightforward per-token Python loop, plus its checks; its
two forms (operators under the published schemas, plain functions) agree."""

import importlib
import importlib.util
import inspect
import sys

import pytest
import torch

from doubles import torch_npu as npu_double
from doubles.torch_npu import SCHEMAS, TorchNpuDouble, install, schema_ops

H, D = 64, 128
# (query count n, key length L): decode, speculative, prefill with a prefix, prefill without, more queries than
# keys (the first ones see nothing), an empty cache.
REQUESTS = [(1, 200), (2, 150), (7, 90), (5, 5), (4, 2), (3, 0)]


# ----------------------------------------------------------------------------------------------- building inputs


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def cumulative(counts):
    return torch.tensor(counts, dtype=torch.int32).cumsum(0).int()


def block_table(entry_counts, block_size, g):
    """A random, non-identity block table (unused columns -1) and the number of blocks in the cache."""
    needs = [-(-c // block_size) for c in entry_counts]
    total = sum(needs) + 3  # spare blocks hold garbage
    perm = torch.randperm(total, generator=g)
    table = torch.full((len(needs), max(needs) + 1), -1, dtype=torch.int32)
    at = 0
    for b, need in enumerate(needs):
        table[b, :need] = perm[at: at + need].int()
        at += need
    return table, total


def paged(entries, table, total, block_size, garbage):
    """Entry j of request b at cache[table[b, j // block_size], j % block_size]; everything else is garbage."""
    cache = garbage((total, block_size, *entries[0].shape[1:]))
    for b, e in enumerate(entries):
        for j in range(e.shape[0]):
            cache[table[b, j // block_size], j % block_size] = e[j]
    return cache


def float_requests(spec, g, dtype=torch.bfloat16):
    return [(torch.randn(n, H, D, generator=g).to(dtype), torch.randn(n, H, generator=g).to(dtype),
             torch.randn(length, D, generator=g).to(dtype)) for n, length in spec]


def lay_out_query(layout, tensors, g):
    """Per-request [n, ...] tensors -> TND (concatenated) or BSND (padded with random garbage rows)."""
    counts = [t.shape[0] for t in tensors]
    if layout == "TND":
        return torch.cat(tensors), cumulative(counts)
    s1 = max(counts)
    out = torch.randn(len(tensors), s1, *tensors[0].shape[1:], generator=g).to(tensors[0].dtype)
    for b, t in enumerate(tensors):
        out[b, : t.shape[0]] = t
    return out, torch.tensor(counts, dtype=torch.int32)


def lay_out_key(layout, keys, g, block_size=64):
    """Per-request [L, D] keys -> (key, actual_seq_lengths_key, block_table) in the given layout."""
    lengths = [k.shape[0] for k in keys]
    garbage = lambda shape: torch.randn(shape, generator=g).to(keys[0].dtype)  # noqa: E731
    if layout == "TND":
        return torch.cat(keys)[:, None], cumulative(lengths), None
    if layout == "BSND":
        out = garbage((len(keys), max(max(lengths), 1), 1, D))
        for b, k in enumerate(keys):
            out[b, : k.shape[0], 0] = k
        return out, torch.tensor(lengths, dtype=torch.int32), None
    table, total = block_table(lengths, block_size, g)
    return paged([k[:, None] for k in keys], table, total, block_size, garbage), torch.tensor(lengths).int(), table


# ----------------------------------------------------------------------------------------------- the loop


def loop_topk(n, length, count, sparse_mode, score_of):
    """For each of a request's n queries: its visible entries, scored one query at a time, best first by sort."""
    rows, vals = [], []
    for i in range(n):
        end = length if sparse_mode == 0 else min(max(length - n + i + 1, 0), length)
        visible = end
        scores = score_of(i, visible).tolist() if visible else []
        order = sorted(range(visible), key=lambda s: (-scores[s], s))[:count]
        rows.append(order + [-1] * (count - len(order)))
        vals.append([scores[s] for s in order] + [float("-inf")] * (count - len(order)))
    return rows, vals


def float_score(q, w, k):
    return lambda i, vis: torch.relu(k[:vis].float() @ q[i].float().T) @ w[i].float()


def quant_score(q, w, qs, k, ks):
    return lambda i, vis: torch.relu(qs[i].float()[None, :] * ks[:vis].float()[:, None]
                                     * (k[:vis].float() @ q[i].float().T)) @ w[i].float()


def expected(layout_query, spec, per_request, count):
    """Stack the loop's rows into the indexer's output shape (BSND: rows past a request's count are -1)."""
    if layout_query == "TND":
        rows = [r for b in per_request for r in b[0]]
        vals = [v for b in per_request for v in b[1]]
        return torch.tensor(rows, dtype=torch.int32)[:, None], torch.tensor(vals)[:, None]
    s1 = max(n for n, _ in spec)
    idx = torch.full((len(spec), s1, 1, count), -1, dtype=torch.int32)
    val = torch.full((len(spec), s1, 1, count), float("-inf"))
    for b, (rows, vals) in enumerate(per_request):
        idx[b, : len(rows), 0], val[b, : len(rows), 0] = torch.tensor(rows, dtype=torch.int32), torch.tensor(vals)
    return idx, val


def check_values(got, want):
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)) and bool((got[~finite] == float("-inf")).all())
    # fp32 sums over heads in another order: error relative to the largest score (terms cancel across heads).
    scale = float(want[finite].abs().max()) if finite.any() else 1.0
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-5 * scale)


# ----------------------------------------------------------------------------------------------- indexer vs loop


@pytest.mark.parametrize("sparse_mode", [3, 0])
@pytest.mark.parametrize("layout_query,layout_key,block_size", [
    ("TND", "PA_BSND", 64), ("TND", "PA_BSND", 128), ("BSND", "PA_BSND", 64), ("TND", "TND", None),
    ("BSND", "BSND", None)])
def test_lightning_indexer_matches_loop(layout_query, layout_key, block_size, sparse_mode):
    g, count = gen(1), 32
    reqs = float_requests(REQUESTS, g)
    query, aslq = lay_out_query(layout_query, [q for q, _, _ in reqs], g)
    weights, _ = lay_out_query(layout_query, [w for _, w, _ in reqs], g)
    key, aslk, table = lay_out_key(layout_key, [k for _, _, k in reqs], g, block_size)
    idx, val = TorchNpuDouble().npu_lightning_indexer(
        query, key, weights, actual_seq_lengths_query=aslq, actual_seq_lengths_key=aslk, block_table=table,
        layout_query=layout_query, layout_key=layout_key, sparse_count=count, sparse_mode=sparse_mode,
        return_value=True)
    per_request = [loop_topk(n, length, count, sparse_mode, float_score(q, w, k))
                   for (n, length), (q, w, k) in zip(REQUESTS, reqs)]
    want_idx, want_val = expected(layout_query, REQUESTS, per_request, count)
    assert idx.dtype == torch.int32 and idx.shape == want_idx.shape
    assert torch.equal(idx, want_idx)
    assert (idx == -1).any() and (idx[..., -1] >= 0).any()  # both padding and truncation happened
    check_values(val, want_val)


def test_values_empty_unless_asked():
    g = gen(2)
    (q, w, k), = float_requests([(2, 40)], g, torch.float16)
    key, aslk, table = lay_out_key("PA_BSND", [k], g)
    idx, val = TorchNpuDouble().npu_lightning_indexer(
        q, key, w, actual_seq_lengths_query=cumulative([2]), actual_seq_lengths_key=aslk, block_table=table,
        layout_query="TND", layout_key="PA_BSND", sparse_count=8)
    assert idx.shape == (2, 1, 8) and val.numel() == 0


def test_ties_go_to_the_lower_position():
    g = gen(3)
    (q, w, k), = float_requests([(1, 50)], g)
    w = w.abs()
    best = int(torch.argmax(float_score(q, w, k)(0, 50)))
    for s in (4, 17, 33):  # three more copies of the best key: four equal top scores
        k[s] = k[best]
    key, aslk, table = lay_out_key("PA_BSND", [k], g)
    idx, _ = TorchNpuDouble().npu_lightning_indexer(
        q, key, w, actual_seq_lengths_query=cumulative([1]), actual_seq_lengths_key=aslk, block_table=table,
        layout_query="TND", layout_key="PA_BSND", sparse_count=6, sparse_mode=0)
    assert idx[0, 0, :4].tolist() == sorted({4, 17, 33, best})
    assert idx[0, 0].tolist() == loop_topk(1, 50, 6, 0, float_score(q, w, k))[0][0]


# ----------------------------------------------------------------------------------------------- quant indexer


def quant_inputs(spec, block_size, g, scale_shape="3d"):
    entries = [length for _, length in spec]
    q = [torch.randint(-127, 128, (n, H, D), generator=g, dtype=torch.int8) for n, _ in spec]
    w = [torch.randn(n, H, generator=g).half() for n, _ in spec]
    qs = [(torch.rand(n, H, generator=g) + 0.05).half() for n, _ in spec]
    k = [torch.randint(-127, 128, (c, 1, D), generator=g, dtype=torch.int8) for c in entries]
    ks = [(torch.rand(c, 1, generator=g) + 0.05).half() for c in entries]
    table, total = block_table(entries, block_size, g)
    key = paged(k, table, total, block_size, lambda s: torch.randint(-127, 128, s, generator=g, dtype=torch.int8))
    key_scale = paged(ks, table, total, block_size, lambda s: torch.rand(s, generator=g).half())
    if scale_shape == "2d":
        key_scale = key_scale[..., 0].contiguous()
    args = dict(query=torch.cat(q), key=key, weights=torch.cat(w), query_dequant_scale=torch.cat(qs),
                key_dequant_scale=key_scale, query_quant_mode=0, key_quant_mode=0,
                actual_seq_lengths_query=cumulative([n for n, _ in spec]),
                actual_seq_lengths_key=torch.tensor([length for _, length in spec], dtype=torch.int32),
                block_table=table)
    return args, [quant_score(*r) for r in zip(q, w, qs, [e[:, 0] for e in k], [e[:, 0] for e in ks])]


@pytest.mark.parametrize("block_size,scale_shape", [(64, "3d"), (128, "2d")])
def test_quant_indexer_matches_loop(block_size, scale_shape):
    g, count = gen(4), 16
    spec = [(1, 203), (2, 150), (6, 90), (3, 9), (2, 2)]
    args, scorers = quant_inputs(spec, block_size, g, scale_shape)
    idx = TorchNpuDouble().npu_quant_lightning_indexer(**args, layout_query="TND", layout_key="PA_BSND",
                                                       sparse_count=count, sparse_mode=3)
    per_request = [loop_topk(n, length, count, 3, score) for (n, length), score in zip(spec, scorers)]
    want_idx, _ = expected("TND", spec, per_request, count)
    assert isinstance(idx, torch.Tensor) and torch.equal(idx, want_idx)  # one tensor, as the schema returns
    assert (idx == -1).any() and (idx[..., -1] >= 0).any()


def test_quant_indexer_takes_no_compression_arguments():
    args, _ = quant_inputs([(1, 70)], 64, gen(5))
    for extra in (dict(cmp_ratio=4), dict(metadata=torch.zeros(3, dtype=torch.int32))):
        with pytest.raises(TypeError):
            TorchNpuDouble().npu_quant_lightning_indexer(**args, layout_query="TND", layout_key="PA_BSND", **extra)
    assert not hasattr(TorchNpuDouble(), "npu_quant_lightning_indexer_metadata")


# ----------------------------------------------------------------------------------------------- validation


def float_call():
    g = gen(6)
    reqs = float_requests([(1, 70), (3, 40)], g)
    key, aslk, table = lay_out_key("PA_BSND", [k for _, _, k in reqs], g, 16)
    return dict(query=torch.cat([q for q, _, _ in reqs]), key=key, weights=torch.cat([w for _, w, _ in reqs]),
                actual_seq_lengths_query=cumulative([1, 3]), actual_seq_lengths_key=aslk, block_table=table,
                layout_query="TND", layout_key="PA_BSND", sparse_count=8)


def non_contiguous(t):
    return t.transpose(0, 1).contiguous().transpose(0, 1)


FLOAT_ERRORS = {
    "query non-contiguous": (lambda a: a.update(query=non_contiguous(a["query"])), "query must be contiguous"),
    "key non-contiguous": (lambda a: a.update(key=non_contiguous(a["key"])), "key must be contiguous"),
    "weights non-contiguous": (lambda a: a.update(weights=non_contiguous(a["weights"])), "weights must be contig"),
    "query fp32": (lambda a: a.update(query=a["query"].float(), key=a["key"].float(), weights=a["weights"].float()),
                   "query has dtype"),
    "key dtype mismatch": (lambda a: a.update(key=a["key"].half()), "key dtype .* must match query"),
    "weights dtype mismatch": (lambda a: a.update(weights=a["weights"].half()), "weights dtype .* must match"),
    "query 3-D for BSND": (lambda a: a.update(layout_query="BSND"), "query must be 4-D"),
    "N1 != 64": (lambda a: a.update(query=a["query"][:, :32].contiguous(), weights=a["weights"][:, :32].contiguous()),
                 "query must have 64 head"),
    "D != 128": (lambda a: a.update(query=a["query"][..., :64].contiguous()), "query head dim D must be 128"),
    "N2 != 1": (lambda a: a.update(key=a["key"].expand(-1, -1, 2, -1).contiguous()), "key must have 1 head"),
    "weights shape": (lambda a: a.update(weights=a["weights"][:3].contiguous()), "weights must have shape"),
    "block_size 40": (lambda a: a.update(key=torch.randn(10, 40, 1, D).bfloat16()), "block_size"),
    "block_size 2048": (lambda a: a.update(key=torch.randn(1, 2048, 1, D).bfloat16()), "block_size"),
    "aslq missing": (lambda a: a.update(actual_seq_lengths_query=None), "actual_seq_lengths_query is required"),
    "aslq int64": (lambda a: a.update(actual_seq_lengths_query=torch.tensor([1, 4])),
                   "actual_seq_lengths_query must be a 1-D int32"),
    "aslq not cumulative": (lambda a: a.update(actual_seq_lengths_query=torch.tensor([3, 1], dtype=torch.int32)),
                            "actual_seq_lengths_query must be cumulative"),
    "aslq wrong total": (lambda a: a.update(actual_seq_lengths_query=torch.tensor([1, 3], dtype=torch.int32)),
                         "actual_seq_lengths_query must end at"),
    "aslk missing": (lambda a: a.update(actual_seq_lengths_key=None), "actual_seq_lengths_key is required"),
    "aslk wrong batch": (lambda a: a.update(actual_seq_lengths_key=torch.tensor([70], dtype=torch.int32)),
                         "actual_seq_lengths_key must have 2 entries"),
    "aslk negative": (lambda a: a.update(actual_seq_lengths_key=torch.tensor([70, -1], dtype=torch.int32)),
                      "actual_seq_lengths_key must be non-negative"),
    "block_table missing": (lambda a: a.update(block_table=None), "block_table must be a 2-D int32"),
    "block_table int64": (lambda a: a.update(block_table=a["block_table"].long()), "block_table must be a 2-D int32"),
    "block_table rows": (lambda a: a.update(block_table=a["block_table"][:1]), "block_table must have 2 rows"),
    "block_table narrow": (lambda a: a.update(block_table=a["block_table"][:, :2].contiguous()),
                           "block_table is too narrow"),
    "block_table range": (lambda a: a["block_table"].__setitem__((1, 0), a["key"].shape[0]),
                          "block_table row 1 has entries outside"),
    "block_table negative": (lambda a: a["block_table"].__setitem__((0, 1), -1), "block_table row 0 has entries"),
    "sparse_count 0": (lambda a: a.update(sparse_count=0), "sparse_count must be an int in"),
    "sparse_count 2049": (lambda a: a.update(sparse_count=2049), "sparse_count must be an int in"),
    "sparse_mode 1": (lambda a: a.update(sparse_mode=1), "sparse_mode must be 0"),
    "layout_query": (lambda a: a.update(layout_query="BNSD"), "layout_query must be one of"),
    "layout_key": (lambda a: a.update(layout_key="PA_NZ"), "layout_key must be one of"),
}


@pytest.mark.parametrize("case", list(FLOAT_ERRORS))
def test_lightning_indexer_validation(case):
    mutate, message = FLOAT_ERRORS[case]
    args = float_call()
    TorchNpuDouble().npu_lightning_indexer(**args)  # the unmutated call is valid
    mutate(args)
    with pytest.raises(RuntimeError, match=message):
        TorchNpuDouble().npu_lightning_indexer(**args)


QUANT_ERRORS = {
    "query not int8": (lambda a: a.update(query=a["query"].half()), "query has dtype"),
    "key not int8": (lambda a: a.update(key=a["key"].half()), "key has dtype"),
    "weights bf16": (lambda a: a.update(weights=a["weights"].bfloat16()), "weights has dtype"),
    "query scale shape": (lambda a: a.update(query_dequant_scale=a["query_dequant_scale"][:, :1].contiguous()),
                          "query_dequant_scale must have shape"),
    "key scale shape": (lambda a: a.update(key_dequant_scale=a["key_dequant_scale"][:, :8].contiguous()),
                        "key_dequant_scale must have shape"),
    "key scale fp32": (lambda a: a.update(key_dequant_scale=a["key_dequant_scale"].float()),
                       "key_dequant_scale has dtype"),
    "negative query scale": (lambda a: a["query_dequant_scale"].__setitem__((0, 3), -1.0),
                             "query_dequant_scale must be >= 0"),
    "negative key scale": (lambda a: a["key_dequant_scale"].neg_(), "key_dequant_scale must be >= 0"),
    "key non-contiguous": (lambda a: a.update(key=non_contiguous(a["key"])), "key must be contiguous"),
    "query_quant_mode 1": (lambda a: a.update(query_quant_mode=1), "quant_mode must be 0"),
    "sparse_count 4096": (lambda a: a.update(sparse_count=4096), "sparse_count must be an int in"),
    "aslk missing": (lambda a: a.update(actual_seq_lengths_key=None), "actual_seq_lengths_key is required"),
    "NaN weights": (lambda a: a["weights"].__setitem__((0, 3), float("nan")), "weights holds NaN"),
    "fp16 overflow": (lambda a: (a["weights"].__setitem__((0, 3), 6e4),
                                 a["query_dequant_scale"].__setitem__((0, 3), 2)), "must stay within fp16"),
    "query_dtype": (lambda a: a.update(query_dtype=1), "query_dtype / key_dtype"),
}


@pytest.mark.parametrize("case", list(QUANT_ERRORS))
def test_quant_indexer_validation(case):
    mutate, message = QUANT_ERRORS[case]
    args, _ = quant_inputs([(1, 70), (3, 40)], 16, gen(7))
    args.update(layout_query="TND", layout_key="PA_BSND", sparse_count=8)
    TorchNpuDouble().npu_quant_lightning_indexer(**args)
    mutate(args)
    with pytest.raises(RuntimeError, match=message):
        TorchNpuDouble().npu_quant_lightning_indexer(**args)


# ----------------------------------------------------------------------------------------------- other ops


def test_scatter_nd_update_in_place():
    npu = TorchNpuDouble()
    cache = torch.randn(10, 4, 1, 8)
    before = cache.clone()
    updates = torch.randn(3, 4, 1, 8)
    out = npu.npu_scatter_nd_update_(cache, torch.tensor([[7], [2], [5]], dtype=torch.int32), updates)
    assert out is cache
    assert torch.equal(cache[[7, 2, 5]], updates)
    keep = [i for i in range(10) if i not in (7, 2, 5)]
    assert torch.equal(cache[keep], before[keep])
    with pytest.raises(RuntimeError, match="indices must lie in"):
        npu.npu_scatter_nd_update_(cache, torch.tensor([[10]]), updates[:1])
    with pytest.raises(RuntimeError, match="updates must have shape"):
        npu.npu_scatter_nd_update_(cache, torch.tensor([[1]]), updates)
    with pytest.raises(RuntimeError, match=r"indices must be an int32/int64 tensor of shape \[N, 1\]"):
        npu.npu_scatter_nd_update_(cache, torch.tensor([1, 2, 3]), updates)


def test_dynamic_quant():
    npu = TorchNpuDouble()
    x = torch.randn(5, 3, 128, generator=gen(8)).bfloat16()
    x[1, 2] = 0
    q, scale = npu.npu_dynamic_quant(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (5, 3)
    assert int(q.min()) >= -127 and bool((q.abs().amax(-1)[scale > 1e-30] == 127).all())
    assert bool((q[1, 2] == 0).all()) and scale[1, 2] > 0
    torch.testing.assert_close(scale, x.float().abs().amax(-1).div(127).clamp_min(torch.finfo(torch.float32).tiny))
    assert float((q.float() * scale[..., None] - x.float()).abs().div(scale[..., None]).max()) <= 0.5 + 1e-5
    smooth = torch.rand(128, generator=gen(9)).bfloat16() + 0.5
    q2, scale2 = npu.npu_dynamic_quant(x, smooth_scales=smooth)
    torch.testing.assert_close(scale2, (x.float() * smooth.float()).abs().amax(-1).div(127).clamp_min(1e-38))
    with pytest.raises(RuntimeError, match="x must be a float16/bfloat16"):
        npu.npu_dynamic_quant(x.float())


# ----------------------------------------------------------------------------------------------- variants, install


@pytest.mark.parametrize("release", sorted(SCHEMAS["schemas"]))
def test_the_schema_operators_and_the_plain_functions_agree(release):
    ns, calls = schema_ops(release)
    args = float_call()
    want, _ = TorchNpuDouble().npu_lightning_indexer(**args)
    got, values = ns.npu_lightning_indexer(**args)
    assert torch.equal(got, want) and values.numel() == 0 and calls[-1][0] == "npu_lightning_indexer"
    with pytest.raises(RuntimeError, match="Unknown keyword argument 'selected_count'"):
        ns.npu_lightning_indexer(**{**args, "selected_count": 8})
    qargs, _ = quant_inputs([(1, 70), (3, 40)], 16, gen(7))
    qargs.update(layout_query="TND", layout_key="PA_BSND", sparse_count=8)
    assert torch.equal(ns.npu_quant_lightning_indexer(**qargs), TorchNpuDouble().npu_quant_lightning_indexer(**qargs))
    x = torch.randn(4, 2, 128, generator=gen(8)).bfloat16()
    for a, b in zip(ns.npu_dynamic_quant(x), npu_double.npu_dynamic_quant(x)):
        assert torch.equal(a, b)
    cache = torch.zeros(6, 128)
    assert ns.npu_scatter_nd_update_(cache, torch.tensor([[4]]), torch.ones(1, 128)) is cache and cache[4].eq(1).all()


def test_install_and_calls(monkeypatch):
    assert not isinstance(sys.modules.get("torch_npu"), TorchNpuDouble)
    with monkeypatch.context() as mp:
        double = install(mp, device_name="Ascend910_9392", version="2.8.0")
        assert importlib.import_module("torch_npu") is double
        assert importlib.util.find_spec("torch_npu") is not None
        import torch_npu  # noqa: F401  (the double)
        assert torch_npu is double and torch_npu.__name__ == "torch_npu" and torch_npu.__version__ == "2.8.0"
        assert torch.npu.is_available() and torch.npu.device_count() == 1
        assert torch.npu.get_device_name(0) == "Ascend910_9392"
        args = float_call()
        query = args.pop("query")
        torch_npu.npu_lightning_indexer(query, **args)
        name, passed = double.calls[-1]
        assert name == "npu_lightning_indexer" and passed["query"] is query and passed["sparse_count"] == 8
        assert "sparse_mode" not in passed  # defaults are not recorded: only what the caller passed
    assert not isinstance(sys.modules.get("torch_npu"), TorchNpuDouble)
    assert not isinstance(getattr(torch, "npu", None), npu_double.NpuDeviceDouble)
    with monkeypatch.context() as mp:
        double = install(mp, available=False)
        assert double.__version__ == npu_double.DEFAULT_VERSION == "2.7.1.post1"
        assert not torch.npu.is_available() and torch.npu.device_count() == 0
        assert "sparse_count" in inspect.signature(double.npu_lightning_indexer).parameters


def test_rotary_mul_matches_a_per_pair_rotation():
    from doubles.torch_npu import npu_rotary_mul

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(1, 3, 2, 8, generator=gen)  # BSND with B = 1; cos / sin 1S1D
    angle = torch.rand(1, 3, 1, 4, generator=gen) * 6
    half = npu_rotary_mul(x, torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1), "half")
    inter = npu_rotary_mul(x, angle.cos().repeat_interleave(2, -1), angle.sin().repeat_interleave(2, -1),
                           "interleave")
    for i in range(4):
        c, s = angle[..., i].cos(), angle[..., i].sin()
        a, b = x[..., i], x[..., i + 4]
        assert torch.allclose(half[..., i], a * c - b * s, atol=1e-6)
        assert torch.allclose(half[..., i + 4], b * c + a * s, atol=1e-6)
        a, b = x[..., 2 * i], x[..., 2 * i + 1]
        assert torch.allclose(inter[..., 2 * i], a * c - b * s, atol=1e-6)
        assert torch.allclose(inter[..., 2 * i + 1], b * c + a * s, atol=1e-6)
