"""dsa_indexer.integrations.transformers inside transformers' own generate(), on tiny random DeepSeek-V3.2 / V4
models built from transformers' config classes.

The oracle is transformers' own indexer: a forward hook runs the original module on the very inputs the swapped one
got (same hidden states, same cache, same mask), and the two top-k sets are compared per query row. Rows that see
at most k keys are compared exactly (every visible key must be picked); rows that see more are counted in the
agreement, which must reach 0.97 on these 48-token prompts: the fp8 rounding of q and k moves picks near the k-th
score (measured here: 0.975-0.99; 0.972 at 100 tokens and 0.966 at 200, README.md; the issue's prototype 0.98-0.99 at
other sizes). Identical greedy tokens are not the test: swapping
only two of transformers' own lowest-ranked picks already changes them within a few steps (issue 25).
The control runs the same harness with a wrong RoPE layout and must fall far below (measured 0.69 / 0.80).
"""

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers (the 'transformers' extra) is not installed")

from dsa_indexer import IndexerInputError  # noqa: E402
from dsa_indexer.integrations.transformers import (PADDED_V4_MESSAGE, STATE_ATTR, restore_indexers,  # noqa: E402
                                                   swap_indexers, swapped_indexers)

AGREEMENT = 0.97
NEW_TOKENS = 20


def tiny_v32(seed=0, index_heads=16, max_positions=256):
    config = transformers.DeepseekV32Config(
        vocab_size=128, hidden_size=256, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, kv_lora_rank=32, q_lora_rank=128, qk_rope_head_dim=64, v_head_dim=16,
        qk_nope_head_dim=16, first_k_dense_replace=2, n_routed_experts=2, num_experts_per_tok=1, n_group=1,
        topk_group=1, moe_intermediate_size=32, max_position_embeddings=max_positions, index_topk=16,
        index_head_dim=128, index_n_heads=index_heads, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return transformers.DeepseekV32ForCausalLM(config).to(torch.bfloat16).eval()


def tiny_v4(seed=0, index_heads=16):
    config = transformers.DeepseekV4Config(
        vocab_size=128, hidden_size=256, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        head_dim=128, partial_rotary_factor=0.5, q_lora_rank=128, n_routed_experts=2, num_experts_per_tok=1,
        sliding_window=8, o_groups=1, o_lora_rank=32, index_n_heads=index_heads, index_head_dim=128, index_topk=8,
        max_position_embeddings=256, layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["moe", "moe"], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return transformers.DeepseekV4ForCausalLM(config).to(torch.bfloat16).eval()


def prompts(batch, length, pad=0, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    if pad:
        ids[-1, :pad], mask[-1, :pad] = 0, 0  # the last row is left-padded
    return ids, mask


def record_against_hf(model):
    """Per call of every swapped indexer: (ours, transformers' on the same inputs, the call's args)."""
    calls = []

    def hook(module, args, kwargs, out):
        calls.append((out, module.hf_indexer(*args, **kwargs), args))

    for module in swapped_indexers(model):
        module.register_forward_hook(hook, with_kwargs=True)
    return calls


def v32_agreement(calls):
    """Top-k set agreement over the (step, layer, row) queries that see more than k keys (transformers' mask);
    short rows must pick every visible key, and no column may be -1 or out of range."""
    agree = total = 0
    for ours, theirs, args in calls:
        mask = args[3]
        assert ours.dtype == theirs.dtype == torch.int32 and ours.shape == theirs.shape
        k, width = ours.shape[-1], mask.shape[-1]
        assert int(ours.min()) >= 0 and int(ours.max()) < width
        for b in range(ours.shape[0]):
            for s in range(ours.shape[1]):
                visible = mask[b, s]
                picked = {int(c) for c in ours[b, s] if visible[c]}
                if int(visible.sum()) <= k:  # every visible key, each once; fillers distinct (the same mask)
                    assert picked == set(visible.nonzero().reshape(-1).tolist())
                    assert len(set(ours[b, s].tolist())) == k
                    continue
                wanted = {int(c) for c in theirs[b, s] if visible[c]}
                assert len(picked) == k
                agree += len(picked & wanted)
                total += len(wanted)
    assert total > 0
    return agree / total


def v4_agreement(calls):
    agree = total = 0
    for ours, theirs, args in calls:
        assert ours.dtype == theirs.dtype == torch.int64 and ours.shape == theirs.shape
        positions = args[2].expand(ours.shape[0], -1)
        k = ours.shape[-1]
        for b in range(ours.shape[0]):
            for s in range(ours.shape[1]):
                visible = int(positions[b, s] + 1) // 4
                picked = set(ours[b, s].tolist()) - {-1}
                assert all(0 <= e < visible for e in picked)
                if visible <= k:
                    assert picked == set(range(visible))
                    continue
                wanted = set(theirs[b, s].tolist()) - {-1}
                agree += len(picked & wanted)
                total += len(wanted)
    assert total > 0
    return agree / total


def generate(model, ids, mask, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, **kwargs)


@pytest.mark.parametrize("batch, pad", [(1, 0), (2, 7)], ids=["batch1", "left-padded-batch2"])
def test_v32_generate_agrees_with_transformers_indexer(batch, pad):
    model = tiny_v32()
    swap_indexers(model)
    calls = record_against_hf(model)
    ids, mask = prompts(batch, 48, pad)
    out = generate(model, ids, mask)
    assert out.shape == (batch, 48 + NEW_TOKENS)
    assert len(calls) == 2 * NEW_TOKENS  # 2 layers x (1 prefill + 19 decode steps)
    assert v32_agreement(calls) >= AGREEMENT


def test_v32_past_max_position_embeddings_refuses_unless_swapped_with_a_longer_table():
    """transformers only warns past max_position_embeddings (its RoPE is computed for any position); the swapped
    indexer's RoPE table holds max_position rows, so generate() refuses past it, naming the position, until the swap
    builds a longer table (the rows past the old end are the same rotation transformers computes there)."""
    model = tiny_v32(max_positions=40)
    ids, mask = prompts(1, 36)
    swap_indexers(model)
    with pytest.raises(IndexerInputError, match=r"request 0 has a token at position 40, past the RoPE table "
                                                r"\(max_position=40 of deepseek-v3.2\)"):
        model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    restore_indexers(model)
    swap_indexers(model, max_position=64)
    calls = record_against_hf(model)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out.shape == (1, 44) and len(calls) == 2 * 8
    assert v32_agreement(calls) >= AGREEMENT


def test_v32_wrong_rope_layout_fails_the_agreement():
    """The control: GPT-J pairs instead of V3.2's rotate-half (the early DeepSeek bug) must not pass."""
    model = tiny_v32()
    swap_indexers(model, rope_interleaved=True)
    calls = record_against_hf(model)
    generate(model, *prompts(1, 48))
    assert v32_agreement(calls) < 0.85


def test_v4_generate_agrees_with_transformers_indexer():
    model = tiny_v4()
    swap_indexers(model)
    calls = record_against_hf(model)
    generate(model, *prompts(1, 48))
    assert len(calls) == NEW_TOKENS  # one CSA layer
    assert v4_agreement(calls) >= AGREEMENT


def test_v4_wrong_rope_layout_fails_the_agreement():
    model = tiny_v4()
    swap_indexers(model, rope_position="first")
    calls = record_against_hf(model)
    generate(model, *prompts(1, 48))
    assert v4_agreement(calls) < 0.9


def test_v4_refuses_a_padded_batch():
    model = tiny_v4()
    swap_indexers(model)
    ids, mask = prompts(2, 12, pad=3)
    with pytest.raises(IndexerInputError, match="does not take padded batches"):
        generate(model, ids, mask)
    # position ids that differ per row (what generate() makes of padding) are refused too, without a mask
    positions = torch.stack([torch.arange(12), torch.arange(12).clamp_min(3) - 3])
    with pytest.raises(IndexerInputError) as info:
        model(ids, position_ids=positions)
    assert PADDED_V4_MESSAGE in str(info.value)


def test_v32_beam_search_runs_and_keeps_state_per_beam():
    model = tiny_v32()
    swap_indexers(model)
    calls = record_against_hf(model)
    out = generate(model, *prompts(1, 40), num_beams=2)
    assert out.shape == (1, 40 + NEW_TOKENS)
    # transformers reorders its cache every step; ours follows through the cache layer's reorder_cache
    assert v32_agreement(calls) >= AGREEMENT


def test_state_lives_on_the_cache_layer_and_follows_crop_and_reset():
    model = tiny_v32()
    swap_indexers(model)
    calls = record_against_hf(model)
    ids, mask = prompts(1, 40)
    cache = transformers.DynamicCache(config=model.config)
    model(ids, past_key_values=cache, use_cache=True)
    state = cache.layers[0].__dict__[STATE_ATTR]
    assert state.lengths == [40]
    cache.crop(-6)  # drop the last 6 tokens (what assisted generation does), then run them again
    assert state.lengths == [34]
    model(ids[:, 34:], past_key_values=cache, use_cache=True)
    assert state.lengths == [40]
    assert v32_agreement(calls) >= AGREEMENT
    cache.reset()
    assert STATE_ATTR not in cache.layers[0].__dict__
    # a cache the integration did not follow is refused, not silently mis-read
    stale = transformers.DynamicCache(config=model.config)
    model(ids, past_key_values=stale, use_cache=True)
    stale.layers[0].__dict__[STATE_ATTR].lengths = [39]
    with pytest.raises(IndexerInputError, match="disagree"):
        model(ids[:, :1], past_key_values=stale, use_cache=True)


def test_restore_gives_back_transformers_modules_and_the_state_dict_is_unchanged():
    model = tiny_v32()
    keys = list(model.state_dict())
    originals = [layer.self_attn.indexer for layer in model.model.layers]
    swap_indexers(model)
    assert list(model.state_dict()) == keys
    swapped = swapped_indexers(model)
    # transformers' weights are shared, not copied
    assert swapped[0].dsa_indexer.wq_b.weight is originals[0].wq_b.weight
    with pytest.raises(ValueError, match="already swapped"):
        swap_indexers(model)
    restore_indexers(model)
    assert [layer.self_attn.indexer for layer in model.model.layers] == originals
    assert swapped_indexers(model) == []


def test_unsupported_models_and_dtypes_are_refused():
    with pytest.raises(ValueError, match="model_type"):
        swap_indexers(torch.nn.Linear(2, 2))
    config = tiny_v32().config
    fp32 = transformers.DeepseekV32ForCausalLM(config).eval()
    with pytest.raises(ValueError, match="bfloat16"):
        swap_indexers(fp32)


def test_v32_fp8_wq_b_is_shared_as_block_fp8():
    """A model loaded from an fp8 checkpoint holds transformers' FP8Linear (fp8 weight + 128 x 128 scales): the
    indexer runs it as its block-fp8 GEMM on the same fp8 tensor, and picks what the dequantized bf16 weight picks."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    from dsa_indexer.indexer import BlockFp8Linear, quantize_block_fp8

    model = tiny_v32()
    for layer in model.model.layers:
        dense = layer.self_attn.indexer.wq_b
        fp8 = FP8Linear(dense.in_features, dense.out_features, block_size=(128, 128))
        weight, scale = quantize_block_fp8(dense.weight.detach())
        fp8.weight = torch.nn.Parameter(weight, requires_grad=False)
        fp8.weight_scale_inv = torch.nn.Parameter(scale, requires_grad=False)
        layer.self_attn.indexer.wq_b = fp8
    ids, mask = prompts(1, 48)
    swap_indexers(model)
    wq_b = swapped_indexers(model)[0].dsa_indexer.wq_b
    assert isinstance(wq_b, BlockFp8Linear) and wq_b.weight is model.model.layers[0].self_attn.indexer.wq_b.weight
    picks = []
    for module in swapped_indexers(model):
        module.register_forward_hook(lambda m, a, kw, out: picks.append((out, a)), with_kwargs=True)
    model(ids, attention_mask=mask)
    restore_indexers(model)
    for layer in model.model.layers:  # the same weights, dequantized, as a plain bf16 linear
        fp8 = layer.self_attn.indexer.wq_b
        dense = torch.nn.Linear(fp8.in_features, fp8.out_features, bias=False, dtype=torch.bfloat16)
        scale = fp8.weight_scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)
        dense.weight.data = (fp8.weight.float() * scale).bfloat16()
        layer.self_attn.indexer.wq_b = dense
    swap_indexers(model)
    reference = []
    for module in swapped_indexers(model):
        module.register_forward_hook(lambda m, a, kw, out: reference.append(out), with_kwargs=True)
    model(ids, attention_mask=mask)
    calls = [(ours, theirs, args) for (ours, args), theirs in zip(picks, reference)]
    assert v32_agreement(calls) >= AGREEMENT
