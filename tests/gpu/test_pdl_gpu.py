"""Programmatic dependent launch (``DSA_INDEXER_PDL=1``, `backends/triton/pdl.py`) on the GPU: a decode step with
PDL on equals the step with PDL off, bit for bit (top-k, and every cache byte), eagerly and replayed from a CUDA
graph, V3.2 (dual stream) and V4's C4 indexer (compressor state too); and every launch kind of the CUDA top-k from
its ``DSA_PDL=1`` build against the shipped one, each right behind the kernel that writes its logits. Each PDL
kernel waits for its predecessor before any load or store, so launch order is the only thing that changes; any
difference is a race."""

import pytest
import torch

from dsa_indexer import CompressorState, DecodeBatch, IndexerConfig, IndexKCache, Indexer, PrefillBatch, ops
from dsa_indexer.backends.cuda import topk as cuda_topk
from dsa_indexer.backends.triton import pdl
from dsa_indexer.contract.cache import PAGE_SIZE
from dsa_indexer.graphs import DecodeGraph

pytestmark = pytest.mark.gpu

MAX_CTX = 8192
PAGES = MAX_CTX // PAGE_SIZE


@pytest.fixture
def pdl_switch(monkeypatch):
    """``switch(on)``: PDL on or off for the launches that follow."""
    def switch(on: bool) -> None:
        monkeypatch.setenv(pdl.PDL_ENV, "1" if on else "0")
        pdl.forget_decisions()
        assert bool(pdl.pdl_options(torch.device("cuda", torch.cuda.current_device()))) == on or \
            torch.cuda.get_device_capability()[0] < 9
    yield switch
    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    pdl.forget_decisions()


def _v32_cache(indexer, batch: int, seed: int) -> IndexKCache:
    cache = IndexKCache.allocate(batch * PAGES, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    slots = torch.arange(batch * PAGES * PAGE_SIZE, device="cuda")
    k = torch.randn(slots.shape[0], 128, device="cuda", generator=gen).to(torch.bfloat16)
    ops.k_prologue_store(k, indexer.k_norm.weight, indexer.k_norm.bias, indexer.config.norm_eps, slots % MAX_CTX,
                         indexer.cos_sin, cache.data, slots, ue8m0=True)
    return cache


def _v32_inputs(indexer, batch: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(3000, MAX_CTX + 1, (batch,), generator=gen)
    table = torch.randperm(batch * PAGES, generator=gen).to(torch.int32).view(batch, PAGES)
    cfg = indexer.config
    x = torch.randn(batch, cfg.hidden_size, generator=gen).to(torch.bfloat16).cuda()
    q_lora = torch.randn(batch, cfg.q_lora_rank, generator=gen).to(torch.bfloat16).cuda()
    return x, q_lora, seq, table


@pytest.mark.parametrize("batch", [1, 32])
def test_v32_decode_with_pdl_equals_without(pdl_switch, batch):
    indexer = Indexer(IndexerConfig.deepseek_v32(max_position=2 * MAX_CTX), device="cuda").init_random(batch)
    base = _v32_cache(indexer, batch, seed=batch)
    results = {}
    for on in (False, True):
        pdl_switch(on)
        eager_cache = IndexKCache(base.data.clone())
        graph_cache = IndexKCache(base.data.clone())
        graph = DecodeGraph.capture(indexer, graph_cache, batch, MAX_CTX)
        runs = []
        for seed in (41, 42):
            x, q_lora, seq, table = _v32_inputs(indexer, batch, seed)
            db = DecodeBatch.build(seq, table, max_context_len=MAX_CTX, device="cuda")
            runs.append((indexer(x, q_lora, db.positions, db, eager_cache).clone(),
                         graph.replay(x, q_lora, seq, table).clone()))
        torch.cuda.synchronize()
        results[on] = (runs, eager_cache.data, graph_cache.data)
    for (off_eager, off_graph), (on_eager, on_graph) in zip(results[False][0], results[True][0]):
        assert torch.equal(off_eager, on_eager), "eager top-k differs with PDL on"
        assert torch.equal(off_graph, on_graph), "graph top-k differs with PDL on"
    assert torch.equal(results[False][1], results[True][1]), "eager cache bytes differ with PDL on"
    assert torch.equal(results[False][2], results[True][2]), "graph cache bytes differ with PDL on"


def test_v4_decode_with_pdl_equals_without(pdl_switch):
    cfg = IndexerConfig.deepseek_v4_flash()
    indexer = Indexer(cfg, device="cuda").init_random(7)
    requests, pages = 4, 8
    gen = torch.Generator().manual_seed(8)
    table = torch.randperm(requests * pages, generator=gen).to(torch.int32).view(requests, pages)
    lengths = [1000, 1001, 1002, 1003]  # every phase of the 4-token window
    inputs = [(torch.randn(requests, cfg.hidden_size, generator=gen).to("cuda", torch.bfloat16),
               torch.randn(requests, cfg.q_lora_rank, generator=gen).to("cuda", torch.bfloat16))
              for _ in range(4)]
    history = torch.randn(sum(lengths), cfg.hidden_size, generator=gen).to("cuda", torch.bfloat16)
    results = {}
    for on in (False, True):
        pdl_switch(on)
        cache = IndexKCache.allocate(requests * pages, "cuda", indexer.fp8_dtype)
        state = CompressorState.allocate(requests, cfg, "cuda")
        first = 0
        for r, n in enumerate(lengths):
            pb = PrefillBatch.build([0], [n], table[r:r + 1], device="cuda", compress_ratio=4, state_slots=[r])
            indexer.store_keys(history[first:first + n], pb, cache, compressor_state=state)
            first += n
        graph = indexer.capture_decode(cache, batch_size=requests, max_context_len=512, compressor_state=state)
        outs = []
        for step, (x, q_lora) in enumerate(inputs, start=1):
            seq = torch.tensor([n + step for n in lengths], dtype=torch.int32)
            outs.append(graph.replay(x, q_lora, seq, table).clone())
        torch.cuda.synchronize()
        results[on] = (outs, cache.data.clone(), state.window.clone())
    for off, on in zip(results[False][0], results[True][0]):
        assert torch.equal(off, on), "V4 top-k differs with PDL on"
    assert torch.equal(results[False][1], results[True][1]), "V4 cache bytes differ with PDL on"
    assert torch.equal(results[False][2], results[True][2]), "V4 compressor state differs with PDL on"


@pytest.mark.parametrize("rows,cols,k,plan", [
    (1, 8192, 2048, cuda_topk.Plan("registers", 1, 16)),
    (32, 8192, 2048, None),
    (4, 32768, 2048, cuda_topk.Plan("stream", 1, 0)),
    (4, 32768, 512, cuda_topk.Plan("stream", 2, 0)),
    (8, 32768, 2048, cuda_topk.Plan("routed", 4, 16)),
    (3, 20000, 2048, cuda_topk.Plan("shared", 1, 32768)),
    (300, 16384, 2048, cuda_topk.Plan("prefill", 1, cuda_topk.PREFILL_THREADS)),
])
def test_topk_launches_with_pdl_equal_the_shipped_build(pdl_switch, rows, cols, k, plan):
    """The logits are written by the kernel just before the top-k (a scale of a random tensor), so a top-k that
    read them before its predecessor finished would see the old values: each launch kind, PDL on against off."""
    gen = torch.Generator(device="cuda").manual_seed(rows * cols + k)
    source = torch.randn(rows, cols, device="cuda", generator=gen)
    ends = torch.randint(k // 2, cols + 1, (rows,), device="cuda", generator=gen, dtype=torch.int32)
    got = {}
    for on in (False, True):
        pdl_switch(on)
        logits = torch.full_like(source, float("nan"))  # stale values a racing top-k would pick up
        torch.cuda.synchronize()
        torch.mul(source, 3.0, out=logits)  # the predecessor kernel
        got[on] = cuda_topk.run_plan(logits, k, ends, None, None, None, plan)
        torch.cuda.synchronize()
    assert torch.equal(got[False], got[True])
    want = torch.topk(torch.where(torch.arange(cols, device="cuda")[None, :] < ends[:, None].long(), source,
                                  float("-inf")), k, dim=1).values
    picked = torch.where(got[True] >= 0, source.gather(1, got[True].clamp_min(0).long()), float("-inf"))
    assert torch.equal(picked.sort(dim=1, descending=True).values, want), "not the k largest"


@pytest.mark.parametrize("rows,cols", [(1, 131072), (64, 8192)])  # the split path (few long rows), the rows path
def test_triton_topk_with_pdl_equals_without(pdl_switch, rows, cols):
    """The Triton top-k (the step's top-k where the CUDA one is not built, e.g. sm120) behind the kernel that writes
    its logits, PDL on against off."""
    from dsa_indexer.backends.triton.topk import topk_indices

    gen = torch.Generator(device="cuda").manual_seed(rows + cols)
    source = torch.randn(rows, cols, device="cuda", generator=gen)
    ends = torch.randint(cols // 2, cols + 1, (rows,), device="cuda", generator=gen, dtype=torch.int32)
    got = {}
    for on in (False, True):
        pdl_switch(on)
        logits = torch.full_like(source, float("nan"))
        torch.cuda.synchronize()
        torch.mul(source, 3.0, out=logits)
        got[on] = topk_indices(logits, 2048, ends)
        torch.cuda.synchronize()
    assert torch.equal(got[False], got[True])
