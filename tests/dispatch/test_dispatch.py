"""Targets, the registry's resolution rules, overrides, strict mode, fallback warnings and thread safety."""

import threading
import warnings

import pytest
import torch

from dsa_indexer.dispatch import (Environment, Implementation, NoImplementationError, Problem, Registry, Target,
                                  detect_target, parse_target)
from dsa_indexer.dispatch.target import reload_environment, target_of_tensor


# --- targets -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, vendor, arch", [
    ("sm90", "cuda", "sm90"), ("sm_90", "cuda", "sm90"), ("sm90a", "cuda", "sm90"), ("sm100", "cuda", "sm100"),
    ("sm120", "cuda", "sm120"), ("gfx942", "rocm", "gfx942"), ("gfx942:sramecc+:xnack-", "rocm", "gfx942"),
    ("gfx950", "rocm", "gfx950"), ("gfx1250", "rocm", "gfx1250"), ("npu", "npu", "npu"), ("cpu", "cpu", "cpu"),
    ("CPU", "cpu", "cpu"),
])
def test_parse_target_accepts_vendor_names(name, vendor, arch):
    target = parse_target(name)
    assert (target.vendor, target.arch) == (vendor, arch)


def test_parse_target_keeps_ascend_soc():
    target = parse_target("npu:Ascend910B3")
    assert (target.vendor, target.arch, target.soc) == ("npu", "npu", "Ascend910B3")
    assert str(target) == "npu:Ascend910B3"


@pytest.mark.parametrize("name", ["sm", "sm9", "gfx", "gfx9g1", "cuda", "rocm", "", "tpu", "npu910"])
def test_parse_target_rejects_unknown_names(name):
    with pytest.raises(ValueError, match="unknown target"):
        parse_target(name)


def test_fp8_flavour_per_target():
    assert parse_target("gfx942").fp8_dtype == torch.float8_e4m3fnuz
    for name in ("gfx950", "gfx1250", "sm90", "sm100", "cpu"):
        assert parse_target(name).fp8_dtype == torch.float8_e4m3fn


def test_detect_target_override_argument_and_environment(monkeypatch):
    monkeypatch.delenv("DSA_INDEXER_TARGET", raising=False)
    reload_environment()
    assert detect_target("cpu") == Target("cpu", "cpu")
    assert detect_target("cpu", override="gfx950") == Target("rocm", "gfx950")
    monkeypatch.setenv("DSA_INDEXER_TARGET", "sm100")
    reload_environment()  # the variable is read once, in one place; Registry.clear_cache() re-reads it
    assert detect_target("cpu") == Target("cuda", "sm100")
    assert target_of_tensor(torch.zeros(1)) == Target("cuda", "sm100")
    monkeypatch.delenv("DSA_INDEXER_TARGET")
    reload_environment()
    assert target_of_tensor(torch.zeros(1)) == Target("cpu", "cpu")
    assert detect_target("cpu", override="cpu") == Target("cpu", "cpu")  # the argument wins over the environment


# --- registry ------------------------------------------------------------------------------------------------
def _impl(impl_id, targets, priority, fn=None, **kw):
    op = impl_id.split(".")[0]
    return Implementation(op, impl_id, tuple(targets), priority, lambda: fn or (lambda *a: impl_id), **kw)


def _registry():
    reg = Registry(environment=Environment.simulated(gpu=True, fastlib=True))
    reg.register(_impl("op.reference.torch", ["*"], 0))
    reg.register(_impl("op.vendor.fast", ["sm90"], 200, requires=("fastlib",)))
    reg.register(_impl("op.vendor.heads", ["cuda"], 150,
                       supports=lambda p, t: None if p.get("heads") in (32, 64) else f"heads={p.get('heads')}"))
    return reg


def test_implementation_id_must_name_op_vendor_variant():
    with pytest.raises(ValueError, match="<op>.<vendor>.<variant>"):
        _impl("op.torch", ["*"], 0)
    with pytest.raises(ValueError, match="<op>.<vendor>.<variant>"):
        Implementation("other", "op.reference.torch", ("*",), 0, lambda: None)


def test_priority_tie_is_an_error_at_registration():
    reg = _registry()
    with pytest.raises(ValueError, match="priority tie"):
        reg.register(_impl("op.other.same", ["sm90", "sm100"], 200))
    reg.register(_impl("op.other.elsewhere", ["gfx950"], 200))  # no shared target: no tie


def test_resolve_lists_every_candidate_with_its_reason():
    reg = _registry()
    res = reg.resolve("op", Target("cuda", "sm100"), Problem(heads=128))
    assert res.chosen.impl_id == "op.reference.torch"
    reasons = {c.impl.impl_id: c.reason for c in res.candidates}
    assert reasons["op.vendor.fast"] == "serves sm90, not sm100"
    assert reasons["op.vendor.heads"] == "heads=128"
    assert reasons["op.reference.torch"] == "chosen"
    text = res.explain()
    assert "op.vendor.heads" in text and "heads=128" in text and "=> op.reference.torch" in text


def test_resolution_prefers_priority_then_falls_through_checks():
    reg = _registry()
    assert reg.resolve("op", Target("cuda", "sm90"), Problem(heads=64)).chosen.impl_id == "op.vendor.fast"
    reg.set_environment(Environment.simulated(gpu=True, fastlib="fastlib is broken: self-test failed"))
    res = reg.resolve("op", Target("cuda", "sm90"), Problem(heads=64))
    assert res.chosen.impl_id == "op.vendor.heads"
    assert "fastlib is broken" in {c.impl.impl_id: c.reason for c in res.candidates}["op.vendor.fast"]


def test_resolve_is_cached_and_pure():
    reg = _registry()
    a = reg.resolve("op", Target("cuda", "sm90"), Problem(heads=64))
    b = reg.resolve("op", Target("cuda", "sm90"), Problem(heads=64))
    assert a is b
    other_env = Environment.simulated(gpu=True)
    c = reg.resolve("op", Target("cuda", "sm90"), Problem(heads=64), environment=other_env)
    assert c.chosen.impl_id == "op.vendor.heads"
    assert reg.resolve("op", Target("cuda", "sm90"), Problem(heads=64)) is a  # the default environment is unchanged


def test_force_by_argument_and_environment(monkeypatch):
    reg = _registry()
    reg.force("op", "op.reference.torch")
    assert reg.resolve("op", Target("cuda", "sm90"), Problem(heads=64)).chosen.impl_id == "op.reference.torch"
    reg.force("op", None)
    monkeypatch.setenv("DSA_INDEXER_FORCE", "op=op.vendor.heads")
    reg.clear_cache()
    res = reg.resolve("op", Target("cuda", "sm90"), Problem(heads=64))
    assert res.chosen.impl_id == "op.vendor.heads" and res.forced == "op.vendor.heads"
    monkeypatch.setenv("DSA_INDEXER_FORCE", "op=op.nope.missing")
    reg.clear_cache()
    with pytest.raises(NoImplementationError, match="not registered"):
        reg.resolve("op", Target("cuda", "sm90"), Problem())
    monkeypatch.setenv("DSA_INDEXER_FORCE", "garbage")
    reg.clear_cache()
    with pytest.raises(ValueError, match="op=impl_id"):
        reg.resolve("op", Target("cuda", "sm90"), Problem())


def test_forced_implementation_that_cannot_run_raises_with_reason():
    reg = _registry()
    reg.force("op", "op.vendor.heads")
    with pytest.raises(NoImplementationError) as info:
        reg.choose("op", Target("cuda", "sm90"), Problem(heads=7))
    assert "heads=7" in str(info.value) and "forced" in str(info.value)


def test_fallback_warns_once_and_strict_mode_refuses(monkeypatch):
    reg = _registry()
    gpu = Target("cuda", "sm90")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reg.set_environment(Environment.simulated(gpu=True))
        fn = reg.function("op", gpu, Problem(heads=128))
        reg.function("op", Target("cuda", "sm90"), Problem(heads=96))
    assert fn() == "op.reference.torch"
    fallback = [w for w in caught if "falls back" in str(w.message)]
    assert len(fallback) == 1
    assert "op.vendor.heads: heads=128" in str(fallback[0].message)
    monkeypatch.setenv("DSA_INDEXER_STRICT", "1")
    reg.clear_cache()
    with pytest.raises(NoImplementationError, match="strict mode"):
        reg.function("op", gpu, Problem(heads=128))
    # The CPU is no GPU target: the reference is the right answer there, strict or not.
    assert reg.function("op", Target("cpu", "cpu"), Problem())() == "op.reference.torch"


def test_no_implementation_error_tells_the_whole_story():
    reg = Registry(environment=Environment.simulated())
    reg.register(_impl("lonely.vendor.only", ["sm90"], 10, requires=("vendorlib",)))
    reg.plugins_failed.append("brokenplugin: import failed: ImportError: nope")
    with pytest.raises(NoImplementationError) as info:
        reg.choose("lonely", Target("rocm", "gfx950"))
    text = str(info.value)
    for needle in ("gfx950", "lonely.vendor.only", "serves sm90, not gfx950", "brokenplugin", "DSA_INDEXER_FORCE"):
        assert needle in text


def test_unknown_op_is_a_clear_error():
    with pytest.raises(KeyError, match="unknown op 'nope'"):
        _registry().resolve("nope", Target("cpu", "cpu"))


def test_call_uses_the_cached_function_and_factory_runs_once():
    calls = []

    def factory():
        calls.append(1)
        return lambda x: x + 1

    reg = Registry(environment=Environment.simulated())
    reg.register(Implementation("inc", "inc.reference.torch", ("*",), 0, factory))
    assert [reg.call("inc", Target("cpu", "cpu"), Problem(), i) for i in range(5)] == [1, 2, 3, 4, 5]
    assert len(calls) == 1


def test_an_id_registered_again_after_unregister_runs_its_new_factory():
    """unregister forgets the function the old factory built (and a failure recorded for it): the same id registered
    again (a test's stand-in, a plugin reloaded) is served by its own factory."""
    reg = Registry(environment=Environment.simulated())
    cpu = Target("cpu", "cpu")
    reg.register(Implementation("inc", "inc.reference.torch", ("*",), 0, lambda: lambda x: x + 1))
    assert reg.call("inc", cpu, Problem(), 1) == 2
    reg.unregister("inc.reference.torch")
    reg.register(Implementation("inc", "inc.reference.torch", ("*",), 0, lambda: lambda x: x + 10))
    assert reg.call("inc", cpu, Problem(), 1) == 11
    reg.unregister("inc.reference.torch")
    reg.register(Implementation("inc", "inc.reference.torch", ("*",), 0, lambda: None))  # its factory fails
    with pytest.raises(NoImplementationError), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "could not be built, falling back": there is nothing else
        reg.call("inc", cpu, Problem(), 1)
    reg.unregister("inc.reference.torch")
    reg.register(Implementation("inc", "inc.reference.torch", ("*",), 0, lambda: lambda x: x + 100))
    assert reg.call("inc", cpu, Problem(), 1) == 101


def test_concurrent_resolution_is_consistent():
    reg = _registry()
    results, errors = [], []

    def work(seed):
        try:
            for i in range(200):
                heads = (32, 64, 128)[(seed + i) % 3]
                results.append((heads, reg.function("op", Target("cuda", "sm100"), Problem(heads=heads))()))
                if i % 50 == 0:
                    reg.clear_cache()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    for heads, chosen in results:
        assert chosen == ("op.vendor.heads" if heads in (32, 64) else "op.reference.torch")


def test_an_installed_vendor_library_that_fails_its_probe_warns_once():
    """Installed but failing (a self-test, an import error) is a surprise: one RuntimeWarning with the reason;
    not installed at all is the normal case elsewhere and stays quiet."""
    import warnings

    from dsa_indexer.dispatch import environment as env_module

    env_module._warned.discard("fake_vendor_lib")
    env = Environment(probes={"fake_vendor_lib": lambda: "self-test failed: wrong output"},
                      libraries={"fake_vendor_lib": "torch", "absent_lib": "no_such_module_here"})
    with pytest.warns(RuntimeWarning, match="torch is installed but not usable.*self-test failed"):
        assert env.missing("fake_vendor_lib") == "self-test failed: wrong output"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        env2 = Environment(probes={"fake_vendor_lib": lambda: "again"}, libraries={"fake_vendor_lib": "torch"})
        env2.missing("fake_vendor_lib")  # once per process
        Environment(probes={"absent_lib": lambda: "not installed"},
                    libraries={"absent_lib": "no_such_module_here"}).missing("absent_lib")


def test_a_supports_check_may_report_every_failing_fact_at_once():
    reg = Registry(environment=Environment.simulated(torch_npu=True))
    from dsa_indexer.dispatch.plugins import load_plugins

    load_plugins(reg, entry_points=False)
    res = reg.resolve("lightning_indexer_ragged", Target("npu", "npu"), Problem(heads=16, k=4096, format="bf16"))
    reason = next(c.reason for c in res.candidates if c.impl.impl_id == "lightning_indexer_ragged.npu.torch_npu")
    assert reason == ("heads=16: torch_npu's lightning indexer takes 64; k=4096: torch_npu's lightning indexer "
                      "takes 1..2048 (its sparse_count)")
    ok = reg.resolve("lightning_indexer_ragged", Target("npu", "npu"), Problem(heads=64, k=2048, format="bf16"))
    assert ok.chosen.impl_id == "lightning_indexer_ragged.npu.torch_npu"  # an empty list says yes


def test_the_aiter_paged_check_reports_next_n_and_heads_together():
    from dsa_indexer.dispatch.plugins import load_plugins

    reg = Registry(environment=Environment.simulated(gpu=True, triton=True, aiter=True))
    load_plugins(reg, entry_points=False)
    res = reg.resolve("paged_mqa_logits", Target("rocm", "gfx950"), Problem(heads=96, dim=128, next_n=2, fp8="fn"))
    reason = next(c.reason for c in res.candidates if c.impl.impl_id == "paged_mqa_logits.rocm.aiter")
    assert reason.startswith("next_n=2: ") and "; heads=96: " in reason
