"""Issue 34 (round 2), items 4 and 10: config fields are refused by name when the config is built.

Errors are matched by the argument or field they must name (as a whole word), as in test_bad_input.py.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from dsa_indexer import IndexerConfig, IndexerInputError, IndexKCache, Indexer, PrefillBatch
from dsa_indexer.rope import YarnScaling

BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn
ERRORS = (IndexerInputError, TypeError, ValueError)
TINY_FIELDS = dict(name="tiny", hidden_size=256, q_lora_rank=256, n_heads=4, topk=16, max_position=1024, yarn=None)
TINY = IndexerConfig(**TINY_FIELDS)


def names(message: str, *candidates: str) -> bool:
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", message) for n in candidates)


def refused(call, *candidates: str, errors=ERRORS) -> str:
    with pytest.raises(errors) as info:
        call()
    message = str(info.value)
    assert names(message, *candidates), f"{type(info.value).__name__} names none of {candidates}: {message!r}"
    return message


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- item 4: string-valued fields take their listed values only --------------------------------------------------
@pytest.mark.parametrize("field, value, accepted", [
    ("k_norm", "LayerNorm", ("layernorm", "rmsnorm", "none")),
    ("k_norm", "layer_norm", ("layernorm", "rmsnorm", "none")),
    ("k_norm", "RMSNorm", ("layernorm", "rmsnorm", "none")),
    ("k_norm", "", ("layernorm", "rmsnorm", "none")),
    ("k_norm", None, ("layernorm", "rmsnorm", "none")),
    ("rope_position", "First", ("first", "last")),
    ("rope_position", "middle", ("first", "last")),
    ("scale_fmt", "UE8M0", ("fp32", "ue8m0")),
    ("wk_gemm", "FP8", ("bf16", "fp8")),
    ("weights_proj_dtype", "float32", ("bf16", "fp32")),
    ("key_quant", "fp4", ("fp8", "fp4_e2m1")),
])
def test_string_fields_refuse_unknown_values_listing_the_accepted_ones(field, value, accepted):
    """Before: k_norm="LayerNorm" was accepted and the reference key prologue applied no norm at all."""
    message = refused(lambda: IndexerConfig(**{**TINY_FIELDS, field: value}), f"IndexerConfig.{field}")
    assert all(repr(a) in message for a in accepted), message


def test_a_case_slip_gets_the_accepted_spelling_as_a_hint():
    message = refused(lambda: IndexerConfig(**TINY_FIELDS, k_norm="LayerNorm"), "IndexerConfig.k_norm")
    assert "did you mean 'layernorm'" in message


@pytest.mark.parametrize("field, value", [("name", 3), ("checkpoint_prefix", 7),
                                          ("checkpoint_prefix", "layers.{lyr}.indexer."),
                                          ("checkpoint_prefix", "layers.{}.indexer.")])
def test_free_text_fields_must_be_strings_that_format(field, value):
    refused(lambda: IndexerConfig(**{**TINY_FIELDS, field: value}), f"IndexerConfig.{field}")


def test_a_c4_config_with_a_key_norm_is_refused():
    """A C4 indexer's keys are normed by its compressor; a k_norm there would be ignored without a word."""
    refused(lambda: dataclasses.replace(IndexerConfig.deepseek_v4_flash(), k_norm="layernorm"),
            "IndexerConfig.k_norm")


@pytest.mark.parametrize("k_norm", ["layernorm", "rmsnorm", "none"])
def test_every_listed_k_norm_builds_and_runs(k_norm):
    indexer = Indexer(dataclasses.replace(TINY, k_norm=k_norm)).init_random(1)
    batch = PrefillBatch.build([0], [40], [[0]], num_cache_pages=1)
    g = gen(2)
    out = indexer(torch.randn(40, 256, generator=g).to(BF16), torch.randn(40, 256, generator=g).to(BF16),
                  batch.positions, batch, IndexKCache.allocate(1))
    assert out.shape == (40, TINY.topk)


# --- item 10: RoPE and YaRN numbers -----------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("rope_dim", 63), ("rope_dim", 130), ("rope_dim", 256), ("rope_dim", 0), ("rope_dim", 64.0),
    ("rope_theta", 0.0), ("rope_theta", -10000.0), ("rope_theta", 1.0), ("rope_theta", float("nan")),
    ("rope_theta", float("inf")), ("rope_theta", "10000"),
])
def test_rope_fields_are_checked_at_construction(field, value):
    """Before: an odd or too wide rope_dim failed at the first forward; rope_theta <= 0 gave NaN tables or a bare
    'math domain error'."""
    refused(lambda: IndexerConfig(**{**TINY_FIELDS, field: value}), f"IndexerConfig.{field}")


@pytest.mark.parametrize("yarn, field", [
    (YarnScaling(factor=0.0), "factor"), (YarnScaling(factor=-4.0), "factor"),
    (YarnScaling(factor=float("nan")), "factor"), (YarnScaling(beta_fast=0.0), "beta_fast"),
    (YarnScaling(beta_slow=-1.0), "beta_slow"), (YarnScaling(original_max_position=4096.5), "original_max_position"),
    ({"factor": 40.0}, "yarn"),
])
def test_yarn_numbers_are_checked_at_construction(yarn, field):
    refused(lambda: IndexerConfig(**{**TINY_FIELDS, "yarn": yarn}),
            f"IndexerConfig.yarn.{field}" if field != "yarn" else "IndexerConfig.yarn")


def _hf_v32(**changes) -> dict:
    config = {"model_type": "deepseek_v32", "hidden_size": 7168, "q_lora_rank": 1536, "index_n_heads": 64,
              "index_head_dim": 128, "index_topk": 2048, "qk_rope_head_dim": 64, "max_position_embeddings": 163840,
              "rope_theta": 10000,
              "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}
    for key, value in changes.items():
        if key.startswith("rope_scaling."):
            sub = key.split(".", 1)[1]
            if value is None:
                del config["rope_scaling"][sub]
            else:
                config["rope_scaling"][sub] = value
        else:
            config[key] = value
    return config


def test_the_hf_fixture_is_valid():
    assert IndexerConfig.from_hf_config(_hf_v32()).rope_dim == 64


@pytest.mark.parametrize("changes, expected", [
    (dict(qk_rope_head_dim=63), ("rope_dim", "qk_rope_head_dim")),
    (dict(qk_rope_head_dim=192), ("rope_dim", "qk_rope_head_dim")),
    (dict(rope_theta=0), ("rope_theta",)),
    (dict(rope_theta=-5.0), ("rope_theta",)),
    ({"rope_scaling.factor": None}, ("factor",)),
    ({"rope_scaling.original_max_position_embeddings": None}, ("original_max_position_embeddings",)),
    ({"rope_scaling.factor": "forty"}, ("factor",)),
])
def test_a_config_json_with_bad_rope_numbers_is_refused_naming_them(changes, expected, tmp_path):
    """Before: a YaRN section without 'factor' raised a bare KeyError('factor'); the others built a config."""
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(_hf_v32(**changes)))
    refused(lambda: IndexerConfig.from_hf_config(path), *expected, errors=(ValueError, TypeError))


