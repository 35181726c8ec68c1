"""The Ascend pipeline strategy: the k path (projection output -> norm, RoPE, store) on a side NPU stream while the
q path (wq_b, RoPE, quant) runs on the current one, joined before scoring, as the Ascend serving integrations
overlap the indexer's two paths. It serves the plain cache layouts only (torch_npu's indexers read those)."""

from __future__ import annotations

import threading
from typing import Callable

import torch

_alt_streams: dict = {}
_lock = threading.Lock()


def _alt_stream(device: torch.device):
    with _lock:
        stream = _alt_streams.get(device)
        if stream is None:
            stream = _alt_streams[device] = torch.npu.Stream(device)  # type: ignore[attr-defined]
        return stream


def make_two_stream() -> Callable:
    def npu_two_stream(plan, x, q_lora, positions, key_store, cache, q_lora_quant):
        """k path on a side NPU stream, q path on the current one; returns (q, q_scales, weights)."""
        steps = plan.steps  # the shared steps (pipeline.PipelineSteps): this backend never imports the model
        if x.device.type != "npu":  # a simulated npu target on host tensors: nothing to overlap
            return steps.plain_single_stream(plan, x, q_lora, positions, key_store, cache, q_lora_quant)
        npu = torch.npu  # type: ignore[attr-defined]
        main = npu.current_stream(x.device)
        alt = _alt_stream(x.device)
        head_weights = k = None
        if plan.fuse_x_projections:
            head_weights, k = steps.project_x(plan, x)
        alt.wait_stream(main)
        with npu.stream(alt):
            steps.k_path_plain(plan, x, positions, key_store, cache, k)
        result = steps.q_path_plain(plan, x, q_lora, positions, q_lora_quant, cache.key_format, head_weights)
        main.wait_stream(alt)  # the scoring reads the keys just stored
        return result

    return npu_two_stream
