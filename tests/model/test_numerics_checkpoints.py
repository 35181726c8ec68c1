"""Configs and checkpoints as the models publish them: IndexerConfig.from_hf_config (V3.2 / V4 config.json, the RoPE
mscale question), from_safetensors under the `model.` prefix and transformers' V4 module names, and a round trip
with files written by transformers' save_pretrained of tiny random models (skipped without transformers)."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from dsa_indexer import IndexerConfig, Indexer

V32_JSON = {  # the indexer-relevant fields of DeepSeek-V3.2's config.json (HF format)
    "model_type": "deepseek_v32", "hidden_size": 7168, "q_lora_rank": 1536, "index_n_heads": 64,
    "index_head_dim": 128, "index_topk": 2048, "qk_rope_head_dim": 64, "max_position_embeddings": 163840,
    "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                          "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
}


def test_v32_config_json_gives_the_model_recipe(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(V32_JSON))
    cfg = IndexerConfig.from_hf_config(tmp_path)
    assert cfg == IndexerConfig.deepseek_v32(scale_fmt="ue8m0", wk_gemm="fp8")
    assert cfg.ue8m0 and cfg.weights_proj_dtype == "fp32" and cfg.yarn.factor == 40


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
