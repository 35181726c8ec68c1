"""No host read inside a pipeline step, on any target whose steps run on the CPU here.

A pipeline strategy (`dsa_indexer.pipeline`, the op ``indexer_pipeline``) only enqueues work: the q and k paths,
on one stream or two. A host read inside it (``.item()``, ``bool(t)``, ``.tolist()``, a boolean-mask index, ``nonzero``)
blocks the host until the device catches up, so on a GPU or NPU nothing after it is enqueued early: a second stream
no longer overlaps (issue 40: the NPU side stream's store made two), and a CUDA graph capture fails.
`dsa_indexer.testing.forbid_host_syncs` raises on each of those, whatever the device, and makes the library's value
checks answer as on a device (`ranges_checked`), so these CPU tests fail where a device run would block.

Each case wraps the resolved strategy of every plan (`Indexer.step_plan`) in the guard and runs a prefill with a
cached prefix, a decode step and a speculative (next_n = 2) step through `Indexer.forward`; the scoring after the
strategy may read the host (prefill's chunk planning, the NPU indexer's NaN checks) and is not wrapped.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from doubles.torch_npu import install_schema_ops
from dsa_indexer import DecodeBatch, Indexer, IndexerConfig, PrefillBatch
from dsa_indexer.compressor import CompressorState
from dsa_indexer.backends import npu as npu_backend
from dsa_indexer.contract.validate import ranges_checked
from dsa_indexer.dispatch.environment import Environment
from dsa_indexer.dispatch.plugins import default_registry
from dsa_indexer.testing import HostSyncError, forbid_host_syncs

V32 = IndexerConfig(name="v32-small", hidden_size=256, q_lora_rank=256, n_heads=64, topk=48, max_position=4096)
_V4 = IndexerConfig.deepseek_v4_flash()
V4 = IndexerConfig(**{**_V4.__dict__, "name": "v4-small", "hidden_size": 256, "q_lora_rank": 256, "topk": 32,
                      "max_position": 4096, "yarn": None})


@pytest.fixture
def npu_ops(monkeypatch):
    """torch_npu as operators under op-plugin master's schemas (tests/doubles/torch_npu.py), probed."""
    install_schema_ops(monkeypatch)
    monkeypatch.setattr(npu_backend.LIBRARY, "detected", None)
    reg = default_registry()
    previous = reg.environment
    env = Environment()
    env.add_probe("torch_npu", npu_backend.torch_npu_probe)
    reg.set_environment(env)
    yield
    reg.set_environment(previous)


def guard_strategies(monkeypatch, indexer: Indexer) -> list[str]:
    """Wrap each plan's strategy in `forbid_host_syncs`; returns the strategies that ran (their impl ids)."""
    ran: list[str] = []
    plan_of = indexer.step_plan

    def step_plan(*args, **kwargs):
        plan = plan_of(*args, **kwargs)
        if not getattr(plan.strategy, "guarded", False):
            strategy, impl = plan.strategy, plan.pipeline.chosen.impl_id

            def guarded(*a, **k):
                ran.append(impl)
                with forbid_host_syncs(f"the pipeline strategy {impl}"):
                    return strategy(*a, **k)

            guarded.guarded = True
            plan.strategy = guarded
        return plan

    monkeypatch.setattr(indexer, "step_plan", step_plan)
    return ran


def _rows(n, width, gen):
    return torch.randn(n, width, generator=gen).to(torch.bfloat16)


def run_v4_steps(indexer: Indexer, seed: int) -> None:
    """V4 (C4 keys by the compressor inside the k path): a prefill of two requests, then a next_n = 2 decode."""
    gen = torch.Generator().manual_seed(seed)
    cache, state = indexer.allocate_cache(4), CompressorState.allocate(2, indexer.config)
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    pb = PrefillBatch.build([0, 0], [230, 170], table, num_cache_pages=4, compress_ratio=4)
    indexer(_rows(400, 256, gen), _rows(400, 256, gen), pb.positions, pb, cache, compressor_state=state)
    for seq, next_n in (([231, 171], 1), ([233, 173], 2)):
        db = DecodeBatch.build(seq, table, next_n=next_n, num_cache_pages=4, compress_ratio=4)
        indexer(_rows(db.num_tokens, 256, gen), _rows(db.num_tokens, 256, gen), db.positions, db, cache,
                compressor_state=state)


def run_steps(indexer: Indexer, seed: int) -> None:
    """Prefill (one request with a 150-token cached prefix), decode, then next_n = 2, on the target's own cache."""
    gen = torch.Generator().manual_seed(seed)
    cache = indexer.allocate_cache(8)
    table = torch.tensor([[3, 0, 5, 7], [1, 4, 2, 6]], dtype=torch.int32)
    hidden = indexer.config.hidden_size
    prefix = PrefillBatch.build([0], [150], table[1:], num_cache_pages=8)
    indexer.store_keys(_rows(150, hidden, gen), prefix, cache)
    pb = PrefillBatch.build([0, 150], [90, 40], table, num_cache_pages=8)
    indexer(_rows(pb.num_tokens, hidden, gen), _rows(pb.num_tokens, hidden, gen), pb.positions, pb, cache)
    for seq, next_n in (([91, 191], 1), ([93, 193], 2)):
        db = DecodeBatch.build(seq, table, next_n=next_n, num_cache_pages=8)
        indexer(_rows(db.num_tokens, hidden, gen), _rows(db.num_tokens, hidden, gen), db.positions, db, cache)


CASES = [
    pytest.param("sm90", V32, False, id="sm90-v32"),
    pytest.param("gfx950", V32, False, id="gfx950-v32"),
    pytest.param("gfx942", V32, False, id="gfx942-v32"),
    pytest.param("npu", V32, True, id="npu-v32-torch_npu"),
    pytest.param("sm90", V4, False, id="sm90-v4"),
    pytest.param("gfx950", V4, False, id="gfx950-v4"),
    pytest.param("npu", V4, True, id="npu-v4-torch_npu"),
]


@pytest.mark.parametrize("target,config,with_npu_ops", CASES)
def test_no_host_sync_inside_a_pipeline_step(request, monkeypatch, target, config, with_npu_ops):
    if with_npu_ops:
        request.getfixturevalue("npu_ops")
    indexer = Indexer(config, target=target).init_random(3)
    ran = guard_strategies(monkeypatch, indexer)
    # the fallback notices warn once per process: keep this test's from silencing another test's expected warning
    monkeypatch.setattr(default_registry(), "_warned", set(default_registry()._warned))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the reference fallbacks' notices (no GPU here)
        (run_v4_steps if indexer.compressor is not None else run_steps)(indexer, seed=4)
    assert len(ran) >= 3, ran  # prefill, decode and next_n = 2 each ran a guarded strategy
    if target == "npu":
        assert set(ran) == {"indexer_pipeline.npu.two_stream"}


@pytest.mark.parametrize("read", ["item", "bool", "tolist", "mask", "nonzero", "int"])
def test_the_guard_catches_each_kind_of_host_read(read):
    x = torch.randn(6, generator=torch.Generator().manual_seed(1))
    reads = {"item": lambda: x[0].item(), "bool": lambda: bool((x > 0).all()), "tolist": lambda: x.tolist(),
             "mask": lambda: x[x > 0], "nonzero": lambda: (x > 0).nonzero(), "int": lambda: int(x.argmax())}
    with pytest.raises(HostSyncError, match="host sync inside the test"):
        with forbid_host_syncs("the test"):
            reads[read]()
    reads[read]()  # outside the guard: allowed


def test_the_guard_treats_cpu_tensors_as_device_ones_for_value_checks():
    t = torch.ones(3)
    assert ranges_checked(t)
    with forbid_host_syncs("the test"):
        assert not ranges_checked(t)
        y = torch.where(t > 0, t, -t) * 2  # device work only: fine
    assert ranges_checked(t) and torch.equal(y, torch.full((3,), 2.0))
