"""Issue 34 (round 2), items 4, 8, 9, 10, 12, 13: config fields, construction and sizes are refused by name before
anything is allocated; and a property test over random `IndexerConfig` values: each is refused naming a field, or
an indexer built from it computes the top-k of an independent float64 oracle (`config_oracle`).

Errors are matched by the argument or field they must name (as a whole word), as in test_bad_input.py.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re

import pytest
import torch

import config_oracle
from dsa_indexer import (CompressorState, DecodeBatch, IndexerConfig, IndexerInputError, IndexKCache, Indexer,
                         PrefillBatch, ops)
from dsa_indexer.contract.cache import MAX_PAGES, PAGE_BYTES
from dsa_indexer.indexer import CHECKPOINT_PREFIX
from dsa_indexer.rope import YarnScaling, cos_sin_table

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


def host_ram() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


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


# --- item 8: the activation dtype is the indexer's -----------------------------------------------------------------
def _decode_step(indexer: Indexer, dtype: torch.dtype, seed: int = 3):
    cfg = indexer.config
    batch = DecodeBatch.build([5, 70], [[0, -1], [1, 2]], num_cache_pages=4)
    g = gen(seed)
    x = torch.randn(2, cfg.hidden_size, generator=g).to(dtype)
    q_lora = torch.randn(2, cfg.q_lora_rank, generator=g).to(dtype)
    cache = IndexKCache.allocate(4)
    cache.data.copy_(torch.randint(0, 256, cache.data.shape, generator=g, dtype=torch.uint8))
    return x, q_lora, batch, cache


def test_float16_activations_into_a_bfloat16_indexer_are_refused_naming_x():
    """Before: check_inputs let them through and torch's GEMM failed with 'Half != BFloat16'."""
    indexer = Indexer(TINY).init_random(0)
    x, q_lora, batch, cache = _decode_step(indexer, torch.float16)
    before = cache.data.clone()
    message = refused(lambda: indexer(x, q_lora, batch.positions, batch, cache), "x")
    assert "bfloat16" in message and "float16" in message
    refused(lambda: indexer.store_keys(x, batch, cache), "x")
    assert torch.equal(cache.data, before), "a refused call wrote into the cache"


def test_a_float16_indexer_takes_float16_activations():
    indexer = Indexer(TINY, dtype=torch.float16).init_random(0)
    x, q_lora, batch, cache = _decode_step(indexer, torch.float16)
    assert indexer(x, q_lora, batch.positions, batch, cache).shape == (2, TINY.topk)
    refused(lambda: indexer(x.to(BF16), q_lora.to(BF16), batch.positions, batch, cache), "x")


# --- item 9: a device this torch cannot use ------------------------------------------------------------------------
def test_a_cuda_device_on_a_torch_without_cuda_is_refused_like_the_cli_does(monkeypatch):
    """Before: torch's AssertionError 'Torch not compiled with CUDA enabled' from inside a Linear."""
    from dsa_indexer.runner import _device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    message = refused(lambda: Indexer(TINY, device="cuda"), "device")
    assert "sees no CUDA/ROCm GPU" in message
    with pytest.raises(ValueError) as cli:
        _device("cuda")
    assert message.split(": ", 1)[1].split(";")[0] in str(cli.value)  # one reason, the CLI's words
    refused(lambda: IndexKCache.allocate(4, device="cuda"), "device")
    refused(lambda: CompressorState.allocate(2, IndexerConfig.deepseek_v4_flash(), device="cuda:0"), "device")


def test_a_gpu_index_past_the_visible_ones_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    message = refused(lambda: Indexer(TINY, device="cuda:3"), "device")
    assert "cuda:0 to cuda:0" in message


def test_a_device_name_torch_does_not_know_is_refused_naming_device():
    refused(lambda: Indexer(TINY, device="gpu0"), "device")
    refused(lambda: Indexer(TINY, device=["cpu"]), "device")


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


# --- item 12: sizes that cannot fit ---------------------------------------------------------------------------------
def test_a_cache_past_the_int32_slot_limit_is_refused_before_allocating():
    """Before: torch's allocator message (2**40 pages) or, on meta, a cache whose slots overflow int32."""
    for pages in (2**40, MAX_PAGES + 1):
        message = refused(lambda: IndexKCache.allocate(pages, device="meta"), "num_pages")
        assert "int32" in message and str(MAX_PAGES) in message
    assert IndexKCache.allocate(MAX_PAGES, device="meta").num_pages == MAX_PAGES  # the last page that fits


def test_a_cache_larger_than_host_memory_is_refused_with_the_size():
    ram = host_ram()
    if ram is None:
        pytest.skip("no os.sysconf physical memory on this platform")
    pages = ram // PAGE_BYTES + 1  # one page more than the host's RAM holds (well below MAX_PAGES)
    message = refused(lambda: IndexKCache.allocate(pages), "num_pages")
    assert str(pages * PAGE_BYTES) in message and "RAM" in message and re.search(r"\d+\.\d [KMGTP]iB", message)


def test_a_compressor_state_larger_than_host_memory_is_refused_with_the_size():
    if host_ram() is None or host_ram() > 16384 * 10**9:
        pytest.skip("needs a host with less than 16 TB of RAM")
    message = refused(lambda: CompressorState.allocate(10**9, IndexerConfig.deepseek_v4_flash()), "num_slots")
    assert str((10**9 + 1) * 16384) in message and "TiB" in message


def test_weights_that_cannot_fit_are_refused_before_allocating():
    cfg = dataclasses.replace(TINY, hidden_size=2**40)  # weights_proj alone: 4 heads x 2**40 x 2 bytes = 8 TiB
    message = refused(lambda: Indexer(cfg), "hidden_size")
    assert "TiB" in message
    cfg = dataclasses.replace(TINY, max_position=2**40)  # the RoPE table: 2**40 x 64 fp32, built at the first step
    refused(lambda: Indexer(cfg), "max_position")


def test_a_topk_past_int32_is_refused():
    refused(lambda: IndexerConfig(**{**TINY_FIELDS, "topk": 2**40}), "IndexerConfig.topk")
    logits = torch.randn(3, 100, generator=gen(4))
    ends = torch.tensor([100, 10, 64], dtype=torch.int32)
    refused(lambda: ops.topk_indices(logits, 2**40, ends), "k")
    refused(lambda: ops.topk_indices(logits, 2**31, ends), "k")


def test_run_with_a_context_that_cannot_fit_is_refused_up_front(capsys):
    """Before: minutes of allocation, then torch's 'DefaultCPUAllocator: can't allocate memory'."""
    from dsa_indexer.cli import main

    context = 10_000_000
    ram = host_ram()
    if ram is None or (torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory > 400 << 30) \
            or ram > context * 7168 * 6:
        pytest.skip("this machine could hold a 10M-token V3.2 context")
    assert main(["run", "--context", str(context)]) == 2
    err = capsys.readouterr().err
    assert "--context 10000000" in err and re.search(r"needs \d+\.\d [GT]iB", err) and "smaller --context" in err


# --- item 13: construction arguments ---------------------------------------------------------------------------------
def _checkpoint(layer: int = 3) -> tuple[dict, str]:
    prefix = CHECKPOINT_PREFIX.format(layer=layer)
    g = gen(5)
    state = {prefix + "wq_b.weight": torch.randn(512, 256, generator=g).to(FP8),
             prefix + "wq_b.weight_scale_inv": torch.rand(4, 2, generator=g) + 0.5,
             prefix + "wk.weight": torch.randn(128, 256, generator=g).to(BF16),
             prefix + "k_norm.weight": torch.randn(128, generator=g).to(BF16),
             prefix + "k_norm.bias": torch.randn(128, generator=g).to(BF16),
             prefix + "weights_proj.weight": torch.randn(4, 256, generator=g).to(BF16)}
    return state, prefix


def test_the_checkpoint_fixture_loads():
    state, prefix = _checkpoint()
    assert Indexer(TINY).load_checkpoint(state, prefix).wq_b_is_block_fp8


@pytest.mark.parametrize("call, expected", [
    (lambda: Indexer(dict(TINY_FIELDS)), "config"),
    (lambda: Indexer(TINY).init_random("abc"), "seed"),
    (lambda: Indexer(TINY).init_random(1.5), "seed"),
    (lambda: Indexer(TINY).init_random(True), "seed"),
    (lambda: Indexer(TINY, dtype=torch.int8), "dtype"),
    (lambda: Indexer(TINY, dtype=torch.float32), "dtype"),
    (lambda: Indexer(TINY, dtype="bf16"), "dtype"),
    (lambda: Indexer(TINY, logits_budget_bytes=-1), "logits_budget_bytes"),
    (lambda: Indexer(TINY, logits_budget_bytes=2.5e9), "logits_budget_bytes"),
    (lambda: Indexer(TINY, wq_b_fp8="yes"), "wq_b_fp8"),
], ids=["config-dict", "seed-str", "seed-float", "seed-bool", "dtype-int8", "dtype-float32", "dtype-str",
        "budget-negative", "budget-float", "wq_b_fp8-str"])
def test_construction_arguments_are_checked(call, expected):
    """Before: AttributeError, torch's manual_seed / requires_grad errors, or (float32, a negative budget) an indexer
    that refused every forward."""
    message = refused(call, expected)
    if expected == "dtype":
        assert "bfloat16" in message and "float16" in message


def test_a_budget_set_later_is_checked_too():
    indexer = Indexer(TINY)
    with pytest.raises(ERRORS, match="logits_budget_bytes"):
        indexer.logits_budget_bytes = -1
    indexer.logits_budget_bytes = 0  # allowed: one row per chunk
    assert indexer.logits_budget_bytes == 0


@pytest.mark.parametrize("change", ["meta", "str", "none"])
def test_load_checkpoint_refuses_values_that_are_not_real_tensors(change):
    """Before: 'Tensor.item() cannot be called on meta tensors' / AttributeError: 'str' object has no 'dtype'."""
    state, prefix = _checkpoint()
    key = prefix + "wk.weight"
    state[key] = {"meta": lambda: state[key].to("meta"), "str": lambda: "wk.bin", "none": lambda: None}[change]()
    refused(lambda: Indexer(TINY).load_checkpoint(state, prefix), key)


def test_load_checkpoint_refuses_a_state_that_is_not_a_mapping():
    state, prefix = _checkpoint()
    refused(lambda: Indexer(TINY).load_checkpoint(list(state.items()), prefix), "state")


@pytest.mark.parametrize("value", [0.0, -0.5])
def test_block_scales_that_are_not_positive_are_refused_naming_the_key(value):
    """Before: a 0 scale zeroed a block of wq_b, a negative one flipped it, and the indexer scored with it."""
    state, prefix = _checkpoint()
    state[prefix + "wq_b.weight_scale_inv"][1, 0] = value
    message = refused(lambda: Indexer(TINY).load_checkpoint(state, prefix), prefix + "wq_b.weight_scale_inv")
    assert "> 0" in message


@pytest.mark.parametrize("layer", ["3", 3.0, -1, True])
def test_from_safetensors_refuses_a_layer_that_is_not_a_layer_number(tmp_path, layer):
    from safetensors.torch import save_file

    state, _ = _checkpoint(3)
    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    assert Indexer.from_safetensors(path, 3, TINY).wq_b_is_block_fp8
    refused(lambda: Indexer.from_safetensors(path, layer, TINY), "layer")


def _q_prologue_args():
    g = gen(6)
    return dict(q=torch.randn(3, 4, 128, generator=g).to(BF16), positions=torch.tensor([0, 5, 9]),
                cos_sin=cos_sin_table(64, 16), head_weights=torch.randn(3, 4, generator=g).to(BF16),
                weight_scale=0.01)


@pytest.mark.parametrize("op, argument, value", [
    ("q_prologue", "interleaved", "yes"), ("q_prologue", "ue8m0", "no"), ("q_prologue", "interleaved", 1),
    ("q_prologue", "rope_offset", 1.5), ("q_prologue_fp4", "interleaved", "yes"),
    ("q_prologue_plain", "interleaved", "yes"), ("quant_fp8_groups", "ue8m0", "false"),
    ("k_prologue_store", "interleaved", "yes"), ("k_prologue_store", "ue8m0", "no"),
])
def test_op_switches_take_bools(op, argument, value):
    """Before: "yes" / "no" are truthy: the switch turned on silently."""
    a = _q_prologue_args()
    if op == "q_prologue":
        def call():
            return ops.q_prologue(**a, **{argument: value})
    elif op == "q_prologue_fp4":
        def call():
            return ops.q_prologue_fp4(**a, **{argument: value})
    elif op == "q_prologue_plain":
        def call():
            return ops.q_prologue_plain(**a, key_format="bf16", **{argument: value})
    elif op == "quant_fp8_groups":
        def call():
            return ops.quant_fp8_groups(a["q"].reshape(12, 128), **{argument: value})
    else:
        cache = IndexKCache.allocate(1)

        def call():
            return ops.k_prologue_store(a["q"][:, 0], torch.ones(128, dtype=BF16), torch.zeros(128, dtype=BF16), 1e-6,
                                        a["positions"], a["cos_sin"], cache.data, torch.tensor([0, 1, 2]),
                                        **{argument: value})
    refused(call, argument)


# --- the property: every config is refused by name, or equals the float64 oracle -----------------------------------
# Each field: values that must be accepted, values that must be refused naming the field.
VALID = {
    "hidden_size": [128, 256, 384], "q_lora_rank": [128, 256, 512], "n_heads": [1, 3, 4, 8],
    "rope_dim": [2, 32, 64, 96, 128], "topk": [1, 7, 16, 40], "rope_position": ["first", "last"],
    "rope_interleaved": [True, False], "rope_theta": [10000.0, 160000.0, 1.5, 50],
    "yarn": [None, YarnScaling(factor=4.0, original_max_position=128), YarnScaling(),
             YarnScaling(factor=16.0, original_max_position=0)],
    "max_position": [256, 512, 4096], "ue8m0": [True, False], "k_norm": ["layernorm", "rmsnorm", "none"],
    "norm_eps": [1e-6, 1e-3, 0.5], "scale_fmt": ["fp32", "ue8m0"], "wk_gemm": ["bf16", "fp8"],
    "weights_proj_dtype": ["bf16", "fp32"], "fp4_block": [16, 32, 64, 128], "name": ["other"],
    "checkpoint_prefix": ["blk.{layer}.idx."],
}
INVALID = {
    "name": [3, None], "hidden_size": [0, -128, 200, 256.0, True, "256"], "q_lora_rank": [0, 64, 384.5],
    "n_heads": [0, -4, 4.0, False], "head_dim": [64, 256, 0], "rope_dim": [0, 63, 130, 256, 64.0],
    "topk": [0, -16, 2**40, 16.0], "rope_position": ["First", "middle", "", None, 0],
    "rope_interleaved": ["yes", 1, None],
    "rope_theta": [0.0, -10000.0, 1.0, 0.5, float("nan"), float("inf"), "10000", True],
    "yarn": [YarnScaling(factor=0.0), YarnScaling(factor=-4.0), YarnScaling(factor=float("nan")),
             YarnScaling(beta_fast=0.0), YarnScaling(beta_slow=-1.0), YarnScaling(original_max_position=4096.0),
             {"factor": 4.0}],
    "max_position": [0, -1, 512.0], "ue8m0": ["no", 0, None],
    "k_norm": ["LayerNorm", "layer_norm", "RMSNorm", "batchnorm", "", None],
    "norm_eps": [0.0, -1e-6, float("nan"), "1e-6", None], "compress_ratio": [2, 0, True, 4.0],
    "fp8_block": [64, 0, 256], "checkpoint_prefix": [3, "layers.{lyr}.indexer.", "layers.{}.indexer."],
    "scale_fmt": ["UE8M0", "e8m0", None], "wk_gemm": ["FP8", "int8"], "weights_proj_dtype": ["float32", "fp16"],
    "key_quant": ["FP8", "fp4", "fp8_ue8m0"], "fp4_block": [48, 0, True],
}


def _sample(rng: random.Random, invalid_field: str | None) -> tuple[dict, bool, set[str]]:
    """(fields, wq_b_fp8, fields any of which a refusal may name; empty: the config is valid): random valid values,
    ``invalid_field`` (if any) set to one of its invalid values."""
    fields = dict(name="prop", hidden_size=256, q_lora_rank=256, n_heads=4, topk=16, max_position=512, yarn=None)
    for field, values in VALID.items():
        if rng.random() < 0.4:
            fields[field] = rng.choice(values)
    if rng.random() < 0.3:  # a C4 indexer: its keys come from the compressor (no wk, no key norm)
        fields.update(compress_ratio=4, topk=rng.choice([1, 4, 7]))
        if rng.random() < 0.8:
            fields.update(k_norm="none", wk_gemm="bf16")
    elif rng.random() < 0.1:
        fields["key_quant"] = "fp4_e2m1"  # V4's FP4 recipe on a V3.2 indexer: refused
    wrong: set[str] = set()
    if invalid_field is not None:
        fields[invalid_field] = rng.choice(INVALID[invalid_field])
        wrong.add(invalid_field)
    ratio = fields.get("compress_ratio", 1)
    if ratio == 4 and fields.get("k_norm", "layernorm") != "none":
        wrong |= {"k_norm", "compress_ratio"}
    if ratio == 4 and fields.get("wk_gemm") == "fp8":
        wrong |= {"wk_gemm", "compress_ratio"}
    if fields.get("key_quant") == "fp4_e2m1" and ratio != 4:
        wrong |= {"key_quant", "compress_ratio"}
    return fields, rng.random() < 0.5, wrong


_RNG = random.Random(34)
# Every other sample gets one invalid field, each field of INVALID once; the valid ones vary the rest at random.
SAMPLES = [_sample(_RNG, invalid) for field in sorted(INVALID) for invalid in (None, field)]
# The oracle's float64 arithmetic (the library's is fp32) may round one bf16 or fp8 element to the neighbouring value
# now and then; one fp8 step of one element moves a logit by about 2**-3 of one q.k term, under 2**-6 of the row's
# largest logit. A top-k is accepted when nothing it left out beats what it took by more than that (measured over
# these samples: 0, every set equal). Deliberate errors miss by far more (test below: 0.05 to 1.9 of the row's
# largest logit).
TOLERANCE = 2.0 ** -6
LENGTHS = (97, 66)  # two requests: a one-pass prefill of all but their last token, then one decode step


def _run(cfg: IndexerConfig, wq_b_fp8: bool, seed: int):
    indexer = Indexer(cfg, wq_b_fp8=wq_b_fp8).init_random(seed)
    g = gen(seed + 1)
    xs = [torch.randn(n, cfg.hidden_size, generator=g).to(BF16) for n in LENGTHS]
    qs = [torch.randn(n, cfg.q_lora_rank, generator=g).to(BF16) for n in LENGTHS]
    table = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32)  # shuffled pages: a kernel ignoring them fails
    cache = IndexKCache.allocate(4)
    c4 = cfg.compress_ratio == 4
    state = CompressorState.allocate(2, cfg) if c4 else None
    extra = dict(compress_ratio=4, state_slots=[0, 1]) if c4 else {}
    pb = PrefillBatch.build([0, 0], [n - 1 for n in LENGTHS], table, num_cache_pages=4, **extra)
    prefill = indexer(torch.cat([x[:-1] for x in xs]), torch.cat([q[:-1] for q in qs]), pb.positions, pb, cache,
                      compressor_state=state)
    db = DecodeBatch.build(list(LENGTHS), table, num_cache_pages=4, **extra)
    decode = indexer(torch.stack([x[-1] for x in xs]), torch.stack([q[-1] for q in qs]), db.positions, db, cache,
                     compressor_state=state)
    rows, start = [], 0
    for n, last in zip(LENGTHS, decode.tolist()):
        rows.append(prefill[start:start + n - 1].tolist() + [last])
        start += n - 1
    return indexer, xs, qs, rows


def _worst_slack(indexer: Indexer, cfg: IndexerConfig, xs, qs, rows) -> float:
    """The largest relative top-k slack of any row against the oracle run with ``cfg``."""
    saved = indexer.config
    indexer.config = cfg  # the oracle reads the recipe from the config, the weights from the indexer
    try:
        worst = 0.0
        for x, q, request_rows in zip(xs, qs, rows):
            logits = config_oracle.request_logits(indexer, x, q)
            for position, row in enumerate(request_rows):
                visible = config_oracle.visible_keys(cfg, position)
                slack = config_oracle.topk_slack(row, logits[position], visible, cfg.topk)
                scale = float(logits[position, :visible].abs().max()) if visible else 0.0
                worst = max(worst, slack / scale if scale > 0 else slack)
        return worst
    finally:
        indexer.config = saved


def _id(sample) -> str:
    fields, wq_b_fp8, wrong = sample
    return ("refused-" + "-".join(sorted(wrong))) if wrong else f"valid-c{fields.get('compress_ratio', 1)}"


@pytest.mark.parametrize("index", range(len(SAMPLES)), ids=[f"{i}-{_id(s)}" for i, s in enumerate(SAMPLES)])
def test_a_random_config_is_refused_by_name_or_equals_the_float64_oracle(index):
    fields, wq_b_fp8, wrong = SAMPLES[index]
    if wrong:
        with pytest.raises((ValueError, TypeError)) as info:
            IndexerConfig(**fields)
        assert names(str(info.value), *wrong, *(f"IndexerConfig.{f}" for f in wrong)), (
            f"refusal names none of {sorted(wrong)}: {info.value}")
        return
    cfg = IndexerConfig(**fields)
    indexer, xs, qs, rows = _run(cfg, wq_b_fp8, seed=index)
    worst = _worst_slack(indexer, cfg, xs, qs, rows)
    assert worst <= TOLERANCE, f"a top-k set differs from the oracle's by {worst:.3g} of the row's largest logit"


def test_the_samples_cover_both_outcomes_and_both_indexer_kinds():
    valid = [s for s in SAMPLES if not s[2]]
    assert len(valid) >= 12 and len(SAMPLES) - len(valid) >= 12
    assert {s[0].get("compress_ratio", 1) for s in valid} == {1, 4}
    assert {f for s in SAMPLES for f in s[2]} >= set(INVALID)


@pytest.mark.parametrize("mutation", [dict(k_norm="none"), dict(rope_theta=15000.0), dict(rope_interleaved=True),
                                      dict(rope_position="last"), dict(ue8m0=False)],
                         ids=["k_norm", "rope_theta", "rope_interleaved", "rope_position", "ue8m0"])
def test_the_oracle_comparison_fails_on_a_result_computed_under_another_config(mutation):
    """The check can fail: the library's top-k under the tiny config, compared with the oracle of a config that
    differs in one field (k_norm "none" is what an unknown k_norm used to compute)."""
    cfg = IndexerConfig(name="prop", hidden_size=256, q_lora_rank=256, n_heads=4, topk=16, max_position=512,
                        yarn=None)
    indexer, xs, qs, rows = _run(cfg, True, seed=7)
    assert _worst_slack(indexer, cfg, xs, qs, rows) <= TOLERANCE
    assert _worst_slack(indexer, dataclasses.replace(cfg, **mutation), xs, qs, rows) > 2 * TOLERANCE
