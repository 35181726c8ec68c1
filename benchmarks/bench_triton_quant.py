"""Speed of the Triton quant, prologue and block-fp8 GEMM kernels against the torch reference (CUDA).

    python benchmarks/bench_triton_quant.py --out DIR [--quick]

Times are medians of `triton.testing.do_bench` (L2 flushed before every call). Bandwidth-bound kernels are
reported as effective bandwidth (bytes the op must read + write, once) and as a fraction of the device-to-device
copy bandwidth measured in the same run (torch copy of a 1 GiB tensor, bytes read + written / time).
The GEMM is reported in TFLOP/s (2*M*N*K) next to a bf16 ``torch.matmul`` of the same shape.
Writes ``DIR/triton_quant.json`` (all numbers, versions, GPU name, command line) and prints a table.
Without CUDA it prints "needs CUDA" and exits 0.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HEADS, DIM, ROPE_DIM = 64, 128, 64


def _ms(fn, quick: bool) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=5 if quick else 25, rep=20 if quick else 100,
                                         return_mode="median"))


def copy_bandwidth(quick: bool) -> dict:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _ms(lambda: dst.copy_(src), quick)
    return {"bytes": 2 * src.numel(), "ms": ms, "GBps": 2 * src.numel() / ms / 1e6}


def _cos_sin(max_pos: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, ROPE_DIM, 2, dtype=torch.float32) / ROPE_DIM))
    angles = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=1).cuda()


def bench_bandwidth_ops(quick: bool, copy_gbps: float) -> list[dict]:
    from dsa_indexer.backends.reference import kernels as ref
    from dsa_indexer.backends.triton import prologue, quant

    fp8 = torch.float8_e4m3fn
    rows = []

    def record(op, shape, nbytes, triton_fn, ref_fn):
        t_ms = _ms(triton_fn, quick)
        r_ms = _ms(ref_fn, quick)
        gbps = nbytes / t_ms / 1e6
        rows.append({"op": op, "shape": shape, "bytes": nbytes, "triton_ms": t_ms, "reference_ms": r_ms,
                     "speedup_vs_reference": r_ms / t_ms, "GBps": gbps, "fraction_of_copy_bw": gbps / copy_gbps})

    for tokens, width in ((4096, 7168), (4096, 1536)):
        x = torch.randn(tokens, width, device="cuda").to(torch.bfloat16)
        w = torch.randn(width, device="cuda").to(torch.bfloat16)
        n = tokens * width
        record("quant_fp8_groups", f"{tokens}x{width}", 2 * n + n + 4 * n // 128,
               lambda: quant.quant_fp8_groups(x, 128, False, fp8), lambda: ref.quant_fp8_groups(x, 128, False, fp8))
        record("rmsnorm_quant_fp8", f"{tokens}x{width}", 2 * n + 2 * width + 2 * n + n + 4 * n // 128,
               lambda: quant.rmsnorm_quant_fp8(x, w, 1e-6, 128, False, fp8),
               lambda: ref.rmsnorm_quant_fp8(x, w, 1e-6, 128, False, fp8))

    cos_sin = _cos_sin(16384)
    for tokens in ((4096,) if quick else (32, 4096)):
        q = torch.randn(tokens, HEADS, DIM, device="cuda").to(torch.bfloat16)
        hw = torch.randn(tokens, HEADS, device="cuda").to(torch.bfloat16)
        pos = torch.randint(0, 16384, (tokens,), device="cuda")
        n = tokens * HEADS * DIM
        nbytes = 2 * n + 2 * tokens * HEADS + 8 * tokens + 4 * tokens * ROPE_DIM + n + 4 * tokens * HEADS
        record("q_prologue", f"T{tokens}xH{HEADS}x{DIM}", nbytes,
               lambda: prologue.q_prologue(q, pos, cos_sin, hw, 0.011, 0, False, False, fp8),
               lambda: ref.q_prologue(q, pos, cos_sin, hw, 0.011, 0, False, False, fp8))

    tokens = 4096
    k = torch.randn(tokens, DIM, device="cuda").to(torch.bfloat16)
    nw = torch.randn(DIM, device="cuda").to(torch.bfloat16)
    nb = torch.randn(DIM, device="cuda").to(torch.bfloat16)
    pos = torch.randint(0, 16384, (tokens,), device="cuda")
    cache = torch.zeros(tokens // 64 + 1, 64, 1, 132, dtype=torch.uint8, device="cuda")
    slots = torch.randperm(cache.shape[0] * 64, device="cuda")[:tokens]
    nbytes = 2 * tokens * DIM + 8 * tokens + 8 * tokens + 4 * tokens * ROPE_DIM + 132 * tokens
    record("k_prologue_store", f"T{tokens}x{DIM} layernorm", nbytes,
           lambda: prologue.k_prologue_store(k, nw, nb, 1e-6, pos, cos_sin, cache, slots),
           lambda: ref.k_prologue_store(k, nw, nb, 1e-6, pos, cos_sin, cache, slots))
    return rows


def bench_gemm(quick: bool) -> list[dict]:
    from dsa_indexer.backends.reference import kernels as ref
    from dsa_indexer.backends.triton import gemm

    fp8 = torch.float8_e4m3fn
    n, k = HEADS * DIM, 1536
    b = (torch.randn(n, k, device="cuda") * 8).clamp(-448, 448).to(fp8)
    b_scales = torch.rand(n // 128, k // 128, device="cuda") * 1e-3
    b_bf16 = torch.randn(n, k, device="cuda").to(torch.bfloat16)
    rows = []
    for m in ((1, 4096) if quick else (1, 32, 128, 1024, 4096)):
        a = (torch.randn(m, k, device="cuda") * 8).clamp(-448, 448).to(fp8)
        a_scales = torch.rand(m, k // 128, device="cuda") * 1e-2
        a_bf16 = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        t_ms = _ms(lambda: gemm.gemm_fp8_blockscale(a, a_scales, b, b_scales), quick)
        r_ms = _ms(lambda: ref.gemm_fp8_blockscale(a, a_scales, b, b_scales), quick)
        bf16_ms = _ms(lambda: torch.matmul(a_bf16, b_bf16.t()), quick)
        flop = 2 * m * n * k
        rows.append({"op": "gemm_fp8_blockscale", "shape": f"M{m}xN{n}xK{k}", "triton_ms": t_ms,
                     "reference_ms": r_ms, "bf16_matmul_ms": bf16_ms, "triton_TFLOPs": flop / t_ms / 1e9,
                     "bf16_matmul_TFLOPs": flop / bf16_ms / 1e9,
                     # Small M streams the weight: report its bandwidth too (fp8 weight + scales + activations).
                     "triton_GBps": (n * k + m * k + 2 * m * n) / t_ms / 1e6})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for triton_quant.json")
    parser.add_argument("--quick", action="store_true", help="fewer shapes and shorter timing loops")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA: the Triton kernels are benchmarked on a GPU; nothing to do here")
        return 0

    import triton

    torch.manual_seed(0)
    copy = copy_bandwidth(args.quick)
    bw_rows = bench_bandwidth_ops(args.quick, copy["GBps"])
    gemm_rows = bench_gemm(args.quick)

    print(f"device-to-device copy: {copy['GBps']:.0f} GB/s (read + write)")
    print(f"{'op':<20} {'shape':<24} {'triton us':>10} {'torch us':>10} {'speedup':>8} {'GB/s':>7} {'% copy':>7}")
    for r in bw_rows:
        print(f"{r['op']:<20} {r['shape']:<24} {r['triton_ms'] * 1e3:>10.1f} {r['reference_ms'] * 1e3:>10.1f} "
              f"{r['speedup_vs_reference']:>7.1f}x {r['GBps']:>7.0f} {100 * r['fraction_of_copy_bw']:>6.0f}%")
    print(f"{'op':<20} {'shape':<24} {'triton us':>10} {'torch us':>10} {'bf16 us':>8} {'TFLOP/s':>8} {'bf16 TF':>8}")
    for r in gemm_rows:
        print(f"{r['op']:<20} {r['shape']:<24} {r['triton_ms'] * 1e3:>10.1f} {r['reference_ms'] * 1e3:>10.1f} "
              f"{r['bf16_matmul_ms'] * 1e3:>8.1f} {r['triton_TFLOPs']:>8.0f} {r['bf16_matmul_TFLOPs']:>8.0f}")

    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "timing": "triton.testing.do_bench median, L2 flushed per call",
        "copy_bandwidth": copy,
        "bandwidth_bound": bw_rows,
        "gemm": gemm_rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "triton_quant.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
