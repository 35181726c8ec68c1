"""Every public op is a torch.library custom op with a fake implementation: opcheck and torch.compile."""

import pytest
import torch

import dsa_indexer.ops  # noqa: F401  (registers the dsa_indexer:: ops)
from dsa_indexer import ops
from dsa_indexer.contract.cache import IndexKCache
from dsa_indexer.rope import cos_sin_table

FP8 = torch.float8_e4m3fn


def _paged_inputs(batch=2, next_n=1, heads=4, pages=6):
    cache = IndexKCache.allocate(pages)
    cache.data.copy_(torch.randint(0, 120, cache.data.shape, dtype=torch.uint8))  # finite fp8 bytes
    from dsa_indexer.contract.cache import page_views
    page_views(cache.data)[1].copy_(torch.rand(pages, 64) + 0.1)
    q = torch.randn(batch, next_n, heads, 128).to(FP8)
    weights = torch.randn(batch * next_n, heads)
    lens = torch.tensor([[100 + b * 30 + n for n in range(next_n)] for b in range(batch)], dtype=torch.int32)
    table = torch.randperm(pages).to(torch.int32)[: batch * 3].view(batch, 3)
    return q, cache.data, weights, lens, table, 192


def _cases():
    t, h = 5, 4
    cos_sin = cos_sin_table(64, 64)
    x = torch.randn(t, 256, dtype=torch.bfloat16)
    cache = IndexKCache.allocate(2)
    slots = torch.tensor([3, 70, -1, 9, 100])
    q, kv, w, lens, table, width = _paged_inputs()
    logits = torch.randn(3, 50)
    a = torch.randn(t, 256).to(FP8)
    int8_cache = IndexKCache.allocate(2, layout="paged64_int8")
    bf16_cache = IndexKCache.allocate(2, layout="paged64_bf16")
    bf16_cache.data.copy_(torch.randn(bf16_cache.data.shape))
    return {
        "quant_fp8_groups": (x, 128, False, FP8),
        "rmsnorm_quant_fp8": (x, torch.randn(256, dtype=torch.bfloat16), 1e-6, 128, False, FP8),
        "q_prologue": (torch.randn(t, h, 128, dtype=torch.bfloat16), torch.arange(t), cos_sin, torch.randn(t, h),
                       0.01, 0, False, True, FP8),
        "q_prologue_fp4": (torch.randn(t, h, 128, dtype=torch.bfloat16), torch.arange(t), cos_sin, torch.randn(t, h),
                           0.01, 0, False, 32, FP8),
        "k_prologue_store": (torch.randn(t, 128, dtype=torch.bfloat16), torch.randn(128), torch.randn(128), 1e-6,
                             torch.arange(t), cos_sin, cache.data, slots, 0, False, True, FP8, "layernorm"),
        "x_projections": (x, torch.randn(h, 256), torch.randn(128, 256, dtype=torch.bfloat16)),
        "decode_metadata": (torch.tensor([70, 129], dtype=torch.int32), table, torch.tensor([1, 0]), 2, 4),
        "gemm_fp8_blockscale": (a, torch.rand(t, 2), torch.randn(256, 256).to(FP8), torch.rand(2, 2),
                                torch.bfloat16, "fp32"),
        "ragged_mqa_logits": (torch.randn(4, h, 128).to(FP8), torch.randn(9, 128).to(FP8), torch.rand(9),
                              torch.randn(4, h), torch.tensor([0, 0, 2, 3], dtype=torch.int32),
                              torch.tensor([1, 5, 9, 3], dtype=torch.int32)),
        "paged_mqa_logits": (q, kv, w, lens, table, width),
        "ragged_mqa_topk": (torch.randn(4, h, 128).to(FP8), torch.randn(9, 128).to(FP8), torch.rand(9),
                            torch.randn(4, h), torch.tensor([0, 0, 2, 3], dtype=torch.int32),
                            torch.tensor([1, 5, 9, 3], dtype=torch.int32), 4),
        "topk_indices": (logits, 7, torch.tensor([50, 4, 30], dtype=torch.int32),
                         torch.tensor([0, 0, 10], dtype=torch.int32), None, None),
        "lightning_indexer": (q, kv, w, lens, table, width, 16, False),
        "c4_compress_pool": (torch.randn(t, 512), torch.randn(3, 8, 512), torch.randn(4, 256), torch.arange(t) + 3,
                             torch.zeros(t, dtype=torch.int32), torch.zeros(t, dtype=torch.int64),
                             torch.tensor([0, 4])),
        "q_prologue_plain": (torch.randn(t, h, 128, dtype=torch.bfloat16), torch.arange(t), cos_sin,
                             torch.randn(t, h), 0.01, 0, False, "int8"),
        "k_prologue_store_plain": (torch.randn(t, 128, dtype=torch.bfloat16), torch.randn(128), torch.randn(128), 1e-6,
                                   torch.arange(t), cos_sin, int8_cache.data, int8_cache.scales, slots, 0, False,
                                   "layernorm", "int8"),
        "lightning_indexer_ragged": (torch.randn(6, 64, 128, dtype=torch.bfloat16), torch.empty(0, dtype=torch.float16),
                                     bf16_cache.data, torch.empty(0, dtype=torch.float16), torch.randn(6, 64),
                                     torch.tensor([0, 2, 6], dtype=torch.int32), torch.tensor([80, 120], dtype=torch.int32),
                                     torch.tensor([[1, 0], [0, 1]], dtype=torch.int32), 16, 1),
    }


# opcheck's schema test compares outputs with arithmetic that torch does not implement for fp8 tensors, so the ops
# that take fp8 inputs are checked for their fake (meta) implementation and autograd registration only.
FP8_INPUT_OPS = {"gemm_fp8_blockscale", "ragged_mqa_logits", "paged_mqa_logits", "lightning_indexer", "ragged_mqa_topk"}


@pytest.mark.parametrize("op", ops.OPS)
def test_opcheck_reference(op):
    args = _cases()[op]
    utils = ("test_faketensor", "test_autograd_registration")
    if op not in FP8_INPUT_OPS:
        utils = ("test_schema",) + utils
    torch.library.opcheck(getattr(torch.ops.dsa_indexer, op).default, args, test_utils=utils)


def test_indexer_scoring_traces_under_torch_compile():
    q, kv, w, lens, table, width = _paged_inputs()

    def score(q, kv, w, lens, table):
        logits = ops.paged_mqa_logits(q, kv, w, lens, table, width)
        return ops.topk_indices(logits, 16, lens.reshape(-1)), ops.lightning_indexer(q, kv, w, lens, table, width, 16)

    eager = score(q, kv, w, lens, table)
    compiled = torch.compile(score, backend="aot_eager", fullgraph=True)(q, kv, w, lens, table)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


def test_a_compiled_call_traces_the_ops_without_lru_cache_or_lock_warnings():
    """A fresh process whose first op call is traced by torch.compile: no functools.lru_cache warning from Dynamo
    and no graph break on the platform table's lock (both seen before)."""
    import subprocess
    import sys

    code = ("import warnings, torch\n"
            "from dsa_indexer import ops\n"
            "f = lambda x: ops.quant_fp8_groups(x, 128)\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    torch.compile(f, backend='aot_eager', fullgraph=True)(torch.randn(4, 256))\n"
            "print('WARNINGS', [str(i.message) for i in w if 'lru_cache' in str(i.message)])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "WARNINGS []" in out.stdout
