"""Issue 40 item 5: aiter's plain paged kernel takes ``SplitKV`` as a ``tl.constexpr`` (ROCm/aiter e4048607,
``aiter/ops/triton/_triton_kernels/attention/pa_mqa_logits.py``: ``SplitKV: tl.constexpr = 1``), so every distinct
value is a compile. The adapter picks it per power-of-two bucket of rows and the probe's self-test launches every
bucket once (`paged.warm_split_buckets`), so no decode step of a new batch size, and no graph capture, compiles.

CPU only: the kernel is `doubles.aiter.PlainPagedKernelDouble` (aiter's kernel emulated from its source; each launch
is recorded), the compute-unit count is patched (aiter's formula reads it from the device).
"""

from __future__ import annotations

import pytest
import torch

from doubles.aiter import PlainPagedKernelDouble
from dsa_indexer.backends.reference import kernels as ref
from dsa_indexer.backends.rocm import aiter_api, paged


def _aiter_split(units, rows):  # aiter's own choice per row count (its wrapper, e4048607), for comparison
    return (max(1, units // rows) + 4) // 5 * 5


@pytest.mark.parametrize("units", [304, 256, 132, 80])
def test_split_values_are_few_and_all_reached_by_the_warm_buckets(units):
    values = {paged.split_kv(units, rows) for rows in range(1, 8193)}
    warmed = {paged.split_kv(units, rows) for rows in paged.split_buckets(units)}
    assert values == warmed
    assert len(values) <= units.bit_length() + 1
    assert len(values) < len({_aiter_split(units, r) for r in range(1, 8193)})
    for rows in (1, 3, 33, 300, 5000):  # never more programs than aiter's choice, at least half of them
        assert _aiter_split(units, rows) >= paged.split_kv(units, rows) >= _aiter_split(units, rows) // 2 - 5


def _decode(rows, gen):
    cache = torch.zeros(3, 64 * 132, dtype=torch.uint8)
    keys = cache.view(3, -1)[:, : 64 * 128].view(torch.float8_e4m3fn)
    keys.copy_(torch.randn(keys.shape, generator=gen).clamp(-8, 8).to(torch.float8_e4m3fn))
    cache.view(3, -1)[:, 64 * 128:].view(torch.float32).copy_(torch.rand(3, 64, generator=gen) + 0.1)
    q = torch.randn(rows, 1, 64, 128, generator=gen).clamp(-8, 8).to(torch.float8_e4m3fn)
    lens = torch.randint(1, 150, (rows, 1), generator=gen, dtype=torch.int32)
    table = torch.randint(0, 3, (rows, 3), generator=gen, dtype=torch.int32)
    return q, cache, torch.randn(rows, 64, generator=gen), lens, table, 192


def test_after_the_warm_up_no_batch_size_launches_a_new_split(monkeypatch):
    monkeypatch.setattr(paged, "_compute_units", lambda device: 304)
    kernel = PlainPagedKernelDouble()
    adapter = paged.make_paged_mqa_logits("kernel", fn=kernel)
    launched = paged.warm_split_buckets(adapter, "cpu")
    assert launched == paged.split_buckets(304)
    warmed = {kw["SplitKV"] for _, kw in kernel.launches}
    assert len(warmed) == len(launched) == 7
    kernel.launches.clear()
    gen = torch.Generator().manual_seed(3)
    for rows in (1, 5, 17, 63, 129):
        args = _decode(rows, gen)
        got = adapter(*args)
        # still aiter's logits (the split only divides the work): -inf pattern exact, values to fp32 rounding
        want = ref.paged_mqa_logits(*args)
        assert torch.equal(torch.isneginf(got), torch.isneginf(want))
        torch.testing.assert_close(got[torch.isfinite(want)], want[torch.isfinite(want)], rtol=1e-5, atol=1e-4)
    assert {kw["SplitKV"] for _, kw in kernel.launches} <= warmed  # nothing new to compile


def test_the_probe_self_test_warms_every_bucket(monkeypatch):
    monkeypatch.setattr(paged, "_compute_units", lambda device: 256)
    kernel = PlainPagedKernelDouble()
    monkeypatch.setattr(paged, "find_kernel", lambda: ("aiter...._deepgemm_fp8_paged_mqa_logits", kernel))
    api = aiter_api.AiterApi(version="test", fp8_dtype=torch.float8_e4m3fn, paged_logits="x")
    api = aiter_api.self_test(api, torch.device("cpu"))
    assert api.paged_self_test is None
    splits = {kw["SplitKV"] for _, kw in kernel.launches}
    assert splits == {paged.split_kv(256, rows) for rows in paged.split_buckets(256)}
