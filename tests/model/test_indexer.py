"""The stable interface: Indexer.forward on decode and prefill batches, checkpoint loading, slot mapping."""

import math

import pytest
import torch

from dsa_indexer import DecodeBatch, IndexerConfig, IndexKCache, Indexer, PrefillBatch
from dsa_indexer.indexer import CHECKPOINT_PREFIX

TINY = IndexerConfig(name="tiny", hidden_size=256, q_lora_rank=256, n_heads=4, topk=16, max_position=1024,
                     yarn=None)


def _oracle_indexer(indexer: Indexer, x, q_lora, positions_all, x_all, visible_fn):
    """Float64 formula of the spec, without fp8: q = wq_b q_lora, k = LN(wk x), RoPE (NeoX, first 64),
    logits = sum_h w_h relu(q_h . k) / sqrt(H D); top-k by (value desc, index asc). Hadamard is dropped: it is
    orthonormal and leaves every dot product unchanged."""
    cfg = indexer.config
    wq = indexer.wq_b.dequantize().double() if indexer.wq_b_is_block_fp8 else indexer.wq_b.weight.double()
    q = (q_lora.double() @ wq.T).view(-1, cfg.n_heads, cfg.head_dim)
    k = x_all.double() @ indexer.wk.weight.double().T
    k = torch.nn.functional.layer_norm(k, (cfg.head_dim,), indexer.k_norm.weight.double(),
                                       indexer.k_norm.bias.double(), cfg.norm_eps)

    def rope(t, pos):
        half = cfg.rope_dim // 2
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(half, dtype=torch.float64) * 2 / cfg.rope_dim))
        ang = pos.double()[:, None] * inv[None, :]
        cos, sin = ang.cos(), ang.sin()
        while cos.dim() < t.dim():
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        a, b = t[..., :half], t[..., half:cfg.rope_dim]
        return torch.cat([a * cos - b * sin, b * cos + a * sin, t[..., cfg.rope_dim:]], dim=-1)

    q = rope(q, positions_all[1])
    k = rope(k, positions_all[0])
    w = x.double() @ indexer.weights_proj.weight.double().T / math.sqrt(cfg.n_heads * cfg.head_dim)
    logits = torch.einsum("thd,sd->ths", q, k).clamp_min(0)
    logits = torch.einsum("ths,th->ts", logits, w)
    out = []
    for t in range(logits.shape[0]):
        keys = visible_fn(t)
        order = sorted(keys, key=lambda s: (-logits[t, s].item(), s))[: cfg.topk]
        out.append(set(order))
    return out


def _agreement(got, want_sets):
    agree = total = 0
    for row, want in zip(got.tolist(), want_sets):
        assert len([i for i in row if i >= 0]) == len(want), "row must hold min(k, visible) indices"
        agree += len(set(i for i in row if i >= 0) & want)
        total += len(want)
    return agree / total


@pytest.fixture(params=[True, False], ids=["wq_b_fp8", "wq_b_bf16"])
def tiny(request):
    torch.manual_seed(0)
    return Indexer(TINY, wq_b_fp8=request.param).init_random(seed=torch.randint(0, 1000, ()).item())


def test_prefill_then_decode_against_float64_oracle(tiny):
    # One request: prefill 200 tokens, then one decode token; another request decodes with its own history.
    pages = 8
    cache = IndexKCache.allocate(pages)
    table = torch.tensor([[5, 2, 7, 0], [1, 6, 3, 4]], dtype=torch.int32)
    lens = [200, 150]
    xs = [torch.randn(n + 1, TINY.hidden_size, dtype=torch.bfloat16) for n in lens]
    qs = [torch.randn(n + 1, TINY.q_lora_rank, dtype=torch.bfloat16) for n in lens]
    pb = PrefillBatch.build([0, 0], lens, table, num_cache_pages=pages)
    x = torch.cat([xs[0][:-1], xs[1][:-1]])
    q_lora = torch.cat([qs[0][:-1], qs[1][:-1]])
    prefill = tiny(x, q_lora, pb.positions, pb, cache)
    assert prefill.shape == (sum(lens), TINY.topk) and prefill.dtype == torch.int32
    db = DecodeBatch.build([n + 1 for n in lens], table, num_cache_pages=pages)
    decode = tiny(torch.stack([xs[0][-1], xs[1][-1]]), torch.stack([qs[0][-1], qs[1][-1]]), db.positions, db, cache)

    # fp8 quantization of q, k and q_lora moves logits by ~1e-2 relative, which can swap keys near the k-th place;
    # a wrong RoPE, mask or page mapping would break most of the set.
    for b, n in enumerate(lens):
        pos = torch.arange(n + 1)
        rows = slice(sum(lens[:b]), sum(lens[:b]) + n)
        want_prefill = _oracle_indexer(tiny, xs[b][:-1], qs[b][:-1], (pos, pos[:-1]), xs[b], lambda t: range(t + 1))
        assert _agreement(prefill[rows], want_prefill) >= 0.9
        want_decode = _oracle_indexer(tiny, xs[b][-1:], qs[b][-1:], (pos, pos[-1:]), xs[b], lambda t: range(n + 1))
        assert _agreement(decode[b:b + 1], want_decode) >= 0.85
        # Short rows (<= k visible keys) hold exactly their visible keys.
        short = prefill[rows][: TINY.topk]
        for t, row in enumerate(short.tolist()):
            assert sorted(i for i in row if i >= 0) == list(range(t + 1))


def test_decode_with_next_n_two_sees_itself_and_not_the_future(tiny):
    cache = IndexKCache.allocate(4)
    table = torch.tensor([[3, 1]], dtype=torch.int32)
    pb = PrefillBatch.build([0], [60], table, num_cache_pages=4)
    tiny(torch.randn(60, TINY.hidden_size, dtype=torch.bfloat16), torch.randn(60, TINY.q_lora_rank,
                                                                                  dtype=torch.bfloat16),
         pb.positions, pb, cache)
    db = DecodeBatch.build([62], table, next_n=2, num_cache_pages=4)
    assert db.context_lens.tolist() == [[61, 62]]
    out = tiny(torch.randn(2, TINY.hidden_size, dtype=torch.bfloat16),
               torch.randn(2, TINY.q_lora_rank, dtype=torch.bfloat16), db.positions, db, cache)
    assert int(out[0].max()) <= 60 and int(out[1].max()) <= 61
    assert (out >= 0).sum(dim=1).tolist() == [16, 16]


def test_to_physical_slots_maps_through_the_block_table(tiny):
    table = torch.tensor([[9, 4], [2, 7]], dtype=torch.int32)
    db = DecodeBatch.build([100, 70], table, num_cache_pages=10)
    local = torch.tensor([[0, 63, 64, 99, -1], [5, 69, -1, -1, 64]], dtype=torch.int32)
    slots = tiny.to_physical_slots(local, db)
    assert slots.tolist() == [[9 * 64, 9 * 64 + 63, 4 * 64, 4 * 64 + 35, -1], [2 * 64 + 5, 7 * 64 + 5, -1, -1, 7 * 64]]


def test_load_checkpoint_from_safetensors(tmp_path, tiny):
    from safetensors.torch import save_file

    layer = 3
    prefix = CHECKPOINT_PREFIX.format(layer=layer)
    state = {prefix + "wq_b.weight": torch.randn(512, 256).to(torch.float8_e4m3fn),
             prefix + "wq_b.weight_scale_inv": torch.rand(4, 2) + 0.5,
             prefix + "wk.weight": torch.randn(128, 256, dtype=torch.bfloat16),
             prefix + "k_norm.weight": torch.randn(128, dtype=torch.bfloat16),
             prefix + "k_norm.bias": torch.randn(128, dtype=torch.bfloat16),
             prefix + "weights_proj.weight": torch.randn(4, 256, dtype=torch.bfloat16),
             "model.layers.4.self_attn.indexer.wk.weight": torch.randn(128, 256, dtype=torch.bfloat16)}
    path = tmp_path / "model-00001.safetensors"
    save_file(state, str(path))
    loaded = Indexer.from_safetensors(path, layer, TINY)
    assert loaded.wq_b_is_block_fp8
    assert torch.equal(loaded.wq_b.weight.view(torch.uint8), state[prefix + "wq_b.weight"].view(torch.uint8))
    assert torch.equal(loaded.wq_b.weight_scale_inv, state[prefix + "wq_b.weight_scale_inv"])
    assert torch.equal(loaded.wk.weight, state[prefix + "wk.weight"])
    assert torch.equal(loaded.k_norm.bias, state[prefix + "k_norm.bias"])
    assert torch.equal(loaded.weights_proj.weight, state[prefix + "weights_proj.weight"])
    # Also from the folder, and errors name the key.
    assert Indexer.from_safetensors(tmp_path, layer, TINY).wq_b_is_block_fp8
    bad = dict(state)
    del bad[prefix + "k_norm.bias"]
    with pytest.raises(KeyError, match="k_norm.bias"):
        Indexer(TINY).load_checkpoint(bad, prefix)
    bad = dict(state)
    bad[prefix + "weights_proj.weight"] = torch.randn(5, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weights_proj.weight"):
        Indexer(TINY).load_checkpoint(bad, prefix)
    with pytest.raises(KeyError, match="no tensors under"):
        Indexer.from_safetensors(path, 7, TINY)


def test_fp8_checkpoint_on_gfx942_is_converted_to_fnuz():
    from dsa_indexer.indexer import fn_to_fnuz

    w = torch.randn(256, 256).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 2) + 0.5
    w2, s2 = fn_to_fnuz(w, scale)
    assert w2.dtype == torch.float8_e4m3fnuz
    # Same real value: fnuz reads each code as half the fn value, the scale doubles.
    assert torch.equal(w2.float() * 2, w.float())
    assert torch.equal(s2, scale * 2)
