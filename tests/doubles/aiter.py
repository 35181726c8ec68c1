"""TEST DOUBLES of amd-aiter (not aiter): its ragged logits (with the alignment bug of 0.1.7), decode top-k and
fused RMSNorm + quant, each emulated from aiter's kernel source, and a double of aiter main's paged logits that keeps
upstream's routing rules (ROCm/aiter main e4048607); the installers put a fake ``aiter`` package in sys.modules for
a test. They drive the AMD adapters without aiter or an AMD GPU; they say nothing about aiter's kernels."""

import sys
import types

import torch

from dsa_indexer.backends.reference import kernels as ref


# --- fake aiter ------------------------------------------------------------------------------------------------------
def emulated_fp8_mqa_logits(q, kv, kv_scales, weights, cu_starts, cu_ends):
    """What aiter 0.1.7's ``_fp8_mqa_logits_kernel`` computes, emulated in torch from its documented block walk:
    unmasked 128-column blocks from the row start up to the first block start >= ``end // 128 * 128``, then one
    block whose window test uses offsets from ``end // 128 * 128`` while its pointers continue from the loop
    (the alignment bug). Stores past the row end land in the next row or outside the buffer in the real kernel;
    here they are dropped."""
    rows, keys = q.shape[0], kv.shape[0]
    out = torch.full((rows, keys), float("-inf"))
    full = ref.ragged_mqa_logits(q, kv, kv_scales, weights, torch.zeros(rows, dtype=torch.int32),
                                 torch.full((rows,), keys, dtype=torch.int32))
    for r in range(rows):
        start, end = max(int(cu_starts[r]), 0), min(int(cu_ends[r]), keys)
        aligned_end = end // 128 * 128
        col = start
        while col < aligned_end:
            out[r, col:min(col + 128, keys)] = full[r, col:min(col + 128, keys)]
            col += 128
        if aligned_end != end:
            for i in range(128):
                offset, dst = aligned_end + i, col + i
                if start <= offset < end and dst < keys:
                    out[r, dst] = full[r, dst] if offset < keys else 0.0
    return out


def _twiddled_keys(values: torch.Tensor) -> torch.Tensor:
    """aiter's ``twiddle_in`` (csrc/kernels/topk_per_row_kernels.cu, e4048607): fp32 bits XOR 0x7fffffff for a clear
    sign bit, unchanged for a set one; the kernel keeps the SMALLEST keys. So larger values win, and a positive NaN
    (0x7fc00000) beats +inf while a negative NaN loses to -inf."""
    bits = values.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(bits >= 0x80000000, bits, bits ^ 0x7FFFFFFF)


def emulated_top_k_per_row_decode(logits, next_n, seqLens, indices, numRows, stride0, stride1):
    """aiter's decode top-k semantics (row r sees [0, seqLens[r // next_n] - next_n + r % next_n + 1); short rows
    give 0..len-1 then -1; long rows the 2048 smallest twiddled keys, ties to the lower column), so a NaN is ranked
    as aiter's kernel ranks it, not by the library's rule."""
    rows = torch.arange(numRows)
    ends = (seqLens.long()[rows // next_n] - next_n + rows % next_n + 1)
    out = torch.full((numRows, 2048), -1, dtype=torch.int32)
    for r in range(numRows):
        end = int(ends[r])
        if end <= 2048:
            out[r, : max(end, 0)] = torch.arange(max(end, 0), dtype=torch.int32)
            continue
        keys = _twiddled_keys(logits[r, :end])
        out[r] = torch.sort(keys, stable=True).indices[:2048].to(torch.int32)
    indices.copy_(out)


def _emulated_fused_rms_fp8_group_quant(inp1, inp1_weight, inp1_epsilon, inp2=None, inp2_weight=None,
                                        inp2_epsilon=None, group_size=128, dtype_quant=torch.float8_e4m3fn, res1=None,
                                        output_unquantized_inp1=False, transpose_scale=False):
    """aiter's fused RMSNorm + group quant recipe in torch: quantize the fp32 normed value (before the bf16
    rounding), amax clamped at 1e-10, range torch.finfo(dtype).max, multiply by 1/scale."""
    xf = inp1.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + inp1_epsilon) * inp1_weight.float()
    groups = normed.reshape(normed.shape[0], -1, group_size)
    fmax = torch.finfo(dtype_quant).max
    scale = groups.abs().amax(dim=-1).clamp_min(1e-10) / fmax
    x_fp8 = (groups * (1.0 / scale)[..., None]).clamp(-fmax, fmax).to(dtype_quant).reshape(inp1.shape)
    return (x_fp8, scale), (normed.to(inp1.dtype) if output_unquantized_inp1 else None), None, None


# --- a double of aiter's paged logits that keeps upstream's routing rules (ROCm/aiter main e4048607) ---------------
GLUON_ARCHS = ("gfx942", "gfx950", "gfx1250")  # aiter's _GLUON_PA_MQA_LOGITS_ARCHS


def _paged_scores(q_row, keys, scales, w_row):
    """sum_h w[h] * relu(q[h] . k) * scale, in fp32 (what every variant computes once it has its keys)."""
    return torch.relu(q_row.float() @ keys.float().T).mul(w_row.float()[:, None]).sum(0) * scales.float()


class PlainPagedKernelDouble:
    """aiter's plain Triton ``_deepgemm_fp8_paged_mqa_logits``, emulated from its source: program ``pid`` ->
    (row, split), chunks of ChunkK keys, key t of request b read at ``kv_indices[b, t // KVBlockSize]`` block and
    token ``t % KVBlockSize`` through the block / token strides it is given (pointer arithmetic via as_strided), a
    -inf mask for ``t > len - next_n + row``, stores below ``max_model_len``. Only launched programs write."""

    # The kernel's parameters in ROCm/aiter e4048607 (kept here as data, independent of the adapter under test).
    arg_names = ["batch_size", "next_n", "heads_num", "Q_buffer", "stride_q_batch", "stride_q_next_n",
                 "stride_q_heads", "KV_buffer", "stride_k_block", "stride_k_token", "scale_buffer",
                 "stride_scale_block", "stride_scale_token", "context_len_ptr", "kv_indices", "weights",
                 "stride_w_batch", "OutLogits_buffer", "stride_out_batch", "max_model_len", "max_blk_len", "ChunkQ",
                 "ChunkK", "HiddenDim", "KVBlockSize", "SplitKV"]

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(**kw):
            missing = set(self.arg_names) - set(kw)
            assert not missing, f"kernel launched without {sorted(missing)}"
            self.launches.append((grid, kw))
            self._run(grid[0], **kw)
        return launch

    @staticmethod
    def _run(programs, *, batch_size, next_n, heads_num, Q_buffer, stride_q_batch, stride_q_next_n, stride_q_heads,
             KV_buffer, stride_k_block, stride_k_token, scale_buffer, stride_scale_block, stride_scale_token,
             context_len_ptr, kv_indices, weights, stride_w_batch, OutLogits_buffer, stride_out_batch,
             max_model_len, max_blk_len, ChunkQ, ChunkK, HiddenDim, KVBlockSize, SplitKV):
        assert ChunkQ == heads_num and Q_buffer.stride(3) == 1
        blocks = KV_buffer.shape[0]
        keys = torch.as_strided(KV_buffer, (blocks, KVBlockSize, HiddenDim), (stride_k_block, stride_k_token, 1))
        kscale = torch.as_strided(scale_buffer, (blocks, KVBlockSize), (stride_scale_block, stride_scale_token))
        table = kv_indices.reshape(-1)
        out = torch.as_strided(OutLogits_buffer, (batch_size * next_n, max_model_len), (stride_out_batch, 1))
        for pid in range(programs):
            row, split = pid % (batch_size * next_n), pid // (batch_size * next_n)
            b, j = row // next_n, row % next_n
            length = int(context_len_ptr[b])
            per_split = -(-(-(-length // ChunkK)) // SplitKV)
            start = split * per_split * ChunkK
            stop = min(length, start + per_split * ChunkK)
            if stop <= start:
                continue
            cols = torch.arange(start, -(-stop // ChunkK) * ChunkK)
            block_idx = cols // KVBlockSize
            valid = (cols < length) & (block_idx < max_blk_len)
            phys = torch.where(valid, table[(b * max_blk_len + block_idx).clamp_max(table.numel() - 1)], 0).long()
            q = torch.as_strided(Q_buffer, (heads_num, HiddenDim), (stride_q_heads, 1),
                                 Q_buffer.storage_offset() + b * stride_q_batch + j * stride_q_next_n)
            w = torch.as_strided(weights, (heads_num,), (1,), weights.storage_offset() + row * stride_w_batch)
            k = torch.where(valid[:, None], keys[phys, cols % KVBlockSize].float(), 0.0)
            s_ = torch.where(valid, kscale[phys, cols % KVBlockSize], 0.0)
            logits = _paged_scores(q, k, s_, w)
            logits = torch.where(cols <= length - next_n + j, logits, float("-inf"))
            keep = cols < max_model_len
            out[row, cols[keep]] = logits[keep]


def _gluon_page_size_one(q, kv_fp8, kv_scale, weights, out, context_lens, kv_indices, max_model_len, chunk):
    """aiter's ``_gluon_deepgemm_fp8_paged_mqa_logits`` (Preshuffle=False) addressing, from its source: key t of
    request b is row ``kv_indices[b * max_block_len + t]`` of ``KV_buffer`` with stride ``stride_k_seq`` (page size
    1, KVBlockSize unused); buffer loads past the table's end read 0."""
    batch, next_n, heads, dim = q.shape
    table = kv_indices.reshape(-1)
    width = kv_indices.shape[1]
    keys = torch.as_strided(kv_fp8, (kv_fp8.shape[0], dim), (kv_fp8.stride(0), 1))
    scales = torch.as_strided(kv_scale, (kv_scale.shape[0],), (kv_scale.stride(0),))
    for b in range(batch):
        length = int(context_lens[b])
        cols = torch.arange(min(-(-length // chunk) * chunk, max_model_len))
        flat = b * width + cols
        idx = torch.where(flat < table.numel(), table[flat.clamp_max(table.numel() - 1)], 0).long()
        for j in range(next_n):
            row = b * next_n + j
            logits = _paged_scores(q[b, j], keys[idx], scales[idx], weights[row])
            out[row, cols] = torch.where(cols <= length - next_n + j, logits, float("-inf"))


def _gluon_preshuffled(q, kv_fp8, kv_scale, weights, out, context_lens, kv_indices, max_model_len, block):
    """aiter's preshuffle kernels' addressing: in each block, key (t, d) at ``d % 16 + d // 16 * 256 + t % 16 * 16
    + t // 16 * 2048`` (16 x 16 tiles), scales per token after the values."""
    batch, next_n, heads, dim = q.shape
    t = torch.arange(block)[:, None]
    d = torch.arange(dim)[None, :]
    offset = d % 16 + d // 16 * 256 + t % 16 * 16 + t // 16 * 2048
    for b in range(batch):
        length = int(context_lens[b])
        cols = torch.arange(min(length, max_model_len))
        phys = kv_indices[b, cols // block].long()
        keys = kv_fp8[phys][torch.arange(cols.numel())[:, None], offset[cols % block]]
        scales = kv_scale[phys, cols % block]
        for j in range(next_n):
            row = b * next_n + j
            logits = _paged_scores(q[b, j], keys, scales, weights[row])
            out[row, cols] = torch.where(cols <= length - next_n + j, logits, float("-inf"))


def _make_paged_wrapper(module, gfx, plain_kernel):
    """aiter's ``deepgemm_fp8_paged_mqa_logits`` with its asserts and its routing: Gluon when the module's
    ``enable_gluon_pa_mqa_logits`` is set (gfx1250 asserts KVBlockSize == 1 without preshuffle), else the plain
    kernel (Preshuffle refused)."""

    def deepgemm_fp8_paged_mqa_logits(q_fp8, kv_cache, weights, out_logits, context_lens, kv_indices, max_model_len,
                                      Preshuffle=False, KVBlockSize=1, ChunkK=256, TotalCuCount=None, WavePerEU=2,
                                      VarCtxSchedule=None):
        module.wrapper_calls.append(dict(Preshuffle=Preshuffle, KVBlockSize=KVBlockSize, ChunkK=ChunkK))
        batch, next_n, heads, dim = q_fp8.shape
        _, block_size, _, index_dim = kv_cache.shape
        assert ChunkK % KVBlockSize == 0 or KVBlockSize % ChunkK == 0
        assert block_size == KVBlockSize
        if Preshuffle:
            assert KVBlockSize % 16 == 0, "Preshuffle mode only supports KVBlockSize aligned to 16"
        kv = kv_cache.view(-1, KVBlockSize * index_dim)
        kv_fp8 = kv[..., : KVBlockSize * dim].view(q_fp8.dtype)
        kv_scale = kv[..., KVBlockSize * dim:].view(torch.float32)
        if module.enable_gluon_pa_mqa_logits:
            if gfx == "gfx1250":
                if Preshuffle:
                    assert KVBlockSize > 1 and ChunkK % KVBlockSize == 0
                else:
                    assert KVBlockSize == 1, "gfx1250 base kernel requires KVBlockSize==1"
            if Preshuffle:
                _gluon_preshuffled(q_fp8, kv_fp8, kv_scale, weights, out_logits, context_lens, kv_indices,
                                   max_model_len, KVBlockSize)
            else:
                _gluon_page_size_one(q_fp8, kv_fp8, kv_scale, weights, out_logits, context_lens, kv_indices,
                                     max_model_len, ChunkK)
            return
        assert not Preshuffle, "Preshuffle mode is only supported on gluon kernel."
        values = kv_fp8.view(-1, KVBlockSize, dim)
        scales = kv_scale.view(-1, KVBlockSize)
        split = 5
        plain_kernel[(batch * next_n * split,)](
            batch_size=batch, next_n=next_n, heads_num=heads, Q_buffer=q_fp8, stride_q_batch=q_fp8.stride(0),
            stride_q_next_n=q_fp8.stride(1), stride_q_heads=q_fp8.stride(2), KV_buffer=values,
            stride_k_block=values.stride(0), stride_k_token=values.stride(1), scale_buffer=scales,
            stride_scale_block=scales.stride(0), stride_scale_token=scales.stride(1), context_len_ptr=context_lens,
            kv_indices=kv_indices, weights=weights, stride_w_batch=weights.stride(0), OutLogits_buffer=out_logits,
            stride_out_batch=out_logits.stride(0), max_model_len=max_model_len, max_blk_len=kv_indices.shape[1],
            ChunkQ=heads, ChunkK=ChunkK, HiddenDim=dim, KVBlockSize=KVBlockSize, SplitKV=split)

    return deepgemm_fp8_paged_mqa_logits


def _install_paged_double(monkeypatch, mods, triton_version="3.5.0", gfx="gfx950", aot=False):
    """aiter main's paged-logits modules: the routing flag computed by upstream's rule (Triton >= 3.5 and a Gluon
    arch, or the AOT switch on older Triton), the wrapper above and the plain kernel double."""
    from packaging.version import Version

    kernel_mod = types.ModuleType("aiter.ops.triton._triton_kernels.attention.pa_mqa_logits")
    wrapper_mod = types.ModuleType("aiter.ops.triton.attention.pa_mqa_logits")
    kernel_mod._deepgemm_fp8_paged_mqa_logits = PlainPagedKernelDouble()
    wrapper_mod.triton_version = Version(triton_version)
    wrapper_mod.enable_gluon_pa_mqa_logits = gfx in GLUON_ARCHS and (Version(triton_version) >= Version("3.5.0")
                                                                       or aot)
    wrapper_mod.wrapper_calls = []
    wrapper = _make_paged_wrapper(wrapper_mod, gfx, kernel_mod._deepgemm_fp8_paged_mqa_logits)
    wrapper.__module__ = wrapper_mod.__name__
    wrapper_mod.deepgemm_fp8_paged_mqa_logits = wrapper
    for name in ("aiter.ops.triton._triton_kernels", "aiter.ops.triton._triton_kernels.attention",
                 "aiter.ops.triton.attention"):
        pkg = types.ModuleType(name)
        pkg.__path__ = []
        mods[name] = pkg
        monkeypatch.setitem(sys.modules, name, pkg)
    for mod in (kernel_mod, wrapper_mod):
        mods[mod.__name__] = mod
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return wrapper_mod, kernel_mod


def _offload_bundle(archs) -> bytes:
    """Bytes standing for a HIP module's embedded code objects: one clang offload-bundle entry id per arch (what
    aiter's arch check scans a ``.so`` for), amid filler."""
    entries = b"".join(b"\0hipv4-amdgcn-amd-amdhsa--" + arch.encode() + b"\0" for arch in archs)
    return b"\x7fELF fake module\0" + entries + b"\0tail"


def _install_arch_check(core, jit_dir, running_arch):
    """aiter's check of a prebuilt module's arch (ROCm/aiter v0.1.17 on, `aiter/jit/core.py` at e4048607:
    ``_needs_arch_rebuild`` with ``_so_offload_archs``, ``get_user_jit_dir``, ``get_gfx_runtime``), emulated from its
    source: the gfx names of ``<user jit dir>/<md>.so``'s offload-bundle ids; rebuild when there are some and the
    running GPU's arch is not among them; no file or no ids: no rebuild."""
    import os
    import re

    def get_user_jit_dir():
        return os.environ.get("AITER_JIT_DIR") or str(jit_dir)

    def get_gfx_runtime():
        return running_arch

    def _so_offload_archs(path):
        try:
            data = open(path, "rb").read()
        except OSError:
            return set()
        return {m.group(1).decode() for m in re.finditer(rb"amdhsa--(gfx[0-9a-z]+)", data)}

    def _needs_arch_rebuild(md_name):
        built = _so_offload_archs(os.path.join(get_user_jit_dir(), f"{md_name}.so"))
        return bool(built) and get_gfx_runtime() not in built

    core.get_user_jit_dir, core.get_gfx_runtime = get_user_jit_dir, get_gfx_runtime
    core._so_offload_archs, core._needs_arch_rebuild = _so_offload_archs, _needs_arch_rebuild


def _install_fake_jit(monkeypatch, mods, tmp_path, prebuilt=(), rebuild=0, running_arch=None, built_for=None):
    """``aiter.jit`` with a ``core`` holding AITER_REBUILD, and a package folder holding ``<module>.so`` files for
    the modules named prebuilt (find_spec only looks for the file; aiter writes ``<md_name>.so``). ``running_arch``:
    this GPU's arch for aiter's arch check (v0.1.17 on), None for an older aiter without that check;
    ``built_for``: module -> the archs its ``.so`` holds code objects for (default: none named)."""
    jit_dir = tmp_path / "aiter_jit"
    jit_dir.mkdir(exist_ok=True)
    for md in prebuilt:
        (jit_dir / f"{md}.so").write_bytes(_offload_bundle((built_for or {}).get(md, ())))
    jit = types.ModuleType("aiter.jit")
    jit.__path__ = [str(jit_dir)]
    core = types.ModuleType("aiter.jit.core")
    core.AITER_REBUILD = rebuild
    if running_arch is not None:
        _install_arch_check(core, jit_dir, running_arch)
    jit.core = core
    mods["aiter"].jit = jit
    monkeypatch.setitem(sys.modules, "aiter.jit", jit)
    monkeypatch.setitem(sys.modules, "aiter.jit.core", core)
    return jit_dir


def install_fake_aiter(monkeypatch, fp8=torch.float8_e4m3fn, with_clean_logits=False, with_stable=False,
                        paged=None, jit=None):
    """A fake aiter package tree in sys.modules whose functions record their calls (see the module docstring).
    ``paged``: kwargs of `_install_paged_double` (aiter main's paged logits); ``jit``: kwargs of `_install_fake_jit`."""
    calls = []
    names = ["aiter", "aiter.dtypes", "aiter.ops", "aiter.ops.triton", "aiter.ops.triton.fp8_mqa_logits",
             "aiter.ops.triton.fused_fp8_quant", "aiter.ops.topk"]
    mods = {name: types.ModuleType(name) for name in names}
    for name, mod in mods.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(mods[parent], child, mod)
        if name != "aiter.dtypes":
            mod.__path__ = []
        monkeypatch.setitem(sys.modules, name, mod)
    mods["aiter.dtypes"].fp8 = fp8

    if with_clean_logits:
        def fp8_mqa_logits(Q, KV, kv_scales, weights, cu_starts, cu_ends, clean_logits=False):
            calls.append(("fp8_mqa_logits", (Q, KV, kv_scales, weights, cu_starts, cu_ends),
                          {"clean_logits": clean_logits}))
            return emulated_fp8_mqa_logits(Q, KV, kv_scales, weights, cu_starts, cu_ends)
    else:
        def fp8_mqa_logits(Q, KV, kv_scales, weights, cu_starts, cu_ends):
            calls.append(("fp8_mqa_logits", (Q, KV, kv_scales, weights, cu_starts, cu_ends), {}))
            return emulated_fp8_mqa_logits(Q, KV, kv_scales, weights, cu_starts, cu_ends)

    if with_stable:
        def top_k_per_row_decode(logits, next_n, seqLens, indices, numRows, stride0, stride1, k=2048, stable=False):
            calls.append(("top_k_per_row_decode", (logits, next_n, seqLens, indices, numRows, stride0, stride1),
                          {"k": k, "stable": stable}))
            emulated_top_k_per_row_decode(logits, next_n, seqLens, indices, numRows, stride0, stride1)
    else:
        def top_k_per_row_decode(logits, next_n, seqLens, indices, numRows, stride0, stride1):
            calls.append(("top_k_per_row_decode", (logits, next_n, seqLens, indices, numRows, stride0, stride1), {}))
            emulated_top_k_per_row_decode(logits, next_n, seqLens, indices, numRows, stride0, stride1)

    def fused_rms_fp8_group_quant(*args, **kwargs):
        calls.append(("fused_rms_fp8_group_quant", args, kwargs))
        return _emulated_fused_rms_fp8_group_quant(*args, **kwargs)

    mods["aiter.ops.triton.fp8_mqa_logits"].fp8_mqa_logits = fp8_mqa_logits
    mods["aiter.ops.topk"].top_k_per_row_decode = top_k_per_row_decode
    mods["aiter.ops.triton.fused_fp8_quant"].fused_rms_fp8_group_quant = fused_rms_fp8_group_quant
    fake = mods["aiter"]
    fake.calls = calls
    if paged is not None:
        fake.paged_wrapper_module, fake.paged_kernel_module = _install_paged_double(monkeypatch, mods, **paged)
    if jit is not None:
        fake.jit_dir = _install_fake_jit(monkeypatch, mods, **jit)
    return fake


def pretend_rocm_gpu(monkeypatch) -> None:
    """The aiter probe's device checks pass (a ROCm torch seeing one GPU); its self-tests run on the CPU; no earlier
    probe result is kept."""
    from dsa_indexer.backends.rocm import aiter_api

    monkeypatch.setattr(torch.version, "hip", "6.4.0-fake")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    real = aiter_api.self_test
    monkeypatch.setattr(aiter_api, "self_test", lambda api, device: real(api, torch.device("cpu")))
    monkeypatch.setattr(aiter_api.LIBRARY, "detected", None)
