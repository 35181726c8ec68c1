"""Decode logits over V4's FP4 pages (68 bytes per token) against the same keys in the fp8 pages (132 bytes), the
Triton kernels side by side, on a GPU (issue 24).

    python benchmarks/bench_fp4_decode.py [--shapes 1x4096,32x16384,128x16384] [--repeats 50] [--json PATH]
        [--configs "tile=128;num_warps=8;tile=128,num_warps=8"]

For each B x keys (64 heads, next_n 1): `logits_fp4.paged_mqa_logits_fp4` with its default tiles and with each of
--configs (`logits.config_override("paged", ...)`: chunk, tile, num_warps, num_stages), and the fp8 kernel
`logits.paged_mqa_logits` over the fp8 pages holding the same values (the fold). CUDA-graph replays timed by CUDA
events with L2 flushed (`dsa_indexer.bench.timing.Timer`), medians; the floor is the pages' bytes plus the fp32
logits written, at the device-to-device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_fp4_prefill import tile_configs  # noqa: E402

from dsa_indexer.backends.reference import kernels as ref  # noqa: E402
from dsa_indexer.backends.triton import logits as fp8_logits  # noqa: E402
from dsa_indexer.backends.triton import logits_fp4  # noqa: E402
from dsa_indexer.bench.timing import Timer, measure_ceilings  # noqa: E402
from dsa_indexer.contract.cache import IndexKCache, store_fp4_rows, store_rows  # noqa: E402

HEADS = 64


def bench(batch: int, keys: int, timer: Timer, copy_gbps: float, configs: list[dict]) -> dict:
    pages = batch * keys // 64
    gen = torch.Generator(device="cuda").manual_seed(batch * keys)
    x = torch.randn(pages * 64, 128, device="cuda", generator=gen)
    values, scales = ref.quant_fp4_e2m1(x, 32)
    fp4 = IndexKCache.allocate(pages, "cuda", layout="paged64_fp4_e2m1")
    store_fp4_rows(fp4.data, torch.arange(pages * 64, device="cuda"), values, scales)
    fp8 = IndexKCache.allocate(pages, "cuda")
    store_rows(fp8.data, torch.arange(pages * 64, device="cuda"), *ref.fold_fp4_to_fp8(values, scales))
    del x, values, scales
    q, row_scale = ref.rotate_quant_fp4(torch.randn(batch, 1, HEADS, 128, device="cuda", generator=gen), 32)
    weights = torch.randn(batch, HEADS, device="cuda", generator=gen) * row_scale.reshape(batch, HEADS)
    lens = torch.full((batch, 1), keys, dtype=torch.int32, device="cuda")
    table = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32).view(batch, -1)
    logits_bytes = batch * keys * 4
    row = {"batch": batch, "keys": keys, "heads": HEADS,
           "floor_us": {"fp4": (68 * batch * keys + logits_bytes) / copy_gbps / 1e3,
                        "fp8": (132 * batch * keys + logits_bytes) / copy_gbps / 1e3},
           "us": {}}
    got = logits_fp4.paged_mqa_logits_fp4(q, fp4.data, weights, lens, table, keys)
    want = fp8_logits.paged_mqa_logits(q, fp8.data, weights, lens, table, keys)
    row["max_rel_diff_fp4_vs_fp8"] = float((got - want).abs().max() / want.abs().max())
    row["us"]["fp8 kernel, fp8 pages"] = timer(
        lambda: fp8_logits.paged_mqa_logits(q, fp8.data, weights, lens, table, keys))
    row["us"]["fp4 kernel, default tiles"] = timer(
        lambda: logits_fp4.paged_mqa_logits_fp4(q, fp4.data, weights, lens, table, keys))
    for config in configs:
        with fp8_logits.config_override("paged", **config):
            row["us"][f"fp4 kernel, {json.dumps(config)}"] = timer(
                lambda: logits_fp4.paged_mqa_logits_fp4(q, fp4.data, weights, lens, table, keys))
    row["us"] = {name: float(us) for name, us in row["us"].items()}
    row["fp4_over_fp8"] = row["us"]["fp4 kernel, default tiles"] / row["us"]["fp8 kernel, fp8 pages"]
    row["fp4_over_floor"] = row["us"]["fp4 kernel, default tiles"] / row["floor_us"]["fp4"]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="1x4096,32x16384,128x16384", help="comma-separated B x keys")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--configs", default="tile=128;num_warps=8;tile=128,num_warps=8",
                        help="FP4 kernel tile choices, ';'-separated, each 'key=value,...' ('' for none)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp4_decode needs a CUDA GPU")
        return 0
    configs = tile_configs(args.configs)
    timer = Timer(torch.device("cuda"), args.repeats)
    ceilings, _ = measure_ceilings(torch.device("cuda"), timer)
    results = {"command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]),
               "device": torch.cuda.get_device_name(), "torch": torch.__version__, "ceilings": ceilings,
               "timing": timer.mode, "runs": []}
    for shape in (s for s in args.shapes.split(",") if s):
        batch, keys = (int(v) for v in shape.split("x"))
        row = bench(batch, keys, timer, ceilings["copy_GBps"], configs)
        results["runs"].append(row)
        print(json.dumps(row, separators=(",", ":")), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
