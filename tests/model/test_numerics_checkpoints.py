"""Configs and checkpoints as the models publish them: IndexerConfig.from_hf_config (V3.2 / V4 config.json, the RoPE
mscale question), from_safetensors under the `model.` prefix and transformers' V4 module names, and a round trip
with files written by transformers' save_pretrained of tiny random models (skipped without transformers)."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dsa_indexer import IndexerConfig, Indexer
from dsa_indexer.rope import YarnScaling

V32_JSON = {  # the indexer-relevant fields of DeepSeek-V3.2's config.json (HF format)
    "model_type": "deepseek_v32", "hidden_size": 7168, "q_lora_rank": 1536, "index_n_heads": 64,
    "index_head_dim": 128, "index_topk": 2048, "qk_rope_head_dim": 64, "max_position_embeddings": 163840,
    "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                          "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
}
# DeepSeek-V4-Flash's config.json, every key (tests/data/deepseek_v4_flash_config.json names its source and revision).
V4_FLASH_JSON = json.loads((Path(__file__).parents[1] / "data" / "deepseek_v4_flash_config.json").read_text())["config"]


def test_v32_config_json_gives_the_model_recipe(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(V32_JSON))
    cfg = IndexerConfig.from_hf_config(tmp_path)
    assert cfg == IndexerConfig.deepseek_v32(scale_fmt="ue8m0", wk_gemm="fp8")
    assert cfg.ue8m0 and cfg.weights_proj_dtype == "fp32" and cfg.yarn.factor == 40


def test_the_deepseek_recipe_presets_set_every_field_of_the_models_numerics():
    """``recipe="deepseek"`` names DeepSeek's own numerics in one argument (the values below are read from DeepSeek's
    inference code and config.json files, docs/ops.md); the serving defaults stay as they were."""
    v32 = IndexerConfig.deepseek_v32(recipe="deepseek")
    assert v32.recipe() == {"scale_fmt": "ue8m0", "index_ue8m0": True, "wk_gemm": "fp8", "weights_proj_dtype": "fp32",
                            "key_quant": "fp8", "fp4_block": 32}
    assert v32 == dataclasses.replace(IndexerConfig.deepseek_v32(), scale_fmt="ue8m0", wk_gemm="fp8")  # nothing else
    v4 = IndexerConfig.deepseek_v4_flash(recipe="deepseek")
    assert v4.recipe() == {"scale_fmt": "ue8m0", "index_ue8m0": True, "wk_gemm": "bf16", "weights_proj_dtype": "bf16",
                           "key_quant": "fp4_e2m1", "fp4_block": 32}
    assert v4 == dataclasses.replace(IndexerConfig.deepseek_v4_flash(), scale_fmt="ue8m0", key_quant="fp4_e2m1")
    # The defaults are unchanged: plain fp32 GEMM-input scales, V3.2's wk dequantized, V4's fp8 keys (vLLM's).
    assert IndexerConfig.deepseek_v32().recipe() == {"scale_fmt": "fp32", "index_ue8m0": True, "wk_gemm": "bf16",
                                                     "weights_proj_dtype": "fp32", "key_quant": "fp8", "fp4_block": 32}
    assert IndexerConfig.deepseek_v4_flash().recipe() == {"scale_fmt": "fp32", "index_ue8m0": True, "wk_gemm": "bf16",
                                                          "weights_proj_dtype": "bf16", "key_quant": "fp8",
                                                          "fp4_block": 32}
    assert IndexerConfig.deepseek_v32(recipe="serving") == IndexerConfig.deepseek_v32()
    assert IndexerConfig.deepseek_v4_flash(recipe="serving") == IndexerConfig.deepseek_v4_flash()
    # The official config.json files give the model's recipe.
    assert IndexerConfig.from_hf_config(V32_JSON) == v32
    assert IndexerConfig.from_hf_config(V4_FLASH_JSON) == v4
    # Fields outside the recipe stay free.
    assert IndexerConfig.deepseek_v32(recipe="deepseek", topk=1024).topk == 1024


def test_a_recipe_with_a_contradicting_field_is_refused_by_name():
    with pytest.raises(ValueError, match=r"recipe='deepseek' sets scale_fmt='ue8m0'.*got scale_fmt='fp32'"):
        IndexerConfig.deepseek_v4_flash(recipe="deepseek", scale_fmt="fp32")
    with pytest.raises(ValueError, match=r"recipe='deepseek' sets wk_gemm='fp8'.*got wk_gemm='bf16'"):
        IndexerConfig.deepseek_v32(recipe="deepseek", wk_gemm="bf16")
    with pytest.raises(ValueError, match=r"recipe='deepseek' sets key_quant='fp4_e2m1'.*got key_quant='fp8_fp32'"):
        IndexerConfig.deepseek_v4_flash("fp8_fp32", recipe="deepseek")
    with pytest.raises(ValueError, match=r"recipe must be 'serving' or 'deepseek', got 'DeepSeek'"):
        IndexerConfig.deepseek_v32(recipe="DeepSeek")
    assert IndexerConfig.deepseek_v4_flash("fp4_e2m1", recipe="deepseek", scale_fmt="ue8m0") == \
        IndexerConfig.deepseek_v4_flash(recipe="deepseek")  # the same values, said twice


def test_a_yarn_config_without_mscale_is_refused_or_corrected_explicitly():
    data = json.loads(json.dumps(V32_JSON))
    del data["rope_scaling"]["mscale"], data["rope_scaling"]["mscale_all_dim"]
    with pytest.raises(ValueError, match=r"scale the indexer's RoPE cos/sin by 1\.369.*allow_missing_mscale=True"):
        IndexerConfig.from_hf_config(data)
    with pytest.warns(UserWarning, match="unscaled table"):
        cfg = IndexerConfig.from_hf_config(data, allow_missing_mscale=True)
    assert cfg.yarn == IndexerConfig.deepseek_v32().yarn
    data["rope_scaling"].update(mscale=1.0, mscale_all_dim=0.707)
    with pytest.raises(ValueError, match="scales the RoPE amplitude"):
        IndexerConfig.from_hf_config(data)


def test_from_hf_config_rejects_other_models():
    with pytest.raises(ValueError, match="model_type is 'llama'"):
        IndexerConfig.from_hf_config({"model_type": "llama"})


def _v4_tensors(cfg, gen):
    h, d, hidden, q = cfg.n_heads, cfg.head_dim, cfg.hidden_size, cfg.q_lora_rank
    return {"wq_b.weight": torch.randn(h * d, q, generator=gen).to(torch.bfloat16) * 0.05,
            "weights_proj.weight": torch.randn(h, hidden, generator=gen).to(torch.bfloat16) * 0.05,
            "compressor.wkv.weight": torch.randn(2 * d, hidden, generator=gen).to(torch.bfloat16) * 0.05,
            "compressor.wgate.weight": torch.randn(2 * d, hidden, generator=gen).to(torch.bfloat16) * 0.05,
            "compressor.ape": torch.randn(4, 2 * d, generator=gen), "compressor.norm.weight": torch.rand(d) + 0.5}


V4_TINY = dataclasses.replace(IndexerConfig.deepseek_v4_flash(), hidden_size=256, q_lora_rank=256, n_heads=4, topk=8,
                              max_position=4096)
HF_NAMES = {"wq_b.weight": "q_b_proj.weight", "weights_proj.weight": "scorer.weights_proj.weight",
            "compressor.wkv.weight": "kv_proj.weight", "compressor.wgate.weight": "gate_proj.weight",
            "compressor.ape": "position_bias", "compressor.norm.weight": "kv_norm.weight"}


@pytest.mark.parametrize("scheme", ["model.layers.3.attn.indexer.", "hf"])
def test_v4_loads_under_the_model_prefix_and_transformers_names(tmp_path, scheme):
    tensors = _v4_tensors(V4_TINY, torch.Generator().manual_seed(int(torch.randint(0, 10_000, ()))))
    if scheme == "hf":
        file = {f"model.layers.3.self_attn.compressor.indexer.{HF_NAMES[k]}": v for k, v in tensors.items()}
    else:
        file = {scheme + k: v for k, v in tensors.items()}
    file["model.layers.3.self_attn.q_b_proj.weight"] = torch.zeros(4, 4)  # attention's own tensors are ignored
    save_file(file, str(tmp_path / "m.safetensors"))
    indexer = Indexer.from_safetensors(tmp_path / "m.safetensors", layer=3, config=V4_TINY)
    assert torch.equal(indexer.wq_b.weight, tensors["wq_b.weight"])
    assert torch.equal(indexer.compressor.ape, tensors["compressor.ape"])
    assert torch.equal(indexer.compressor.wgate.weight.to(torch.bfloat16), tensors["compressor.wgate.weight"])
    assert torch.equal(indexer.weights_proj.weight, tensors["weights_proj.weight"])


def test_save_pretrained_round_trip_v32(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers (the 'transformers' extra) is not installed")
    config = transformers.DeepseekV32Config(
        vocab_size=64, hidden_size=256, num_hidden_layers=2, num_attention_heads=2, q_lora_rank=256, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, intermediate_size=128, index_n_heads=4, index_head_dim=128, index_topk=8,
        max_position_embeddings=4096, first_k_dense_replace=1)
    torch.manual_seed(int(torch.randint(0, 10_000, ())))
    model = transformers.DeepseekV32ForCausalLM(config)
    model.save_pretrained(tmp_path)
    indexer = Indexer.from_safetensors(tmp_path, layer=1)  # config.json beside the file is read
    hf = model.model.layers[1].self_attn.indexer
    assert (indexer.config.hidden_size, indexer.config.n_heads, indexer.config.topk) == (256, 4, 8)
    assert not indexer.wq_b_is_block_fp8 and indexer.config.scale_fmt == "fp32"  # a bf16 file: no fp8 recipe
    for ours, theirs in ((indexer.wq_b.weight, hf.wq_b.weight), (indexer.wk.weight, hf.wk.weight),
                         (indexer.k_norm.bias, hf.k_norm.bias), (indexer.weights_proj.weight, hf.weights_proj.weight)):
        assert torch.equal(ours, theirs.detach().to(ours.dtype))  # the file holds fp32; bf16 modules round it


def test_save_pretrained_round_trip_v4(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers (the 'transformers' extra) is not installed")
    config = transformers.DeepseekV4Config(
        vocab_size=64, hidden_size=256, num_hidden_layers=3, num_attention_heads=2, q_lora_rank=256, o_lora_rank=64,
        o_groups=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, index_n_heads=4,
        index_head_dim=128, index_topk=8, max_position_embeddings=4096,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"])
    torch.manual_seed(int(torch.randint(0, 10_000, ())))
    model = transformers.DeepseekV4ForCausalLM(config)
    model.save_pretrained(tmp_path)
    indexer = Indexer.from_safetensors(tmp_path, layer=1)
    hf = model.model.layers[1].self_attn.compressor.indexer
    assert indexer.config.key_quant == "fp4_e2m1" and indexer.config.compress_ratio == 4
    assert indexer.config.rope_theta == 160000.0 and indexer.config.yarn is None  # the file's "default" rope
    for ours, theirs in ((indexer.wq_b.weight, hf.q_b_proj.weight), (indexer.compressor.wkv.weight, hf.kv_proj.weight),
                         (indexer.compressor.ape, hf.position_bias), (indexer.compressor.norm.weight, hf.kv_norm.weight),
                         (indexer.weights_proj.weight, hf.scorer.weights_proj.weight)):
        assert torch.equal(ours, theirs.detach().to(ours.dtype))  # the file holds fp32; bf16 modules round it


def _v4_checkpoint_layer(cfg, layer: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One C4 indexer as DeepSeek's V4 checkpoint stores it: e4m3 wq_b with a UE8M0 scale per 128 x 128, bf16
    weights_proj and compressor projections, fp32 ape (names and dtypes of model.safetensors.index.json)."""
    p, hd, d = f"layers.{layer}.attn.indexer.", cfg.n_heads * cfg.head_dim, cfg.head_dim
    exponents = torch.randint(118, 124, (hd // 128, cfg.q_lora_rank // 128), generator=gen, dtype=torch.int32)
    return {p + "wq_b.weight": (torch.randn(hd, cfg.q_lora_rank, generator=gen) * 0.05).to(torch.float8_e4m3fn),
            p + "wq_b.scale": exponents.to(torch.uint8).view(torch.float8_e8m0fnu),
            p + "weights_proj.weight": (torch.randn(cfg.n_heads, cfg.hidden_size, generator=gen) * 0.02)
            .to(torch.bfloat16),
            p + "compressor.wkv.weight": (torch.randn(2 * d, cfg.hidden_size, generator=gen) * 0.02).to(torch.bfloat16),
            p + "compressor.wgate.weight": (torch.randn(2 * d, cfg.hidden_size, generator=gen) * 0.02)
            .to(torch.bfloat16),
            p + "compressor.ape": torch.randn(4, 2 * d, generator=gen),
            p + "compressor.norm.weight": (1 + 0.1 * torch.randn(d, generator=gen)).to(torch.bfloat16)}


def _fresh_gen() -> torch.Generator:
    return torch.Generator().manual_seed(int(torch.randint(0, 10_000, ())))


def test_the_official_v4_flash_config_json_loads_with_the_model_recipe(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(V4_FLASH_JSON))
    cfg = IndexerConfig.from_hf_config(tmp_path)
    # The file's own values (config.json: compress_rope_theta, rope_scaling, max_position_embeddings, index_*) ...
    assert (cfg.hidden_size, cfg.q_lora_rank, cfg.n_heads, cfg.head_dim, cfg.topk) == (4096, 1024, 64, 128, 512)
    assert cfg.rope_theta == 160000.0 and cfg.max_position == 1048576 and cfg.compress_ratio == 4
    assert cfg.yarn == YarnScaling(factor=16.0, original_max_position=65536, beta_fast=32.0, beta_slow=1.0)
    # ... and DeepSeek's numerics: FP4 e2m1 per 32 for q and keys, ue8m0 GEMM-input scales (quantization_config).
    assert (cfg.key_quant, cfg.fp4_block, cfg.scale_fmt, cfg.ue8m0) == ("fp4_e2m1", 32, "ue8m0", True)
    assert cfg == IndexerConfig.deepseek_v4_flash(recipe="deepseek")


def test_transformers_gives_v4s_compress_rope_attention_factor_one():
    """The fact the V4 rule follows: transformers' DeepseekV4Config sets the compress rope's attention_factor to 1.0
    when the file has none (huggingface/transformers src/transformers/models/deepseek_v4/configuration_deepseek_v4.py
    @015c078164151a049126942989817713e83a8f3e, DeepseekV4Config.__post_init__), so it never applies YaRN's
    0.1 ln(16) + 1 = 1.277 to the indexer's cos / sin; DeepSeek's inference code applies none either."""
    transformers = pytest.importorskip("transformers", reason="transformers (the 'transformers' extra) is not installed")
    hf = transformers.DeepseekV4Config(**V4_FLASH_JSON)
    assert hf.rope_parameters["compress"]["rope_type"] == "yarn"
    assert hf.rope_parameters["compress"]["attention_factor"] == 1.0
    assert IndexerConfig.from_hf_config(hf) == IndexerConfig.from_hf_config(V4_FLASH_JSON)


def test_a_v4_config_whose_rope_is_really_scaled_is_still_refused():
    """Only a missing attention_factor is read as transformers reads it (1.0); a stated one that scales is refused."""
    data = json.loads(json.dumps(V4_FLASH_JSON))
    data["rope_scaling"]["attention_factor"] = 1.277
    with pytest.raises(ValueError, match=r"attention_factor 1.277 scales the RoPE amplitude by 1\.2770"):
        IndexerConfig.from_hf_config(data)
    # A V3.2 config keeps the mscale rule (transformers sets no attention_factor there).
    v32 = json.loads(json.dumps(V32_JSON))
    v32["rope_scaling"]["attention_factor"] = 1.0
    del v32["rope_scaling"]["mscale"], v32["rope_scaling"]["mscale_all_dim"]
    assert IndexerConfig.from_hf_config(v32).yarn.factor == 40
    del v32["rope_scaling"]["attention_factor"]
    with pytest.raises(ValueError, match=r"by 1\.369"):
        IndexerConfig.from_hf_config(v32)


def test_a_v4_flash_checkpoint_with_its_config_json_loads_layer_2(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(V4_FLASH_JSON))
    full = IndexerConfig.deepseek_v4_flash()
    tensors = _v4_checkpoint_layer(full, 2, _fresh_gen())
    save_file(tensors, str(tmp_path / "model-00001-of-00046.safetensors"))
    indexer = Indexer.from_safetensors(tmp_path, layer=2)
    assert indexer.config == IndexerConfig.deepseek_v4_flash(recipe="deepseek")
    assert indexer.wq_b_is_block_fp8 and indexer.gemm_scale_fmt("wq_b") == "ue8m0"  # e8m0 scales + ue8m0 recipe
    assert torch.equal(indexer.compressor.ape, tensors["layers.2.attn.indexer.compressor.ape"])


# --- which files a checkpoint folder is read from (model.safetensors.index.json, duplicate keys) ---
def _index(folder: Path, weight_map: dict[str, str]) -> Path:
    path = folder / "model.safetensors.index.json"
    path.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return path


def test_a_folder_with_an_index_reads_the_tensors_from_the_files_it_names(tmp_path):
    gen = _fresh_gen()
    fresh = _v4_checkpoint_layer(V4_TINY, 2, gen)
    stale = _v4_checkpoint_layer(V4_TINY, 2, gen)  # other values under the same names
    # The index spreads the layer over two shards; a stale single file sits beside them, and it sorts last.
    first = {k: v for k, v in fresh.items() if "compressor" in k}
    second = {k: v for k, v in fresh.items() if "compressor" not in k}
    save_file(first, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(second, str(tmp_path / "model-00002-of-00002.safetensors"))
    save_file(stale, str(tmp_path / "model.safetensors"))
    _index(tmp_path, {**dict.fromkeys(first, "model-00001-of-00002.safetensors"),
                      **dict.fromkeys(second, "model-00002-of-00002.safetensors"),
                      "layers.0.attn.wkv.weight": "model-00003-of-00003.safetensors"})  # not needed, not read
    for source in (tmp_path, tmp_path / "model.safetensors.index.json"):
        indexer = Indexer.from_safetensors(source, layer=2, config=V4_TINY)
        p = "layers.2.attn.indexer."
        assert torch.equal(indexer.compressor.ape, fresh[p + "compressor.ape"])
        assert torch.equal(indexer.weights_proj.weight, fresh[p + "weights_proj.weight"])
        assert torch.equal(indexer.wq_b.weight.view(torch.uint8), fresh[p + "wq_b.weight"].view(torch.uint8))


def test_an_index_naming_a_missing_shard_names_the_index_and_the_shard(tmp_path):
    tensors = _v4_checkpoint_layer(V4_TINY, 2, _fresh_gen())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    index = _index(tmp_path, dict.fromkeys(tensors, "model-00001-of-00002.safetensors"))
    with pytest.raises(FileNotFoundError, match=rf"{index} puts layers\.2\.attn\.indexer\.\S+ \(and 6 more\) in "
                                                r"model-00001-of-00002\.safetensors, but \S+ does not exist"):
        Indexer.from_safetensors(tmp_path, layer=2, config=V4_TINY)
    # A shard that exists but lacks a tensor the index puts in it: the two disagree.
    save_file({k: v for k, v in tensors.items() if not k.endswith("ape")},
              str(tmp_path / "model-00001-of-00002.safetensors"))
    with pytest.raises(ValueError, match=r"model-00001-of-00002\.safetensors does not hold "
                                         r"layers\.2\.attn\.indexer\.compressor\.ape"):
        Indexer.from_safetensors(tmp_path, layer=2, config=V4_TINY)


def test_an_index_that_is_not_an_index_is_refused_naming_it(tmp_path):
    save_file(_v4_checkpoint_layer(V4_TINY, 2, _fresh_gen()), str(tmp_path / "model.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": ')
    with pytest.raises(ValueError, match=rf"{index} is not valid JSON"):
        Indexer.from_safetensors(tmp_path, layer=2, config=V4_TINY)
    index.write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match=rf"{index} has no 'weight_map'"):
        Indexer.from_safetensors(tmp_path, layer=2, config=V4_TINY)


def test_without_an_index_a_tensor_in_two_files_is_refused_naming_both(tmp_path):
    gen = _fresh_gen()
    save_file(_v4_checkpoint_layer(V4_TINY, 2, gen), str(tmp_path / "model-00001-of-00001.safetensors"))
    save_file(_v4_checkpoint_layer(V4_TINY, 2, gen), str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.2\.attn\.indexer\.\S+ is in both "
                                         r".*model-00001-of-00001\.safetensors and .*model\.safetensors"):
        Indexer.from_safetensors(tmp_path, layer=2, config=V4_TINY)
    # Other layers' tensors in a second file are no conflict: each needed tensor is in one file.
    (tmp_path / "model.safetensors").unlink()
    save_file(_v4_checkpoint_layer(V4_TINY, 4, gen), str(tmp_path / "model-extra.safetensors"))
    assert Indexer.from_safetensors(tmp_path, layer=2, config=V4_TINY).compressor is not None


# --- files that are not what their name says: the error names the file ---
def test_a_config_json_that_is_not_json_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "deepseek_v4", "hidden_size": 4096,\n')  # cut short
    with pytest.raises(ValueError, match=rf"{path} is not valid JSON \(.* line 2"):
        IndexerConfig.from_hf_config(tmp_path)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    with pytest.raises(ValueError, match=rf"{path} is not a UTF-8 JSON text file"):
        IndexerConfig.from_hf_config(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=rf"{path} holds a JSON list, not the object of a config.json"):
        IndexerConfig.from_hf_config(path)
    # A config.json beside a checkpoint is read the same way, and its errors name it too.
    save_file(_v4_checkpoint_layer(V4_TINY, 2, _fresh_gen()), str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{path} holds a JSON list"):
        Indexer.from_safetensors(tmp_path, layer=2)
    # The config's own errors name the file it came from.
    path.write_text(json.dumps({**V4_FLASH_JSON, "quantization_config": {"scale_fmt": "e8m0"}}))
    with pytest.raises(ValueError, match=rf"{path}: config scale_fmt is 'e8m0'"):
        IndexerConfig.from_hf_config(path)


@pytest.mark.parametrize("damage", ["truncated", "text", "empty"])
def test_a_safetensors_file_that_is_not_one_names_the_file(tmp_path, damage):
    good = tmp_path / "good.safetensors"
    save_file(_v4_checkpoint_layer(V4_TINY, 2, _fresh_gen()), str(good))
    bad = tmp_path / "model-00002-of-00002.safetensors"
    data = {"truncated": good.read_bytes()[: good.stat().st_size // 2], "text": b"version https://git-lfs.github.com",
            "empty": b""}[damage]
    bad.write_bytes(data)
    with pytest.raises(ValueError, match=rf"{bad} is not a readable safetensors file \(.+\)"):
        Indexer.from_safetensors(bad, layer=2, config=V4_TINY)
    with pytest.raises(ValueError, match=rf"{bad} is not a readable safetensors file"):
        Indexer.from_safetensors(tmp_path, layer=2, config=V4_TINY)
