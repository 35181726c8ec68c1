"""V4's FP4 indexer recipe on the GPU against the CPU reference: the quant + fold bit for bit, and the whole C4
indexer (compressor, FP4 keys in the fp8 pages, the target's fp8 logits and top-k) against the CPU run."""

import dataclasses

import pytest
import torch

from dsa_indexer import CompressorState, DecodeBatch, IndexerConfig, IndexKCache, Indexer, PrefillBatch
from dsa_indexer.fp4 import rotate_quant_fp4

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run with -m gpu on the H200 test machine)", allow_module_level=True)


def test_fp4_quant_and_fold_match_the_cpu():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 10_000, ())))
    x = (torch.randn(4096, 64, 128, generator=gen) * torch.rand(4096, 64, 1, generator=gen) * 4).to(torch.bfloat16)
    cpu = rotate_quant_fp4(x)
    gpu = rotate_quant_fp4(x.cuda())
    assert torch.isfinite(gpu[1]).all() and bool((gpu[1] > 0).all())  # every row written, a positive scale
    # The Hadamard is the butterfly transform (one correctly rounded fp32 operation per step): the same bits on any
    # device (with the earlier fp32 matmul, 1 in 10^5-10^6 codes differed).
    codes = (gpu[0].view(torch.uint8).cpu() == cpu[0].view(torch.uint8)).float().mean().item()
    scales = (gpu[1].cpu() == cpu[1]).float().mean().item()
    print(f"FP4 quant GPU vs CPU: codes equal {codes:.6f}, row scales equal {scales:.6f}")
    assert codes == 1.0 and scales == 1.0


def test_fp4_c4_indexer_on_the_gpu_matches_the_cpu_reference():
    cfg = dataclasses.replace(IndexerConfig.deepseek_v4_flash(key_quant="fp4_e2m1"), max_position=16384)
    seed = int(torch.randint(0, 10_000, ()))
    gen = torch.Generator().manual_seed(seed)
    lengths = [3001, 4099]
    x = torch.randn(sum(lengths) + 4, cfg.hidden_size, generator=gen).to(torch.bfloat16)
    q_lora = torch.randn(sum(lengths) + 4, cfg.q_lora_rank, generator=gen).to(torch.bfloat16)
    pages = 40
    table = torch.arange(pages, dtype=torch.int32).view(2, 20)
    outs = {}
    for device in ("cpu", "cuda"):
        indexer = Indexer(cfg, device=device).init_random(seed)
        cache = IndexKCache.allocate(pages, device=device)
        state = CompressorState.allocate(2, cfg, device)
        pb = PrefillBatch.build([0, 0], lengths, table, device=device, num_cache_pages=pages, compress_ratio=4)
        n = sum(lengths)
        pre = indexer(x[:n].to(device), q_lora[:n].to(device), pb.positions, pb, cache, compressor_state=state)
        dec = []
        for step in range(2):
            db = DecodeBatch.build([lengths[0] + step + 1, lengths[1] + step + 1], table, device=device,
                                   num_cache_pages=pages, compress_ratio=4)
            rows = slice(n + 2 * step, n + 2 * step + 2)
            dec.append(indexer(x[rows].to(device), q_lora[rows].to(device), db.positions, db, cache,
                               compressor_state=state))
        outs[device] = (torch.cat([pre] + dec).cpu(), cache.data.cpu())
    (cpu_idx, cpu_cache), (gpu_idx, gpu_cache) = outs["cpu"], outs["cuda"]
    assert gpu_idx.shape == cpu_idx.shape and bool((gpu_idx >= -1).all())
    assert torch.equal(gpu_idx < 0, cpu_idx < 0)  # the same visible counts per row
    same_bytes = (gpu_cache == cpu_cache).float().mean().item()
    agree = total = 0
    for g, c in zip(gpu_idx.tolist(), cpu_idx.tolist()):
        want = {i for i in c if i >= 0}
        agree += len(want & {i for i in g if i >= 0})
        total += len(want)
    print(f"FP4 C4 indexer, GPU vs CPU reference: top-512 agreement {agree / total:.5f}, cache bytes equal "
          f"{same_bytes:.5f}")
    assert same_bytes > 0.99 and agree / total >= 0.99


def test_triton_fp4_q_prologue_is_bit_identical_to_the_recipe():
    """The Triton FP4 q prologue on fresh random inputs (V4-Flash: 64 heads x 128, interleaved RoPE on the last 64
    dims with the real YaRN table) against the recipe written in the tests (tests/fp4_recipe.py), on the GPU and on
    the CPU, and against the library's reference on the GPU: bit for bit, outputs handed in filled with NaN. Also
    printed: the time of the kernel and of the torch reference."""
    from fp4_recipe import fp4_q_recipe

    from dsa_indexer import ops
    from dsa_indexer.backends.reference import kernels as ref
    from dsa_indexer.backends.triton import prologue as tprologue
    from dsa_indexer.rope import cos_sin_table

    cfg = IndexerConfig.deepseek_v4_flash(key_quant="fp4_e2m1")
    cos_sin = cos_sin_table(cfg.rope_dim, 16384, cfg.rope_theta, cfg.yarn, "cuda")
    args = dict(rope_offset=cfg.rope_offset, interleaved=cfg.rope_interleaved, block=cfg.fp4_block)
    seed = int(torch.randint(0, 10_000, ()))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for tokens in (1, 7, 64, 1000, 4099):
        q = torch.randn(tokens, 64, 128, device="cuda", generator=gen)
        q = (q * torch.rand(tokens, 64, 1, device="cuda", generator=gen) * 4).to(torch.bfloat16)
        positions = torch.randint(0, 16384, (tokens,), device="cuda", generator=gen)
        head_weights = torch.randn(tokens, 64, device="cuda", generator=gen).to(torch.bfloat16)
        want = fp4_q_recipe(q, positions, cos_sin, head_weights, cfg.weight_scale, cfg.rope_offset,
                            cfg.rope_interleaved, cfg.fp4_block, torch.float8_e4m3fn)
        want_cpu = fp4_q_recipe(q.cpu(), positions.cpu(), cos_sin.cpu(), head_weights.cpu(), cfg.weight_scale,
                                cfg.rope_offset, cfg.rope_interleaved, cfg.fp4_block, torch.float8_e4m3fn)
        q_fp8 = torch.full((tokens, 64, 128), float("nan"), device="cuda").to(torch.float8_e4m3fn)
        weights = torch.full((tokens, 64), float("nan"), device="cuda")
        tprologue.q_prologue_fp4_into(q, positions, cos_sin, head_weights, cfg.weight_scale, cfg.rope_offset,
                                      cfg.rope_interleaved, cfg.fp4_block, q_fp8, weights)
        same = {
            "triton == recipe (GPU)": torch.equal(q_fp8.view(torch.uint8), want[0].view(torch.uint8))
            and torch.equal(weights.view(torch.int32), want[1].view(torch.int32)),
            "triton == recipe (CPU)": torch.equal(q_fp8.view(torch.uint8).cpu(), want_cpu[0].view(torch.uint8))
            and torch.equal(weights.view(torch.int32).cpu(), want_cpu[1].view(torch.int32)),
        }
        lib = ref.q_prologue_fp4(q, positions, cos_sin, head_weights, cfg.weight_scale, cfg.rope_offset,
                                 cfg.rope_interleaved, cfg.fp4_block, torch.float8_e4m3fn)
        same["reference == recipe (GPU)"] = torch.equal(lib[0].view(torch.uint8), want[0].view(torch.uint8)) \
            and torch.equal(lib[1].view(torch.int32), want[1].view(torch.int32))
        via_op = ops.q_prologue_fp4(q, positions, cos_sin, head_weights, cfg.weight_scale, **args)
        same["ops.q_prologue_fp4 == triton"] = torch.equal(via_op[0].view(torch.uint8), q_fp8.view(torch.uint8))
        print(f"T={tokens}: {same}")
        assert all(same.values()), same

    def timed(fn, reps=20):
        fn()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            fn()
        stop.record()
        torch.cuda.synchronize()
        return start.elapsed_time(stop) / reps * 1e3

    kernel_us = timed(lambda: tprologue.q_prologue_fp4(q, positions, cos_sin, head_weights, cfg.weight_scale,
                                                       cfg.rope_offset, cfg.rope_interleaved, cfg.fp4_block))
    torch_us = timed(lambda: ref.q_prologue_fp4(q, positions, cos_sin, head_weights, cfg.weight_scale,
                                                cfg.rope_offset, cfg.rope_interleaved, cfg.fp4_block))
    print(f"T=4099 x 64 heads: Triton FP4 q prologue {kernel_us:.1f} us, torch reference {torch_us:.1f} us")
