"""Plugins: the example backend installed through its entry point, and broken plugins reported, not fatal."""

import sys
import types
from importlib import metadata

import pytest
import torch

from dsa_indexer.dispatch import Environment, Problem, Registry, Target, hookimpl, load_plugins
from dsa_indexer.dispatch import discovery


def _example_entry_point():
    found = [ep for ep in metadata.entry_points(group="dsa_indexer.backends") if ep.name == "example"]
    if not found:
        pytest.fail("the example plugin is not installed: run `pip install -e tests/plugins/example_backend` "
                    "(the README's test command does)")
    return found[0]


def test_example_plugin_is_installed_through_its_entry_point():
    assert _example_entry_point().value == "dsa_indexer_example_backend"


def test_example_plugin_registers_and_wins_on_its_new_arch():
    reg = Registry(environment=Environment.simulated(gpu=True))
    load_plugins(reg)
    assert "example" in reg.plugins_loaded
    res = reg.resolve("topk_indices", Target("cuda", "sm103"), Problem(k=4, slots=False, starts=False))
    assert res.chosen.impl_id == "topk_indices.example.torch_topk"
    assert res.chosen.origin == "example"
    # Elsewhere it is not a candidate that can win.
    assert reg.resolve("topk_indices", Target("cpu", "cpu"), Problem(k=4)).chosen.vendor == "reference"


def test_example_plugin_implementation_meets_the_top_k_contract():
    reg = Registry(environment=Environment.simulated(gpu=True))
    load_plugins(reg)
    plugin_fn = reg.function("topk_indices", Target("cuda", "sm103"), Problem(k=5))
    ref_fn = reg.function("topk_indices", Target("cpu", "cpu"), Problem(k=5))
    logits = torch.randn(6, 40)
    logits[:, 10:20] = 0.0  # exact ties, as the ReLU makes
    ends = torch.tensor([40, 3, 25, 12, 40, 0], dtype=torch.int32)
    starts = torch.tensor([0, 0, 5, 10, 30, 0], dtype=torch.int32)
    got, want = plugin_fn(logits, 5, ends, starts), ref_fn(logits, 5, ends, starts)
    for g, w in zip(got.tolist(), want.tolist()):
        assert sorted(g) == sorted(w)


def _fake_entry_points(monkeypatch, entries):
    real = metadata.entry_points

    def fake(group=None, **kw):
        if group == "dsa_indexer.backends":
            return [metadata.EntryPoint(name, value, group) for name, value in entries]
        return real(group=group, **kw)

    monkeypatch.setattr(discovery.metadata, "entry_points", fake)  # the one discovery path reads entry points


def test_broken_plugins_are_reported_not_fatal(monkeypatch):
    half = types.ModuleType("dsa_test_half_plugin")

    @hookimpl
    def dsa_indexer_register(registry):
        registry.implementation("topk_indices", impl_id="topk_indices.half.first", targets=("sm90",),
                                priority=500)(lambda: None)
        raise RuntimeError("second registration exploded")

    half.dsa_indexer_register = dsa_indexer_register
    monkeypatch.setitem(sys.modules, "dsa_test_half_plugin", half)
    _fake_entry_points(monkeypatch, [("missing", "dsa_test_no_such_module"), ("half", "dsa_test_half_plugin")])
    reg = Registry(environment=Environment.simulated(gpu=True))
    load_plugins(reg)
    failed = "\n".join(reg.plugins_failed)
    assert "missing (dsa_test_no_such_module): import failed: ModuleNotFoundError" in failed
    assert "half: register failed: RuntimeError: second registration exploded" in failed
    # What the failed plugin registered before failing was rolled back; the built-ins are intact.
    ids = [i.impl_id for i in reg.implementations("topk_indices")]
    assert "topk_indices.half.first" not in ids and "topk_indices.reference.torch" in ids
    assert "reference" in reg.plugins_loaded


def test_allow_list_and_autoload_switch(monkeypatch):
    _fake_entry_points(monkeypatch, [("missing", "dsa_test_no_such_module")])
    monkeypatch.setenv("DSA_INDEXER_DISABLE_PLUGIN_AUTOLOAD", "1")
    reg = Registry(environment=Environment.simulated())
    load_plugins(reg)
    assert reg.plugins_failed == [] and "reference" in reg.plugins_loaded
    monkeypatch.delenv("DSA_INDEXER_DISABLE_PLUGIN_AUTOLOAD")
    monkeypatch.setenv("DSA_INDEXER_PLUGINS", "someone_else")
    reg = Registry(environment=Environment.simulated())
    load_plugins(reg)
    # The allow-list skips "missing" (so its import error never happens) and says that "someone_else" is not there.
    (failure,) = reg.plugins_failed
    assert failure.startswith("someone_else: named in DSA_INDEXER_PLUGINS but no such entry point is installed")


def test_a_plugin_raising_systemexit_at_import_is_contained(monkeypatch, tmp_path):
    (tmp_path / "dsa_test_exits_at_import.py").write_text('raise SystemExit("rocminfo not found")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    _fake_entry_points(monkeypatch, [("exits", "dsa_test_exits_at_import")])
    reg = Registry(environment=Environment.simulated())
    load_plugins(reg)
    assert any(f.startswith("exits (dsa_test_exits_at_import): import failed: SystemExit: rocminfo not found")
               for f in reg.plugins_failed), reg.plugins_failed
    assert "reference" in reg.plugins_loaded


def test_a_failing_factory_is_rejected_with_its_reason_and_resolution_falls_back():
    reg = Registry(environment=Environment.simulated(gpu=True))
    load_plugins(reg, entry_points=False)

    def factory():
        import dsa_test_vendor_library_that_is_not_installed  # noqa: F401

    reg.implementation("topk_indices", impl_id="topk_indices.brokenvendor.kernel", targets=("cpu",), priority=150,
                       description="a plugin whose vendor import is missing")(factory)
    with pytest.warns(RuntimeWarning, match="topk_indices.brokenvendor.kernel could not be built, falling back"):
        fn = reg.function("topk_indices", Target("cpu", "cpu"), Problem(k=4))
    logits = torch.randn(2, 10)
    assert fn(logits, 4, torch.tensor([10, 3])).shape == (2, 4)
    res = reg.resolve("topk_indices", Target("cpu", "cpu"), Problem(k=4))
    assert res.chosen.impl_id == "topk_indices.reference.torch"
    assert "factory failed: ModuleNotFoundError" in next(
        c for c in res.candidates if c.impl.impl_id == "topk_indices.brokenvendor.kernel").reason


def test_a_new_vendor_is_one_folder_a_platform_and_a_backend(monkeypatch):
    """tests/plugins/acme_vendor adds a vendor: its platform parses its archs and says its fp8 flavour, its
    backend serves them; dispatch is not touched."""
    from pathlib import Path

    from dsa_indexer.dispatch import parse_target, register_platform
    from dsa_indexer.dispatch.platform import unregister_platform

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "plugins" / "acme_vendor"))
    import dsa_indexer_acme
    from dsa_indexer_acme.platform import PLATFORM

    register_platform(PLATFORM)
    try:
        target = parse_target("acme1")
        assert target.vendor == "acme" and target.is_accelerator
        assert parse_target("acme2").fp8_dtype == torch.float8_e4m3fnuz
        reg = Registry(environment=Environment.simulated(gpu=True))
        load_plugins(reg, builtins=("dsa_indexer.backends.reference", "dsa_indexer_acme"), entry_points=False)
        assert "dsa_indexer_acme" in reg.plugins_loaded
        res = reg.resolve("topk_indices", target, Problem(k=4))
        assert res.chosen.impl_id == "topk_indices.acme.torch_topk", res.explain()
        logits = torch.randn(3, 20)
        got = reg.function("topk_indices", target, Problem(k=4))(logits, 4, torch.tensor([20, 3, 11]))
        ref = reg.function("topk_indices", Target("cpu", "cpu"), Problem(k=4))(logits, 4, torch.tensor([20, 3, 11]))
        assert [sorted(r) for r in got.tolist()] == [sorted(r) for r in ref.tolist()]
    finally:
        unregister_platform("acme")
    with pytest.raises(ValueError, match="unknown target"):
        parse_target("acme1")
    assert dsa_indexer_acme.ARCH == "acme1"


def test_a_plugin_registering_an_unknown_op_is_reported_not_loaded(monkeypatch):
    plugin = types.ModuleType("dsa_test_typo_plugin")

    @hookimpl
    def dsa_indexer_register(registry):
        registry.implementation("topk_indicse", impl_id="topk_indicse.typo.kernel", targets=("*",), priority=5
                                )(lambda: None)

    plugin.dsa_indexer_register = dsa_indexer_register
    monkeypatch.setitem(sys.modules, "dsa_test_typo_plugin", plugin)
    _fake_entry_points(monkeypatch, [("typo", "dsa_test_typo_plugin")])
    reg = Registry(environment=Environment.simulated())
    load_plugins(reg)
    assert "typo" not in reg.plugins_loaded
    assert any(f.startswith("typo: registers unknown op(s) topk_indicse; known ops:") for f in reg.plugins_failed)
    assert "topk_indicse.typo.kernel" not in reg.snapshot_ids()
