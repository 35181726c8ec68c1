"""Issue 36 on the Ascend backend: the four torch_npu registrations declare the problem facts they take
(`dispatch.capabilities.Capabilities`), and their ``supports`` checks keep only what the problem cannot say (the
probed release's operators, the Ascend product).

Each declared rule refuses a problem that breaks it with that rule's words, several broken rules give several reasons
at once, and the problems torch_npu's kernels take are still accepted. The expected reasons are written out here,
not read from the declarations.
"""

from __future__ import annotations

import pytest

from doubles.torch_npu import install_schema_ops
from dsa_indexer.backends import npu as npu_backend
from dsa_indexer.dispatch.environment import Environment
from dsa_indexer.dispatch.plugins import default_registry, load_plugins
from dsa_indexer.dispatch.problem import Problem
from dsa_indexer.dispatch.registry import Registry
from dsa_indexer.dispatch.target import Target

NPU = Target("npu", "npu")
RAGGED = "lightning_indexer_ragged.npu.torch_npu"
FP8_PAGES = "lightning_indexer.npu.torch_npu_fp8"
K_STORE = "k_prologue_store_plain.npu.torch_npu"
Q_PROLOGUE = "q_prologue_plain.npu.torch_npu"
A2, A950 = "Ascend910B3", "Ascend950PR_9579"

C4_WORDS = ("ratio=4: torch_npu's lightning indexer takes 1 (uncompressed keys: no released torch_npu indexer takes "
            "a compression ratio, op-plugin master 517f2e7d, 7.3.0, 26.0.0 and 26.1.0, so V4's C4 indexer, "
            "compress_ratio 4, is served by the reference)")
FP4_WORDS = ("keys=fp4: Ascend 950's fp8 indexer takes fp8 (V4's FP4 pages, 68 bytes: no torch_npu indexer reads "
             "e2m1 keys)")
PRODUCT_UNKNOWN = ("the Ascend product is known only after the torch_npu probe (fp8 keys: Ascend 950PR / 950DT, "
                   "op-plugin 26.1.0 on); run on the NPU")


@pytest.fixture
def simulated():
    """A registry of the built-in backends with torch_npu assumed present and not probed (the published API)."""
    reg = Registry(environment=Environment.simulated(torch_npu=True))
    load_plugins(reg, entry_points=False)
    return reg


@pytest.fixture
def probed(monkeypatch):
    """install(release, device_name, ops=None) -> the default registry over the schema-op torch_npu, probed."""
    reg = default_registry()
    previous = reg.environment

    def install(release="op-plugin master", device_name=A950, ops=None):
        install_schema_ops(monkeypatch, release, device_name=device_name, ops=ops)
        monkeypatch.setattr(npu_backend.LIBRARY, "detected", None)
        env = Environment()
        env.add_probe("torch_npu", npu_backend.torch_npu_probe)
        reg.set_environment(env)
        reg.clear_cache()
        assert npu_backend.torch_npu_probe() is None
        return reg

    yield install
    reg.set_environment(previous)
    reg.clear_cache()


def _candidate(reg, op, impl_id, **facts):
    return next(c for c in reg.resolve(op, NPU, Problem(**facts)).candidates if c.impl.impl_id == impl_id)


def _accepted(reg, op, impl_id, **facts) -> bool:
    return _candidate(reg, op, impl_id, **facts).accepted


def _reason(reg, op, impl_id, **facts) -> str:
    """The refusal's text: its reasons joined by "; " (some reasons hold a "; " of their own)."""
    cand = _candidate(reg, op, impl_id, **facts)
    assert not cand.accepted, facts
    return cand.reason


# ------------------------------------------------------------------------------- lightning_indexer_ragged.npu.torch_npu
RAGGED_OK = dict(heads=64, dim=128, k=2048, format="bf16", ratio=1)


@pytest.mark.parametrize("fact, value, words", [
    ("heads", 16, "heads=16: torch_npu's lightning indexer takes 64"),
    ("heads", 128, "heads=128: torch_npu's lightning indexer takes 64"),
    ("dim", 64, "head dim 64: torch_npu's lightning indexer takes 128"),
    ("k", 0, "k=0: torch_npu's lightning indexer takes 1..2048 (its sparse_count)"),
    ("k", 2049, "k=2049: torch_npu's lightning indexer takes 1..2048 (its sparse_count)"),
    ("ratio", 4, C4_WORDS),
])
def test_ragged_indexer_refuses_each_declared_fact_with_its_words(simulated, fact, value, words):
    assert _reason(simulated, "lightning_indexer_ragged", RAGGED, **{**RAGGED_OK, fact: value}) == words


def test_ragged_indexer_reports_every_broken_fact_at_once(simulated):
    assert _reason(simulated, "lightning_indexer_ragged", RAGGED, heads=16, dim=64, k=4096, format="int8",
                   ratio=4) == "; ".join(["heads=16: torch_npu's lightning indexer takes 64",
                                          "head dim 64: torch_npu's lightning indexer takes 128",
                                          "k=4096: torch_npu's lightning indexer takes 1..2048 (its sparse_count)",
                                          C4_WORDS])


@pytest.mark.parametrize("facts", [RAGGED_OK, dict(RAGGED_OK, k=1, format="int8"), dict(heads=64), {}])
def test_ragged_indexer_still_takes_what_torch_npu_takes(simulated, facts):
    assert _accepted(simulated, "lightning_indexer_ragged", RAGGED, **facts)
    assert simulated.resolve("lightning_indexer_ragged", NPU, Problem(**facts)).chosen.impl_id == RAGGED


def test_ragged_indexer_reports_the_release_beside_the_declared_facts(probed):
    """A release without the int8 indexer: the supports check's reason (the release decides) comes after the
    declared one, both at once."""
    reg = probed("op-plugin master", A2, ops=["npu_lightning_indexer", "npu_scatter_nd_update_", "npu_rotary_mul",
                                              "npu_dynamic_quant"])
    heads, release = _reason(reg, "lightning_indexer_ragged", RAGGED, heads=16, dim=128, k=64,
                             format="int8").split("; ", 1)
    assert heads == "heads=16: torch_npu's lightning indexer takes 64"
    assert "npu_quant_lightning_indexer" in release and release.endswith("(int8 keys)")
    assert _accepted(reg, "lightning_indexer_ragged", RAGGED, heads=64, dim=128, k=64, format="bf16")


# ------------------------------------------------------------------------------- lightning_indexer.npu.torch_npu_fp8
FP8_OK = dict(heads=64, dim=128, k=2048, fp8="fn", keys="fp8", next_n=2)


@pytest.mark.parametrize("fact, value, words", [
    ("heads", 128, "heads=128: Ascend 950's fp8 indexer takes 8, 16, 24, 32 or 64"),
    ("heads", 12, "heads=12: Ascend 950's fp8 indexer takes 8, 16, 24, 32 or 64"),
    ("dim", 64, "head dim 64: Ascend 950's fp8 indexer takes 128"),
    ("k", 4096, "k=4096: Ascend 950's fp8 indexer takes 1..2048 (its sparse_count)"),
    ("keys", "fp4", FP4_WORDS),
    ("fp8", "fnuz", "fp8=fnuz: Ascend 950's fp8 indexer takes fn (float8_e4m3fn)"),
])
def test_fp8_pages_refuse_each_declared_fact_with_its_words(probed, fact, value, words):
    reg = probed("op-plugin master", A950)
    assert _reason(reg, "lightning_indexer", FP8_PAGES, **{**FP8_OK, fact: value}) == words


def test_fp8_pages_report_every_broken_fact_and_the_product_at_once(probed):
    broken = dict(heads=128, dim=64, k=0, fp8="fnuz", keys="fp4")
    declared = "; ".join(["heads=128: Ascend 950's fp8 indexer takes 8, 16, 24, 32 or 64",
                          "head dim 64: Ascend 950's fp8 indexer takes 128",
                          "k=0: Ascend 950's fp8 indexer takes 1..2048 (its sparse_count)",
                          FP4_WORDS, "fp8=fnuz: Ascend 950's fp8 indexer takes fn (float8_e4m3fn)"])
    assert _reason(probed("op-plugin master", A950), "lightning_indexer", FP8_PAGES, **broken) == declared
    reason = _reason(probed("op-plugin master", A2), "lightning_indexer", FP8_PAGES, **broken)
    assert reason.startswith(declared + "; on Atlas A2 npu_quant_lightning_indexer takes int8 keys only")


@pytest.mark.parametrize("heads", [8, 16, 24, 32, 64])
def test_fp8_pages_still_take_the_950_problems(probed, heads):
    reg = probed("op-plugin master", A950)
    assert _accepted(reg, "lightning_indexer", FP8_PAGES, **{**FP8_OK, "heads": heads})
    assert _accepted(reg, "lightning_indexer", FP8_PAGES, **{**FP8_OK, "heads": heads, "k": 1})


def test_fp8_pages_unprobed_say_only_that_the_product_is_unknown(simulated):
    assert _reason(simulated, "lightning_indexer", FP8_PAGES, **FP8_OK) == PRODUCT_UNKNOWN
    assert _reason(simulated, "lightning_indexer", FP8_PAGES, **{**FP8_OK, "dim": 64}) == (
        "head dim 64: Ascend 950's fp8 indexer takes 128; " + PRODUCT_UNKNOWN)


# ------------------------------------------------------------------------------- the plain prologues
PROLOGUES = [("k_prologue_store_plain", K_STORE, "torch_npu's k prologue"),
             ("q_prologue_plain", Q_PROLOGUE, "torch_npu's q prologue")]


@pytest.mark.parametrize("op, impl_id, owner", PROLOGUES)
def test_prologues_refuse_another_head_dim_with_its_words(simulated, op, impl_id, owner):
    assert _reason(simulated, op, impl_id, dim=64, format="bf16") == (
        f"head dim 64: {owner} takes 128 (what the plain layouts hold)")
    assert _reason(simulated, op, impl_id, dim=256, interleaved=True, format="int8") == (
        f"head dim 256: {owner} takes 128 (what the plain layouts hold)")


@pytest.mark.parametrize("op, impl_id, owner", PROLOGUES)
@pytest.mark.parametrize("facts", [dict(dim=128, format="bf16"), dict(dim=128, interleaved=True, format="int8"), {}])
def test_prologues_still_take_the_plain_head_dim(simulated, op, impl_id, owner, facts):
    assert _accepted(simulated, op, impl_id, **facts)


@pytest.mark.parametrize("op, impl_id, owner", PROLOGUES)
def test_prologues_report_the_release_beside_the_head_dim(probed, op, impl_id, owner):
    """A release without npu_dynamic_quant: int8 keys need it (the supports check, the release decides), reported
    with the declared head dim at once."""
    reg = probed("op-plugin master", A2, ops=["npu_lightning_indexer", "npu_quant_lightning_indexer",
                                              "npu_scatter_nd_update_", "npu_rotary_mul"])
    dim, release = _reason(reg, op, impl_id, dim=64, format="int8").split("; ", 1)
    assert dim == f"head dim 64: {owner} takes 128 (what the plain layouts hold)"
    assert "npu_dynamic_quant" in release
    assert _accepted(reg, op, impl_id, dim=128, format="bf16")


# ------------------------------------------------------------------------------- the split itself
def test_supports_checks_keep_no_problem_fact(simulated):
    """Unprobed (the published API assumed), the shape facts are the declarations' alone: the supports checks of the
    indexer and the prologues say nothing about a problem that breaks every declared rule."""
    assert npu_backend._indexer_api_supports(Problem(heads=16, dim=64, k=0, ratio=4, format="bf16"), NPU) == []
    for store in (True, False):
        assert npu_backend._prologue_supports(store)(Problem(dim=64, format="int8", interleaved=True), NPU) == []
    for impl_id in (RAGGED, FP8_PAGES, K_STORE, Q_PROLOGUE):
        impl = next(i for op in simulated.ops() for i in simulated.implementations(op) if i.impl_id == impl_id)
        assert impl.capabilities is not None and impl.supports is not None, impl_id
