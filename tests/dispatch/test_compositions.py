"""A composition declares the ops it uses (`Implementation.uses`) and its factory receives them bound for the target
and problem it was chosen for (`Registry.composition`): a warm call reaches the inner kernels with no registry
call, and an override of an inner op (``Registry.force``) reaches the composition on its next call."""

from __future__ import annotations

import pytest
import torch

from dsa_indexer import ops
from dsa_indexer.backends.reference import kernels as ref
from dsa_indexer.dispatch.bind import bind
from dsa_indexer.dispatch.plugins import default_registry
from dsa_indexer.dispatch.registry import Registry
from dsa_indexer.dispatch.target import Target
from dsa_indexer.generic import LIGHTNING_INDEXER_USES, RAGGED_MQA_TOPK_USES
from dsa_indexer.testing import random_cache

CPU = Target("cpu", "cpu")
COMPOSED = "lightning_indexer.generic.composed"


def _decode_inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    cache = random_cache(8, "cpu", seed=seed)
    table = torch.randperm(8, generator=gen).to(torch.int32).view(2, 4)
    q = torch.randn(2, 1, 4, 128, generator=gen).to(torch.float8_e4m3fn)
    weights = torch.randn(2, 4, generator=gen)
    lens = torch.tensor([[int(torch.randint(40, 256, (1,), generator=gen))], [100]], dtype=torch.int32)
    return q, cache.data, weights, lens, table, 256, 16


@pytest.fixture
def composed():
    """The default registry with the lightning indexer forced to the composition (restored after)."""
    registry = default_registry()
    previous = registry.force("lightning_indexer", COMPOSED)
    try:
        yield registry
    finally:
        registry.force("lightning_indexer", previous)


def test_the_compositions_declare_the_ops_they_use():
    registry = default_registry()
    uses = {i.impl_id: set(i.uses) for op in ("lightning_indexer", "ragged_mqa_topk")
            for i in registry.implementations(op) if i.uses}
    assert uses == {COMPOSED: {"paged_mqa_logits", "topk_indices"},
                    "ragged_mqa_topk.generic.composed": {"ragged_mqa_logits", "topk_indices"}}
    assert LIGHTNING_INDEXER_USES.keys() == {"paged_mqa_logits", "topk_indices"}
    assert RAGGED_MQA_TOPK_USES.keys() == {"ragged_mqa_logits", "topk_indices"}


def test_the_inner_problems_are_made_from_the_outer_one(composed):
    args = _decode_inputs(0)
    outer = ops.OPERATORS["lightning_indexer"].problem(*args, False)
    fn = composed.composition(composed.bound("lightning_indexer", CPU, outer).implementation, CPU, outer)
    assert callable(fn)
    paged = LIGHTNING_INDEXER_USES["paged_mqa_logits"](outer)
    # the paged logits are bound for exactly the problem their own call would make (the page count included)
    assert paged == ops.OPERATORS["paged_mqa_logits"].problem(*args[:6])
    logits = ref.paged_mqa_logits(*args[:6])
    topk = LIGHTNING_INDEXER_USES["topk_indices"](outer)
    assert topk == ops.OPERATORS["topk_indices"].problem(logits, 16, args[3].reshape(-1), None, None, None)


def test_a_warm_composition_call_makes_no_registry_call(composed, monkeypatch):
    """After the first call the composition's inner ops are bound: the next call asks the registry nothing."""
    args = _decode_inputs(1)
    first = ops.lightning_indexer(*args)
    assert bind("lightning_indexer", CPU, ops.OPERATORS["lightning_indexer"].problem(*args, False)).impl_id == COMPOSED

    def refuse(*_, **__):
        raise AssertionError("a warm call asked the registry")

    for name in ("resolve", "choose", "chosen", "function", "call", "bound", "composition"):
        monkeypatch.setattr(composed, name, refuse)
    again = ops.lightning_indexer(*args)
    assert torch.equal(first, again)


def test_forcing_an_inner_op_reaches_the_composition(composed):
    """An inner op forced to another implementation (the registry's override) is what the composition runs on its
    next call; releasing the override goes back."""
    calls = []

    def counting_factory():
        def topk_indices(*args):
            calls.append(args[1])
            return ref.topk_indices(*args)
        return topk_indices

    composed.implementation("topk_indices", impl_id="topk_indices.test.counting", targets=("cpu",),
                            priority=-5)(counting_factory)
    try:
        args = _decode_inputs(2)
        expected = ops.lightning_indexer(*args)
        assert calls == []  # not chosen unforced (its priority is below the reference's)
        previous = composed.force("topk_indices", "topk_indices.test.counting")
        try:
            assert torch.equal(ops.lightning_indexer(*args), expected)
            assert calls == [16]
        finally:
            composed.force("topk_indices", previous)
        ops.lightning_indexer(*args)
        assert calls == [16]
    finally:
        composed.unregister("topk_indices.test.counting")


def test_an_inner_op_that_cannot_run_raises_its_own_error_without_breaking_the_composition():
    reg = Registry()
    reg.implementation("outer", impl_id="outer.generic.composed", targets=("*",), priority=1,
                       uses={"inner": lambda outer: outer})(lambda inner: inner.fn)
    with pytest.raises(KeyError, match="unknown op 'inner'"):
        reg.call("outer", CPU, None, 1)
    reg.implementation("inner", impl_id="inner.reference.torch", targets=("*",), priority=0)(
        lambda: (lambda x: x + 1))
    assert reg.call("outer", CPU, None, 1) == 2  # not marked broken by the first failure
    assert reg.failed_implementations() == {}
