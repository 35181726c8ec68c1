"""Issue 20, items 6 and 7: no input and no setting may turn into a plausible, wrong top-k without an error.

- the target and strict mode reach the inner ops of a composition;
- boolean environment variables are parsed by one parser (a typo is an error naming the variable);
- `info` / `explain` report what a call runs (a plugin whose factory fails is not shown as chosen);
- checkpoint dtypes and values are checked, naming the key;
- `Indexer.forward(positions=)` must agree with the batch;
- block-table pages a top-k row uses must be valid;
- the NaN rule: a NaN score ranks exactly as -inf, on the reference and the Triton kernels (CUDA, aiter and NPU
  adapters are tested beside their backends), and NaN reaching a quantized group makes its scale NaN.

Kernels run in Triton's interpreter on the CPU (tiny shapes) and on the GPU when there is one.
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsa_indexer import DecodeBatch, Indexer, IndexerConfig, IndexKCache, PrefillBatch, ops  # noqa: E402
from dsa_indexer.backends.reference import kernels as ref  # noqa: E402
from dsa_indexer.contract.validate import IndexerInputError  # noqa: E402
from dsa_indexer.dispatch.environment import Environment  # noqa: E402
from dsa_indexer.dispatch.plugins import default_registry  # noqa: E402
from dsa_indexer.dispatch.problem import Problem  # noqa: E402
from dsa_indexer.dispatch.registry import NoImplementationError, Registry  # noqa: E402
from dsa_indexer.dispatch.target import Target  # noqa: E402
from dsa_indexer.envflags import EnvironmentFlagError, parse_flag  # noqa: E402
from dsa_indexer.indexer import CHECKPOINT_PREFIX  # noqa: E402
from dsa_indexer.testing import random_cache  # noqa: E402

TINY = IndexerConfig(name="tiny", hidden_size=256, q_lora_rank=256, n_heads=4, topk=16, max_position=1024,
                     yarn=None)
FP8 = torch.float8_e4m3fn
NEG_INF = float("-inf")


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _nan_as_neg_inf(x: torch.Tensor) -> torch.Tensor:
    return x.masked_fill(torch.isnan(x), NEG_INF)


def _same_sets(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.shape == expected.shape and out.dtype == torch.int32
    for row in range(out.shape[0]):
        assert sorted(out[row].tolist()) == sorted(expected[row].tolist()), f"row {row}"


# --- item 6: the target reaches the inner ops of a composition --------------------------------------------------
def _decode_inputs(device="cpu", batch=2, context=150, heads=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = random_cache(8, device, seed=seed)
    table = torch.arange(8, dtype=torch.int32, device=device).view(2, 4)[:batch]
    q = torch.randn(batch, 1, heads, 128, generator=gen).to(FP8).to(device)
    weights = torch.randn(batch, heads, generator=gen).to(device)
    lens = torch.tensor([[context], [context - 37]], dtype=torch.int32, device=device)[:batch]
    return q, cache.data, weights, lens, table


def test_composed_lightning_indexer_resolves_its_inner_ops_for_the_callers_target(monkeypatch):
    """On the CPU, ``target="sm90"`` must reach paged_mqa_logits and topk_indices: under strict mode nothing
    accelerated can run them here, so the call raises (before the fix the inner ops re-detected the CPU from the
    tensors and ran the reference silently)."""
    registry = default_registry()
    saved = registry.environment
    registry.set_environment(Environment.simulated())  # no accelerator here, on any machine: sm90 has no kernel
    registry.force("lightning_indexer", "lightning_indexer.generic.composed")
    try:
        q, kv, w, lens, table = _decode_inputs()
        monkeypatch.setenv("DSA_INDEXER_STRICT", "1")
        registry.clear_cache()
        with pytest.raises(NoImplementationError, match="strict mode.*on accelerator target sm90"):
            ops.lightning_indexer(q, kv, w, lens, table, 256, 16, target="sm90")
        monkeypatch.delenv("DSA_INDEXER_STRICT")
        registry.clear_cache()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the reference fallback on sm90 warns once
            out = ops.lightning_indexer(q, kv, w, lens, table, 256, 16, target="sm90")
        inner = {op for (op, target, _problem) in registry.used if target == Target("cuda", "sm90")}
        assert {"lightning_indexer", "paged_mqa_logits", "topk_indices"} <= inner
        expected = ref.lightning_indexer(q, kv, w, lens, table, 256, 16)
        _same_sets(out, expected)
    finally:
        registry.force("lightning_indexer", None)
        registry.set_environment(saved)
        registry.clear_cache()


def test_a_composition_receives_its_inner_op_bound_for_the_outer_target_and_its_problem():
    """The factory of a composition (``uses``) is given its inner op bound for the target the outer call was
    resolved for, with the problem it derives from the outer problem; a plain implementation's factory gets
    nothing."""
    reg = Registry(environment=Environment.simulated())
    received = []

    def composed_factory(inner):
        received.append(inner)
        return lambda x: ("composed", inner(x))

    reg.implementation("inner", impl_id="inner.reference.torch", targets=("*",), priority=0)(
        lambda: (lambda x: ("inner", x)))
    reg.implementation("outer", impl_id="outer.generic.composed", targets=("*",), priority=1,
                       uses={"inner": lambda outer: Problem(width=outer["width"] * 2)})(composed_factory)
    gfx = Target("rocm", "gfx950")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the reference-named inner op falls back on gfx950
        assert reg.call("outer", gfx, Problem(width=3), 2) == ("composed", ("inner", 2))
    (inner,) = received
    assert inner.op == "inner" and inner.target == gfx and inner.problem == Problem(width=6)
    assert inner.impl_id == "inner.reference.torch"


# --- item 7: boolean environment variables -----------------------------------------------------------------------
@pytest.mark.parametrize("raw, want", [("1", True), ("true", True), ("TRUE", True), (" yes ", True), ("On", True),
                                       ("0", False), ("false", False), ("False", False), ("no", False),
                                       ("OFF", False), ("", False), (None, False)])
def test_one_boolean_parser(raw, want):
    assert parse_flag("DSA_INDEXER_X", raw) is want


def test_an_unknown_boolean_word_is_an_error_naming_the_variable():
    with pytest.raises(EnvironmentFlagError, match="DSA_INDEXER_STRICT='ture' is not a boolean"):
        parse_flag("DSA_INDEXER_STRICT", "ture")


@pytest.mark.parametrize("value, strict", [("False", False), ("off", False), ("NO", False), ("On", True)])
def test_strict_mode_reads_the_word(monkeypatch, value, strict):
    reg = Registry(environment=Environment.simulated(gpu=True))
    reg.implementation("op", impl_id="op.reference.torch", targets=("*",), priority=0)(lambda: (lambda: "ref"))
    monkeypatch.setenv("DSA_INDEXER_STRICT", value)
    if strict:
        with pytest.raises(NoImplementationError, match="strict mode"):
            reg.function("op", Target("cuda", "sm90"), Problem())
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            assert reg.function("op", Target("cuda", "sm90"), Problem())() == "ref"


def test_check_ranges_and_plugin_autoload_read_the_word(monkeypatch):
    from dsa_indexer.contract.validate import ranges_checked
    from dsa_indexer.dispatch.plugins import load_plugins

    meta = torch.empty(3, device="meta")  # not the CPU, so the flag decides
    monkeypatch.setenv("DSA_INDEXER_CHECK_RANGES", "off")
    assert not ranges_checked(meta)
    monkeypatch.setenv("DSA_INDEXER_CHECK_RANGES", "Yes")
    assert ranges_checked(meta)
    monkeypatch.setenv("DSA_INDEXER_CHECK_RANGES", "maybe")
    with pytest.raises(EnvironmentFlagError, match="DSA_INDEXER_CHECK_RANGES"):
        ranges_checked(meta)
    # DISABLE_PLUGIN_AUTOLOAD=False means: load the third-party entry points (one is faked here, so the check does
    # not depend on which plugins this machine has installed).
    import types as types_module
    from importlib import metadata

    from dsa_indexer.dispatch import discovery
    from dsa_indexer.dispatch.plugins import hookimpl

    plugin = types_module.ModuleType("dsa_test_autoload_plugin")
    plugin.dsa_indexer_register = hookimpl(lambda registry: None)
    monkeypatch.setitem(sys.modules, "dsa_test_autoload_plugin", plugin)
    real = metadata.entry_points

    def fake(group=None, **kw):
        if group == "dsa_indexer.backends":
            return [metadata.EntryPoint("autoload_probe", "dsa_test_autoload_plugin", group)]
        return real(group=group, **kw)

    monkeypatch.setattr(discovery.metadata, "entry_points", fake)
    monkeypatch.setenv("DSA_INDEXER_DISABLE_PLUGIN_AUTOLOAD", "False")
    reg = Registry(environment=Environment.simulated())
    load_plugins(reg)
    with_entry_points = set(reg.plugins_loaded)
    monkeypatch.setenv("DSA_INDEXER_DISABLE_PLUGIN_AUTOLOAD", "ON")
    reg = Registry(environment=Environment.simulated())
    load_plugins(reg)
    assert "autoload_probe" in with_entry_points
    assert set(reg.plugins_loaded) == with_entry_points - {"autoload_probe"}  # the entry-point plugin is left out


# --- item 7: info / explain report what runs -------------------------------------------------------------------
def test_explain_does_not_report_an_unbuildable_implementation_as_chosen(capsys):
    from dsa_indexer import cli

    registry = default_registry()

    def broken_factory():
        raise ImportError("vendor_lib_xyz is missing its shared library")

    registry.implementation("topk_indices", impl_id="topk_indices.brokenvendor.fast", targets=("cpu",),
                            priority=10_000, description="a plugin whose factory fails")(broken_factory)
    try:
        res = registry.resolve_runnable("topk_indices", Target("cpu", "cpu"), Problem(k=16))
        assert res.chosen.impl_id != "topk_indices.brokenvendor.fast"
        assert cli.main(["explain", "topk_indices", "--target", "cpu"]) == 0
        text = capsys.readouterr().out
        line = next(t for t in text.splitlines() if "topk_indices.brokenvendor.fast" in t)
        assert "factory failed: ImportError: vendor_lib_xyz" in line and "chosen" not in line
        assert cli.main(["info", "--target", "cpu"]) == 0
        info_line = next(t for t in capsys.readouterr().out.splitlines() if t.strip().startswith("topk_indices "))
        assert "brokenvendor" not in info_line
        # And what a call runs is the same implementation.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            registry.function("topk_indices", Target("cpu", "cpu"), Problem(k=16))
        used = registry.used[("topk_indices", Target("cpu", "cpu"), Problem(k=16))]
        assert used.chosen.impl_id == res.chosen.impl_id
    finally:
        registry.unregister("topk_indices.brokenvendor.fast")
        registry.clear_cache()


# --- item 7: checkpoint formats ----------------------------------------------------------------------------------
def _checkpoint(layer: int = 3) -> tuple[dict, str]:
    prefix = CHECKPOINT_PREFIX.format(layer=layer)
    state = {prefix + "wq_b.weight": torch.randn(512, 256).to(FP8),
             prefix + "wq_b.weight_scale_inv": torch.rand(4, 2) + 0.5,
             prefix + "wk.weight": torch.randn(128, 256, dtype=torch.bfloat16),
             prefix + "k_norm.weight": torch.randn(128, dtype=torch.bfloat16),
             prefix + "k_norm.bias": torch.randn(128, dtype=torch.bfloat16),
             prefix + "weights_proj.weight": torch.randn(4, 256, dtype=torch.bfloat16)}
    return state, prefix


def _load(tmp_path, state, layer=3):
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    return Indexer.from_safetensors(path, layer, TINY)


def test_checkpoint_loads_when_formats_are_right(tmp_path):
    state, prefix = _checkpoint()
    assert _load(tmp_path, state).wq_b_is_block_fp8


@pytest.mark.parametrize("change, message", [
    ("bf16_weight_with_scale", r"wq_b.weight is bfloat16 but .*wq_b.weight_scale_inv is beside it"),
    ("fp8_weight_without_scale", r"wq_b.weight is float8_e4m3fn without its block scale"),
    ("int8_weights_proj", r"weights_proj.weight is int8; this weight is bfloat16, float16, float32"),
    ("nan_weights_proj", r"weights_proj.weight holds NaN or inf"),
    ("nan_scale", r"wq_b.weight_scale_inv holds NaN or inf"),
    ("int_scale", r"wq_b.weight_scale_inv is int32; block scales are"),
])
def test_checkpoint_formats_are_checked_naming_the_key(tmp_path, change, message):
    state, prefix = _checkpoint()
    if change == "bf16_weight_with_scale":
        state[prefix + "wq_b.weight"] = torch.randn(512, 256, dtype=torch.bfloat16)
    elif change == "fp8_weight_without_scale":
        del state[prefix + "wq_b.weight_scale_inv"]
    elif change == "int8_weights_proj":
        state[prefix + "weights_proj.weight"] = torch.randint(-5, 5, (4, 256), dtype=torch.int8)
    elif change == "nan_weights_proj":
        state[prefix + "weights_proj.weight"][1, 7] = float("nan")
    elif change == "nan_scale":
        state[prefix + "wq_b.weight_scale_inv"][0, 1] = float("nan")
    elif change == "int_scale":
        state[prefix + "wq_b.weight_scale_inv"] = torch.ones(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        _load(tmp_path, state)


# --- item 7: positions must agree with the batch ---------------------------------------------------------------
def test_forward_positions_that_disagree_with_the_batch_are_refused():
    torch.manual_seed(0)
    indexer = Indexer(TINY).init_random(0)
    cache = IndexKCache.allocate(num_pages=4)
    table = torch.arange(4, dtype=torch.int32).view(1, 4)
    batch = PrefillBatch.build([0], [50], table, num_cache_pages=4)
    x = torch.randn(50, TINY.hidden_size, dtype=torch.bfloat16)
    q_lora = torch.randn(50, TINY.q_lora_rank, dtype=torch.bfloat16)
    wrong = batch.positions.clone()
    wrong[20:] += 3
    with pytest.raises(IndexerInputError, match=r"positions disagree with batch.positions at 30 of 50 rows "
                                                r"\(first: row 20"):
        indexer(x, q_lora, wrong, batch, cache)
    same_values = batch.positions.clone()  # another tensor with the same values is fine
    assert indexer(x, q_lora, same_values, batch, cache).shape == (50, TINY.topk)
    decode = DecodeBatch.build([51], table, num_cache_pages=4)
    with pytest.raises(IndexerInputError, match="positions disagree"):
        indexer(x[:1], q_lora[:1], decode.positions + 1, decode, cache)


# --- item 7: block tables of the slot transform ------------------------------------------------------------------
def test_topk_slot_transform_refuses_invalid_pages_a_row_uses():
    logits = torch.randn(2, 100)
    ends = torch.tensor([100, 60], dtype=torch.int32)
    with pytest.raises(IndexerInputError, match=r"block_table values must lie in \[0, .*got range \[-1, "):
        ops.topk_indices(logits, 3, ends, block_table=torch.tensor([[-1, 4], [2, 3]], dtype=torch.int32))
    with pytest.raises(IndexerInputError, match="block_table values"):  # request 1's second page is used (ends 100)
        ops.topk_indices(logits, 3, ends, block_table=torch.tensor([[5, 6], [2, -1]], dtype=torch.int32),
                         row_request=torch.tensor([1, 1], dtype=torch.int32))
    # A -1 in a page no row uses is padding: accepted; slots are never negative.
    out = ops.topk_indices(logits, 3, torch.tensor([60, 64], dtype=torch.int32),
                           block_table=torch.tensor([[5, -1], [2, -1]], dtype=torch.int32))
    assert bool((out >= 0).all())
    assert bool((out[0] // 64 == 5).all()) and bool((out[1] // 64 == 2).all())


# --- item 7: the NaN rule ------------------------------------------------------------------------------------------
def _nan_rows(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random rows with NaN at random places, one all-NaN row, one of NaN and -inf only, one with few numbers."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen)
    x[torch.rand(rows, cols, generator=gen) < 0.1] = float("nan")
    x[1] = float("nan")
    x[2, ::2] = NEG_INF
    x[2, 1::2] = float("nan")
    x[3] = float("nan")
    x[3, torch.randperm(cols, generator=gen)[:5]] = torch.randn(5, generator=gen)
    return x


def test_reference_topk_ranks_nan_as_neg_inf():
    x = _nan_rows(6, 300, seed=1)
    ends = torch.tensor([300, 300, 300, 300, 200, 10], dtype=torch.int32)
    out = ref.topk_indices(x, 40, ends)
    sanitized = ref.topk_indices(_nan_as_neg_inf(x), 40, ends)
    assert torch.equal(out, sanitized)
    for row in range(6):  # no NaN position chosen while a value above -inf was left out
        chosen = out[row][out[row] >= 0].long()
        above = int((x[row, :ends[row]] > NEG_INF).sum())  # NaN compares False: not counted
        assert int(torch.isnan(x[row, chosen]).sum()) <= max(0, min(40, int(ends[row])) - above)


@pytest.mark.parametrize("path", ["rows", "split"])
def test_triton_topk_ranks_nan_as_neg_inf(device, path):
    from dsa_indexer.backends.triton import topk as triton_topk

    x = _nan_rows(5, 700, seed=2).to(device)
    ends = torch.tensor([700, 700, 640, 700, 333], dtype=torch.int32, device=device)
    starts = torch.tensor([0, 5, 0, 100, 3], dtype=torch.int32, device=device)
    with triton_topk.config_override(path=path):
        out = triton_topk.topk_indices(x, 64, ends, starts)
    _same_sets(out.cpu(), ref.topk_indices(_nan_as_neg_inf(x).cpu(), 64, ends.cpu(), starts.cpu()))


def test_triton_quant_gives_a_nan_group_a_nan_scale(device):
    """Before: ``tl.max`` skipped the NaN, the group got a finite scale and its NaN was clamped to -448."""
    from dsa_indexer.backends.triton import quant as triton_quant

    x = torch.randn(3, 256)
    x[0, 3] = float("nan")
    x[2, 200] = float("nan")
    for ue8m0 in (False, True):
        q, scale = triton_quant.quant_fp8_groups(x.to(device), 128, ue8m0=ue8m0)
        q_ref, scale_ref = ref.quant_fp8_groups(x, 128, ue8m0, FP8)
        assert torch.equal(torch.isnan(scale.cpu()), torch.isnan(scale_ref)), ue8m0
        assert torch.isnan(scale_ref).sum() == 2
        finite = ~torch.isnan(scale_ref).repeat_interleave(128, dim=1)
        assert torch.equal(q.cpu().float()[finite], q_ref.float()[finite])
    normed_in = torch.randn(2, 256, dtype=torch.bfloat16)
    normed_in[1, 9] = float("nan")
    _normed, _q, scale = triton_quant.rmsnorm_quant_fp8(normed_in.to(device), torch.rand(256).to(device), 1e-6,
                                                        128, False, FP8)
    assert torch.isnan(scale.cpu()[1]).all() and torch.isfinite(scale.cpu()[0]).all()


def _ragged_inputs(device, s=12, n=300, heads=16, seed=3):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(s, heads, 128, generator=gen).to(FP8)
    k = torch.randn(n, 128, generator=gen).to(FP8)
    k_scales = torch.rand(n, generator=gen) + 0.5
    weights = torch.randn(s, heads, generator=gen)
    k_scales[torch.randperm(n, generator=gen)[:20]] = float("nan")  # NaN cached keys (their scale)
    weights[4, 2] = float("nan")  # one row's head weights
    ks = torch.zeros(s, dtype=torch.int32)
    ke = torch.arange(n - s + 1, n + 1, dtype=torch.int32)
    return [t.to(device) for t in (q, k, k_scales, weights, ks, ke)]


def test_ragged_logits_and_scoring_never_rank_nan_above_a_number(device):
    """NaN key scales and NaN head weights: the reference and Triton logits keep the NaN, and the fused Triton
    logits + top-k and the composed scoring rank it as -inf."""
    from dsa_indexer.backends.triton import logits as triton_logits
    from dsa_indexer.backends.triton.fused_topk import fused_ragged_topk

    q, k, k_scales, weights, ks, ke = _ragged_inputs(device)
    want_logits = ref.ragged_mqa_logits(q.cpu(), k.cpu(), k_scales.cpu(), weights.cpu(), ks.cpu(), ke.cpu())
    got_logits = triton_logits.ragged_mqa_logits(q, k, k_scales, weights, ks, ke).cpu()
    assert torch.equal(torch.isnan(got_logits), torch.isnan(want_logits))
    assert bool(torch.isnan(want_logits[4, :int(ke[4])]).all())  # a NaN weight: the row's every visible score
    topk = 32
    expected = ref.topk_indices(_nan_as_neg_inf(got_logits), topk, ke.cpu(), ks.cpu())
    fused = fused_ragged_topk(q, k, k_scales, weights, ks, ke, topk, capacity=64, target=40).cpu()
    assert torch.equal(fused, expected) or all(
        sorted(fused[r].tolist()) == sorted(expected[r].tolist()) for r in range(fused.shape[0]))
    nan_keys = torch.isnan(k_scales.cpu())
    for row in range(fused.shape[0]):
        if row == 4:
            continue  # every score NaN: the first columns by the tie rule
        picked = fused[row][fused[row] >= 0].long()
        assert not bool(nan_keys[picked].any()), f"row {row} picked a NaN key"
    assert fused[4].tolist() == list(range(topk))  # all -inf: ties to the lower column


def test_flashinfer_adapter_never_passes_nan_to_flashinfer():
    from dsa_indexer.backends.cuda import flashinfer_topk

    class TieBreak:
        SMALL = "small"

    class Double:
        """flashinfer's documented top_k_ragged_transform as a sort; it refuses NaN so the adapter must not pass
        one (FlashInfer's own NaN order is undocumented)."""
        TopKTieBreak = TieBreak

        @staticmethod
        def top_k_ragged_transform(x, offsets, lengths, k, deterministic, tie_break):
            assert not bool(torch.isnan(x).any()), "NaN reached flashinfer"
            return ref.topk_indices(x, k, lengths)

    adapter = flashinfer_topk.make_topk_indices(Double())
    x = _nan_rows(5, 400, seed=4)
    ends = torch.tensor([400, 400, 400, 400, 123], dtype=torch.int32)
    assert torch.equal(adapter(x, 50, ends), ref.topk_indices(x, 50, ends))
