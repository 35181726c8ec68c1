"""Issue 34 item 14: every DSA_INDEXER_* variable is checked when the library first reads its environment, on any
device; DSA_INDEXER_FORCE entries are checked whole, not only for the op being resolved."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from dsa_indexer import ops
from dsa_indexer.dispatch import Environment, Problem, Registry, Target, load_plugins, plugins
from dsa_indexer.dispatch.registry import parse_force
from dsa_indexer import envflags
from dsa_indexer.envflags import EnvironmentFlagError


@pytest.mark.parametrize("name, value, words", [
    ("DSA_INDEXER_CHECK_RANGES", "maybe", "is not a boolean: use one of 1, true, yes, on"),
    ("DSA_INDEXER_DUAL_STREAM_GEMM_SMS", "lots", "is not an SM limit: use a positive SM count"),
    ("DSA_INDEXER_DUAL_STREAM_GEMM_SMS", "-2", "is not an SM limit"),
    ("DSA_INDEXER_DUAL_STREAM_MAX_TOKENS", "0", "must be >= 1"),
    ("DSA_INDEXER_FORCE", "topk_indices=a,topk_indices=b", "names op 'topk_indices' twice"),
])
def test_a_bad_value_is_refused_at_the_first_read_on_the_cpu(monkeypatch, name, value, words):
    """On the CPU the range checks always run (CHECK_RANGES is never read there) and the dual-stream knobs are
    NVIDIA's: the value is still checked, when the default registry is built, before any op runs."""
    monkeypatch.setenv(name, value)
    monkeypatch.setattr(plugins, "_default", None)  # a fresh process's first call (restored after the test)
    logits = torch.randn(3, 40)
    with pytest.raises(EnvironmentFlagError, match=f"{name}.*{re.escape(words)}"):
        ops.topk_indices(logits, 4, torch.tensor([40, 9, 25], dtype=torch.int32))


def test_good_values_pass_and_the_gemm_sm_limit_parses_its_words():
    envflags.check_environment({"DSA_INDEXER_CHECK_RANGES": "On", "DSA_INDEXER_DUAL_STREAM_GEMM_SMS": "half",
                       "DSA_INDEXER_DUAL_STREAM_MAX_TOKENS": "512", "DSA_INDEXER_FORCE": "a=x, a=x",
                       "DSA_INDEXER_CACHE_DIR": "/tmp/anything"})
    parsed = [envflags.parse_sm_limit("V", raw) for raw in ("", "off", "0", "half", "66")]
    assert parsed == [None, None, None, "half", 66]


def test_every_bad_value_is_named_at_once():
    with pytest.raises(EnvironmentFlagError) as exc:
        envflags.check_environment({"DSA_INDEXER_STRICT": "ture", "DSA_INDEXER_DUAL_STREAM_GEMM_SMS": "lots"})
    assert "DSA_INDEXER_STRICT='ture'" in str(exc.value) and "DSA_INDEXER_DUAL_STREAM_GEMM_SMS='lots'" in str(exc.value)


def test_a_variable_the_library_does_not_read_warns_once_naming_the_ones_it_reads():
    with pytest.warns(RuntimeWarning, match="DSA_INDEXER_STRICKT_TEST is not read by the library \\(misspelled\\?\\); "
                                            "it reads DSA_INDEXER_STRICT, "):
        envflags.check_environment({"DSA_INDEXER_STRICKT_TEST": "1"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        envflags.check_environment({"DSA_INDEXER_STRICKT_TEST": "1"})  # said once


def test_the_dual_stream_gemm_limit_refuses_a_bad_value_where_it_is_read(monkeypatch):
    from dsa_indexer.backends.cuda import dual_stream

    monkeypatch.setenv(dual_stream.GEMM_SMS_ENV, "lots")
    with pytest.raises(EnvironmentFlagError, match="DSA_INDEXER_DUAL_STREAM_GEMM_SMS='lots'"):
        dual_stream._gemm_sm_limit()
    monkeypatch.setenv(dual_stream.GEMM_SMS_ENV, "off")
    assert dual_stream._gemm_sm_limit() is None


def test_force_naming_an_op_twice_is_an_error_not_a_dropped_entry():
    with pytest.raises(ValueError, match="DSA_INDEXER_FORCE names op 'topk_indices' twice "
                                         "\\('topk_indices.reference.torch' and 'topk_indices.triton.topk'\\)"):
        parse_force("topk_indices=topk_indices.reference.torch, topk_indices=topk_indices.triton.topk")
    assert parse_force("topk_indices=topk_indices.reference.torch,topk_indices=topk_indices.reference.torch") == {
        "topk_indices": "topk_indices.reference.torch"}


def test_a_forced_entry_for_an_op_not_reached_is_said_at_the_first_resolution(monkeypatch):
    reg = Registry(environment=Environment.simulated())
    load_plugins(reg, entry_points=False)
    monkeypatch.setenv("DSA_INDEXER_FORCE", "q_prologue_plain=q_prologue_plain.npu.torchnpu")
    with pytest.warns(RuntimeWarning, match="DSA_INDEXER_FORCE names 'q_prologue_plain.npu.torchnpu' for "
                                            "'q_prologue_plain', which is not registered; registered: "
                                            "q_prologue_plain.npu.torch_npu, q_prologue_plain.reference.torch"):
        res = reg.resolve("topk_indices", Target("cpu", "cpu"), Problem(k=4))
    assert res.chosen.impl_id == "topk_indices.reference.torch"  # the other ops still resolve
    with pytest.raises(ValueError, match="DSA_INDEXER_FORCE names 'q_prologue_plain.npu.torchnpu'"):
        reg.check_forced()
