"""The Ascend adapters against torch_npu's PUBLISHED operator schemas (tests/data/torch_npu_schemas.json: op-plugin
master and the 7.3.0 / 26.0.0 / 26.1.0 branches, each with its commit), registered as real operators with
torch.library (tests/doubles/torch_npu.py ``schema_ops``): detection reads the schemas, every call is bound by them.

Also here: schemas the adapter must refuse (named argument in the reason), V4's compressed keys refused, the
documented ``npu_rotary_mul`` limits, and the NaN rule on the NPU path (NaN never reaches torch_npu's kernels, whose
NaN order is undefined: the path raises naming the argument).
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch

from doubles import torch_npu as npu_double
from doubles.torch_npu import SCHEMAS, define_ops, install_schema_ops, schema_ops
from dsa_indexer import ops
from dsa_indexer.backends import npu as npu_backend
from dsa_indexer.backends.npu import api as npu_api
from dsa_indexer.backends.npu.lightning import make_lightning_indexer_ragged
from dsa_indexer.contract.validate import IndexerInputError
from dsa_indexer.dispatch.environment import Environment
from dsa_indexer.dispatch.plugins import default_registry
from dsa_indexer.dispatch.target import parse_target as resolve_target

RELEASES = sorted(SCHEMAS["schemas"])
NPU_STORE = "k_prologue_store_plain.npu.torch_npu"
NPU_Q = "q_prologue_plain.npu.torch_npu"
NPU_INDEXER = "lightning_indexer_ragged.npu.torch_npu"
REF = {"k_prologue_store_plain": "k_prologue_store_plain.reference.torch",
       "q_prologue_plain": "q_prologue_plain.reference.torch",
       "lightning_indexer_ragged": "lightning_indexer_ragged.reference.torch"}
NPU = {"k_prologue_store_plain": NPU_STORE, "q_prologue_plain": NPU_Q, "lightning_indexer_ragged": NPU_INDEXER}


@pytest.fixture
def probed(monkeypatch):
    """install(release, ops=None) -> the schema-op torch_npu, probed, in a fresh default-registry environment."""
    reg = default_registry()
    previous = reg.environment

    def install(release="op-plugin master", ops=None):
        module = install_schema_ops(monkeypatch, release, ops=ops)
        monkeypatch.setattr(npu_backend.LIBRARY, "detected", None)
        env = Environment()
        env.add_probe("torch_npu", npu_backend.torch_npu_probe)
        reg.set_environment(env)
        return module

    yield install
    reg.set_environment(previous)
    for op in NPU:
        reg.force(op, None)


def _force(impls):
    reg = default_registry()
    for op, impl in impls.items():
        reg.force(op, impl)


# ----------------------------------------------------------------------------------------------- the data


def test_schema_strings_carry_their_sources_and_match_the_ops_the_adapter_uses():
    assert set(SCHEMAS["schemas"]) == set(SCHEMAS["sources"])
    for release, source in SCHEMAS["sources"].items():
        assert source["repo"] == "Ascend/op-plugin" and re.fullmatch(r"[0-9a-f]{40}", source["commit"])
        assert source["path"] == "op_plugin/config/op_plugin_functions.yaml"
        assert set(SCHEMAS["schemas"][release]) == set(npu_api.CALLS)
        for name, text in SCHEMAS["schemas"][release].items():
            assert text.startswith(name + "(")
    assert SCHEMAS["sources"]["op-plugin master"]["commit"].startswith("517f2e7d")
    exports = SCHEMAS["torch_npu_exports"]
    assert exports["repo"] == "Ascend/pytorch" and exports["commit"].startswith("9e73e708")


@pytest.mark.parametrize("release", RELEASES)
def test_detection_reads_the_operator_schemas(probed, release):
    module = probed(release)
    # what torch_npu really hands over: operator objects whose Python signature hides every parameter
    assert isinstance(module.npu_lightning_indexer, torch._ops.OpOverloadPacket)
    assert str(inspect.signature(module.npu_lightning_indexer)).startswith("(*args")
    assert npu_backend.torch_npu_probe() is None
    api = npu_backend.LIBRARY.detected_api()
    for op in npu_api.CALLS:
        assert api.signatures[op].source == "schema", op
        assert op in api.signatures[op].text
    assert isinstance(api.indexer, torch._ops.OpOverload) and isinstance(api.quant_indexer, torch._ops.OpOverload)
    assert api.rotary_interleave and not api.missing


# ----------------------------------------------------------------------------------------------- one step, each release


def _cos_sin(positions, rope_dim, gen):
    angle = torch.rand(positions, rope_dim // 2, generator=gen) * 6.28
    return torch.cat([angle.cos(), angle.sin()], dim=-1)


def _plain_step(gen, tokens, key_format, interleaved, pages=24):
    """A prefill of ``tokens`` rows of one request: key store, q prologue, indexer (plain layout)."""
    k = torch.randn(tokens, 128, generator=gen).to(torch.bfloat16)
    q = torch.randn(tokens, 64, 128, generator=gen).to(torch.bfloat16)
    head_weights = torch.randn(tokens, 64, generator=gen).to(torch.bfloat16)
    norm_w, norm_b = torch.rand(128, generator=gen) + 0.5, torch.randn(128, generator=gen) * 0.1
    positions = torch.arange(tokens, dtype=torch.int64)
    cos_sin = _cos_sin(tokens, 64, gen)
    perm = torch.randperm(pages, generator=gen).int()
    table = perm[None, : -(-tokens // 64)].contiguous()
    slots = (table[0].long()[:, None] * 64 + torch.arange(64)).reshape(-1)[:tokens]
    return dict(k=k, q=q, head_weights=head_weights, norm_w=norm_w, norm_b=norm_b, positions=positions,
                cos_sin=cos_sin, table=table, slots=slots, key_format=key_format, interleaved=interleaved,
                pages=pages)


def _run_step(step, impls, topk=32):
    _force(impls)
    fmt = step["key_format"]
    dtype = torch.bfloat16 if fmt == "bf16" else torch.int8
    cache = torch.zeros(step["pages"], 64, 1, 128, dtype=dtype)
    scales = torch.zeros(step["pages"], 64, 1, dtype=torch.float16) if fmt == "int8" else \
        torch.empty(0, dtype=torch.float16)
    ops.k_prologue_store_plain(step["k"], step["norm_w"], step["norm_b"], 1e-6, step["positions"], step["cos_sin"],
                               cache, scales, step["slots"], key_format=fmt, interleaved=step["interleaved"],
                               target="npu")
    q, q_scales, weights = ops.q_prologue_plain(step["q"], step["positions"], step["cos_sin"], step["head_weights"],
                                                0.125, key_format=fmt, interleaved=step["interleaved"], target="npu")
    t = step["k"].shape[0]
    out = ops.lightning_indexer_ragged(q, q_scales, cache, scales, weights, torch.tensor([0, t], dtype=torch.int32),
                                       torch.tensor([t], dtype=torch.int32), step["table"], topk, target="npu")
    return cache, scales, out


@pytest.mark.parametrize("release", RELEASES)
def test_a_v32_prefill_over_1000_tokens_runs_through_each_release(probed, release):
    """bf16 keys, half-mode RoPE on 1100 tokens: above the batch limit (1000) that the old [T, 1, N, R] call hit."""
    module = probed(release)
    step = _plain_step(torch.Generator().manual_seed(1), 1100, "bf16", interleaved=False)
    cache, _, got = _run_step(step, NPU)
    names = {c[0] for c in module.calls}
    assert {"npu_rotary_mul", "npu_scatter_nd_update_", "npu_lightning_indexer"} <= names
    rotary = [c[1] for c in module.calls if c[0] == "npu_rotary_mul"]
    assert all(c["self"].shape[:2] == (1, 1100) and c["r1"].shape == (1, 1100, 1, 64) for c in rotary)
    ref_cache, _, want = _run_step(step, REF)
    # RoPE, norm and the bf16 store are the same fp32 arithmetic as the reference's, rounded once to bf16
    assert torch.equal(cache, ref_cache)
    # weights go to the kernel in bf16 (the reference keeps fp32): compare the selected sets' scores
    assert torch.equal((got >= 0).sum(1), (want >= 0).sum(1))
    agree = sum(len(set(a) & set(b) - {-1}) for a, b in zip(got.tolist(), want.tolist()))
    assert agree >= 0.98 * sum(len(set(b) - {-1}) for b in want.tolist())


@pytest.mark.parametrize("release", RELEASES)
def test_int8_keys_and_interleaved_rope_through_each_release(probed, release):
    module = probed(release)
    step = _plain_step(torch.Generator().manual_seed(2), 300, "int8", interleaved=True)
    cache, scales, got = _run_step(step, NPU)
    assert {"npu_dynamic_quant", "npu_quant_lightning_indexer"} <= {c[0] for c in module.calls}
    assert all(c[1]["rotary_mode"] == "interleave" for c in module.calls if c[0] == "npu_rotary_mul")
    ref_cache, ref_scales, want = _run_step(step, REF)
    # bf16-rounded input to npu_dynamic_quant: at most ~1.5 int8 steps from the reference (test_npu_backend.py)
    step_size = torch.maximum(scales, ref_scales).float()[..., None]
    diff = (cache.float() * scales.float()[..., None] - ref_cache.float() * ref_scales.float()[..., None]).abs()
    assert bool((diff <= 1.6 * step_size + 1e-6).all())
    agree = sum(len(set(a) & set(b) - {-1}) for a, b in zip(got.tolist(), want.tolist()))
    assert agree >= 0.97 * sum(len(set(b) - {-1}) for b in want.tolist())
    assert torch.equal((got >= 0).sum(1), (want >= 0).sum(1))


# ---------------------------------------------------------------------------------------------- schemas that do not fit

MISFITS = {
    # the lengths as int lists: the adapter passes tensors
    "npu_lightning_indexer": (
        "npu_lightning_indexer(Tensor query, Tensor key, Tensor weights, *, int[]? actual_seq_lengths_query=None, "
        "Tensor? actual_seq_lengths_key=None, Tensor? block_table=None, str layout_query=\"BSND\", "
        "str layout_key=\"BSND\", int sparse_count=2048, int sparse_mode=3) -> (Tensor, Tensor)",
        "argument 'actual_seq_lengths_query' is int[], the adapter passes Tensor"),
    # the quant modes keyword-only (the form of a custom-op package): the adapter passes them positionally
    "npu_quant_lightning_indexer": (
        "npu_quant_lightning_indexer(Tensor query, Tensor key, Tensor weights, Tensor query_dequant_scale, "
        "Tensor key_dequant_scale, *, Tensor? actual_seq_lengths_query=None, Tensor? actual_seq_lengths_key=None, "
        "Tensor? block_table=None, int query_quant_mode=0, int key_quant_mode=0, str layout_query=\"BSND\", "
        "str layout_key=\"BSND\", int sparse_count=2048, int sparse_mode=3) -> Tensor",
        "takes 5 positional arguments, the adapter passes 7"),
    # a layout as an int
    "npu_rotary_mul": ("npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, int rotary_mode=0) -> Tensor", None),
}


def test_schemas_that_do_not_take_the_adapters_call_are_refused_with_the_argument(probed):
    namespace = define_ops("dsa_npu_test_misfit", {name: text for name, (text, _) in MISFITS.items()})
    module = probed()
    for name in MISFITS:
        setattr(module, name, getattr(namespace, name))
    api = npu_api.detect(module)
    assert npu_backend.torch_npu_probe() == (
        "torch_npu (test operators: op-plugin master schemas) on Ascend910B3 has neither npu_lightning_indexer nor "
        f"npu_quant_lightning_indexer ({api.missing['npu_lightning_indexer']}; "
        f"{api.missing['npu_quant_lightning_indexer']})")
    for name, (_, words) in MISFITS.items():
        if words:
            assert words in api.missing[name], api.missing[name]
    # rotary_mode typed int: not the "interleave" string the adapter passes, so V4's RoPE is refused
    assert not api.rotary_interleave and api.rotary is not None
    module = probed()
    module.npu_rotary_mul = namespace.npu_rotary_mul
    assert npu_backend.torch_npu_probe() is None
    check = npu_backend._prologue_supports(store=True)
    # every reason at once, as a list: here the one (the head dim fits, the other operators bind)
    (reason,) = check(ops.problem("k_prologue_store_plain", dim=128, interleaved=True, format="bf16"), None)
    assert "takes no rotary_mode" in reason


def test_a_positional_name_or_result_count_that_differs_is_refused():
    sig = npu_api.schema_signature(torch._C.parse_schema(
        "npu_lightning_indexer(Tensor q, Tensor key, Tensor weights, *, Tensor? actual_seq_lengths_query=None, "
        "Tensor? actual_seq_lengths_key=None, Tensor? block_table=None, str layout_query=\"BSND\", "
        "str layout_key=\"BSND\", int sparse_count=2048, int sparse_mode=3) -> (Tensor, Tensor)"))
    assert npu_api.mismatch("npu_lightning_indexer", sig) == \
        "positional argument 0 is 'q', the adapter passes 'query' there"
    sig = npu_api.schema_signature(torch._C.parse_schema("npu_dynamic_quant(Tensor input) -> Tensor"))
    assert npu_api.mismatch("npu_dynamic_quant", sig) == "returns 1 results, the adapter reads 2"
    sig = npu_api.schema_signature(torch._C.parse_schema(
        "npu_lightning_indexer(Tensor query, Tensor key, Tensor weights, *, Tensor? actual_seq_lengths_query=None, "
        "Tensor? actual_seq_lengths_key=None, Tensor? block_table=None, str layout_query=\"BSND\", "
        "str layout_key=\"BSND\", int selected_count=2048, int sparse_mode=3) -> (Tensor, Tensor)"))
    assert npu_api.mismatch("npu_lightning_indexer", sig) == "has no argument 'sparse_count'"


# ----------------------------------------------------------------------------------------------- V4's C4 indexer


def test_compressed_keys_are_refused_and_the_published_schema_rejects_cmp_ratio(probed):
    module = probed()
    assert npu_backend.torch_npu_probe() is None
    target = resolve_target("npu")
    problem = ops.problem("lightning_indexer_ragged", heads=64, dim=128, k=512, format="int8", ratio=4)
    res = default_registry().resolve("lightning_indexer_ragged", target, problem)
    reason = next(c.reason for c in res.candidates if c.impl.impl_id == NPU_INDEXER)
    # every reason at once: the declared ratio is the only one
    assert reason.startswith("ratio=4: torch_npu's lightning indexer takes 1 (uncompressed keys")
    assert "compress_ratio 4" in reason and "no released torch_npu indexer" in reason
    assert res.chosen.impl_id == REF["lightning_indexer_ragged"]
    assert default_registry().resolve("lightning_indexer_ragged", target, ops.problem(
        "lightning_indexer_ragged", heads=64, dim=128, k=512, format="int8", ratio=1)).chosen.impl_id == NPU_INDEXER
    q = torch.zeros(1, 64, 128, dtype=torch.int8)
    # query, key, weights, query_dequant_scale, key_dequant_scale: the published positional order
    args = (q, torch.zeros(1, 64, 1, 128, dtype=torch.int8), torch.ones(1, 64, dtype=torch.float16),
            torch.ones(1, 64, dtype=torch.float16), torch.ones(1, 64, 1, dtype=torch.float16))
    keywords = dict(actual_seq_lengths_query=torch.tensor([1], dtype=torch.int32),
                    actual_seq_lengths_key=torch.tensor([4], dtype=torch.int32),
                    block_table=torch.zeros(1, 1, dtype=torch.int32), layout_query="TND", layout_key="PA_BSND")
    module.npu_quant_lightning_indexer(*args, 0, 0, **keywords)  # the published call binds
    with pytest.raises(RuntimeError, match="Unknown keyword argument 'cmp_ratio'"):  # what the old adapter passed
        module.npu_quant_lightning_indexer(*args, 0, 0, **keywords, cmp_ratio=4)
    adapter = make_lightning_indexer_ragged(npu_backend.detected_api)
    with pytest.raises(IndexerInputError, match="compress_ratio=4: no released torch_npu indexer"):
        adapter(q, args[3], args[1], args[4], torch.ones(1, 64), torch.tensor([0, 1], dtype=torch.int32),
                torch.tensor([4], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), 1, compress_ratio=4)


# ----------------------------------------------------------------------------------------------- npu_rotary_mul limits


def test_the_rotary_double_enforces_the_documented_limits():
    ns, _ = schema_ops()
    gen = torch.Generator().manual_seed(3)
    angle = torch.rand(1100, 32, generator=gen) * 6.28
    half_cos, half_sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    x = torch.randn(1100, 64, 64, generator=gen)
    # today's layout on main: [T, 1, N, R] with [T, 1, 1, R] puts T on the batch axis
    with pytest.raises(RuntimeError, match="half mode needs B < 1000"):
        ns.npu_rotary_mul(x[:, None], half_cos[:, None, None], half_sin[:, None, None], "half")
    with pytest.raises(RuntimeError, match="interleave mode needs B \\* N < 1000"):
        ns.npu_rotary_mul(x[:20, None], half_cos[:20, None, None], half_sin[:20, None, None], "interleave")
    with pytest.raises(RuntimeError, match="interleave mode takes r1 / r2 of layout 1S1D"):
        ns.npu_rotary_mul(x[None, :8], half_cos[:8, None].expand(8, 64, 64)[None].contiguous(),
                          half_sin[:8, None].expand(8, 64, 64)[None].contiguous(), "interleave")
    with pytest.raises(RuntimeError, match="D even and < 896"):
        ns.npu_rotary_mul(torch.zeros(1, 2, 1, 900), torch.zeros(1, 2, 1, 900), torch.zeros(1, 2, 1, 900))
    # the adapter's layout: [1, T, N, R] with [1, T, 1, R], in both modes, any T
    out = ns.npu_rotary_mul(x[None], half_cos[None, :, None], half_sin[None, :, None], "half")
    a, b = x[..., :32], x[..., 32:]
    c, s = angle.cos()[:, None], angle.sin()[:, None]
    torch.testing.assert_close(out[0], torch.cat([a * c - b * s, b * c + a * s], -1), rtol=1e-6, atol=1e-6)
    ns.npu_rotary_mul(x[None], angle.cos().repeat_interleave(2, -1)[None, :, None],
                      angle.sin().repeat_interleave(2, -1)[None, :, None], "interleave")


# ----------------------------------------------------------------------------------------------- the NaN rule


def _store_args(gen, tokens=70):
    return dict(k=torch.randn(tokens, 128, generator=gen).to(torch.bfloat16), norm_weight=torch.ones(128),
                norm_bias=torch.zeros(128), eps=1e-6, positions=torch.arange(tokens), cos_sin=_cos_sin(tokens, 64, gen),
                key_cache=torch.zeros(2, 64, 1, 128, dtype=torch.bfloat16), key_scales=torch.empty(0).half(),
                slot_mapping=torch.arange(tokens))


def _store(args):
    ops.k_prologue_store_plain(args["k"], args["norm_weight"], args["norm_bias"], args["eps"], args["positions"],
                               args["cos_sin"], args["key_cache"], args["key_scales"], args["slot_mapping"],
                               key_format="bf16", target="npu")


def _score_over(args, format="bf16"):
    """A scoring over the stored cache through the NPU indexer (where the store's device-side check is raised)."""
    q = torch.randn(2, 64, 128, generator=torch.Generator().manual_seed(8))
    if format == "bf16":
        q, q_scales = q.to(torch.bfloat16), torch.empty(0, dtype=torch.float16)
    else:
        q, q_scales = (q * 30).round().clamp(-127, 127).to(torch.int8), torch.full((2, 64), 0.01).half()
    return ops.lightning_indexer_ragged(q, q_scales, args["key_cache"], args["key_scales"], torch.rand(2, 64),
                                        torch.tensor([0, 2], dtype=torch.int32), torch.tensor([70], dtype=torch.int32),
                                        torch.tensor([[0, 1]], dtype=torch.int32), 16, target="npu")


def test_nan_keys_never_reach_the_npu_indexer(probed):
    """The store checks on the device (no host read inside a pipeline step): it writes a non-finite row as zeros,
    and the next scoring over that cache raises naming the rows, before torch_npu's indexer runs."""
    module = probed()
    _force({"k_prologue_store_plain": NPU_STORE, "lightning_indexer_ragged": NPU_INDEXER})
    gen = torch.Generator().manual_seed(4)
    args = _store_args(gen)
    args["k"][5, 7] = float("nan")
    _store(args)  # no error yet: the store only enqueues work
    assert not bool(args["key_cache"].isnan().any()) and not bool(args["key_cache"].view(-1, 128)[5].any())
    before = len(module.calls)
    with pytest.raises(IndexerInputError, match=r"the keys to store \(from k\) holds NaN or inf in 1 of its 70 rows "
                                                 r"\(rows \[5\]\)"):
        _score_over(args)
    assert not any(c[0] == "npu_lightning_indexer" for c in module.calls[before:])
    _score_over(args)  # reported once: the cache holds zeros there now, finite
    args = _store_args(gen)
    args["norm_weight"][3] = float("inf")
    _store(args)
    with pytest.raises(IndexerInputError, match="from norm_weight / norm_bias or cos_sin"):
        _score_over(args)
    args = _store_args(gen)
    args["k"][9] = float("nan")
    args["slot_mapping"][9] = -1  # a padding row stores nothing: its garbage is no error
    args["slot_mapping"][10] = -1
    kept = args["key_cache"].view(-1, 128)[9:11].clone()
    _store(args)
    assert bool(torch.isfinite(args["key_cache"].float()).all())
    assert torch.equal(args["key_cache"].view(-1, 128)[9:11], kept)  # padding rows changed nothing
    _score_over(args)


def test_the_int8_store_and_q_prologue_refuse_nan_at_the_scoring(probed):
    probed()
    _force({"k_prologue_store_plain": NPU_STORE, "lightning_indexer_ragged": NPU_INDEXER, "q_prologue_plain": NPU_Q})
    gen = torch.Generator().manual_seed(9)
    args = _store_args(gen)
    args["key_cache"] = torch.zeros(2, 64, 1, 128, dtype=torch.int8)
    args["key_scales"] = torch.zeros(2, 64, 1, dtype=torch.float16)
    args["norm_weight"] = torch.full((128,), 1e7)  # normed keys ~1e7: int8 scales past fp16's 65504 (inf there)
    ops.k_prologue_store_plain(args["k"], args["norm_weight"], args["norm_bias"], args["eps"], args["positions"],
                               args["cos_sin"], args["key_cache"], args["key_scales"], args["slot_mapping"],
                               key_format="int8", target="npu")
    with pytest.raises(IndexerInputError, match=r"^the key scales to store \(fp16\) holds NaN or inf in 70 of"):
        _score_over(args, "int8")
    q = torch.randn(3, 64, 128, generator=gen).to(torch.bfloat16)
    q[1, 2, 0] = float("nan")
    cos_sin = _cos_sin(3, 64, gen)
    q_int8, scales, _ = ops.q_prologue_plain(q, torch.arange(3), cos_sin, torch.rand(3, 64), 1.0, key_format="int8",
                                             target="npu")
    assert torch.isnan(scales).nonzero().tolist() == [[1, 2]]  # that (token, head) only, for the scoring to refuse
def _indexer_args(gen):
    q = torch.randn(3, 64, 128, generator=gen).to(torch.bfloat16)
    cache = torch.randn(2, 64, 1, 128, generator=gen).to(torch.bfloat16)
    return [q, torch.empty(0, dtype=torch.float16), cache, torch.empty(0, dtype=torch.float16),
            torch.randn(3, 64, generator=gen), torch.tensor([0, 3], dtype=torch.int32),
            torch.tensor([100], dtype=torch.int32), torch.tensor([[1, 0]], dtype=torch.int32), 16]


@pytest.mark.parametrize("where,name", [(0, "q"), (4, "weights"), (2, "key_cache")])
def test_nan_inputs_never_reach_the_npu_indexer(probed, where, name):
    module = probed()
    _force({"lightning_indexer_ragged": NPU_INDEXER})
    args = _indexer_args(torch.Generator().manual_seed(5))
    ops.lightning_indexer_ragged(*args, target="npu")  # finite: fine
    args[where].view(-1)[11] = float("nan")
    before = len(module.calls)
    with pytest.raises(IndexerInputError, match=f"^{re.escape(name)} holds NaN or inf in 1 of"):
        ops.lightning_indexer_ragged(*args, target="npu")
    assert len(module.calls) == before  # the kernel was not called


def test_nan_int8_scales_and_fp16_overflow_never_reach_the_quant_indexer(probed):
    probed()
    adapter = make_lightning_indexer_ragged(npu_backend.detected_api)
    assert npu_backend.torch_npu_probe() is None
    gen = torch.Generator().manual_seed(6)
    base = [torch.randint(-127, 128, (2, 64, 128), generator=gen, dtype=torch.int8),
            torch.rand(2, 64, generator=gen).half() + 0.01,
            torch.randint(-127, 128, (1, 64, 1, 128), generator=gen, dtype=torch.int8),
            torch.rand(1, 64, 1, generator=gen).half() + 0.01, torch.randn(2, 64, generator=gen),
            torch.tensor([0, 2], dtype=torch.int32), torch.tensor([40], dtype=torch.int32),
            torch.tensor([[0]], dtype=torch.int32), 8]
    assert adapter(*base).shape == (2, 8)
    for where, value, words in ((1, float("nan"), "q_scales"), (4, 1e6, "weights"),
                                (4, 6e4, "weights \\* q_scales"), (3, float("nan"), "key_scales")):
        args = [a.clone() if isinstance(a, torch.Tensor) else a for a in base]
        if where == 4 and value == 6e4:
            args[1].fill_(2.0)
        args[where].view(-1)[0] = value
        with pytest.raises(IndexerInputError, match=f"^{words} holds"):
            adapter(*args)


def test_the_schema_double_refuses_nan_itself():
    """So a path that let NaN through would fail here rather than pick an order the kernel does not document."""
    ns, _ = schema_ops()
    args = _indexer_args(torch.Generator().manual_seed(7))
    q, _, cache, _, w, cu, seq, table, k = args
    w = w.to(torch.bfloat16)
    q[0, 0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="query holds NaN"):
        ns.npu_lightning_indexer(q, cache, w, actual_seq_lengths_query=cu[1:], actual_seq_lengths_key=seq,
                                 block_table=table, layout_query="TND", layout_key="PA_BSND", sparse_count=k)
    assert npu_double.FUNCTIONS["npu_lightning_indexer"] is npu_double.npu_lightning_indexer
