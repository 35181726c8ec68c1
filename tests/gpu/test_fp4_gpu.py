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


def test_triton_fp4_paged_logits_on_the_gpu_match_the_reference():
    """The Triton FP4 paged logits (`backends/triton/logits_fp4.py`) on the H200 against the CPU reference over the
    same 68-byte pages: fresh random keys, contexts 0, 1, non-multiples of 64 and several pages, next_n 1 and 2; the
    output starts NaN-free only if the kernel wrote every element. Also printed: its time beside the fp8 kernel's."""
    from dsa_indexer import ops
    from dsa_indexer.backends.reference import kernels as ref
    from dsa_indexer.backends.triton import logits as fp8_logits
    from dsa_indexer.backends.triton import logits_fp4
    from dsa_indexer.contract.cache import store_fp4_rows, store_rows
    from dsa_indexer.dispatch.plugins import default_registry
    from dsa_indexer.dispatch.target import detect_target

    seed = int(torch.randint(0, 10_000, ()))
    gen = torch.Generator().manual_seed(seed)
    pages, heads = 96, 64
    x = torch.randn(pages * 64, 128, generator=gen)
    x = x * torch.exp2(torch.randint(-6, 4, (pages * 64, 4, 1), generator=gen).float()).repeat_interleave(32, 1)[..., 0]
    values, scales = ref.quant_fp4_e2m1(x, 32)
    cache = IndexKCache.allocate(pages, layout="paged64_fp4_e2m1")
    store_fp4_rows(cache.data, torch.arange(pages * 64), values, scales)
    for next_n in (1, 2):
        batch = 6
        q = (torch.randn(batch, next_n, heads, 128, generator=gen) * 2).to(torch.float8_e4m3fn)
        weights = torch.randn(batch * next_n, heads, generator=gen)
        table = torch.randperm(pages, generator=gen).to(torch.int32)[:batch * 16].view(batch, 16)
        last = torch.tensor([0, 1, 63, 65, 777, 1024], dtype=torch.int32)
        lens = (last[:, None] - (next_n - 1 - torch.arange(next_n))).clamp_min(0).to(torch.int32)
        for max_len in (1024, 1000 + next_n):
            lens_here = lens.clamp_max(max_len)
            want = ref.paged_mqa_logits(q, cache.data, weights, lens_here, table, max_len)
            args = [t.cuda() for t in (q, cache.data, weights, lens_here, table)]
            got = logits_fp4.paged_mqa_logits_fp4(*args, max_len).cpu()
            via_op = ops.paged_mqa_logits(*args, max_len).cpu()
            assert not torch.isnan(got).any() and not torch.isposinf(got).any()  # every element written
            assert torch.equal(torch.isneginf(got), torch.isneginf(want))
            visible = ~torch.isneginf(want)
            err = float(((got - want).abs()[visible]).max() / want[visible].abs().max())
            print(f"next_n={next_n} max_len={max_len}: Triton FP4 logits vs CPU reference, max |diff| / max |ref| "
                  f"= {err:.2e}; ops.paged_mqa_logits == kernel: {torch.equal(via_op, got)}")
            assert err <= 2e-3 and torch.equal(via_op, got)
    problem = ops.paged_mqa_logits.problem(*args, max_len)
    chosen = default_registry().resolve("paged_mqa_logits", detect_target(torch.device("cuda")), problem).chosen
    print(f"paged_mqa_logits with keys={problem.get('keys')} resolves to {chosen.impl_id}")
    assert chosen.impl_id in ("paged_mqa_logits.triton.logits_fp4", "paged_mqa_logits.cuda.deepgemm_fp4")

    # Decode-size timing: 32 requests x 16384 keys (69 MB of fp8 pages, 36 MB of FP4 ones).
    batch, context = 32, 16384
    big_pages = batch * context // 64
    fp4_cache = torch.randint(0, 256, (big_pages, 64, 1, 68), dtype=torch.uint8, device="cuda")
    fp4_cache.view(big_pages, -1)[:, 4096:] = 120  # sane ue8m0 scales (2^-7)
    fp8_cache = IndexKCache.allocate(big_pages, device="cuda").data
    store_rows(fp8_cache, torch.arange(big_pages * 64, device="cuda"),
               torch.randn(big_pages * 64, 128, device="cuda").to(torch.float8_e4m3fn),
               torch.rand(big_pages * 64, device="cuda"))
    q = torch.randn(batch, 1, heads, 128, device="cuda").to(torch.float8_e4m3fn)
    weights = torch.randn(batch, heads, device="cuda")
    lens = torch.full((batch, 1), context, dtype=torch.int32, device="cuda")
    table = torch.arange(big_pages, dtype=torch.int32, device="cuda").view(batch, -1)

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

    fp4_us = timed(lambda: logits_fp4.paged_mqa_logits_fp4(q, fp4_cache, weights, lens, table, context))
    fp8_us = timed(lambda: fp8_logits.paged_mqa_logits(q, fp8_cache, weights, lens, table, context))
    fp4_gbs, fp8_gbs = 68 * batch * context / fp4_us / 1e3, 132 * batch * context / fp8_us / 1e3
    print(f"B={batch} x {context} keys, 64 heads: Triton FP4 logits {fp4_us:.1f} us ({fp4_gbs:.0f} GB/s of keys), "
          f"fp8 logits {fp8_us:.1f} us ({fp8_gbs:.0f} GB/s of keys)")


def test_fp4_layout_c4_indexer_on_the_gpu_matches_the_cpu_reference():
    """The whole FP4 C4 indexer with the 68-byte FP4 pages (prefill 3001 + 4099 tokens, two decode steps, V4-Flash
    size) on the H200 against the same run on the CPU; and against the fold path (fp8 pages) on the GPU."""
    cfg = dataclasses.replace(IndexerConfig.deepseek_v4_flash(key_quant="fp4_e2m1"), max_position=16384)
    seed = int(torch.randint(0, 10_000, ()))
    gen = torch.Generator().manual_seed(seed)
    lengths = [3001, 4099]
    x = torch.randn(sum(lengths) + 4, cfg.hidden_size, generator=gen).to(torch.bfloat16)
    q_lora = torch.randn(sum(lengths) + 4, cfg.q_lora_rank, generator=gen).to(torch.bfloat16)
    pages = 40
    table = torch.arange(pages, dtype=torch.int32).view(2, 20)
    outs = {}
    runs = (("cpu", "paged64_fp4_e2m1"), ("cuda", "paged64_fp4_e2m1"), ("cuda", "paged64_fp8_e4m3"),
            ("cuda", "folded"))
    for device, layout in runs:
        indexer = Indexer(cfg, device=device).init_random(seed)
        if layout == "folded":  # the FP4 pages with prefill folding their keys into fp8 rows (the fp8 kernels)
            indexer.fp4_prefill_keys, layout = "folded", "paged64_fp4_e2m1"
            key = (device, "folded")
        else:
            key = (device, layout)
        cache = indexer.allocate_cache(pages, layout)
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
        outs[key] = (torch.cat([pre] + dec).cpu(), cache.data.cpu(), dec)

    def agreement(a, b):
        agree = total = 0
        for g, c in zip(a.tolist(), b.tolist()):
            want = {i for i in c if i >= 0}
            agree += len(want & {i for i in g if i >= 0})
            total += len(want)
        return agree / total

    cpu_idx, cpu_cache, _ = outs[("cpu", "paged64_fp4_e2m1")]
    gpu_idx, gpu_cache, gpu_dec = outs[("cuda", "paged64_fp4_e2m1")]
    fold_idx, _, fold_dec = outs[("cuda", "paged64_fp8_e4m3")]
    assert gpu_idx.shape == cpu_idx.shape and bool((gpu_idx >= -1).all())
    assert torch.equal(gpu_idx < 0, cpu_idx < 0)
    same_bytes = (gpu_cache == cpu_cache).float().mean().item()
    vs_cpu, vs_fold = agreement(gpu_idx, cpu_idx), agreement(gpu_idx, fold_idx)
    decode_vs_fold = agreement(torch.cat(gpu_dec).cpu(), torch.cat(fold_dec).cpu())
    # Prefill over the same FP4 pages, keys read as stored (the Triton FP4 ragged logits) vs folded (fp8 kernels).
    packed_vs_folded = agreement(gpu_idx, outs[("cuda", "folded")][0])
    print(f"FP4 pages, C4 indexer on the GPU: top-512 agreement {vs_cpu:.5f} with the CPU reference (cache bytes equal "
          f"{same_bytes:.5f}); {vs_fold:.5f} with the fold path on the GPU (decode rows {decode_vs_fold:.5f}); "
          f"prefill keys packed vs folded {packed_vs_folded:.5f}")
    assert same_bytes > 0.99 and vs_cpu >= 0.99 and vs_fold >= 0.99 and packed_vs_folded >= 0.99
