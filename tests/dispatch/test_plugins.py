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


# --- issue 34, items 5 and 6: a factory returning None, a raising check --------------------------------------------
_NONE_FACTORY_SCRIPT = """
import warnings
import torch
from dsa_indexer.dispatch import Environment, Problem, Registry, Target, load_plugins

reg = Registry(environment=Environment.simulated(gpu=True))
load_plugins(reg, entry_points=False)
reg.implementation("topk_indices", impl_id="topk_indices.nonevendor.kernel", targets=("cpu",), priority=150)(
    lambda: None)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fn = reg.function("topk_indices", Target("cpu", "cpu"), Problem(k=4))
    fn_again = reg.function("topk_indices", Target("cpu", "cpu"), Problem(k=4))
logits = torch.randn(3, 20)
print("shape", tuple(fn(logits, 4, torch.tensor([20, 3, 11])).shape))
print("same", fn is fn_again)
print("warnings", [str(w.message) for w in caught])
res = reg.resolve("topk_indices", Target("cpu", "cpu"), Problem(k=4))
print("chosen", res.chosen.impl_id)
print("reason", {c.impl.impl_id: c.reason for c in res.candidates}["topk_indices.nonevendor.kernel"])
"""


def test_a_factory_returning_none_is_rejected_and_falls_back_instead_of_hanging():
    # In a child process with a timeout: the old registry spun forever at 100% CPU on this call.
    import os
    import subprocess
    from pathlib import Path

    root = str(Path(__file__).parents[2])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        done = subprocess.run([sys.executable, "-c", _NONE_FACTORY_SCRIPT], capture_output=True, text=True,
                              timeout=120, env=env, cwd=root)
    except subprocess.TimeoutExpired:
        pytest.fail("Registry.function hangs on a factory that returns None")
    assert done.returncode == 0, done.stderr
    out = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert out["shape"] == "(3, 4)" and out["same"] == "True"
    assert out["chosen"] == "topk_indices.reference.torch"
    assert out["reason"] == "factory returned None"
    warned = [w for w in eval(out["warnings"]) if "nonevendor" in w]  # noqa: S307 - our own child's repr
    assert warned == ["dsa_indexer: topk_indices.nonevendor.kernel could not be built, falling back (factory "
                      "returned None)"]  # once, although the op was asked for twice


def test_a_factory_returning_a_non_callable_is_rejected_with_what_it_returned():
    reg = Registry(environment=Environment.simulated(gpu=True))
    load_plugins(reg, entry_points=False)
    reg.implementation("topk_indices", impl_id="topk_indices.strvendor.kernel", targets=("cpu",), priority=150)(
        lambda: "kernel")
    with pytest.warns(RuntimeWarning, match="factory returned a str, not a callable"):
        fn = reg.function("topk_indices", Target("cpu", "cpu"), Problem(k=4))
    assert fn(torch.randn(2, 9), 4, torch.tensor([9, 2])).shape == (2, 4)
    assert reg.failed_implementations() == {"topk_indices.strvendor.kernel": "factory returned a str, not a callable"}


def test_info_and_explain_build_the_factory_and_show_a_none_factory_rejected():
    """`resolve_runnable` (what `dsa-indexer info` / `explain` report) builds the chosen factory as a call would: a
    None factory is shown rejected, not as the choice (in the detected environment: a simulated one builds nothing)."""
    reg = Registry()
    load_plugins(reg, entry_points=False)
    reg.implementation("topk_indices", impl_id="topk_indices.nonevendor.kernel", targets=("cpu",), priority=150)(
        lambda: None)
    res = reg.resolve_runnable("topk_indices", Target("cpu", "cpu"), Problem(k=4))
    assert res.chosen.impl_id == "topk_indices.reference.torch"
    assert {c.impl.impl_id: c.reason for c in res.candidates}["topk_indices.nonevendor.kernel"] == \
        "factory returned None"


def _raising_check_plugin(monkeypatch, check: str):
    plugin = types.ModuleType("dsa_test_raising_check_plugin")

    def explode(*args):
        raise RuntimeError("the vendor library's version query exploded")

    @hookimpl
    def dsa_indexer_register(registry):
        registry.implementation("topk_indices", impl_id="topk_indices.badcheck.kernel", targets=("cpu",),
                                priority=150, **{check: explode})(lambda: _never_called)

    plugin.dsa_indexer_register = dsa_indexer_register
    monkeypatch.setitem(sys.modules, "dsa_test_raising_check_plugin", plugin)
    _fake_entry_points(monkeypatch, [("badcheck", "dsa_test_raising_check_plugin")])


def _never_called(*args):
    raise AssertionError("an implementation whose check raised was called")


@pytest.mark.parametrize("check", ["supports", "available"])
def test_a_raising_check_rejects_its_implementation_and_every_call_still_runs(monkeypatch, check):
    from dsa_indexer import ops
    from dsa_indexer.dispatch import plugins

    _raising_check_plugin(monkeypatch, check)
    reg = Registry()
    load_plugins(reg)
    assert "badcheck" in reg.plugins_loaded
    monkeypatch.setattr(plugins, "_default", reg)  # what ops.* and the CLI use
    logits = torch.randn(4, 30)
    ends = torch.tensor([30, 7, 19, 30], dtype=torch.int32)
    with pytest.warns(RuntimeWarning, match=f"topk_indices.badcheck.kernel \\(plugin badcheck\\) is rejected: its "
                                            f"{check} check raised RuntimeError: the vendor library's version"):
        got = ops.topk_indices(logits, 5, ends)
    for row, end in enumerate(ends.tolist()):  # distinct random logits: the top 5 set is unique
        assert sorted(got[row].tolist()) == sorted(torch.topk(logits[row, :end], 5).indices.tolist())
    res = reg.resolve("topk_indices", Target("cpu", "cpu"), Problem(k=5, slots=False, starts=False))
    assert res.chosen.impl_id == "topk_indices.reference.torch"
    reason = {c.impl.impl_id: c.reason for c in res.candidates}["topk_indices.badcheck.kernel"]
    assert reason == f"{check} check raised RuntimeError: the vendor library's version query exploded"


def test_info_and_explain_show_a_raising_supports_check_instead_of_dying(monkeypatch, capsys):
    from dsa_indexer.cli import main
    from dsa_indexer.dispatch import plugins

    _raising_check_plugin(monkeypatch, "supports")
    reg = Registry()
    load_plugins(reg)
    monkeypatch.setattr(plugins, "_default", reg)  # what the CLI's default_registry() returns
    with pytest.warns(RuntimeWarning, match="badcheck.kernel"):
        assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert ("implementations failed: topk_indices.badcheck.kernel: supports check raised RuntimeError: the vendor "
            "library's version query exploded") in out
    assert "topk_indices" in out and "-> topk_indices.reference.torch" in out
    assert main(["explain", "topk_indices"]) == 0
    out = capsys.readouterr().out
    assert "- topk_indices.badcheck.kernel" in out and "supports check raised RuntimeError" in out
