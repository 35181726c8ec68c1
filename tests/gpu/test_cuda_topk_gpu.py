"""The CUDA C++ top-k (``topk_indices.cuda.radix``: the register, streaming and shared-memory kernels, each plan)
and the sm90 lightning indexer on the H200, against the reference.

Tolerance: none for the top-k. It is an exact selection, so the returned index SET must equal the reference's
(`torch.sort`-based, ties to the lower column) on the same logits with every NaN replaced by -inf (the library's
NaN rule), bit for bit. Order within the k is not part of the contract (rows with <= k visible columns: the
visible positions ascending, then -1, which is checked). The lightning indexer's logits come from DeepGEMM, so
its sets are compared with the reference top-k of DeepGEMM's own (masked) logits. Inputs are fresh random rows
every run: real indexer logits (the project's k and q paths over random weights and activations), randn, and
adversarial rows; outputs are poisoned (the kernels write into torch.empty) so unwritten entries show up as a
set mismatch.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu  # skipped without a GPU by tests/conftest.py

from dsa_indexer.backends.cuda import topk as cuda_topk  # noqa: E402
from dsa_indexer.backends.reference import kernels as ref  # noqa: E402

DEVICE = "cuda"


@pytest.fixture(scope="module")
def kernel_ready():
    reason = cuda_topk.probe()
    if reason is not None:
        pytest.skip(reason)


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _plans(rows: int, cols: int, vec: int = 4):
    """The planned launch (None) and every other launch that can hold such rows: each register-kernel chunk
    size with its cluster, and the shared-memory kernel."""
    plans = [None]
    for keys in cuda_topk.REGISTERS_KEYS:
        cluster = -(-cols // (keys * cuda_topk.REGISTERS_THREADS))
        if cluster <= cuda_topk.REGISTERS_MAX_CLUSTER:
            plans.append(cuda_topk.Plan("registers", cluster, keys))
    shared = cuda_topk.plan(rows, cols, _sms(), vec)
    if shared is not None:
        plans.append(cuda_topk.Plan("shared", *shared))
    if cols <= cuda_topk.STREAM_MAX_COLS:  # the streaming kernel, forced on every width (its fallback on short rows)
        plans.append(cuda_topk.Plan("stream", 1, 0))
        # its split pass: 2 CTAs per row (uneven shares of a row's batches) and 8 (CTAs with no batch of a shorter
        # row; rows one CTA holds handed to the cluster's CTAs in turn)
        plans += [cuda_topk.Plan("stream", 2, 0), cuda_topk.Plan("stream", 8, 0)]
    reg = cuda_topk.register_plan(rows, cols, _sms())
    if reg is not None and cuda_topk.SHORT_ROWS_MAX_COLS < cols <= cuda_topk.STREAM_MAX_COLS:
        plans.append(cuda_topk.Plan("routed", *reg))  # both kernels side by side, each row to one of them
    return plans


def _check_short_rows(got, k, ends, starts):
    """Rows with <= k visible columns: every visible position ascending, then -1 (the contract's layout)."""
    got = got.cpu()
    for r in range(got.shape[0]):
        s = int(starts[r]) if starts is not None else 0
        e = int(ends[r])
        if e - s <= k:
            assert torch.equal(got[r, : e - s], torch.arange(max(e - s, 0), dtype=torch.int32)), f"row {r}"
            assert bool((got[r, max(e - s, 0):] == -1).all()), f"row {r}"


def _check(logits, k, ends, starts=None, table=None, req=None, plan=None):
    got = cuda_topk.run_plan(logits, k, ends, starts, table, req, plan)
    want = ref.topk_indices(cuda_topk.nan_as_neg_inf(logits), k, ends, starts, table, req)
    assert got.shape == want.shape and got.dtype == torch.int32
    assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values), f"plan {plan}"
    if table is None:
        _check_short_rows(got, k, ends, starts)
    return got


def _real_logits(batch, ctx, seed):
    from dsa_indexer.testing import real_decode_logits

    logits, lens, table, *_ = real_decode_logits(batch, ctx, DEVICE, seed=seed)
    return logits, lens.reshape(-1), table


@pytest.mark.parametrize("batch,ctx", [(1, 8192), (4, 8192), (3, 32768), (2, 131072)])
def test_real_logits_match_reference(kernel_ready, batch, ctx):
    logits, ends, _ = _real_logits(batch, ctx, seed=batch * 31 + ctx)
    ends2 = torch.randint(1, ctx + 1, (batch,), device=DEVICE, dtype=torch.int32)  # ragged lengths
    for plan in _plans(batch, ctx):
        _check(logits, 2048, ends, plan=plan)
        _check(logits, 2048, ends2, plan=plan)


@pytest.mark.parametrize("batch,ctx", [(16, 8192), (4, 32768)])
def test_triton_rows_path_on_real_logits(batch, ctx):
    """The portable Triton top-k (what AMD GPUs get) on real logits, whose rows include ones with a negative
    k-th value and a positive maximum (the case its first binning handled slowly): same set as the reference."""
    from dsa_indexer.backends.triton import topk as triton_topk

    logits, ends, _ = _real_logits(batch, ctx, seed=batch * 7 + ctx)
    want = ref.topk_indices(logits, 2048, ends)
    got = triton_topk.topk_indices(logits, 2048, ends)
    assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)


@pytest.mark.parametrize("rows,cols,k", [(64, 8192, 2048), (8, 131072, 2048), (1, 262144, 2048), (5, 3000, 512),
                                         (300, 4096, 64), (2, 70001, 2048),
                                         # issue 35: k = 1024 and 4096 (past the staged write's 2 x 2048 bins)
                                         (16, 8192, 1024), (40, 163840, 1024), (16, 32768, 4096), (3, 131072, 4096)])
def test_randn_rows_match_reference(kernel_ready, rows, cols, k):
    logits = torch.randn(rows, cols, device=DEVICE)
    ends = torch.randint(cols // 2, cols + 1, (rows,), device=DEVICE, dtype=torch.int32)
    ends[0] = cols
    for plan in _plans(rows, cols):
        _check(logits, k, ends, plan=plan)


def test_every_plan_writes_the_callers_out_buffer(kernel_ready):
    """``out=``: each launch writes the caller's buffer (poisoned with -7 first, which no result holds), every
    element, and returns it; the same set as the launch without ``out``."""
    logits = torch.randn(6, 70001, device=DEVICE)
    ends = torch.randint(35000, 70002, (6,), device=DEVICE, dtype=torch.int32)
    ends[1] = 100  # fewer columns than k: -1 padding
    for plan in _plans(6, 70001):
        want = cuda_topk.run_plan(logits, 2048, ends, None, None, None, plan)
        out = torch.full((6, 2048), -7, dtype=torch.int32, device=DEVICE)
        assert cuda_topk.run_plan(logits, 2048, ends, None, None, None, plan, out=out) is out
        assert torch.equal(out.sort(dim=1).values, want.sort(dim=1).values), f"plan {plan}"


@pytest.mark.parametrize("cols", [3000, 20000, 70001])
def test_adversarial_rows(kernel_ready, cols):
    gen = torch.Generator(device=DEVICE).manual_seed(int(torch.randint(0, 1 << 30, ())))
    k = 2048 if cols > 2048 else 512
    x = torch.randn(12, cols, device=DEVICE, generator=gen)
    x[0] = 3.25  # all equal
    x[1] = torch.randint(0, 3, (cols,), device=DEVICE, generator=gen).float()  # massive ties at the k-th value
    x[2, ::3] = float("-inf")  # visible -inf
    x[3, ::11] = float("nan")  # NaN ranks as -inf
    x[4] = torch.where(torch.rand(cols, device=DEVICE, generator=gen) < 0.5, 0.0, -0.0)  # signed zeros tie
    x[5] = torch.exp(torch.randn(cols, device=DEVICE, generator=gen) * 8)  # wide dynamic range
    x[6] = 1e6 + torch.randn(cols, device=DEVICE, generator=gen)  # a narrow band far from zero
    x[7, :] = float("-inf")
    x[8] = torch.randn(cols, device=DEVICE, generator=gen) * 1e-30  # denormal-scale values straddling zero
    x[10] = -torch.exp(torch.randn(cols, device=DEVICE, generator=gen))  # only negatives: the threshold below 0
    sparse = torch.rand(cols, device=DEVICE, generator=gen) < 0.05  # a few positives among signed zeros:
    zeros = torch.where(torch.rand(cols, device=DEVICE, generator=gen) < 0.5, 0.0, -0.0)  # the k-th is a zero
    x[11] = torch.where(sparse, torch.rand(cols, device=DEVICE, generator=gen) + 1e-3, zeros)
    ends = torch.full((12,), cols, dtype=torch.int32, device=DEVICE)
    ends[9] = k - 548  # shorter than k: every visible column then -1
    starts = torch.zeros(12, dtype=torch.int32, device=DEVICE)
    for plan in _plans(12, cols):
        _check(x, k, ends, plan=plan)
    starts[2], starts[5], starts[6], starts[11] = 1, min(4097, cols // 2), 123, 2  # windows with starts, unaligned
    for plan in _plans(12, cols):
        _check(x, k, ends, starts, plan=plan)


@pytest.mark.parametrize("cols", [3000, 8192, 40000, 131072])
def test_nan_ranks_as_negative_infinity(kernel_ready, cols):
    """The NaN rule: equal to the reference on the row with NaN replaced by -inf, for NaN at random positions,
    whole-NaN rows, NaN mixed with -inf, rows with fewer non-NaN values than k, and short rows."""
    gen = torch.Generator(device=DEVICE).manual_seed(int(torch.randint(0, 1 << 30, ())))
    k = 2048 if cols > 2048 else 512
    x = torch.randn(8, cols, device=DEVICE, generator=gen)
    x[0, torch.rand(cols, device=DEVICE, generator=gen) < 0.3] = float("nan")  # random positions
    x[1] = float("nan")  # whole row
    nan_or_inf = torch.rand(cols, device=DEVICE, generator=gen)
    x[2, nan_or_inf < 0.4] = float("nan")
    x[2, nan_or_inf > 0.6] = float("-inf")  # NaN and -inf mixed with values
    x[3, k // 2:] = float("nan")  # fewer than k values: NaN selected as -inf would be, lowest columns
    x[4, : cols - k // 3] = float("nan")
    x[4, : cols // 4] = float("-inf")  # NaN / -inf ties around the k-th place
    bits = torch.randint(0x7F800001, 0x7FFFFFFF, (cols,), device=DEVICE, generator=gen, dtype=torch.int32)
    x[5] = torch.where(torch.rand(cols, device=DEVICE, generator=gen) < 0.5, bits.view(torch.float32), x[5])
    x[5, ::2] = -x[5, ::2]  # other NaN bit patterns, both signs
    x[6, ::5] = float("nan")
    x[6, 1::5] = float("inf")
    ends = torch.full((8,), cols, dtype=torch.int32, device=DEVICE)
    ends[7] = k - 5  # a short row holding NaN: every visible column, then -1
    x[7, ::2] = float("nan")
    starts = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    starts[0], starts[2], starts[3] = 3, 77, 1
    for plan in _plans(8, cols):
        _check(x, k, ends, plan=plan)
        _check(x, k, ends, starts, plan=plan)


def test_slot_transform_and_row_request(kernel_ready):
    rows, cols, k = 12, 9000, 2048
    logits = torch.randn(rows, cols, device=DEVICE)
    ends = torch.randint(100, cols + 1, (rows,), device=DEVICE, dtype=torch.int32)
    pages = -(-cols // 64)
    table = torch.randperm(4 * pages, device=DEVICE).to(torch.int32).view(4, pages)
    req = torch.randint(0, 4, (rows,), device=DEVICE, dtype=torch.int32)
    for plan in _plans(rows, cols):
        _check(logits, k, ends, None, table, req, plan=plan)
        _check(logits, k, ends, None, table[:rows] if rows <= 4 else table.repeat(3, 1), None, plan=plan)


@pytest.mark.parametrize("batch,ctx,real", [(8, 32768, True), (2, 131072, False), (64, 8192, False)])
def test_bitwise_repeatable_and_graph_equals_eager(kernel_ready, batch, ctx, real):
    if real:
        logits, ends, _ = _real_logits(batch, ctx, seed=int(torch.randint(0, 1000, ())))
    else:  # ties at the k-th value too: the column tie-break must repeat as well
        logits = torch.randint(0, 200, (batch, ctx), device=DEVICE).float()
        ends = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    ends[0] = ctx // 3
    for plan in _plans(batch, ctx):
        first = cuda_topk.run_plan(logits, 2048, ends, None, None, None, plan)
        for _ in range(20):
            assert torch.equal(cuda_topk.run_plan(logits, 2048, ends, None, None, None, plan), first), plan
        out = torch.full_like(first, -7)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = cuda_topk.run_plan(logits, 2048, ends, None, None, None, plan)
        captured.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        out.copy_(captured)
        assert torch.equal(out, first), plan


def test_strided_logits_rows(kernel_ready):
    base = torch.randn(6, 8192 + 256, device=DEVICE)
    view = base[:, 1:8193]  # unaligned rows: the scalar-load path
    ends = torch.full((6,), 8192, dtype=torch.int32, device=DEVICE)
    for plan in _plans(6, 8192, vec=1):
        _check(view, 2048, ends, plan=plan)


def test_lightning_indexer_cuda_matches_reference_on_its_logits(kernel_ready):
    from dsa_indexer import default_registry, ops
    from dsa_indexer.dispatch.problem import Problem
    from dsa_indexer.dispatch.target import detect_target

    registry = default_registry()
    res = registry.resolve("lightning_indexer", detect_target("cuda"),
                           Problem(heads=64, dim=128, next_n=1, k=2048, fp8="fn", slots=False))
    if res.chosen is None or res.chosen.impl_id != "lightning_indexer.cuda.deepgemm_radix":
        pytest.skip("lightning_indexer.cuda.deepgemm_radix is not chosen here: " + res.explain().splitlines()[-1])
    logits, lens, table, q, weights, cache = _real_decode_step(16, 8192)
    lens_ragged = torch.randint(1, 8193, (16, 1), device=DEVICE, dtype=torch.int32)
    lens_ragged[0] = 0  # a padding row
    for context_lens in (lens, lens_ragged):
        masked = ops.paged_mqa_logits(q, cache.data, weights, context_lens, table, 8192)
        want = ref.topk_indices(masked, 2048, context_lens.reshape(-1))
        got = ops.lightning_indexer(q, cache.data, weights, context_lens, table, 8192, 2048)
        assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)
        slots = ops.lightning_indexer(q, cache.data, weights, context_lens, table, 8192, 2048, return_slots=True)
        want_slots = ref.indices_to_slots(want, table, torch.arange(16, device=DEVICE, dtype=torch.int32))
        assert torch.equal(slots.sort(dim=1).values, want_slots.sort(dim=1).values)


def _real_decode_step(batch, ctx):
    from dsa_indexer.testing import real_decode_logits

    logits, lens, table, q, weights, cache = real_decode_logits(batch, ctx, DEVICE, seed=batch + ctx)
    return logits, lens, table, q, weights, cache


# --- per-row routing: rows of their own lengths inside a padded width (engines pad to max_model_len) -------------
def _padded(lengths, width, seed, above=True):
    """randn rows of the given lengths in a [R, width] tensor whose columns past each row's end hold values above
    every visible one (a kernel that reads past an end selects them, and the set check fails)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = torch.randn(len(lengths), width, generator=gen, device=DEVICE)
    ends = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    past = torch.arange(width, device=DEVICE)[None, :] >= ends[:, None]
    return logits.masked_fill(past, 1e30 if above else float("nan")), ends


@pytest.mark.parametrize("lengths,width", [
    ([8192], 163840), ([8192] * 32, 163840), ([8192] * 128, 163840), ([32768] * 32, 163840),
    ([100, 2048, 2049, 5000, 16384, 16387, 16388, 40000, 131072, 163840], 163840),  # solo / cluster boundaries
    ([3000 + 997 * i for i in range(70)], 131072),  # more rows than one wave of clusters holds
])
def test_rows_routed_by_their_own_length(kernel_ready, lengths, width):
    logits, ends = _padded(lengths, width, seed=len(lengths) * 7 + width % 1000)
    for plan in [None] + [p for p in _plans(len(lengths), width) if p is not None and p.kernel != "shared"]:
        _check(logits, 2048, ends, plan=plan)
        _check(logits, 512, ends, plan=plan)


@pytest.mark.parametrize("packed", [False, True])
def test_mixed_lengths_with_starts_and_slots(kernel_ready, packed, monkeypatch):
    """Solo and cluster rows in one launch, windows with starts, the slot transform through row_request; both
    grids (one cluster per row, and one wave of clusters looping over their rows: PACK_ROWS)."""
    monkeypatch.setattr(cuda_topk, "PACK_ROWS", packed)
    gen = torch.Generator().manual_seed(99)
    rows, width = 96, 163840
    lengths = (torch.rand(rows, generator=gen) * 12.0 + 5.0).exp2().long().clamp(1, width - 64).tolist()
    logits, ends = _padded(lengths, width, seed=5)
    starts = torch.tensor([int(torch.randint(0, max(n // 3, 1), (1,), generator=gen)) for n in lengths],
                          dtype=torch.int32, device=DEVICE)
    table = torch.randperm(64 * (width // 64), generator=gen).to(torch.int32).view(64, width // 64).to(DEVICE)
    req = torch.randint(0, 64, (rows,), generator=gen, dtype=torch.int32).to(DEVICE)
    plan = cuda_topk.Plan("registers", *cuda_topk.register_plan(rows, width, _sms()))
    _check(logits, 2048, ends, starts, plan=plan)
    _check(logits, 2048, ends, starts, table, req, plan=plan)
    _check(logits, 2048, ends, starts, plan=cuda_topk.Plan("stream", 1, 0))
    for cluster in (2, 4):  # the split pass on windows with starts and the slot transform
        _check(logits, 2048, ends, starts, plan=cuda_topk.Plan("stream", cluster, 0))
        _check(logits, 2048, ends, starts, table, req, plan=cuda_topk.Plan("stream", cluster, 0))
    routed = cuda_topk.Plan("routed", *cuda_topk.register_plan(rows, width, _sms()))
    _check(logits, 2048, ends, starts, plan=routed)
    _check(logits, 2048, ends, starts, table, req, plan=routed)


@pytest.mark.parametrize("n_long", [3, 31, 32, 40])
def test_routed_launch_sends_long_rows_by_their_count(kernel_ready, n_long):
    """A routed launch: rows of > 64K columns go to the clusters while fewer than 32 are that long, else they
    stream; short and medium rows beside them, k 2048 and 512, and a captured graph replayed with the other count
    (the route is read on the device at every replay) equal to eager bitwise."""
    width = 163840
    lengths = [70000 + 1237 * i for i in range(n_long)] + [1000, 2049, 8192, 16384, 16389, 40000, 65536]
    logits, ends = _padded(lengths, width, seed=n_long)
    plan = cuda_topk.Plan("routed", *cuda_topk.register_plan(len(lengths), width, _sms()))
    _check(logits, 2048, ends, plan=plan)
    _check(logits, 512, ends, plan=plan)
    out = cuda_topk.run_plan(logits, 2048, ends, None, None, None, plan)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda_topk.run_plan(logits, 2048, ends, None, None, None, plan)
    # Replayed with other lengths: no long row at all, or every row long (32 or more of them from n_long = 31 on).
    other = [min(n, 40000) for n in lengths] if n_long >= 32 else [70000 + 997 * i for i in range(len(lengths))]
    fresh, fresh_ends = _padded(other, width, seed=n_long + 100)
    logits.copy_(fresh)
    ends.copy_(fresh_ends)
    graph.replay()
    want = ref.topk_indices(logits, 2048, ends)
    assert torch.equal(out.sort(dim=1).values, want.sort(dim=1).values)
    assert torch.equal(out, cuda_topk.run_plan(logits, 2048, ends, None, None, None, plan)), "graph != eager"


def test_clusters_looping_over_rows_of_different_groups(kernel_ready):
    """More rows than the grid's 65535 clusters: a cluster meets a second row whose route (one CTA alone, or all 3)
    differs from its first's. Checked on the rows of both turns of the first clusters, and a sample of the rest
    (the reference over 66000 rows would take minutes)."""
    rows, width = 66000, 40000
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    logits = torch.randn(rows, width, generator=gen, device=DEVICE)
    lengths = torch.randint(2049, width + 1, (rows,), generator=gen, device=DEVICE, dtype=torch.int32)
    plan = cuda_topk.Plan("registers", *cuda_topk.register_plan(rows, width, _sms()))
    assert plan.cluster == 3
    got = cuda_topk.run_plan(logits, 2048, lengths, None, None, None, plan)
    probe = torch.cat([torch.arange(0, 600), torch.arange(65400, rows),
                       torch.randint(0, rows, (400,), generator=torch.Generator().manual_seed(4))]).to(DEVICE)
    want = ref.topk_indices(logits[probe], 2048, lengths[probe])
    assert torch.equal(got[probe].sort(dim=1).values, want.sort(dim=1).values)


def test_split_pass_clusters_fit_this_gpu(kernel_ready):
    """The split pass's clusters this GPU runs at once, one CTA per SM with the streaming kernel's shared memory:
    at least one cluster of 8 (the GPU tests force 8 CTAs per row on up to 5 rows), never more CTAs than SMs, fewer
    clusters as they grow (what `launched_plan` narrows a split plan to)."""
    device = torch.device(DEVICE)
    active = {c: cuda_topk.stream_active_clusters(device, c) for c in (2, 4, 8)}
    print("split-pass clusters at once:", active)
    assert active[8] >= 5 and active[2] >= active[4] >= active[8]
    assert all(c * n <= _sms() for c, n in active.items())


@pytest.mark.parametrize("split", [False, True])
def test_padded_graph_replays_other_lengths(kernel_ready, split, monkeypatch):
    """A graph captured at one batch of lengths stays right when replayed with others (the routing is read on
    the device at every replay), and equals the eager call bitwise; with the streaming kernel's split pass (the
    default: 4 CTAs per row planned at 32 rows, narrowed at launch to the clusters the GPU runs at once) and
    without it (SPLIT_STREAM off: one CTA per row)."""
    monkeypatch.setattr(cuda_topk, "SPLIT_STREAM", split)
    cuda_topk.plan_for.cache_clear()
    monkeypatch.setattr(cuda_topk, "plan_for", cuda_topk.plan_for.__wrapped__)
    rows, width = 32, 163840
    logits, ends = _padded([8192] * rows, width, seed=11)
    assert cuda_topk.plan_for(rows, width, _sms(), 4) == cuda_topk.Plan("stream", 4 if split else 1, 0)
    out = cuda_topk.topk_indices(logits, 2048, ends)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda_topk.topk_indices(logits, 2048, ends)
    gen = torch.Generator().manual_seed(12)
    for trial in range(3):
        lengths = (torch.rand(rows, generator=gen) * 6.0 + 11.0).exp2().long().clamp(1, width).tolist()
        fresh, fresh_ends = _padded(lengths, width, seed=20 + trial)
        logits.copy_(fresh)
        ends.copy_(fresh_ends)
        graph.replay()
        want = ref.topk_indices(logits, 2048, ends)
        assert torch.equal(out.sort(dim=1).values, want.sort(dim=1).values), f"trial {trial}"
        assert torch.equal(out, cuda_topk.topk_indices(logits, 2048, ends)), f"trial {trial}: graph != eager"
