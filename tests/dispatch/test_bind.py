"""`dispatch.bind`: a Bound is what the registry would run for (op, target, problem), with the resolution that chose
it and the chosen implementation's facts; it is cached until the registry changes, and a change makes it stale."""

import warnings

import pytest
import torch

from dsa_indexer import ops
from dsa_indexer.dispatch import Bound, Environment, NoImplementationError, Problem, Registry, Target, bind

SM90, SM100, CPU = Target("cuda", "sm90"), Target("cuda", "sm100"), Target("cpu", "cpu")


def _registry() -> Registry:
    """Three implementations of "op", each returning its own name: reference everywhere, a sm90 one that needs a
    library, a cuda one for 32 or 64 heads with a fact in ``info``."""
    reg = Registry(environment=Environment.simulated(gpu=True, fastlib=True))

    def named(name):
        return lambda: (lambda *args, **kwargs: (name, args, kwargs))

    reg.implementation("op", impl_id="op.reference.torch", targets=("*",), priority=0)(named("reference"))
    reg.implementation("op", impl_id="op.vendor.fast", targets=("sm90",), priority=200, requires=("fastlib",),
                       info={"layout": "k-major"})(named("fast"))
    reg.implementation("op", impl_id="op.vendor.heads", targets=("cuda",), priority=150, info={"tile": 64},
                       supports=lambda p, t: None if p.get("heads") in (32, 64) else f"heads={p.get('heads')}"
                       )(named("heads"))
    return reg


def test_bind_takes_what_resolve_chooses_and_calls_what_function_would():
    reg = _registry()
    for target, problem, expected in ((SM90, Problem(heads=64), "op.vendor.fast"),
                                      (SM100, Problem(heads=64), "op.vendor.heads")):
        bound = bind("op", target, problem, registry=reg)
        assert isinstance(bound, Bound)
        assert bound.impl_id == reg.resolve("op", target, problem).chosen.impl_id == expected
        assert bound.resolution is reg.resolve("op", target, problem)
        assert bound.fn is reg.function("op", target, problem)
        assert bound.info == reg.resolve("op", target, problem).chosen.info
        assert (bound.op, bound.target, bound.problem) == ("op", target, problem)
        assert bound(1, x=2) == (expected.split(".")[2], (1,), {"x": 2})  # the chosen function, called


def test_bind_follows_force_and_the_fallback():
    reg = _registry()
    reg.force("op", "op.vendor.heads")
    forced = bind("op", SM90, Problem(heads=32), registry=reg)
    assert forced.impl_id == "op.vendor.heads" and forced.resolution.forced == "op.vendor.heads"
    assert forced.info == {"tile": 64}
    reg.force("op", None)
    # sm100 with 128 heads: the cuda one refuses the heads, so the reference runs (a fallback, said once).
    with pytest.warns(RuntimeWarning, match="falls back to the slow reference"):
        fallback = bind("op", SM100, Problem(heads=128), registry=reg)
    assert fallback.impl_id == "op.reference.torch" and fallback.resolution.is_fallback
    assert fallback.info == {} and fallback(3)[0] == "reference"
    assert "heads=128" in fallback.resolution.explain()


def test_the_fallback_warning_is_given_once_until_the_cache_is_cleared():
    """Once per (op, target): a second resolution is quiet. clear_cache forgets that it was said, as it forgets the
    resolutions, so a caller that changes the environment and clears hears it again (a test that expects the
    warning no longer depends on which tests ran before it in the same process)."""
    reg = _registry()
    with pytest.warns(RuntimeWarning, match="falls back to the slow reference"):
        bind("op", SM100, Problem(heads=128), registry=reg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bind("op", SM100, Problem(heads=96), registry=reg)  # the same (op, target): said already
    reg.clear_cache()
    with pytest.warns(RuntimeWarning, match="falls back to the slow reference"):
        bind("op", SM100, Problem(heads=128), registry=reg)


def test_a_missing_implementation_raises_the_registrys_error():
    reg = Registry(environment=Environment.simulated(gpu=True))
    reg.implementation("op", impl_id="op.vendor.fast", targets=("sm90",), priority=200,
                       requires=("fastlib",))(lambda: (lambda: "fast"))
    with pytest.raises(NoImplementationError, match="no implementation of 'op' can run on target sm90") as caught:
        bind("op", SM90, Problem(), registry=reg)
    assert "op.vendor.fast" in str(caught.value)  # the whole trace: the candidate and why it was rejected
    with pytest.raises(KeyError, match="unknown op 'other'"):
        bind("other", SM90, Problem(), registry=reg)


def test_strict_mode_refuses_the_fallback_at_bind():
    reg = _registry()
    reg.set_strict(True)
    with pytest.raises(NoImplementationError, match="strict mode"):
        bind("op", SM100, Problem(heads=128), registry=reg)


def test_a_bound_is_cached_until_the_registry_changes():
    reg = _registry()
    first = bind("op", SM90, Problem(heads=64), registry=reg)
    assert bind("op", SM90, Problem(heads=64), registry=reg) is first and first.current
    for change in (lambda: reg.force("op", "op.vendor.heads"), lambda: reg.force("op", None),
                   lambda: reg.set_environment(Environment.simulated(gpu=True)), lambda: reg.set_strict(False),
                   lambda: reg.implementation("op", impl_id="op.vendor.new", targets=("sm100",), priority=300)(
                       lambda: (lambda *a: "new")),
                   reg.clear_cache):
        before = bind("op", SM90, Problem(heads=64), registry=reg)
        change()
        assert not before.current
        again = bind("op", SM90, Problem(heads=64), registry=reg)
        assert again is not before and again.current
    # Without fastlib (the environment set above), sm90 with 64 heads is served by the cuda one.
    assert bind("op", SM90, Problem(heads=64), registry=reg).impl_id == "op.vendor.heads"


def test_a_broken_factory_binds_the_next_candidate():
    reg = Registry(environment=Environment.simulated(gpu=True))
    reg.implementation("op", impl_id="op.reference.torch", targets=("*",), priority=0)(lambda: (lambda: "ref"))

    def broken():
        raise ImportError("no vendor library here")

    reg.implementation("op", impl_id="op.vendor.broken", targets=("sm90",), priority=200)(broken)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the "could not be built" and fallback warnings
        bound = bind("op", SM90, Problem(), registry=reg)
    assert bound.impl_id == "op.reference.torch" and bound() == "ref"
    assert bound.current  # bound after the broken one was marked: valid for the registry as it is now
    assert "no vendor library here" in reg.failed_implementations()["op.vendor.broken"]


def test_bind_defaults_to_the_process_registry_and_the_public_op_runs_the_bound():
    logits = torch.randn(3, 40)
    ends = torch.tensor([40, 17, 0], dtype=torch.int32)
    arguments = (logits, 5, ends, None, None, None)
    bound = bind("topk_indices", CPU, ops.topk_indices.problem(*arguments))
    assert bound.impl_id == "topk_indices.reference.torch"
    expected = torch.topk(logits[1, :17], 5).indices.sort().values
    assert torch.equal(bound(*arguments)[1].sort().values.long(), expected)
    assert torch.equal(bound(*arguments), ops.topk_indices(logits, 5, ends))


def test_the_public_op_follows_every_registry_change_between_two_calls_of_one_problem():
    """The public op keeps its previous call's binding for a call with the same target and problem: a registry
    change in between (registering, forcing, unforcing, unregistering) must reach the very next call."""
    from dsa_indexer.backends.reference import kernels
    from dsa_indexer.dispatch.plugins import default_registry

    registry = default_registry()
    calls = []

    def counted(*args):
        calls.append("counted")
        return kernels.topk_indices(*args)

    logits = torch.randn(2, 40)
    ends = torch.tensor([40, 13], dtype=torch.int32)
    want = ops.topk_indices(logits, 5, ends)
    assert calls == []
    registry.implementation("topk_indices", impl_id="topk_indices.test.counted", targets=("cpu",), priority=10_000,
                            origin="tests")(lambda: counted)
    try:
        for expected in (["counted"], ["counted"] * 2):  # registered: the next call runs it, and the one after
            assert torch.equal(ops.topk_indices(logits, 5, ends), want) and calls == expected
        registry.force("topk_indices", "topk_indices.reference.torch")
        assert torch.equal(ops.topk_indices(logits, 5, ends), want) and calls == ["counted"] * 2
        registry.force("topk_indices", None)
        assert torch.equal(ops.topk_indices(logits, 5, ends), want) and calls == ["counted"] * 3
    finally:
        registry.force("topk_indices", None)
        registry.unregister("topk_indices.test.counted")
    assert torch.equal(ops.topk_indices(logits, 5, ends), want) and calls == ["counted"] * 3  # gone: not called
