"""Decode context parallelism (`dsa_indexer.parallel.context_parallel_decode`): what one step exchanges per rank and
what its exact merge costs, measured on the CPU, with the all-gather projected for NVLink.

    python benchmarks/bench_decode_context_parallel.py [--out benchmarks/results] [--repeats N]

Per (model, rows R = batch x next_n, world W):
- bytes: each rank contributes R x topk candidates of 8 bytes (one int64 holding the fp32 score and the position);
  the all-gather delivers (W - 1) x that to every rank (a ring all-gather also sends that much per rank);
- merge on the CPU: the local encode (`_candidate_keys`, [R, topk]) and the merge (`merge_candidates`, a top-k over
  [R, W x topk] int64), median wall time, one thread;
- all-gather over gloo on the CPU (forked processes on this machine, one thread each), median of the collective
  alone: a CPU transport, not a prediction for GPUs;
- NVLink projection: ``latency + (W - 1) x R x topk x 8 B / 450 GB/s``. 450 GB/s is the H200's NVLink 4 bandwidth per
  direction (NVIDIA's H200 datasheet: 900 GB/s total per GPU, 18 links of 50 GB/s both ways); the latency term is an
  assumed 10 us for a small NCCL all-gather inside one NVSwitch node, not measured here (no multi-GPU machine this
  session). Peak bandwidth makes the projection a lower bound; NCCL reaches less than the peak.
- GPU merge lower bound: the top-k reads R x W x topk x 8 B once; at the H200's 4.8 TB/s HBM that is the floor
  (the kernel launch, a few us, comes on top). Not measured.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from dsa_indexer.parallel import _all_gather_stacked, _candidate_keys, merge_candidates  # noqa: E402

NVLINK_BYTES_PER_S = 450e9  # H200 NVLink 4, per direction (datasheet: 900 GB/s total)
NCCL_LATENCY_S = 10e-6  # assumed small-message all-gather latency in one NVSwitch node (not measured)
HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e (datasheet)
MODELS = {"v3.2": 2048, "v4-c4": 512}  # topk of DeepSeek V3.2 and of V4's C4 indexer
ROWS = (1, 8, 32, 128)
WORLDS = (2, 4, 8)
GLOO_ROWS = (1, 32)
GLOO_WORLDS = (2, 4)


def median_s(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def candidates(rows: int, k: int, world: int, rank: int, gen: torch.Generator):
    scores = torch.randn(rows, k, generator=gen)
    positions = torch.arange(k, dtype=torch.int32)[None, :].expand(rows, -1) * world + rank
    return _candidate_keys(scores, positions)


def merge_times(rows: int, k: int, world: int, repeats: int) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(rows * 131 + world)
    scores = torch.randn(rows, k, generator=gen)
    positions = torch.arange(k, dtype=torch.int32)[None, :].expand(rows, -1).contiguous()
    gathered = torch.cat([candidates(rows, k, world, r, gen) for r in range(world)], dim=1)
    encode = median_s(lambda: _candidate_keys(scores, positions), repeats)
    merge = median_s(lambda: merge_candidates(gathered, k), repeats)
    return encode, merge


def _gloo_worker(rank: int, world: int, init: str, out: str, rows: int, k: int, repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        keys = candidates(rows, k, world, rank, torch.Generator().manual_seed(rank))
        samples = []
        for i in range(repeats + 2):
            dist.barrier()
            start = time.perf_counter()
            _all_gather_stacked(keys, world, None)
            if i >= 2:
                samples.append(time.perf_counter() - start)
        if rank == 0:
            Path(out).write_text(json.dumps(statistics.median(samples)))
    finally:
        dist.destroy_process_group()


def gloo_all_gather_s(rows: int, k: int, world: int, repeats: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "median.json")
        mp.start_processes(_gloo_worker, args=(world, os.path.join(tmp, "init"), out, rows, k, repeats),
                           nprocs=world, join=True, start_method="fork")
        return json.loads(Path(out).read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cells = []
    for model, k in MODELS.items():
        for rows in ROWS:
            for world in WORLDS:
                payload = rows * k * 8
                received = (world - 1) * payload
                encode, merge = merge_times(rows, k, world, args.repeats)
                cell = {"model": model, "topk": k, "rows": rows, "world": world,
                        "bytes_contributed_per_rank": payload, "bytes_received_per_rank": received,
                        "cpu_encode_us": round(encode * 1e6, 1), "cpu_merge_us": round(merge * 1e6, 1),
                        "nvlink_all_gather_us_projected": round((NCCL_LATENCY_S + received / NVLINK_BYTES_PER_S)
                                                                * 1e6, 2),
                        "gpu_merge_us_lower_bound": round(world * payload / HBM_BYTES_PER_S * 1e6, 3)}
                if rows in GLOO_ROWS and world in GLOO_WORLDS:
                    cell["cpu_gloo_all_gather_us"] = round(gloo_all_gather_s(rows, k, world, args.repeats) * 1e6, 1)
                cells.append(cell)
                print(json.dumps(cell), flush=True)
    report = {"command": "python benchmarks/bench_decode_context_parallel.py" + (" " + " ".join(argv or sys.argv[1:])
                                                                                   if (argv or sys.argv[1:]) else ""),
              "machine": platform.machine(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
              "torch": torch.__version__, "threads": 1,
              "assumptions": {"nvlink_bytes_per_s": NVLINK_BYTES_PER_S,
                              "nvlink_source": "NVIDIA H200 datasheet: NVLink 900 GB/s per GPU (450 GB/s each way)",
                              "nccl_latency_s": NCCL_LATENCY_S,
                              "nccl_latency_source": "assumed, not measured (no multi-GPU machine this session)",
                              "hbm_bytes_per_s": HBM_BYTES_PER_S, "hbm_source": "NVIDIA H200 datasheet: 4.8 TB/s"},
              "cells": cells}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_context_parallel_cpu.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
