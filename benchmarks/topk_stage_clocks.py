"""Where one row's register select spends its time: the SM-clock stamps of a `DSA_TOPK_STAGE_CLOCKS` build.

    python3 benchmarks/topk_stage_clocks.py --out OUT.json [--cells BxLxWxK ... --] DSA_TOPK_STAGE_CLOCKS=1 \
        DSA_TOPK_STAGE_CLOCKS=1,OTHER=1 ...

Each argument is a comma-separated list of defines for a build of `csrc/topk_registers.cu`; with the stage-clock probe
on, the first CTA of a launch prints the SM cycles between the stages of its first row's select (entry, keys loaded,
each radix level, the selection and scan, the ordered write; "KPT -1": a row the streaming kernel streams, whose
stamps are entry, the sample's loads and range, its threshold, the pass, each radix level over the candidates, the
bitmap's ordered write; "KPT -2": a row of the prefill kernel (CTAs looping over rows, e.g. 1024 rows: --cells
1024x32768x32768x2048), whose stamps are entry, the sample's loads and range (sampled rows only), the threshold, the
candidate pass, each radix level, the ordered write, of the first CTA's first row). Session 18's stage clocks
(`*_s18_h100.json`) predate the loads' own stamp: their first stage after entry is loads and levels together. Each
cell runs three times eagerly after a 256 MiB L2 flush, on real V3.2 decode logits (the engines benchmark's
`real_logits`). Needs a CUDA GPU; results are right (the probe only reads the clock).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

CELLS = [(1, 8192, 8192, 2048), (32, 8192, 8192, 2048), (128, 8192, 8192, 2048), (1, 8192, 8192, 512),
         (1, 2048, 2048, 512), (1, 32768, 32768, 512), (1, 8192, 163840, 2048), (128, 32768, 32768, 512),
         (32, 32768, 163840, 2048), (128, 131072, 131072, 2048)]
LINE = re.compile(r"\[(?P<variant>[^\]]*)\] B=(?P<b>\d+) L=(?P<l>\d+) W=(?P<w>\d+) k=(?P<k>\d+) rep (?P<rep>\d+): "
                  r"stage clocks KPT (?P<kpt>-?\d+) csize (?P<csize>\d+) levels (?P<levels>\d+): total (?P<total>\d+) \|"
                  r"(?P<stages>[ \d]*)")


def child(variants: list[str], cells: list[tuple[int, int, int, int]]) -> None:
    """Runs every cell under every build; the kernels' printf lines follow each cell's header on stdout."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_topk_engines import real_logits

    from dsa_indexer.backends.cuda import topk as cuda_topk

    dev = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    makers = {}
    for batch, length, width, k in cells:
        if batch not in makers:
            makers[batch] = real_logits(batch, max(length for b, length, _, _ in cells if b == batch), dev)
        logits = makers[batch](length)
        if width > length:  # a padded row: columns past its end hold a value above every real logit
            padded = torch.full((batch, width), 1e30, device=dev)
            padded[:, :length] = logits
            logits = padded
        ends = torch.full((batch,), length, dtype=torch.int32, device=dev)
        for variant in variants:
            cuda_topk.use_register_variant(tuple(d for d in variant.split(",") if d))
            for rep in range(3):
                flush.zero_()
                torch.cuda.synchronize()
                print(f"[{variant}] B={batch} L={length} W={width} k={k} rep {rep}: ", end="", flush=True)
                cuda_topk.topk_indices(logits, k, ends)
                torch.cuda.synchronize()
                sys.stdout.flush()
        cuda_topk.use_register_variant()


def cell(text: str) -> tuple[int, int, int, int]:
    """"BxLxWxK" -> (rows, valid length, width, k)."""
    parts = text.split("x")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"a cell is rows x length x width x k, e.g. 1024x32768x32768x2048: {text!r}")
    return tuple(int(p) for p in parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cells", nargs="+", type=cell, default=CELLS, metavar="BxLxWxK",
                        help="rows x valid length x width x k of each cell (default: the decode cells above)")
    parser.add_argument("variants", nargs="+", help="comma-separated defines of each build (include "
                                                    "DSA_TOPK_STAGE_CLOCKS=1)")
    args = parser.parse_args(argv)
    if args.child:
        child(args.variants, args.cells)
        return 0
    # The kernels' printf goes to the process's stdout: run the cells in a child and parse what it printed.
    cell_args = ["--cells", *("x".join(map(str, c)) for c in args.cells)]
    run = subprocess.run([sys.executable, __file__, "--out", args.out, "--child", *cell_args, "--", *args.variants],
                         capture_output=True, text=True, env=os.environ.copy())
    records = []
    for m in LINE.finditer(run.stdout):
        records.append({"variant": m["variant"], "batch": int(m["b"]), "length": int(m["l"]), "width": int(m["w"]),
                        "k": int(m["k"]), "rep": int(m["rep"]), "keys_per_thread": int(m["kpt"]),
                        "cluster": int(m["csize"]), "levels": int(m["levels"]), "total_cycles": int(m["total"]),
                        "stage_cycles": [int(x) for x in m["stages"].split()]})
    Path(args.out).write_text(json.dumps({"command": " ".join(["python3", "benchmarks/topk_stage_clocks.py",
                                                               "--out", args.out, *cell_args, "--", *args.variants]),
                                          "stages": "entry -> keys loaded -> each radix level -> selection and scan "
                                                    "-> ordered write (cycles between stamps)",
                                          "records": records}, indent=1) + "\n")
    print(f"{len(records)} records -> {args.out}")
    if run.returncode != 0 or not records:
        print(run.stdout[-2000:], run.stderr[-4000:], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
