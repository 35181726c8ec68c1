"""Issue 34 item 7: a plugin's results are checked (metadata on every eager call, values by the conformance check
plugin authors run), and a registration for an arch no platform parses is said, not silently loaded."""

from __future__ import annotations

import re
import sys
import types

import pytest
import torch

from dsa_indexer import ops
from dsa_indexer.backends.reference import kernels as reference
from dsa_indexer.dispatch import Environment, Problem, Registry, Target, hookimpl, load_plugins, plugins
from dsa_indexer import testing
from tests.dispatch.test_plugins import _fake_entry_points


def _registry_with(monkeypatch, impl_id: str, kernel, targets=("cpu",), op: str = "topk_indices") -> Registry:
    """A registry that loaded a plugin named "acme" registering ``kernel`` for ``op``; it is the default one (what
    ops.* and the CLI use) for the test."""
    plugin = types.ModuleType("dsa_test_acme_kernels")

    @hookimpl
    def dsa_indexer_register(registry):
        registry.implementation(op, impl_id=impl_id, targets=targets, priority=150)(lambda: kernel)

    plugin.dsa_indexer_register = dsa_indexer_register
    monkeypatch.setitem(sys.modules, "dsa_test_acme_kernels", plugin)
    _fake_entry_points(monkeypatch, [("acme", "dsa_test_acme_kernels")])
    reg = Registry(environment=Environment.simulated(gpu=True, triton=True))
    load_plugins(reg)
    assert "acme" in reg.plugins_loaded, reg.plugins_failed
    monkeypatch.setattr(plugins, "_default", reg)
    return reg


def _result_error():
    from dsa_indexer.dispatch.results import ImplementationResultError

    return ImplementationResultError


def _int64_topk(logits, k, ends, starts=None, block_table=None, row_request=None):
    return reference.topk_indices(logits, k, ends, starts, block_table, row_request).long()


def _one_short_topk(logits, k, ends, starts=None, block_table=None, row_request=None):
    return reference.topk_indices(logits, k, ends, starts, block_table, row_request)[:, : k - 1]


def _smallest_topk(logits, k, ends, starts=None, block_table=None, row_request=None):
    return reference.topk_indices(-logits, k, ends, starts, block_table, row_request)


@pytest.mark.parametrize("kernel, says", [
    (_int64_topk, "the result is int64 [4, 5]; expected int32 [4, 5]"),
    (_one_short_topk, "the result is int32 [4, 4]; expected int32 [4, 5]"),
])
def test_a_plugin_result_of_the_wrong_dtype_or_shape_raises_at_the_call(monkeypatch, kernel, says):
    _registry_with(monkeypatch, "topk_indices.acme.radix", kernel)
    logits = torch.randn(4, 30)
    with pytest.raises(_result_error(),
                       match=f"topk_indices.acme.radix \\(plugin acme\\) returned a wrong result for topk_indices: "
                             f"{says.replace('[', '.').replace(']', '.')}"):
        ops.topk_indices(logits, 5, torch.tensor([30, 7, 19, 30], dtype=torch.int32))


def test_the_metadata_check_passes_a_right_plugin_and_leaves_built_ins_unwrapped(monkeypatch):
    reg = _registry_with(monkeypatch, "topk_indices.acme.radix", reference.topk_indices)
    logits = torch.randn(4, 30)
    ends = torch.tensor([30, 7, 19, 30], dtype=torch.int32)
    got = ops.topk_indices(logits, 5, ends)
    for row, end in enumerate(ends.tolist()):  # distinct random logits: the top 5 set is unique
        assert sorted(got[row].tolist()) == sorted(torch.topk(logits[row, :end], 5).indices.tolist())
    wrapped = reg.function("topk_indices", Target("cpu", "cpu"), Problem(k=5, slots=False, starts=False))
    assert wrapped.__wrapped__ is reference.topk_indices
    builtin = reg.function("paged_mqa_logits", Target("cpu", "cpu"), Problem())
    assert not hasattr(builtin, "__wrapped__")  # the built-in backends' results are not re-checked per call


@pytest.mark.parametrize("kernel, says", [
    (_int64_topk, "k 16: wrong result: the result is int64 \\[6, 16\\]; expected int32 \\[6, 16\\]"),
    (_one_short_topk, "k 16: wrong result: the result is int32 \\[6, 15\\]; expected int32 \\[6, 16\\]"),
    (_smallest_topk, "k 16: row \\d+ selects key \\d+ \\(score -?[0-9.]+\\) that is not among the top 16"),
])
def test_the_conformance_check_fails_a_wrong_plugin_naming_the_case(monkeypatch, kernel, says):
    _registry_with(monkeypatch, "topk_indices.acme.radix", kernel)
    with pytest.raises(testing.ConformanceError) as exc:
        testing.check_implementation("topk_indices.acme.radix")
    text = str(exc.value)
    assert text.startswith("topk_indices.acme.radix on cpu disagrees with topk_indices.reference.torch")
    assert re.search(says, text), text


def test_the_conformance_check_passes_the_example_plugin_on_its_arch():
    reg = Registry(environment=Environment.simulated(gpu=True))
    load_plugins(reg)
    lines = testing.check_implementation("topk_indices.example.torch_topk", registry=reg)  # target: its sm103
    assert lines == ["k 16: ok", "k 16 with starts: ok", "slots: ok", "k 2048: ok"]


def test_the_conformance_check_passes_another_real_implementation():
    """The Triton q prologue (CPU interpreter here) is a different computation of the same contract: it must pass,
    or the tolerances are wrong."""
    reg = Registry(environment=Environment.simulated(gpu=True, triton=True))
    load_plugins(reg, entry_points=False)
    assert testing.check_implementation("q_prologue.triton.prologue", target="sm90", registry=reg) == ["V3.2: ok"]


def _prologue_without_hadamard(q, positions, cos_sin, head_weights, weight_scale, rope_offset, interleaved, ue8m0,
                               fp8_dtype):
    x = reference.apply_rope(q.float(), positions, cos_sin, rope_offset, interleaved)
    q_fp8, q_scale = reference.quant_fp8_groups(x, x.shape[-1], ue8m0, fp8_dtype)
    return q_fp8, head_weights.float() * weight_scale * q_scale.squeeze(-1)


def _store_everywhere(k, norm_weight, norm_bias, eps, positions, cos_sin, kv_cache, slot_mapping, rope_offset,
                      interleaved, ue8m0, fp8_dtype, norm):
    reference.k_prologue_store(k, norm_weight, norm_bias, eps, positions, cos_sin, kv_cache, slot_mapping,
                               rope_offset, interleaved, ue8m0, fp8_dtype, norm)
    from dsa_indexer.contract.cache import page_views

    keys, _ = page_views(kv_cache, fp8_dtype)
    named = set(slot_mapping.tolist())
    stray = next(slot for slot in range(keys.shape[0] * 64) if slot not in named)
    keys.view(torch.uint8)[stray // 64, stray % 64] = 7  # a slot the step does not name


@pytest.mark.parametrize("op, kernel, says", [
    ("q_prologue", _prologue_without_hadamard, "V3.2: q codes x head weights:"),
    ("k_prologue_store", _store_everywhere, "V3.2: kv_cache keys: 1 slots that slot_mapping does not name were "
                                            "written"),
])
def test_the_conformance_check_fails_wrong_values_and_stray_writes(monkeypatch, op, kernel, says):
    _registry_with(monkeypatch, f"{op}.acme.kernel", kernel, op=op)
    with pytest.raises(testing.ConformanceError, match=says.replace("(", "\\(").replace(")", "\\)")):
        testing.check_implementation(f"{op}.acme.kernel")


def test_the_conformance_check_says_what_it_cannot_run():
    with pytest.raises(ValueError, match="'topk_indices.nobody.kernel' is not registered; registered for topk_indices"):
        testing.check_implementation("topk_indices.nobody.kernel")
    with pytest.raises(ValueError, match="checks implementations of the declared ops"):
        testing.check_implementation("indexer_pipeline.reference.single_stream")
    reg = Registry(environment=Environment.simulated(gpu=True, triton=True))
    load_plugins(reg, entry_points=False)
    with pytest.raises(ValueError, match="ran on none of the cases: fp4 pages: skipped, .* keys=fp4: the Triton"):
        testing.check_implementation("paged_mqa_logits.triton.logits", target="sm90", registry=reg,
                             cases={"fp4 pages": _fp4_paged_case()})


def _fp4_paged_case():
    return testing.sample_arguments("paged_mqa_logits")["fp4 pages"]


def test_a_plugin_registering_an_arch_no_platform_parses_warns_once_and_info_shows_it(monkeypatch, capsys):
    from dsa_indexer.cli import main

    with pytest.warns(RuntimeWarning) as caught:
        _registry_with(monkeypatch, "topk_indices.acme.radix", reference.topk_indices, targets=("sm9O", "sm90a"))
    said = [str(w.message) for w in caught if "acme" in str(w.message)]
    assert said == [
        "dsa_indexer: plugin acme: registers topk_indices.acme.radix for target 'sm90a', which the cuda platform "
        "reads as sm90, so it never serves (a target is an arch such as cpu, sm90, gfx942, npu, a vendor: cpu, cuda, "
        "rocm, npu, or '*')",
        "dsa_indexer: plugin acme: registers topk_indices.acme.radix for target 'sm9O', which no platform parses, so "
        "it never serves (a target is an arch such as cpu, sm90, gfx942, npu, a vendor: cpu, cuda, rocm, npu, or '*')"]
    assert main(["info"]) == 0
    assert "plugins warned: acme: registers topk_indices.acme.radix for target 'sm90a'" in capsys.readouterr().out


@pytest.mark.parametrize("op", sorted(testing.sample_arguments.__globals__["_COMPARE"]))
def test_every_sample_is_a_valid_call_and_the_declaration_matches_the_reference(op):
    """The samples pass the public op's own checks (on the CPU they include the range checks), so a plugin is
    checked on inputs a caller may give; and the reference's results have the metadata the op's declaration gives
    (what the per-call check of a plugin compares with), on every sample."""
    from dsa_indexer.dispatch import results

    public = ops.OPERATORS[op].public
    reference_fn = next(i for i in plugins.default_registry().implementations(op)
                        if i.impl_id == f"{op}.reference.torch").factory()
    for label, args in testing.sample_arguments(op, seed=3).items():
        public(**dict(zip(public.decl.arguments, args)))  # raises naming the argument if a sample is invalid
        out = reference_fn(*args)
        assert results.mismatch(results.expected_result(public.decl, args), out, args[0].device) is None, label


def test_a_case_that_is_not_a_valid_call_is_refused_naming_it():
    logits = torch.randn(2, 10)
    with pytest.raises(ValueError, match="case 'mine' is not a valid call of topk_indices: .*ends"):
        testing.check_implementation("topk_indices.reference.torch",
                                     cases={"mine": (logits, 4, torch.tensor([10, 3]), None, None, None)})
