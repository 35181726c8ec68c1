"""The per-step context (`contract.step.StepContext`): what a decode step's kernels share lives in the step's
context, not on a caller's tensor, so a step run under ``torch.inference_mode`` (as vLLM and SGLang run) launches
no more kernels than under ``no_grad``; a caller's own context hands in an output buffer.

DeepGEMM is a test double here (argument handling only, not DeepGEMM): a module with the fp8_fp4 API that counts its
calls and computes with the reference kernels, so the adapters run on the CPU; the CUDA top-k is replaced by the
reference top-k (the CUDA kernel runs in tests/gpu)."""

import dataclasses
import sys
import types
import warnings

import pytest
import torch

from dsa_indexer import DecodeBatch, IndexKCache, Indexer, IndexerConfig, IndexerInputError, StepContext
from dsa_indexer.backends.cuda import deepgemm as dg_adapt
from dsa_indexer.backends.cuda import lightning
from dsa_indexer.backends.reference import kernels as ref
from dsa_indexer.contract.cache import PAGE_SIZE
from dsa_indexer.dispatch import Environment, Registry, load_plugins

# 32 heads: a head count DeepGEMM's paged logits serve on sm90 (its capabilities).
CFG = dataclasses.replace(IndexerConfig.deepseek_v32(), name="tiny-32h", hidden_size=256, q_lora_rank=256, n_heads=32,
                          topk=16, max_position=4096)
LAYERS = 3


def _counting_deep_gemm() -> types.ModuleType:
    mod = types.ModuleType("deep_gemm")
    mod.__version__ = "0.0-double"
    mod.calls = []

    def get_num_sms():
        return 6

    def get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms):
        mod.calls.append("get_paged_mqa_logits_metadata")
        return torch.zeros(num_sms + 1, 2, dtype=torch.int32)

    def fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                                 clean_logits=False, logits_dtype=torch.float32, indices=None):
        mod.calls.append("fp8_fp4_paged_mqa_logits")
        return ref.paged_mqa_logits(q[0], kv_cache, weights, context_lens, block_table, max_context_len)

    def fp8_fp4_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=True, max_seqlen_k=0,
                           logits_dtype=torch.float32):
        mod.calls.append("fp8_fp4_mqa_logits")
        return ref.ragged_mqa_logits(q[0], kv[0], kv[1], weights, cu_seq_len_k_start, cu_seq_len_k_end)

    def fp8_gemm_nt(a, b, d, c=None, recipe=None, compiled_dims="nk", disable_ue8m0_cast=False):
        mod.calls.append("fp8_gemm_nt")
        d.copy_(ref.gemm_fp8_blockscale(a[0], a[1], b[0], b[1], d.dtype))

    for fn in (get_num_sms, get_paged_mqa_logits_metadata, fp8_fp4_paged_mqa_logits, fp8_fp4_mqa_logits, fp8_gemm_nt):
        setattr(mod, fn.__name__, fn)
    return mod


@pytest.fixture(params=[True, False], ids=["deepgemm_radix", "composed"])
def deepgemm_step(monkeypatch, request):
    """Layers resolving for sm90 with DeepGEMM present (the double) and the CUDA top-k stood in by the reference;
    without the CUDA JIT (no nvcc) the decode scorer is the composition of DeepGEMM's logits and a top-k."""
    module = _counting_deep_gemm()
    monkeypatch.setitem(sys.modules, "deep_gemm", module)
    monkeypatch.setattr(dg_adapt.LIBRARY, "detected", None)
    monkeypatch.setattr(lightning, "topk_indices", ref.topk_indices)
    registry = Registry()
    load_plugins(registry, entry_points=False)
    registry.set_environment(Environment.simulated(gpu=True, triton=False, deep_gemm=True,
                                                   cuda_jit=True if request.param else "no nvcc (simulated)"))
    layers = []
    for seed in range(LAYERS):
        layer = Indexer(CFG, target="sm90").init_random(seed)
        layer._registry = registry
        layers.append(layer)
    return module, layers


def _step(layers, mode, seed: int, context=None):
    """One decode step of every layer (one batch, one cache each), with every tensor made under ``mode``."""
    with mode():
        gen = torch.Generator().manual_seed(seed)
        seq = [3 * CFG.topk + 5, 5 * CFG.topk]
        pages = -(-max(seq) // PAGE_SIZE)
        table = torch.arange(len(seq) * pages, dtype=torch.int32).view(len(seq), pages)
        batch = DecodeBatch.build(seq, table, num_cache_pages=table.numel())
        outs = []
        for layer in layers:
            cache = IndexKCache.allocate(table.numel())
            cache.data.copy_(torch.randint(0, 0x78, cache.data.shape, dtype=torch.uint8, generator=gen))
            x = torch.randn(batch.num_tokens, CFG.hidden_size, generator=gen).to(torch.bfloat16)
            q_lora = torch.randn(batch.num_tokens, CFG.q_lora_rank, generator=gen).to(torch.bfloat16)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # the reference fallbacks of a simulated sm90
                outs.append(layer(x, q_lora, batch.positions, batch, cache, context=context).clone())
        return outs


def test_an_inference_mode_step_launches_no_more_kernels_than_a_no_grad_step(deepgemm_step):
    module, layers = deepgemm_step
    seed = int(torch.randint(0, 1 << 30, ()))
    _step(layers, torch.no_grad, seed)  # warm: plans bound, adapters built
    plan = layers[0].step_plan(2, True)
    assert plan.kernels["score"].impl_id in ("lightning_indexer.cuda.deepgemm_radix",
                                             "lightning_indexer.generic.composed")
    counts = {}
    results = {}
    for mode in (torch.no_grad, torch.inference_mode):
        module.calls.clear()
        results[mode] = _step(layers, mode, seed)
        counts[mode] = list(module.calls)
    assert counts[torch.inference_mode] == counts[torch.no_grad]
    # One schedule per step, shared by the layers (the tensors made under inference_mode keep no version counter:
    # a memo on them missed on every layer).
    assert counts[torch.no_grad].count("get_paged_mqa_logits_metadata") == 1
    assert counts[torch.no_grad].count("fp8_fp4_paged_mqa_logits") == LAYERS
    for got, want in zip(results[torch.inference_mode], results[torch.no_grad]):
        assert torch.equal(got, want)


def test_a_public_op_called_alone_computes_its_own_schedule(deepgemm_step):
    module, layers = deepgemm_step
    plan = layers[0].step_plan(2, True)
    bound = plan.kernels["score"]
    db = DecodeBatch.build([40, 70], [[0, 1], [2, 3]])
    q = torch.zeros(2, 1, CFG.n_heads, 128).to(torch.float8_e4m3fn)
    cache = IndexKCache.allocate(4)
    weights = torch.ones(2, CFG.n_heads)
    for _ in range(2):
        bound.fn(q, cache.data, weights, db.context_lens, db.block_table, db.max_context_len, CFG.topk)
    assert module.calls.count("get_paged_mqa_logits_metadata") == 2  # no context: no step to share it with
    module.calls.clear()
    context = StepContext()
    for _ in range(2):
        bound.fn(q, cache.data, weights, db.context_lens, db.block_table, db.max_context_len, CFG.topk,
                 context=context)
    assert module.calls.count("get_paged_mqa_logits_metadata") == 1


def test_a_callers_context_fills_its_output_buffer(deepgemm_step):
    _, layers = deepgemm_step
    seed = int(torch.randint(0, 1 << 30, ()))
    want = _step(layers[:1], torch.no_grad, seed)[0]
    out = torch.full((2, CFG.topk), -7, dtype=torch.int32)
    context = StepContext(topk_out=out)
    got = _step(layers[:1], torch.no_grad, seed, context=context)[0]
    assert torch.equal(out, want) and torch.equal(got, want)
    with pytest.raises(IndexerInputError, match="context.topk_out"):
        _step(layers[:1], torch.no_grad, seed, context=StepContext(topk_out=torch.zeros(2, 8, dtype=torch.int32)))
    with pytest.raises(IndexerInputError, match="context must be a StepContext"):
        _step(layers[:1], torch.no_grad, seed, context={"topk_out": out})
