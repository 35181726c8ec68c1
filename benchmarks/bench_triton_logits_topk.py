"""Speed of the Triton logits and top-k kernels (CUDA), next to the ceilings they are judged against.

    python benchmarks/bench_triton_logits_topk.py --out DIR [--quick] [--sweep]

In one run:
* ceilings: device-to-device copy bandwidth (torch copy of 1 GiB, bytes read + written / time) and a large
  fp8 ``torch._scaled_mm`` (8192^3, tensorwise scales, row-major A, column-major B) in TFLOP/s;
* paged decode logits, B x ctx (B * ctx <= 8M tokens), next_n 1 (and 2 for a few shapes): effective GB/s
  counting 132 B/token read + 4 B/token/row of logits written, and the fraction of the copy bandwidth; the
  pure-torch reference beside it while B * ctx <= 256K (larger shapes skip it: seconds per call);
* ragged causal prefill logits at S = N: TFLOP/s counting 2 * H * D flops per visible (row, key) pair, and
  the fraction of the ``_scaled_mm`` rate;
* top-k (k = 2048) on indexer-like logits (exp of a normal, 20% exact zeros) for R x C, against
  ``torch.topk`` on the same logits, both eager and replayed from a CUDA graph (the graph removes launch
  overhead, as in a captured decode step); the index sets are compared too;
* the lightning indexer (paged logits + top-k) against its two parts and against logits + torch.topk.

Times are medians of ``triton.testing.do_bench``, which flushes the L2 cache before every call (a 256 MB
write), so inputs that would fit in the 50 MB L2 are read from memory as in a real step.
``--sweep`` also times a grid of tile configurations per kernel (for tuning; a few minutes more).
Writes ``DIR/triton_logits_topk.json`` (all numbers, GPU name, versions, command line) and prints a compact
table last. Without CUDA it prints "needs CUDA" and exits 0.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HEADS, DIM, PAGE, TOKEN_BYTES, TOPK = 64, 128, 64, 132, 2048
FP8 = torch.float8_e4m3fn


def _ms(fn, quick: bool) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=5 if quick else 25, rep=20 if quick else 100,
                                         return_mode="median"))


def _graphed(fn):
    """fn captured in a CUDA graph (compiled and warmed up first); returns the replay callable."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def copy_bandwidth(quick: bool) -> dict:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _ms(lambda: dst.copy_(src), quick)
    return {"bytes": 2 * src.numel(), "ms": ms, "GBps": 2 * src.numel() / ms / 1e6}


def scaled_mm_rate(quick: bool) -> dict:
    m = n = k = 8192
    a = torch.randn(m, k, device="cuda").to(FP8)
    b = torch.randn(n, k, device="cuda").to(FP8).t()  # [K, N] column-major, as cuBLASLt's fp8 path wants
    one = torch.ones((), device="cuda")
    ms = _ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), quick)
    return {"shape": f"{m}x{n}x{k}", "ms": ms, "TFLOPs": 2 * m * n * k / ms / 1e9}


def _paged_inputs(batch: int, ctx: int, next_n: int):
    pages = batch * (-(-ctx // PAGE))
    kv_cache = torch.empty(pages, PAGE, 1, TOKEN_BYTES, dtype=torch.uint8, device="cuda")
    from dsa_indexer.contract.cache import page_views

    keys, scales = page_views(kv_cache, FP8)
    keys.copy_(torch.randn(keys.shape, device="cuda").to(FP8))
    scales.copy_(torch.rand(scales.shape, device="cuda") + 0.5)
    block_table = torch.randperm(pages, device="cuda").int().reshape(batch, -1)
    q = torch.randn(batch, next_n, HEADS, DIM, device="cuda").to(FP8)
    weights = torch.randn(batch * next_n, HEADS, device="cuda") * HEADS ** -0.5
    lens = torch.full((batch, next_n), ctx, dtype=torch.int32, device="cuda")
    lens -= torch.arange(next_n - 1, -1, -1, device="cuda", dtype=torch.int32)[None, :]
    return q, kv_cache, weights, lens, block_table


def _paged_bytes(batch: int, ctx: int, next_n: int) -> int:
    return batch * ctx * TOKEN_BYTES + batch * next_n * ctx * 4


def bench_paged(quick: bool, copy_gbps: float) -> list[dict]:
    from dsa_indexer.backends.reference import kernels as ref
    from dsa_indexer.backends.triton import logits

    shapes = [(b, c, 1) for b in (1, 32, 64, 128, 256) for c in (8192, 32768, 131072) if b * c <= 8 << 20]
    shapes += [(1, 131072, 2), (32, 32768, 2), (128, 8192, 2)]
    if quick:
        shapes = [(1, 131072, 1), (32, 8192, 1), (64, 32768, 1), (256, 8192, 1), (32, 32768, 2)]
    rows = []
    for batch, ctx, next_n in shapes:
        q, kv_cache, weights, lens, block_table = _paged_inputs(batch, ctx, next_n)
        args = (q, kv_cache, weights, lens, block_table, ctx)
        t_ms = _ms(lambda: logits.paged_mqa_logits(*args), quick)
        r_ms = _ms(lambda: ref.paged_mqa_logits(*args), quick) if batch * ctx <= 256 << 10 else None
        gbps = _paged_bytes(batch, ctx, next_n) / t_ms / 1e6
        rows.append({"B": batch, "ctx": ctx, "next_n": next_n, "triton_ms": t_ms, "reference_ms": r_ms,
                     "GBps": gbps, "fraction_of_copy_bw": gbps / copy_gbps,
                     "config": logits._paged_config(batch, ctx, q.device)})
    return rows


def _ragged_inputs(s: int, n: int):
    q = torch.randn(s, HEADS, DIM, device="cuda").to(FP8)
    k = torch.randn(n, DIM, device="cuda").to(FP8)
    k_scales = torch.rand(n, device="cuda") + 0.5
    weights = torch.randn(s, HEADS, device="cuda") * HEADS ** -0.5
    ks = torch.zeros(s, dtype=torch.int32, device="cuda")
    ke = (n - s + 1 + torch.arange(s, device="cuda")).int()  # causal: row i sees keys [0, n - s + i]
    return q, k, k_scales, weights, ks, ke


def bench_ragged(quick: bool, mm_tflops: float) -> list[dict]:
    from dsa_indexer.backends.triton import logits

    rows = []
    for s in ((4096,) if quick else (4096, 8192)):
        args = _ragged_inputs(s, s)
        pairs = int((args[5] - args[4]).sum())
        t_ms = _ms(lambda: logits.ragged_mqa_logits(*args), quick)
        tflops = 2 * HEADS * DIM * pairs / t_ms / 1e9
        rows.append({"S": s, "N": s, "visible_pairs": pairs, "triton_ms": t_ms, "TFLOPs": tflops,
                     "fraction_of_scaled_mm": tflops / mm_tflops,
                     "config": logits._ragged_config(s, s, HEADS, args[0].device)})
    return rows


def _indexer_like_logits(rows: int, cols: int) -> torch.Tensor:
    x = torch.randn(rows, cols, device="cuda").exp_()
    return x.masked_fill_(torch.rand(rows, cols, device="cuda") < 0.2, 0.0)


def bench_topk(quick: bool) -> list[dict]:
    from dsa_indexer.backends.triton import topk

    shapes = [(r, c) for r in (1, 8, 32, 64, 128, 256) for c in (8192, 32768, 131072)]
    if quick:
        shapes = [(1, 8192), (1, 131072), (64, 32768), (256, 131072)]
    rows = []
    for r, c in shapes:
        x = _indexer_like_logits(r, c)
        ends = torch.full((r,), c, dtype=torch.int32, device="cuda")
        ours = lambda: topk.topk_indices(x, TOPK, ends)  # noqa: E731
        theirs = lambda: torch.topk(x, TOPK, dim=1)  # noqa: E731
        same = torch.equal(ours().sort(dim=1).values, theirs().indices.int().sort(dim=1).values)
        t_ms, ref_ms = _ms(ours, quick), _ms(theirs, quick)
        tg_ms, refg_ms = _ms(_graphed(ours), quick), _ms(_graphed(theirs), quick)
        rows.append({"R": r, "C": c, "k": TOPK, "triton_ms": t_ms, "torch_topk_ms": ref_ms,
                     "speedup": ref_ms / t_ms, "triton_graph_ms": tg_ms, "torch_topk_graph_ms": refg_ms,
                     "speedup_graph": refg_ms / tg_ms, "same_set_as_torch": same,
                     "config": topk._topk_config(r, c, x.device)})
    return rows


def bench_lightning(quick: bool) -> list[dict]:
    from dsa_indexer.backends.triton import logits, topk

    shapes = [(1, 131072), (8, 32768)] if quick else [(1, 32768), (1, 131072), (8, 32768), (32, 32768),
                                                      (8, 131072), (64, 32768)]
    rows = []
    for batch, ctx in shapes:
        q, kv_cache, weights, lens, block_table = _paged_inputs(batch, ctx, 1)
        args = (q, kv_cache, weights, lens, block_table, ctx)
        ends = lens.reshape(-1)
        scores = logits.paged_mqa_logits(*args)
        full = lambda: topk.lightning_indexer(*args, TOPK)  # noqa: E731
        with_torch = lambda: torch.topk(logits.paged_mqa_logits(*args), TOPK, dim=1)  # noqa: E731
        row = {"B": batch, "ctx": ctx,
               "lightning_ms": _ms(full, quick),
               "logits_ms": _ms(lambda: logits.paged_mqa_logits(*args), quick),
               "topk_ms": _ms(lambda: topk.topk_indices(scores, TOPK, ends), quick),
               "logits_plus_torch_topk_ms": _ms(with_torch, quick),
               "lightning_graph_ms": _ms(_graphed(full), quick),
               "logits_plus_torch_topk_graph_ms": _ms(_graphed(with_torch), quick)}
        rows.append(row)
    return rows


def sweep(quick: bool, copy_gbps: float, mm_tflops: float) -> dict:
    """Time a grid of tile configurations; the best per shape is what the defaults should become."""
    from dsa_indexer.backends.triton import logits, topk

    out: dict = {"paged": [], "ragged": [], "topk": []}
    for batch, ctx in ((1, 131072), (32, 32768), (256, 8192)):
        q, kv_cache, weights, lens, block_table = _paged_inputs(batch, ctx, 1)
        args = (q, kv_cache, weights, lens, block_table, ctx)
        for chunk, tile, warps, stages in itertools.product((256, 512, 1024, 2048), (64, 128), (4, 8), (2, 3, 4)):
            cfg = dict(chunk=chunk, tile=tile, num_warps=warps, num_stages=stages)
            try:
                with logits.config_override("paged", **cfg):
                    ms = _ms(lambda: logits.paged_mqa_logits(*args), True)
            except Exception as exc:  # a config the compiler rejects (shared memory, registers)
                out["paged"].append({"B": batch, "ctx": ctx, **cfg, "error": repr(exc)[:200]})
                continue
            gbps = _paged_bytes(batch, ctx, 1) / ms / 1e6
            out["paged"].append({"B": batch, "ctx": ctx, **cfg, "ms": ms, "fraction_of_copy_bw": gbps / copy_gbps})
    args = _ragged_inputs(4096, 4096)
    pairs = int((args[5] - args[4]).sum())
    for bm, bn, warps, stages in itertools.product((1, 2, 4), (64, 128, 256), (4, 8), (2, 3, 4)):
        cfg = dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
        try:
            with logits.config_override("ragged", **cfg):
                ms = _ms(lambda: logits.ragged_mqa_logits(*args), True)
        except Exception as exc:
            out["ragged"].append({"S": 4096, **cfg, "error": repr(exc)[:200]})
            continue
        tflops = 2 * HEADS * DIM * pairs / ms / 1e9
        out["ragged"].append({"S": 4096, **cfg, "ms": ms, "fraction_of_scaled_mm": tflops / mm_tflops})
    for r, c in ((1, 32768), (1, 131072), (8, 131072), (64, 32768), (64, 131072), (256, 32768)):
        x = _indexer_like_logits(r, c)
        ends = torch.full((r,), c, dtype=torch.int32, device="cuda")
        grid = [dict(path="rows", block=b) for b in (1024, 2048, 4096)]
        grid += [dict(path="split", block=b, split=s) for b in (1024, 2048) for s in (4, 16, 64, 128)]
        for cfg in grid:
            with topk.config_override(**cfg):
                ms = _ms(_graphed(lambda: topk.topk_indices(x, TOPK, ends)), True)
            out["topk"].append({"R": r, "C": c, **cfg, "graph_ms": ms})
    return out


def _best(rows: list[dict], keys: tuple[str, ...], metric: str = "ms") -> list[dict]:
    best: dict = {}
    for row in rows:
        if metric not in row:
            continue
        key = tuple(row[k] for k in keys)
        if key not in best or row[metric] < best[key][metric]:
            best[key] = row
    return list(best.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"),
                        help="folder for triton_logits_topk.json")
    parser.add_argument("--quick", action="store_true", help="fewer shapes and shorter timing loops")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of tile configurations")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA: the Triton logits and top-k kernels are benchmarked on a GPU; nothing to do here")
        return 0
    import triton

    torch.manual_seed(0)
    copy = copy_bandwidth(args.quick)
    mm = scaled_mm_rate(args.quick)
    paged = bench_paged(args.quick, copy["GBps"])
    ragged = bench_ragged(args.quick, mm["TFLOPs"])
    topk_rows = bench_topk(args.quick)
    lightning = bench_lightning(args.quick)
    swept = sweep(args.quick, copy["GBps"], mm["TFLOPs"]) if args.sweep else None

    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "gpu": torch.cuda.get_device_name(),
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                     "python": platform.python_version()},
        "method": "triton.testing.do_bench medians, L2 flushed before every call",
        "copy_bandwidth": copy, "scaled_mm_fp8": mm, "paged_logits": paged, "ragged_logits": ragged,
        "topk": topk_rows, "lightning_indexer": lightning, "sweep": swept,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "triton_logits_topk.json"
    path.write_text(json.dumps(result, indent=2) + "\n")

    if swept:
        print("sweep, best configurations:")
        for row in _best(swept["paged"], ("B", "ctx")):
            print(f"  paged B={row['B']} ctx={row['ctx']}: chunk {row['chunk']} tile {row['tile']} warps "
                  f"{row['num_warps']} stages {row['num_stages']}: {row['ms'] * 1e3:.1f} us, "
                  f"{100 * row['fraction_of_copy_bw']:.0f}% of copy")
        for row in _best(swept["ragged"], ("S",)):
            print(f"  ragged S={row['S']}: block_m {row['block_m']} block_n {row['block_n']} warps "
                  f"{row['num_warps']} stages {row['num_stages']}: {row['ms'] * 1e3:.0f} us, "
                  f"{100 * row['fraction_of_scaled_mm']:.0f}% of _scaled_mm")
        for row in _best(swept["topk"], ("R", "C"), "graph_ms"):
            cfg = {k: row[k] for k in ("path", "block", "split") if k in row}
            print(f"  topk R={row['R']} C={row['C']}: {cfg}: {row['graph_ms'] * 1e3:.1f} us (graph)")

    print(f"{result['gpu']}; torch {torch.__version__}, triton {triton.__version__}")
    print(f"copy {copy['GBps']:.0f} GB/s; fp8 _scaled_mm {mm['shape']}: {mm['TFLOPs']:.0f} TFLOP/s")
    print("paged logits: us (reference us) GB/s %copy")
    for (batch, next_n), group in itertools.groupby(paged, key=lambda r: (r["B"], r["next_n"])):
        cells = []
        for r in group:
            ref_us = f" ({r['reference_ms'] * 1e3:.0f})" if r["reference_ms"] is not None else ""
            cells.append(f"{r['ctx'] // 1024}K {r['triton_ms'] * 1e3:.1f}{ref_us} {r['GBps']:.0f} "
                         f"{100 * r['fraction_of_copy_bw']:.0f}%")
        print(f"  B={batch} next_n={next_n}: " + " | ".join(cells))
    print("ragged causal logits: " + " | ".join(
        f"S=N={r['S']} {r['triton_ms'] * 1e3:.0f} us {r['TFLOPs']:.0f} TFLOP/s "
        f"{100 * r['fraction_of_scaled_mm']:.0f}% of _scaled_mm" for r in ragged))
    print("top-k k=2048: us vs torch.topk us (speedup), eager / CUDA graph, path")
    for r_count, group in itertools.groupby(topk_rows, key=lambda r: r["R"]):
        print(f"  R={r_count}: " + " | ".join(
            f"{r['C'] // 1024}K {r['triton_ms'] * 1e3:.1f}/{r['torch_topk_ms'] * 1e3:.1f} ({r['speedup']:.1f}x) "
            f"g {r['triton_graph_ms'] * 1e3:.1f}/{r['torch_topk_graph_ms'] * 1e3:.1f} ({r['speedup_graph']:.1f}x) "
            f"{r['config']['path']}" for r in group))
    differ = [f"R{r['R']}C{r['C']}" for r in topk_rows if not r["same_set_as_torch"]]
    print("top-k index sets equal to torch.topk's: " + ("all" if not differ else "NOT for " + ", ".join(differ)))
    print("lightning indexer us: total (logits + topk) vs logits + torch.topk; CUDA graph")
    for r in lightning:
        print(f"  B={r['B']} ctx={r['ctx'] // 1024}K: {r['lightning_ms'] * 1e3:.1f} ({r['logits_ms'] * 1e3:.1f} + "
              f"{r['topk_ms'] * 1e3:.1f}) vs {r['logits_plus_torch_topk_ms'] * 1e3:.1f}; graph "
              f"{r['lightning_graph_ms'] * 1e3:.1f} vs {r['logits_plus_torch_topk_graph_ms'] * 1e3:.1f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
