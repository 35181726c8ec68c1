"""``out=`` on the top-k ops: the result is written into the caller's int32 buffer, every element of it, and the
buffer itself is returned (engines keep persistent top-k buffers and replay CUDA graphs into them).

For each op and each implementation reachable on the CPU (the reference, the generic compositions, Triton's kernels
in the interpreter behind a simulated sm90, aiter's and FlashInfer's adapters over their doubles, plugins with and
without ``out`` support) the promises are: the same values as the call without ``out`` (exactly: one
implementation, one input), ``is out``, the same storage, no element left as the sentinel it was filled with. An
implementation that declares writes_out receives the buffer itself; one that does not is copied into it. Then each
bad buffer is refused with an error naming ``out``, and each ``<op>_out`` custom op passes opcheck and traces
under torch.compile. DeepGEMM + radix and the NPU adapters: tests/backends (their doubles' fixtures live there); the
CUDA kernels: tests/gpu/test_cuda_topk_gpu.py.
"""

from __future__ import annotations

import contextlib
import sys
import warnings

import pytest
import torch

from dsa_indexer import ops
from dsa_indexer.contract import validate as v
from dsa_indexer.contract.cache import PAGE_SIZE, IndexKCache, page_views
from dsa_indexer.contract.specs import DECLARED, WRITES_OUT_INFO
from dsa_indexer.dispatch import Environment
from dsa_indexer.dispatch.bind import bind
from dsa_indexer.dispatch.plugins import default_registry
from dsa_indexer.dispatch.target import Target

FP8 = torch.float8_e4m3fn
I32 = torch.int32
SENTINEL = 12345  # no index of these tiny problems, and not -1: an element left unwritten keeps it
OUT_OPS = ("topk_indices", "ragged_mqa_topk", "lightning_indexer", "lightning_indexer_ragged")
SM90 = Target("cuda", "sm90")


def _topk_call(slots: bool = False):
    rows, cols, k = 6, 300, 16
    logits = torch.randn(rows, cols)
    ends = torch.randint(40, cols + 1, (rows,), dtype=I32)
    ends[1] = 9  # fewer visible columns than k: -1 padding
    starts = (torch.rand(rows) * (ends - 5).clamp_min(0)).to(I32)
    kwargs = {}
    if slots:
        kwargs = dict(block_table=torch.randperm(40).to(I32)[:30].view(3, 10),
                      row_request=torch.randint(0, 3, (rows,), dtype=I32))
    return (logits, k, ends, starts), kwargs, (rows, k)


def _ragged_call(heads: int = 32):
    s, n, topk = 7, 60, 8
    q = torch.randn(s, heads, 128).to(FP8)
    k = torch.randn(n, 128).to(FP8)
    k_scales = torch.rand(n) + 0.5
    weights = torch.randn(s, heads)
    ks = torch.randint(0, 20, (s,), dtype=I32)
    ke = torch.minimum(ks + torch.randint(3, 45, (s,), dtype=I32), torch.tensor(n, dtype=I32))
    ke[2] = ks[2] + 4  # a row that sees fewer keys than topk
    return (q, k, k_scales, weights, ks, ke, topk), {}, (s, topk)


def _paged_call(slots: bool = False, heads: int = 32):
    batch, next_n, pages, k = 2, 2, 8, 16
    cache = IndexKCache.allocate(pages)
    cache.data.copy_(torch.randint(0, 120, cache.data.shape, dtype=torch.uint8))  # finite fp8 bytes
    page_views(cache.data)[1].copy_(torch.rand(pages, PAGE_SIZE) + 0.1)
    q = torch.randn(batch, next_n, heads, 128).to(FP8)
    weights = torch.randn(batch * next_n, heads)
    lens = torch.stack([torch.tensor([n0, n0 + 1]) for n0 in torch.randint(5, 190, (batch,)).tolist()]).to(I32)
    lens[0] = torch.tensor([7, 8], dtype=I32)  # rows that see fewer keys than k: -1 padding
    table = torch.randperm(pages).to(I32).view(batch, pages // batch)
    return (q, cache.data, weights, lens, table, 256, k), dict(return_slots=slots), (batch * next_n, k)


def _plain_ragged_call():
    cache = IndexKCache.allocate(5, layout="paged64_bf16")
    cache.data.copy_(torch.randn(cache.data.shape))
    q = torch.randn(7, 64, 128, dtype=torch.bfloat16)
    # Three requests: 2 rows of 80 tokens, 4 of 120, and 1 of 5 (fewer than k: -1 padding).
    return ((q, torch.empty(0, dtype=torch.float16), cache.data, torch.empty(0, dtype=torch.float16),
             torch.randn(7, 64), torch.tensor([0, 2, 6, 7], dtype=I32), torch.tensor([80, 120, 5], dtype=I32),
             torch.tensor([[1, 0], [3, 2], [4, 4]], dtype=I32), 16), {}, (7, 16))


CALLS = {"topk_indices": _topk_call, "ragged_mqa_topk": _ragged_call, "lightning_indexer": _paged_call,
         "lightning_indexer_ragged": _plain_ragged_call}


@contextlib.contextmanager
def _served_by(op: str, impl_id: str, simulated_gpu: bool):
    """The default registry forced to ``impl_id`` for ``op``; with ``simulated_gpu`` the environment claims a GPU
    with Triton, so sm90's Triton kernels resolve and run (in the interpreter) on these CPU tensors."""
    registry = default_registry()
    saved = registry.environment
    if simulated_gpu:
        registry.set_environment(Environment.simulated(gpu=True, triton=True))
    previous = registry.force(op, impl_id)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the reference "falls back" on a simulated sm90
            yield
    finally:
        registry.force(op, previous)
        if simulated_gpu:
            registry.set_environment(saved)
        registry.clear_cache()


def _assert_written_in_place(call, op: str, target) -> torch.Tensor:
    args, kwargs, shape = call
    public = getattr(ops, op)
    want = public(*args, **kwargs, target=target)
    out = torch.full(shape, SENTINEL, dtype=I32)
    address = out.data_ptr()
    got = public(*args, **kwargs, out=out, target=target)
    assert got is out
    assert out.data_ptr() == address
    assert not bool((out == SENTINEL).any()), "an element of out was left unwritten"
    assert torch.equal(out, want)
    assert bool((out == -1).any()), "the problem exercises the -1 padding"
    return out


# (op, implementation, problem builder, whether sm90 is simulated so Triton serves)
CASES = [
    ("topk_indices", "topk_indices.reference.torch", _topk_call, False),
    ("topk_indices", "topk_indices.reference.torch", lambda: _topk_call(slots=True), False),
    ("topk_indices", "topk_indices.triton.topk", _topk_call, True),
    ("topk_indices", "topk_indices.triton.topk", lambda: _topk_call(slots=True), True),
    ("ragged_mqa_topk", "ragged_mqa_topk.reference.torch", _ragged_call, False),
    ("ragged_mqa_topk", "ragged_mqa_topk.generic.composed", _ragged_call, False),
    ("ragged_mqa_topk", "ragged_mqa_topk.generic.composed", _ragged_call, True),  # Triton logits + top-k inside
    ("ragged_mqa_topk", "ragged_mqa_topk.triton.fused_topk", _ragged_call, True),
    ("lightning_indexer", "lightning_indexer.reference.torch", _paged_call, False),
    ("lightning_indexer", "lightning_indexer.reference.torch", lambda: _paged_call(slots=True), False),
    ("lightning_indexer", "lightning_indexer.generic.composed", _paged_call, False),
    ("lightning_indexer", "lightning_indexer.generic.composed", lambda: _paged_call(slots=True), True),
    ("lightning_indexer_ragged", "lightning_indexer_ragged.reference.torch", _plain_ragged_call, False),
]


@pytest.mark.parametrize("op, impl_id, make, simulated_gpu", CASES,
                         ids=[f"{impl}-{'sm90' if gpu else 'cpu'}-{n}" for n, (_, impl, _, gpu) in enumerate(CASES)])
def test_out_is_written_whole_and_returned(op, impl_id, make, simulated_gpu):
    call = make()
    with _served_by(op, impl_id, simulated_gpu):
        target = SM90 if simulated_gpu else None
        problem = getattr(ops, op).problem(*getattr(ops, op).decl.check(*call[0], **call[1])[:-1])
        assert bind(op, target or Target("cpu", "cpu"), problem).impl_id == impl_id
        _assert_written_in_place(call, op, target)


def test_every_builtin_implementation_of_these_ops_says_whether_it_writes_out():
    """Where a kernel can store into the caller's buffer it declares so; the two vendor calls that return their own
    tensors (FlashInfer, torch_npu) do not, and the dispatch layer copies for them."""
    registry = default_registry()
    copied = {"topk_indices.cuda.flashinfer", "lightning_indexer.npu.torch_npu_fp8",
              "lightning_indexer_ragged.npu.torch_npu"}
    for op in OUT_OPS:
        for impl in registry.implementations(op):
            if impl.origin not in registry.builtin_origins:
                continue
            assert bool(impl.info.get(WRITES_OUT_INFO)) == (impl.impl_id not in copied), impl.impl_id


def test_triton_topk_writes_out_on_both_of_its_paths():
    from dsa_indexer.backends.triton import topk as triton_topk

    (logits, k, ends, starts), _, shape = _topk_call()
    for path in ("rows", "split"):
        with triton_topk.config_override(path=path):
            want = triton_topk.topk_indices(logits, k, ends, starts)
            out = torch.full(shape, SENTINEL, dtype=I32)
            assert triton_topk.topk_indices(logits, k, ends, starts, out=out) is out
        assert torch.equal(out, want), path


def test_a_persistent_buffers_row_slice_is_written_and_nothing_past_it():
    """An engine hands ``buffer[:rows]`` of a buffer sized for its largest batch: that view is contiguous."""
    (logits, k, ends, starts), _, (rows, _) = _topk_call()
    buffer = torch.full((rows + 5, k), SENTINEL, dtype=I32)
    got = ops.topk_indices(logits, k, ends, starts, out=buffer[:rows])
    assert got.data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[:rows], ops.topk_indices(logits, k, ends, starts))
    assert bool((buffer[rows:] == SENTINEL).all())


@contextlib.contextmanager
def _vendor_served(op: str, impl_id: str, environment: Environment):
    """The default registry in ``environment`` (a simulated GPU with the vendor library present) with ``op`` forced
    to ``impl_id``, whose factory then builds its adapter over the test's double of the library."""
    registry = default_registry()
    saved = registry.environment
    registry.set_environment(environment)
    previous = registry.force(op, impl_id)
    try:
        yield
    finally:
        registry.force(op, previous)
        registry.set_environment(saved)
        registry._factories.pop(impl_id, None)  # built over this test's double: not to be served to a later test
        registry.clear_cache()


def test_aiters_top_k_writes_out_as_the_kernels_indices_argument(monkeypatch):
    """aiter's top_k_per_row_decode writes its ``indices`` argument in place: with ``out=`` that argument is the
    caller's buffer itself (positions, and slots converted in it). The double (tests/doubles/aiter.py) writes its
    result into ``indices`` as the kernel does; it says nothing about aiter's kernel."""
    from doubles.aiter import install_fake_aiter

    fake = install_fake_aiter(monkeypatch, with_stable=True)
    rows = 5
    logits = torch.randn(rows, 3000)
    ends = torch.tensor([3000, 10, 2049, 2500, 700], dtype=I32)  # row 1: fewer columns than k, -1 padded
    table = torch.randperm(3 * 47).to(I32).view(3, 47)
    slots = dict(block_table=table, row_request=torch.randint(0, 3, (rows,), dtype=I32))
    with _vendor_served("topk_indices", "topk_indices.rocm.aiter_stable",
                        Environment.simulated(gpu=True, triton=True, aiter=True)):
        for kwargs in ({}, slots):
            out = _assert_written_in_place(((logits, 2048, ends), kwargs, (rows, 2048)), "topk_indices",
                                           Target("rocm", "gfx942"))
            assert fake.calls[-1][1][3] is out  # the kernel's indices argument
    assert len(fake.calls) == 4  # aiter's kernel served every call


def test_flashinfers_top_k_returns_its_own_tensor_which_dispatch_copies_into_out(monkeypatch):
    """FlashInfer's top_k_ragged_transform takes no output buffer: its registration declares no writes_out and its
    adapter takes no ``out`` (a TypeError if handed one); the dispatch layer copies the result into the buffer. The
    double (tests/doubles/flashinfer.py) follows FlashInfer's documented semantics; it is not FlashInfer."""
    from doubles.flashinfer import flashinfer_double

    module, calls = flashinfer_double()
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    (logits, k, ends, _), _, shape = _topk_call()  # FlashInfer's windows start at column 0
    with _vendor_served("topk_indices", "topk_indices.cuda.flashinfer",
                        Environment.simulated(gpu=True, flashinfer=True)):
        _assert_written_in_place(((logits, k, ends), {}, shape), "topk_indices", SM90)
    assert len(calls) == 2


@pytest.mark.parametrize("slots", [False, True])
def test_the_cuda_top_k_hands_out_to_the_triton_top_k_for_rows_no_launch_holds(monkeypatch, slots):
    """`topk_indices.cuda.radix` serves rows no CUDA launch holds with the Triton top-k: the caller's buffer goes
    with them. The CUDA kernels themselves (which get ``out``'s pointer) run on a GPU only."""
    from dsa_indexer.backends.cuda import topk as cuda_topk
    from dsa_indexer.backends.triton import topk as triton_topk

    real = triton_topk.topk_indices
    received = []

    def recording(*args, out=None):
        received.append(out)
        return real(*args, out=out)

    monkeypatch.setattr(triton_topk, "topk_indices", recording)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # CPU tensors: the device's facts stood in
    monkeypatch.setattr(cuda_topk, "_device_facts", lambda index: (132, 232448, (9, 0)))
    monkeypatch.setattr(cuda_topk, "plan_for", lambda *args, **kwargs: None)  # no CUDA launch holds the rows
    (logits, k, ends, starts), kwargs, shape = _topk_call(slots)
    rest = (kwargs["block_table"], kwargs["row_request"]) if slots else (None, None)
    want = real(logits, k, ends, starts, *rest)
    out = torch.full(shape, SENTINEL, dtype=I32)
    assert cuda_topk.topk_indices(logits, k, ends, starts, *rest, out=out) is out
    assert received == [out] and torch.equal(out, want)
    reference = ops.topk_indices(logits, k, ends, starts, **kwargs)  # the same sets (order is not the contract's)
    assert torch.equal(out.sort(dim=1).values, reference.sort(dim=1).values)


def _reference_topk_without_out(logits, k, ends, starts=None, block_table=None, row_request=None):
    """A plugin's top-k written before ``out=`` existed: it takes no ``out`` (passing one would be a TypeError)."""
    from dsa_indexer.backends.reference import kernels as ref

    return ref.topk_indices(logits, k, ends, starts, block_table, row_request)


@contextlib.contextmanager
def _plugin_topk(fn, info=None):
    """``fn`` registered as an sm103 top-k (an arch no built-in serves), as a vendor's plugin registers one."""
    registry = default_registry()
    registry.implementation("topk_indices", impl_id="topk_indices.outtest.plugin", targets=("sm103",), priority=900,
                            info=info)(lambda: fn)
    try:
        yield
    finally:
        registry.unregister("topk_indices.outtest.plugin")


# The ops whose sm103 call reaches the plugin's top-k: itself, and the compositions' inner top-k
# (`contract.specs.call_into`).
THROUGH_PLUGIN = [("topk_indices", None), ("ragged_mqa_topk", "ragged_mqa_topk.generic.composed"),
                  ("lightning_indexer", "lightning_indexer.generic.composed")]


@pytest.mark.parametrize("op, composed", THROUGH_PLUGIN)
def test_an_implementation_without_out_support_still_serves_out_by_a_copy(op, composed):
    """A plugin top-k that takes no ``out`` and does not declare writes_out: a call with ``out=`` is served all the
    same, the dispatch layer (or the composition) copying its result into the buffer."""
    calls = []

    def no_out(*args):
        calls.append(args)
        return _reference_topk_without_out(*args)

    with _plugin_topk(no_out), contextlib.ExitStack() as stack:
        if composed is not None:
            stack.enter_context(_served_by(op, composed, simulated_gpu=False))
        _assert_written_in_place(CALLS[op](), op, Target("cuda", "sm103"))
    assert len(calls) == 2  # the plugin served both calls, the one without out= and the one with it


@pytest.mark.parametrize("op, composed", THROUGH_PLUGIN)
def test_a_plugin_that_declares_writes_out_receives_the_buffer(op, composed):
    received = []

    def writes_into(logits, k, ends, starts=None, block_table=None, row_request=None, *, out=None):
        from dsa_indexer.backends.reference import kernels as ref

        received.append(out)
        return ref.topk_indices(logits, k, ends, starts, block_table, row_request, out=out)

    with _plugin_topk(writes_into, {WRITES_OUT_INFO: True}), contextlib.ExitStack() as stack:
        if composed is not None:
            stack.enter_context(_served_by(op, composed, simulated_gpu=False))
        out = _assert_written_in_place(CALLS[op](), op, Target("cuda", "sm103"))
    assert received[0] is None and received[1] is out  # without out=, then the caller's buffer itself


def test_a_writes_out_implementation_that_allocates_after_all_is_still_copied_into_out():
    """An implementation may declare writes_out yet take a path that allocates (a fallback inside it): the op still
    returns the caller's buffer, filled."""
    def ignores_out(logits, k, ends, starts=None, block_table=None, row_request=None, *, out=None):
        return _reference_topk_without_out(logits, k, ends, starts, block_table, row_request)

    with _plugin_topk(ignores_out, {WRITES_OUT_INFO: True}):
        _assert_written_in_place(_topk_call(), "topk_indices", Target("cuda", "sm103"))


def _bad_buffers(shape, inputs: dict[str, torch.Tensor]):
    rows, k = shape
    yield "a-list", torch.zeros(shape, dtype=I32).tolist(), "must be a torch.Tensor"
    yield "int64", torch.zeros(shape, dtype=torch.int64), "dtype int32"
    yield "one-column-short", torch.zeros(rows, k - 1, dtype=I32), "shape"
    yield "one-row-more", torch.zeros(rows + 1, k, dtype=I32), "shape"
    yield "meta", torch.zeros(shape, dtype=I32, device="meta"), "is on meta"
    yield "transposed", torch.zeros(k, rows, dtype=I32).t(), "contiguous"
    yield "column-slice", torch.zeros(rows, k + 3, dtype=I32)[:, :k], "contiguous"
    yield "rows-broadcast", torch.zeros(1, k, dtype=I32).expand(rows, k), "contiguous"  # every row one memory row
    for name, tensor in inputs.items():
        if tensor.numel() * tensor.element_size() >= rows * k * 4:
            alias = tensor.view(-1).view(torch.uint8)[: rows * k * 4].view(I32).view(rows, k)
            yield f"overlaps-{name}", alias, f"shares memory with {name}"


@pytest.mark.parametrize("op", OUT_OPS)
def test_a_bad_out_is_refused_naming_out(op):
    args, kwargs, shape = CALLS[op]()
    names = DECLARED[op].arguments
    inputs = {n: a for n, a in zip(names, args) if isinstance(a, torch.Tensor) and a.dim() > 0}
    seen = 0
    for what, buffer, message in _bad_buffers(shape, inputs):
        with pytest.raises(v.IndexerInputError, match=rf"^out\b.*{message}") as caught:
            getattr(ops, op)(*args, **kwargs, out=buffer)
        assert "out" in str(caught.value), what
        seen += 1
    assert seen > 8  # at least one input big enough to alias


def test_out_is_keyword_only_and_declared_once():
    for op in OUT_OPS:
        decl = DECLARED[op]
        assert decl.out == "out" and "out" not in decl.arguments
        assert "Tensor(a" in decl.out_schema and decl.out_schema.endswith("out) -> ()")
        assert hasattr(torch.ops.dsa_indexer, f"{op}_out")
    with pytest.raises(TypeError):
        ops.topk_indices(torch.randn(2, 8), 2, torch.tensor([8, 8], dtype=I32), None, torch.zeros(2, 2, dtype=I32))


@pytest.mark.parametrize("op", OUT_OPS)
def test_the_out_ops_pass_opcheck(op):
    """``<op>_out`` as torch.library sees it: its fake, its autograd registration and (inputs without fp8) its
    schema's mutation annotation, which must name ``out`` as what it writes."""
    args, kwargs, shape = CALLS[op]()
    arguments = ops.OPERATORS[op].arguments(*args, **kwargs)  # the checked implementation arguments, out left out
    utils = ("test_faketensor", "test_autograd_registration")
    if not any(isinstance(a, torch.Tensor) and a.dtype == FP8 for a in arguments):
        utils = ("test_schema",) + utils  # torch cannot compare fp8 tensors there (test_torch_integration.py)
    out = torch.full(shape, SENTINEL, dtype=I32)
    torch.library.opcheck(getattr(torch.ops.dsa_indexer, f"{op}_out").default, (*arguments, out), test_utils=utils)


@pytest.mark.parametrize("op", OUT_OPS)
def test_out_under_torch_compile_writes_the_buffer(op):
    """A compiled caller (fullgraph: the ``<op>_out`` custom op traces without a graph break) fills its buffer with
    what the eager call without ``out`` returns, and gets that buffer's values back."""
    args, kwargs, shape = CALLS[op]()
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def score(out, *inputs):
        call = list(args)
        for i, tensor in zip(tensors, inputs):
            call[i] = tensor
        return getattr(ops, op)(*call, **kwargs, out=out)

    want = getattr(ops, op)(*args, **kwargs)
    out = torch.full(shape, SENTINEL, dtype=I32)
    compiled = torch.compile(score, backend="aot_eager", fullgraph=True)  # aot: the mutation is functionalized
    got = compiled(out, *(args[i] for i in tensors))
    assert torch.equal(out, want) and torch.equal(got, want)
    assert got.data_ptr() == out.data_ptr()

    traced = []

    def recording(graph_module, example_inputs):
        traced.extend(node.target for node in graph_module.graph.nodes)
        return graph_module.forward

    torch.compile(score, backend=recording, fullgraph=True)(torch.empty(shape, dtype=I32), *(args[i] for i in tensors))
    packet = getattr(torch.ops.dsa_indexer, f"{op}_out")
    assert packet in traced or packet.default in traced  # the op is in the graph, not a trace of its body
