"""Declared capabilities (dispatch/capabilities.py): facts as data, every failing fact reported at once, merged
with an implementation's own ``supports`` by the registry, shown by explain."""

import pytest

from dsa_indexer.dispatch.capabilities import Capabilities, Rule
from dsa_indexer.dispatch.environment import Environment
from dsa_indexer.dispatch.problem import Problem
from dsa_indexer.dispatch.registry import Implementation, Registry
from dsa_indexer.dispatch.target import Target

SM90, SM100, SM120 = Target("cuda", "sm90"), Target("cuda", "sm100"), Target("cuda", "sm120")
CAPS = Capabilities("the kernel", heads=(32, 64), dim=(128,), next_n={"sm90": (1, 2), "sm100": None},
                    k=Rule(lambda k: k % 128 == 0, "multiples of 128"))


def test_every_failing_fact_is_named_at_once():
    reasons = CAPS.reasons(Problem(heads=16, dim=64, next_n=3, k=100), SM90)
    assert reasons == ["heads=16: the kernel takes 32 or 64", "head dim 64: the kernel takes 128",
                       "next_n=3: the kernel on sm90 takes 1 or 2", "k=100: the kernel takes multiples of 128"]
    assert CAPS.reasons(Problem(heads=64, dim=128, next_n=2, k=256), SM90) == []


def test_per_arch_limits_and_facts_the_problem_does_not_carry():
    assert CAPS.reasons(Problem(next_n=7), SM100) == []  # None: any value on sm100
    assert CAPS.reasons(Problem(next_n=1), SM120) == ["next_n=1: the kernel is not declared for sm120"]
    assert CAPS.reasons(Problem(), SM90) == []  # a coarse problem is not refused for what it does not say


def test_a_malformed_declaration_is_refused():
    with pytest.raises(TypeError, match="capability 'heads' of x"):
        Capabilities("x", heads=64)


def test_the_registry_merges_capabilities_with_supports_and_explain_shows_them():
    reg = Registry(Environment.simulated(gpu=True))
    reg.register(Implementation("op", "op.vendor.kernel", ("sm90",), 10, lambda: (lambda: "kernel"),
                                supports=lambda p, t: "disabled by a knob" if p.get("knob") else None,
                                capabilities=CAPS))
    reg.register(Implementation("op", "op.reference.torch", ("*",), 0, lambda: (lambda: "reference")))
    env = Environment.simulated(gpu=True)
    res = reg.resolve("op", SM90, Problem(heads=16, knob=True), environment=env)
    verdict = next(c for c in res.candidates if c.impl.impl_id == "op.vendor.kernel")
    assert verdict.reason == "heads=16: the kernel takes 32 or 64; disabled by a knob"
    res = reg.resolve("op", SM90, Problem(heads=64), environment=env)
    assert res.chosen.impl_id == "op.vendor.kernel"
    assert "takes: heads 32 or 64, dim 128, next_n sm90: 1 or 2; sm100: any, k multiples of 128" in res.explain()
    assert res.to_dict()["capabilities"]["heads"] == "32 or 64"
