"""Top-k on real decode logits in the ways engines call it: this library's CUDA kernel (its planned launch and, with
--plans, other launches), torch.topk, optionally the Triton top-k and engine kernels, side by side in one run.

    python3 benchmarks/bench_topk_engines.py --out DIR [--cells grid padded mixed v4] [--batches 1 32 64 128]
        [--contexts 8192 32768 131072] [--repeats 50] [--plans] [--triton] [--engines PATH.py] [--budget-s 300]

Cells (--cells; all four by default):
- grid: B x ctx logits of width ctx (every row ctx long), k = 2048;
- padded: rows of one length in logits padded to max_model_len (163840, vLLM's V3.2 width): 1 / 32 / 128 x 8K and
  32 x 32K, k = 2048;
- mixed: 32 and 128 rows of lengths log-uniform in [2K, 128K] (seeded) in the same padded width, k = 2048;
- v4: V4's k = 512 on B x ctx of width ctx, ctx in 2K / 8K / 32K (compressed-key rows).
Columns past a row's length hold a value above every real logit, so a kernel that reads them selects them and the
check fails.

Logits: keys stored by the project's own k path (random bf16 activations drawn on the GPU, seeded random V3.2
weights), queries from its q path, paged logits through the registry: one cache of 128 requests x the longest
context; a shorter row is the first tokens of the same request. Timing (`dsa_indexer.bench.Timer`): CUDA-graph
replays timed by CUDA events, a 256 MiB L2 flush before each, the median of --repeats. Every result is checked
exactly: per row, the multiset of the logits it selects (NaN-free here) must equal torch.topk's over the row's
valid columns, and the indices must be distinct and inside the row.

--engines PATH.py: a file (kept outside the repository: engine code and bindings are never committed) defining
``engines() -> dict[name, callable(logits, k, ends) -> int indices [B, >= k]]``; each is timed like ours. The file
may define ``VERSIONS`` (what was built, from which release), recorded in the JSON, and ``path_seen(engine, B,
width, k, longest)`` (the kernel that engine's own dispatch takes), recorded per cell.
Writes DIR/topk_engines.json with the command, versions, every cell and, per cell, ours over the best engine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

K = 2048


def real_logits(batch: int, context: int, device: torch.device, seed: int = 0):
    """``logits_for(ctx) -> [batch, ctx]`` fp32 real decode logits: the k path stores ``batch * context``
    keys, the q path makes one decode query per request; logits for a shorter context read its first tokens."""
    from dsa_indexer import ops
    from dsa_indexer.config import IndexerConfig
    from dsa_indexer.contract.cache import PAGE_SIZE, IndexKCache
    from dsa_indexer.indexer import Indexer
    from dsa_indexer.pipeline import k_path, q_path

    cfg = IndexerConfig.deepseek_v32()
    indexer = Indexer(cfg, device=device).init_random(seed)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    pages = -(-context // PAGE_SIZE)
    cache = IndexKCache.allocate(batch * pages, device, indexer.fp8_dtype)
    table = torch.randperm(batch * pages, generator=gen, device=device).to(torch.int32).view(batch, pages)
    step = 32768
    with torch.no_grad():
        for b in range(batch):
            for start in range(0, context, step):
                n = min(step, context - start)
                x = torch.randn(n, cfg.hidden_size, generator=gen, device=device).to(torch.bfloat16)
                pos = torch.arange(start, start + n, device=device)
                slots = table[b].long()[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
                k_path(indexer.step_plan(n, False), x, pos, slots, cache.data)
        x = torch.randn(batch, cfg.hidden_size, generator=gen, device=device).to(torch.bfloat16)
        q_lora = torch.randn(batch, cfg.q_lora_rank, generator=gen, device=device).to(torch.bfloat16)
        positions = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
        q_fp8, weights = q_path(indexer.step_plan(batch, True), x, q_lora, positions, None)
    q = q_fp8.view(batch, 1, cfg.n_heads, cfg.head_dim)

    def logits_for(ctx: int) -> torch.Tensor:
        lens = torch.full((batch, 1), ctx, dtype=torch.int32, device=device)
        with torch.no_grad():
            return ops.paged_mqa_logits(q, cache.data, weights, lens, table[:, : -(-ctx // PAGE_SIZE)], ctx)

    return logits_for




def check(logits: torch.Tensor, ends: torch.Tensor, k: int, got: torch.Tensor) -> int:
    """Rows whose selection is wrong: the selected values' multiset differs from torch.topk's over the row's valid
    columns, or indices repeat or leave the row."""
    wrong = 0
    got = got[:, :k].long()
    for length in sorted(set(ends.tolist())):
        rows = (ends == length).nonzero().flatten()
        sub, idx = logits[rows, :length], got[rows]
        want = torch.topk(sub, min(k, length), dim=1).values
        bad = (idx < 0) | (idx >= length)
        vals = sub.gather(1, idx.clamp(0, length - 1)).sort(dim=1, descending=True).values[:, : want.shape[1]]
        row_wrong = bad[:, : want.shape[1]].any(dim=1) | (vals != want).any(dim=1)
        row_wrong |= (idx[:, : want.shape[1]].sort(dim=1).values.diff(dim=1) == 0).any(dim=1)
        wrong += int(row_wrong.sum())
    return wrong


def cells(args):
    """(family, batch, per-row lengths [B] int32, width, k) of every cell asked for: the grid, then the engines'
    ways of calling the top-k as `dsa-indexer bench --suite topk` defines them on a GPU (one definition)."""
    from dsa_indexer.bench.suites import engine_call_cells

    out = []
    if "grid" in args.cells:
        out += [("grid", b, torch.full((b,), c, dtype=torch.int32), c, K) for c in args.contexts for b in args.batches]
    for family, lengths, width, k in engine_call_cells(True, args.batches, args.contexts):
        if family in args.cells:
            out.append((family, len(lengths), torch.tensor(lengths, dtype=torch.int32), width, k))
    return out


def ours(cuda_topk, args, logits, ends, k, width, sms):
    """This library's top-k: the planned launch, with --plans the launches it chooses between, and each of those
    again from every --variant build."""
    impls = {"cuda.radix": lambda: cuda_topk.topk_indices(logits, k, ends)}
    if args.plans:
        impls.update(other_plans(cuda_topk, logits, ends, k, width, sms))
    for variant in args.variant:  # the same launches from another build of the register kernels
        name, _, defines = variant.partition("=")
        for label, fn in list(impls.items()):
            if "[" in label or "grid" in label or "trimmed" in label:
                continue  # variants of variants; grids and trims, which a build does not change

            def from_variant(fn=fn, defines=tuple(defines.split(","))):
                cuda_topk.use_register_variant(defines)
                try:
                    return fn()
                finally:
                    cuda_topk.use_register_variant()

            impls[f"{label} [{name}]"] = from_variant
    return impls


def other_plans(cuda_topk, logits, ends, k, width, sms):
    """The launches the plan chooses between, besides the one it chose (--plans)."""
    impls = {}
    rows = logits.shape[0]

    def forced(plan):
        return lambda: cuda_topk.run_plan(logits, k, ends, None, None, None, plan)

    def packed():
        saved, cuda_topk.PACK_ROWS = cuda_topk.PACK_ROWS, not cuda_topk.PACK_ROWS
        try:
            return cuda_topk.topk_indices(logits, k, ends)
        finally:
            cuda_topk.PACK_ROWS = saved

    impls["cuda.radix packed grid" if not cuda_topk.PACK_ROWS else "cuda.radix unpacked grid"] = packed
    planned = cuda_topk.plan_for(rows, width, sms, 4, k)
    reg = cuda_topk.register_plan(rows, width, sms)
    if reg is not None and (planned is None or planned.kernel != "registers"):
        alt = cuda_topk.Plan("registers", *reg)
        impls[f"cuda.radix registers x{alt.cluster} keys{alt.per_cta}"] = forced(alt)
    if (reg is not None and (planned is None or planned.kernel != "routed")
            and cuda_topk.SHORT_ROWS_MAX_COLS < width <= cuda_topk.STREAM_MAX_COLS):
        routed = cuda_topk.Plan("routed", *reg)
        impls[f"cuda.radix routed x{routed.cluster} keys{routed.per_cta}"] = forced(routed)
    if (planned is None or planned.kernel != "stream") and width <= cuda_topk.STREAM_MAX_COLS:
        impls["cuda.radix stream"] = forced(cuda_topk.Plan("stream", 1, 0))

    def runs_as(plan):  # the plan as run_plan launches it on this GPU (a split pass narrowed to one wave)
        if not logits.is_cuda:
            return plan
        return cuda_topk.launched_plan(plan, rows, torch.cuda.get_device_capability(logits.device))

    if cuda_topk.SHORT_ROWS_MAX_COLS < width <= cuda_topk.STREAM_MAX_COLS:  # the split pass, within one wave
        for cluster in cuda_topk.STREAM_CLUSTERS[1:]:
            split = cuda_topk.Plan("stream", cluster, 0)
            if split != runs_as(planned) and runs_as(split) == split and rows * cluster <= sms:
                impls[f"cuda.radix stream x{cluster}"] = forced(split)
    # the prefill kernel (CTAs looping over rows) where there are rows for every SM
    if (planned is None or planned.kernel != "prefill") and rows >= sms and width < cuda_topk.PREFILL_MAX_COLS:
        impls["cuda.radix prefill"] = forced(cuda_topk.Plan("prefill", 1, cuda_topk.PREFILL_THREADS))
    longest = int(ends.max())
    if longest < width:  # what a host bound on the lengths (vLLM's max_seq_len) would give: the plan of the longest
        trimmed = logits[:, :longest]
        impls["cuda.radix trimmed to the longest row"] = lambda: cuda_topk.topk_indices(trimmed, k, ends)
    return impls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cells", nargs="+", default=["grid", "padded", "mixed", "v4"],
                        choices=["grid", "padded", "mixed", "v4"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 64, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=MACRO[,MACRO]",
                        help="also time the planned launch from a build of the register kernels with these macros "
                             "(e.g. window=DSA_TOPK_SOLO_WINDOW=1), in the same process, each its own cached build; "
                             "repeatable")
    parser.add_argument("--plans", action="store_true", help="also time the other launches the plan chooses between")
    parser.add_argument("--triton", action="store_true", help="also time the Triton top-k")
    parser.add_argument("--engines", default=None, help="a .py file defining engines() (kept out of the repo)")
    parser.add_argument("--engine-names", nargs="*", default=None, help="time only these of the file's engines")
    parser.add_argument("--budget-s", type=float, default=400.0, help="stop starting new cells after this long")
    args = parser.parse_args(argv)

    from dsa_indexer.backends.cuda import topk as cuda_topk
    from dsa_indexer.bench import Timer

    device = torch.device("cuda")
    began = time.perf_counter()
    assert cuda_topk.probe() is None, cuda_topk.probe()
    engines, engine_module = {}, None
    if args.engines:
        spec = importlib.util.spec_from_file_location("topk_engines_binding", args.engines)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # (dataclasses in the binding look their module up)
        spec.loader.exec_module(module)
        engines = module.engines()
        if args.engine_names is not None:
            engines = {name: fn for name, fn in engines.items() if name in args.engine_names}
        engine_module = module
    timer = Timer(device, args.repeats)
    todo = cells(args)
    longest = max(int(lens.max()) for _, _, lens, _, _ in todo)
    real = real_logits(max(b for _, b, _, _, _ in todo), longest, device)(longest)
    above = float(real.max()) * 2 + 1.0  # past a row's end: above every real logit
    print(f"logits ready in {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def write_report() -> None:
        """The report so far, rewritten after every cell: a run cut short (a device call's time limit) keeps its
        measured cells."""
        report = {"command": "python3 benchmarks/bench_topk_engines.py " + " ".join(argv or sys.argv[1:]),
                  "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                  "cuda": torch.version.cuda,
                  "timing": "CUDA-graph replay, CUDA events, 256 MiB L2 flush before each, median of --repeats",
                  "logits": "real V3.2 decode logits (k path keys, q path query, registry paged logits); columns "
                            "past a row's length hold a value above every real logit",
                  "rows": rows}
        if engine_module is not None:
            report["engine_versions"] = getattr(engine_module, "VERSIONS", None)
        (out / "topk_engines.json").write_text(json.dumps(report, indent=1))

    rows = []
    for family, batch, lens, width, k in todo:
        name = f"{family} B={batch} " + (f"len={int(lens[0])}" if bool((lens == lens[0]).all()) else "len=mixed") \
            + f" width={width} k={k}"
        if time.perf_counter() - began > args.budget_s:
            rows.append({"cell": name, "skipped": "time budget"})
            continue
        logits = torch.full((batch, width), above, dtype=torch.float32, device=device)
        for r, n in enumerate(lens.tolist()):
            logits[r, :n] = real[r, :n]
        ends = lens.to(device)
        cell = {"cell": name, "family": family, "batch": batch, "width": width, "k": k,
                "lengths": lens.tolist() if family == "mixed" else int(lens[0]), "times_us": {}, "wrong_rows": {}}
        planned = cuda_topk.plan_for(batch, width, sms, 4, k)
        cell["plan"] = list(planned) if planned else None
        impls = {"torch.topk (valid prefix of the longest row)": lambda: torch.topk(logits[:, : int(lens.max())], k,
                                                                                   dim=1).indices}
        impls.update(ours(cuda_topk, args, logits, ends, k, width, sms))
        if args.triton:
            from dsa_indexer.backends.triton import topk as triton_topk

            impls["triton.topk"] = lambda: triton_topk.topk_indices(logits, k, ends)
        for engine, fn in engines.items():
            impls[engine] = lambda fn=fn: fn(logits, k, ends)
        for impl, fn in impls.items():
            try:
                if not impl.startswith("torch.topk"):
                    cell["wrong_rows"][impl] = check(logits, ends, k, fn())
                cell["times_us"][impl] = round(timer(fn), 2)
                cell.setdefault("timing", {})[impl] = timer.mode
            except Exception as exc:  # noqa: BLE001 - recorded, the rest still runs
                cell.setdefault("errors", {})[impl] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        times = cell["times_us"]
        engine_times = {e: times[e] for e in engines if e in times and cell["wrong_rows"].get(e) == 0}
        if engine_times and "cuda.radix" in times:
            best = min(engine_times, key=engine_times.get)
            cell["best_engine"], cell["ours_over_best_engine"] = best, round(times["cuda.radix"] / times[best], 3)
        path_seen = getattr(engine_module, "path_seen", None)
        if callable(path_seen):
            cell["engine_dispatch"] = {}
            for engine in engines:
                try:
                    cell["engine_dispatch"][engine] = path_seen(engine, batch, width, k, int(lens.max()))
                except Exception as exc:  # noqa: BLE001 - a description only
                    cell["engine_dispatch"][engine] = f"unknown ({type(exc).__name__})"
        rows.append(cell)
        ratio = f"  ours/best={cell['ours_over_best_engine']:.2f}" if "ours_over_best_engine" in cell else ""
        print(f"{name}: " + "  ".join(f"{n}={t:.1f}" for n, t in times.items())
              + f"  wrong={sum(cell['wrong_rows'].values())}{ratio}", flush=True)
        write_report()
    write_report()
    behind = [r["cell"] for r in rows if r.get("ours_over_best_engine", 0) > 1.0]
    if engines:
        print(f"cells behind the best engine: {len(behind)} of {sum('ours_over_best_engine' in r for r in rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
