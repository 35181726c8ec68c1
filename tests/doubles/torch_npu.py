"""A test double of the Ascend ``torch_npu`` indexer ops, in plain torch (CPU). It is NOT torch_npu.

Two forms, one arithmetic:

* ``schema_ops(release)`` registers test-only operators with torch.library (namespace ``dsa_npu_test_<release>``)
  under the EXACT schema strings op-plugin publishes (tests/data/torch_npu_schemas.json, with source repo, path and
  commit), with CPU kernels running the functions below. torch_npu exports its kernels the same way
  (``torch_npu.<op>`` is the ``torch.ops.npu.<op>`` OpOverloadPacket), so ``install_schema_ops`` gives the library a
  ``torch_npu`` whose attributes are real operator objects: detection reads their schemas and every adapter call is
  bound by the schema (a keyword, position or type it does not take raises), as with torch_npu.
* ``TorchNpuDouble`` / ``install``: the same functions as plain Python attributes, an extra (its signatures are
  Python signatures of the same arguments).

The functions are written from torch_npu's documented semantics (op-plugin ``docs/zh/custom_APIs/torch_npu/``),
independently of the adapter:

* ``npu_lightning_indexer`` / ``npu_quant_lightning_indexer``: per query token t and visible key s, the score
  ``sum_h w[t,h] * relu(q[t,h] . k[s])`` (quant: ``relu(q_scale[t,h] * k_scale[s] * (q_int8[t,h] . k_int8[s]))``),
  in fp32; output the ``sparse_count`` best visible positions, request-local, best first, padded with -1. The quant
  indexer returns that one tensor; the float one (indices, values).
* ``npu_scatter_nd_update_`` and ``npu_dynamic_quant``: the cache write and the per-row int8 quantization.
* ``npu_rotary_mul``: RoPE with full-width cos / sin, "half" (rotate-half) or "interleave" pairs, with the documented
  shape limits (jit_compile=False, A2 / A3): 3-D input is TND (r1 / r2 T1D or TND; interleave T1D only), 4-D input
  is read as BSND, the layout the adapter uses (r1 / r2 1S1D, BS1D or BSND; interleave 1S1D only); half mode needs
  B < 1000 and N < 1000, interleave B * N < 1000; D even and < 896; r1 / r2 in [-1, 1]. (The kernel infers the
  layout from the shapes; this double reads 4-D as BSND only, so a shape that is valid only under another reading
  fails here.)

Choices where torch_npu documents nothing (the tests pin them):

* ties in score are broken by the LOWER key position (torch_npu does not document its tie order);
* NaN scores: op-plugin documents the top-k order of NaN as undefined; this double refuses NaN in its float inputs
  (so a test that lets one through fails) instead of picking an order;
* ``npu_dynamic_quant`` uses the symmetric range -127..127 (never -128) and rounds half to even (torch.round);
* ``key_dequant_scale`` may be ``key.shape[:-1]`` ([block_count, block_size, 1] for PA_BSND) or ``key.shape[:-2]``
  ([block_count, block_size]);
* with layout_query BSND and per-batch query counts, rows past a batch's count are all -1 (values -inf);
* only the block_table entries a request uses are range-checked (callers pad the rest with anything);
* ``pre_tokens``/``next_tokens`` are accepted and ignored: the mask is set by ``sparse_mode`` alone;
* a block_table passed with a layout_key other than PA_BSND is an error (it would be silently unused).
"""

import contextlib
import functools
import importlib.machinery
import inspect
import json
import math
import re
import sys
import types
from pathlib import Path

import torch

__all__ = ["DEFAULT_VERSION", "NpuDeviceDouble", "SCHEMAS", "TorchNpuDouble", "install", "install_schema_ops",
           "schema_ops"]

DEFAULT_VERSION = "2.7.1.post1"
MAX_SPARSE_COUNT = 2048
HEADS_Q, HEADS_K, HEAD_DIM = 64, 1, 128
NO_LIMIT = 2**63 - 1
ROTARY_LIMIT = 1000  # half: B, N < 1000; interleave: B * N < 1000
ROTARY_MAX_D = 896  # D < 896
_FLOATS = (torch.bfloat16, torch.float16)
_LAYOUTS_Q = ("BSND", "TND")
_LAYOUTS_K = ("BSND", "TND", "PA_BSND")
SCHEMAS = json.loads((Path(__file__).parents[1] / "data" / "torch_npu_schemas.json").read_text())


def _fail(message: str):
    raise RuntimeError(f"torch_npu double: {message}")


# ----------------------------------------------------------------------------------------------- argument checks


def _check_tensor(name, t, dtypes, ndim, strided_axis0=False):
    """``strided_axis0``: axis 0 may be strided (the quant indexer's PA_BSND key and key scales), the rest not."""
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        _fail(f"{name} has dtype {t.dtype}; supported: {', '.join(map(str, dtypes))}")
    if t.dim() != ndim:
        _fail(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if not (t[0] if strided_axis0 and t.dim() > 1 and t.shape[0] else t).is_contiguous():
        _fail(f"{name} must be contiguous (non-contiguous input is not supported)")


def _check_heads_dim(name, t, heads):
    if t.shape[-2] != heads:
        _fail(f"{name} must have {heads} head(s) (N{1 if heads == HEADS_Q else 2} = {heads}), got {t.shape[-2]}")
    if t.shape[-1] != HEAD_DIM:
        _fail(f"{name} head dim D must be {HEAD_DIM}, got {t.shape[-1]}")


def _check_attrs(layout_query, layout_key, sparse_count, sparse_mode):
    if layout_query not in _LAYOUTS_Q:
        _fail(f"layout_query must be one of {_LAYOUTS_Q}, got {layout_query!r}")
    if layout_key not in _LAYOUTS_K:
        _fail(f"layout_key must be one of {_LAYOUTS_K}, got {layout_key!r}")
    if isinstance(sparse_count, bool) or not isinstance(sparse_count, int) or not 1 <= sparse_count <= MAX_SPARSE_COUNT:
        _fail(f"sparse_count must be an int in [1, {MAX_SPARSE_COUNT}], got {sparse_count!r}")
    if sparse_mode not in (0, 3):
        _fail(f"sparse_mode must be 0 (no mask) or 3 (bottom-right causal), got {sparse_mode!r}")


def _lengths(name, t, batch=None) -> list[int]:
    """A 1-D int32 tensor of non-negative lengths, as a list."""
    if t is None:
        _fail(f"{name} is required here")
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
        got = f"{t.dtype} shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        _fail(f"{name} must be a 1-D int32 tensor, got {got}")
    if batch is not None and t.numel() != batch:
        _fail(f"{name} must have {batch} entries (one per request), got {t.numel()}")
    values = t.tolist()
    if any(v < 0 for v in values):
        _fail(f"{name} must be non-negative, got {values}")
    return values


def _counts(name, t, batch, bound) -> list[int]:
    """BSND / PA_BSND: per-request counts, each <= bound; all ``bound`` when ``t`` is None."""
    if t is None:
        return [bound] * batch
    values = _lengths(name, t, batch)
    if max(values, default=0) > bound:
        _fail(f"{name} entries must be <= {bound} (the sequence axis), got {values}")
    return values


def _cumulative(name, t, total) -> list[int]:
    """TND: cumulative ends (prefix sums without the leading 0) -> per-request counts."""
    ends = _lengths(name, t)
    if not ends:
        _fail(f"{name} must have at least one entry")
    if any(b < a for a, b in zip(ends, ends[1:])):
        _fail(f"{name} must be cumulative (non-decreasing) with layout TND, got {ends}")
    if ends[-1] != total:
        _fail(f"{name} must end at the token count {total} with layout TND, got last {ends[-1]}")
    return [b - a for a, b in zip([0] + ends[:-1], ends)]


# ----------------------------------------------------------------------------------------------- request layout


def _query_spans(layout, query, lengths):
    """-> (per-request (first flat row, query count), output shape without the sparse axis)."""
    if layout == "TND":
        counts = _cumulative("actual_seq_lengths_query", lengths, query.shape[0])
        starts = [sum(counts[:b]) for b in range(len(counts))]
        return list(zip(starts, counts)), (query.shape[0], HEADS_K)
    batch, s1 = query.shape[0], query.shape[1]
    counts = _counts("actual_seq_lengths_query", lengths, batch, s1)
    return [(b * s1, counts[b]) for b in range(batch)], (batch, s1, HEADS_K)


def _key_rows(layout, key, lengths, block_table, batch):
    """-> (per-request flat row indices of its keys in key.reshape(-1, D), key lengths L)."""
    if layout != "PA_BSND" and block_table is not None:
        _fail(f"block_table is only used with layout_key PA_BSND, got layout_key {layout!r}")
    if layout == "TND":
        counts = _cumulative("actual_seq_lengths_key", lengths, key.shape[0])
        if len(counts) != batch:
            _fail(f"actual_seq_lengths_key has {len(counts)} requests but the query has {batch}")
        starts = [sum(counts[:b]) for b in range(batch)]
        return [torch.arange(s, s + n) for s, n in zip(starts, counts)], counts
    if layout == "BSND":
        if key.shape[0] != batch:
            _fail(f"key batch {key.shape[0]} does not match the query's {batch}")
        s2 = key.shape[1]
        counts = _counts("actual_seq_lengths_key", lengths, batch, s2)
        return [b * s2 + torch.arange(n) for b, n in enumerate(counts)], counts
    # PA_BSND: position p of request b lives at key[block_table[b, p // bs], p % bs, 0].
    block_count, block_size = key.shape[0], key.shape[1]
    if block_size % 16 or not 16 <= block_size <= 1024:
        _fail(f"block_size (key.shape[1]) must be a multiple of 16 in [16, 1024], got {block_size}")
    counts = _lengths("actual_seq_lengths_key", lengths, batch)
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2:
        _fail("block_table must be a 2-D int32 tensor [B, max_blocks] with layout_key PA_BSND")
    if block_table.shape[0] != batch:
        _fail(f"block_table must have {batch} rows (one per request), got {block_table.shape[0]}")
    rows = []
    for b, n in enumerate(counts):
        pos = torch.arange(n)
        need = -(-len(pos) // block_size)
        if need > block_table.shape[1]:
            _fail(f"block_table is too narrow: request {b} needs {need} blocks, it has {block_table.shape[1]} columns")
        used = block_table[b, :need].long()
        if need and (used.min() < 0 or used.max() >= block_count):
            _fail(f"block_table row {b} has entries outside [0, {block_count}): {used.tolist()}")
        rows.append(used[pos // block_size] * block_size + pos % block_size)
    return rows, counts


def _visible(n, length, sparse_mode):
    """How many keys each of a request's n queries sees (sparse_mode 3: bottom-right-aligned causal)."""
    if sparse_mode == 0:
        return torch.full((n,), length, dtype=torch.long)
    return (length - n + 1 + torch.arange(n)).clamp(0, length)


def _top(scores, visible, k):
    """Best k visible entries per row: descending score, ties to the lower position (this double's choice)."""
    n, c = scores.shape
    pos = torch.arange(c)
    masked = scores.masked_fill(pos[None, :] >= visible[:, None], float("-inf"))
    # A stable descending sort keeps equal scores in ascending position order; masked entries sort after visible ones.
    values, order = torch.sort(masked, dim=1, descending=True, stable=True)
    values, order = values[:, :k], order[:, :k]
    keep = order < visible[:, None]
    idx = torch.full((n, k), -1, dtype=torch.int32)
    val = torch.full((n, k), float("-inf"))
    idx[:, : order.shape[1]] = torch.where(keep, order, -1).int()
    val[:, : order.shape[1]] = torch.where(keep, values, float("-inf"))
    return idx, val


def _run(spans, key_rows, lengths, out_prefix, k, sparse_mode, score, return_value):
    rows = math.prod(out_prefix)  # the trailing N2 axis is 1
    indices = torch.full((rows, k), -1, dtype=torch.int32)
    values = torch.full((rows, k), float("-inf"))
    for (start, n), kr, length in zip(spans, key_rows, lengths):
        if n == 0:
            continue
        q_rows = torch.arange(start, start + n)
        idx, val = _top(score(q_rows, kr), _visible(n, length, sparse_mode), k)
        indices[q_rows], values[q_rows] = idx, val
    indices = indices.reshape(*out_prefix, k)
    return indices, (values.reshape(*out_prefix, k) if return_value else torch.empty(0))


# ----------------------------------------------------------------------------------------------- release and product
# What each op-plugin release's docs let the indexers take, by Ascend product (the docs at the commits in
# tests/data/torch_npu_schemas.json, `docs/zh/custom_APIs/torch_npu/torch_npu-npu_(quant_)lightning_indexer.md`):
# * npu_lightning_indexer weights: 7.3.0 the query's dtype only; 26.0.0, 26.1.0, master also float32, which
#   26.1.0 and master refuse on Ascend 950PR / 950DT ("参数weights不支持float32类型");
# * npu_quant_lightning_indexer: int8 query / key with fp16 weights and scales (A2 / A3, and 950); float8_e4m3fn
#   query / key on Ascend 950PR / 950DT only, in 26.1.0 and master, with (bf16 weights, fp32 scales) or all fp16;
#   950 takes query heads 8, 16, 24, 32 or 64; PA_BSND key and key_dequant_scale may be non-contiguous on axis 0.
# The product is read as torch_npu's own test helper reads it: the device name's prefix ("Ascend910B": A2,
# "Ascend910_93": A3, "Ascend950": 950PR / 950DT).
DEFAULT_RELEASE = "op-plugin master"
FP32_WEIGHTS_RELEASES = ("op-plugin 26.0.0", "op-plugin 26.1.0", "op-plugin master")
FP8_RELEASES = ("op-plugin 26.1.0", "op-plugin master")
HEADS_950 = (8, 16, 24, 32, 64)
_rules = {"release": DEFAULT_RELEASE}


@contextlib.contextmanager
def release_rules(release: str):
    previous, _rules["release"] = _rules["release"], release
    try:
        yield
    finally:
        _rules["release"] = previous


def product() -> str:
    name = str(getattr(getattr(torch, "npu", None), "get_device_name", lambda *a: "")(0) or "")
    return "950" if name.startswith("Ascend950") else "a3" if name.startswith("Ascend910_93") else "a2"


# ----------------------------------------------------------------------------------------------- the ops


def _finite(name, t):
    if not bool(torch.isfinite(t.float()).all()):
        _fail(f"{name} holds NaN or inf: the kernels' top-k order of NaN is undefined (this double refuses them)")


def npu_lightning_indexer(query, key, weights, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                          block_table=None, layout_query="BSND", layout_key="BSND", sparse_count=2048, sparse_mode=3,
                          pre_tokens=NO_LIMIT, next_tokens=NO_LIMIT, return_value=False):
    """bf16 / fp16 indexer -> (sparse_indices int32 [.., 1, sparse_count], sparse_values (empty unless asked))."""
    _check_attrs(layout_query, layout_key, sparse_count, sparse_mode)
    q_dim = 3 if layout_query == "TND" else 4
    _check_tensor("query", query, _FLOATS, q_dim)
    fp32_weights = isinstance(weights, torch.Tensor) and weights.dtype == torch.float32
    if fp32_weights and (_rules["release"] not in FP32_WEIGHTS_RELEASES or product() == "950"):
        _fail(f"float32 weights are not taken by {_rules['release']} on this product ({product()}): its docs list "
              "them from 26.0.0 on, and not on Ascend 950PR / 950DT")
    for name, t in (("key", key), ("weights", weights)):
        if isinstance(t, torch.Tensor) and t.dtype != query.dtype and not (name == "weights" and fp32_weights):
            _fail(f"{name} dtype {t.dtype} must match query dtype {query.dtype}")
    _check_tensor("key", key, _FLOATS, 3 if layout_key == "TND" else 4)
    _check_tensor("weights", weights, _FLOATS + (torch.float32,), q_dim - 1)
    _check_heads_dim("query", query, HEADS_Q)
    _check_heads_dim("key", key, HEADS_K)
    if weights.shape != query.shape[:-1]:
        _fail(f"weights must have shape {tuple(query.shape[:-1])} (query without D), got {tuple(weights.shape)}")
    spans, out_prefix = _query_spans(layout_query, query, actual_seq_lengths_query)
    key_rows, lengths = _key_rows(layout_key, key, actual_seq_lengths_key, block_table, len(spans))
    _finite("query", query)
    _finite("weights", weights)
    for kr in key_rows:
        _finite("key (the rows a request reads)", key.reshape(-1, HEAD_DIM)[kr])
    q = query.reshape(-1, HEADS_Q, HEAD_DIM).float()
    w = weights.reshape(-1, HEADS_Q).float()
    k = key.reshape(-1, HEAD_DIM).float()

    def score(q_rows, k_rows):
        logits = torch.relu(torch.einsum("thd,sd->ths", q[q_rows], k[k_rows]))
        return (w[q_rows, :, None] * logits).sum(dim=1)

    return _run(spans, key_rows, lengths, out_prefix, sparse_count, sparse_mode, score, return_value)


def npu_quant_lightning_indexer(query, key, weights, query_dequant_scale, key_dequant_scale, query_quant_mode,
                                key_quant_mode, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                                block_table=None, layout_query="BSND", layout_key="BSND", sparse_count=2048,
                                sparse_mode=3, pre_tokens=NO_LIMIT, next_tokens=NO_LIMIT, query_dtype=None,
                                key_dtype=None):
    """Per-token-head quant indexer -> sparse_indices: int8 query and key with fp16 weights and scales (A2 / A3 /
    950), or on Ascend 950 (26.1.0 on) float8_e4m3fn ones with bf16 weights and fp32 scales (or all fp16)."""
    _check_attrs(layout_query, layout_key, sparse_count, sparse_mode)
    if query_quant_mode != 0 or key_quant_mode != 0:
        _fail(f"query_quant_mode/key_quant_mode must be 0 (per-token-head), got {query_quant_mode}/{key_quant_mode}")
    if query_dtype is not None or key_dtype is not None:
        _fail("query_dtype / key_dtype (hifloat8 inputs on Ascend 950) are not emulated: pass None")
    q_dim = 3 if layout_query == "TND" else 4
    fp8 = isinstance(query, torch.Tensor) and query.dtype == torch.float8_e4m3fn
    if fp8:
        if _rules["release"] not in FP8_RELEASES or product() != "950":
            _fail(f"float8_e4m3fn query / key are taken on Ascend 950PR / 950DT from 26.1.0 on, not by "
                  f"{_rules['release']} on {product()}")
        _check_tensor("query", query, (torch.float8_e4m3fn,), q_dim)
        _check_tensor("key", key, (torch.float8_e4m3fn,), 3 if layout_key == "TND" else 4,
                      strided_axis0=layout_key == "PA_BSND")
        pair = (weights.dtype, query_dequant_scale.dtype, key_dequant_scale.dtype)
        if pair not in ((torch.bfloat16, torch.float32, torch.float32), (torch.float16,) * 3):
            _fail(f"fp8 query / key take (bf16, fp32, fp32) or (fp16, fp16, fp16) weights / query_dequant_scale / "
                  f"key_dequant_scale, got {pair}")
        if query.shape[-2] not in HEADS_950:
            _fail(f"Ascend 950 takes query heads {HEADS_950}, got {query.shape[-2]}")
    else:
        _check_tensor("query", query, (torch.int8,), q_dim)
        _check_tensor("key", key, (torch.int8,), 3 if layout_key == "TND" else 4,
                      strided_axis0=layout_key == "PA_BSND")
        _check_tensor("weights", weights, (torch.float16,), q_dim - 1)
        _check_tensor("query_dequant_scale", query_dequant_scale, (torch.float16,), q_dim - 1)
        _check_heads_dim("query", query, HEADS_Q)
    if query.shape[-1] != HEAD_DIM:
        _fail(f"query head dim D must be {HEAD_DIM}, got {query.shape[-1]}")
    _check_heads_dim("key", key, HEADS_K)
    for name, t in (("query", query), ("weights", weights), ("query_dequant_scale", query_dequant_scale)):
        if not t.is_contiguous():
            _fail(f"{name} must be contiguous")
    for name, t in (("key", key), ("key_dequant_scale", key_dequant_scale)):
        # PA_BSND: axis 0 may be strided (the pages of a larger cache), every other axis contiguous
        inner = t[0] if layout_key == "PA_BSND" and t.dim() > 1 and t.shape[0] else t
        if not inner.is_contiguous():
            _fail(f"{name} must be contiguous{' past axis 0' if layout_key == 'PA_BSND' else ''}")
    for name, t in (("weights", weights), ("query_dequant_scale", query_dequant_scale)):
        if t.shape != query.shape[:-1]:
            _fail(f"{name} must have shape {tuple(query.shape[:-1])} (query without D), got {tuple(t.shape)}")
    if not isinstance(key_dequant_scale, torch.Tensor) or key_dequant_scale.shape not in (key.shape[:-1],
                                                                                         key.shape[:-2]):
        got = tuple(key_dequant_scale.shape) if isinstance(key_dequant_scale, torch.Tensor) else key_dequant_scale
        _fail(f"key_dequant_scale must have shape {tuple(key.shape[:-1])} or {tuple(key.shape[:-2])}, got {got}")
    _check_tensor("key_dequant_scale", key_dequant_scale, (torch.float32,) if fp8 else (torch.float16,),
                  key_dequant_scale.dim(), strided_axis0=layout_key == "PA_BSND")
    _finite("weights", weights)
    for name, t in (("query_dequant_scale", query_dequant_scale), ("key_dequant_scale", key_dequant_scale)):
        if not bool((t >= 0).all()):  # also rejects NaN
            _fail(f"{name} must be >= 0 (it is a dequantization scale)")
        _finite(name, t)
    _finite("weights * query_dequant_scale (must stay within fp16)", (weights.float() * query_dequant_scale.float()
                                                                      ).to(torch.float16))
    spans, out_prefix = _query_spans(layout_query, query, actual_seq_lengths_query)
    key_rows, lengths = _key_rows(layout_key, key, actual_seq_lengths_key, block_table, len(spans))
    if fp8:
        _finite("query", query)
        for kr in key_rows:
            _finite("key (the rows a request reads)", key.reshape(-1, HEAD_DIM)[kr])
    # int8 . int8 over D = 128 is at most 2**21 in magnitude: exact in fp32 whatever the summation order.
    heads = query.shape[-2]
    q = query.reshape(-1, heads, HEAD_DIM).float()
    k = key.reshape(-1, HEAD_DIM).float()  # a copy when axis 0 is strided: the keys, row by row
    w = weights.reshape(-1, heads).float()
    qs = query_dequant_scale.reshape(-1, heads).float()
    ks = key_dequant_scale.reshape(-1).float()

    def score(q_rows, k_rows):
        dots = torch.einsum("thd,sd->ths", q[q_rows], k[k_rows])
        logits = torch.relu(qs[q_rows, :, None] * ks[k_rows][None, None, :] * dots)
        return (w[q_rows, :, None] * logits).sum(dim=1)

    indices, _ = _run(spans, key_rows, lengths, out_prefix, sparse_count, sparse_mode, score, False)
    return indices


def npu_scatter_nd_update_(self, indices, updates):
    """In place: self[indices[i, 0]] = updates[i]. Returns self. (Duplicate rows: the last write wins here.)"""
    if not isinstance(indices, torch.Tensor) or indices.dtype not in (torch.int32, torch.int64) or (
            indices.dim() != 2 or indices.shape[1] != 1):
        _fail("indices must be an int32/int64 tensor of shape [N, 1] (row numbers in self's first dim)")
    n = indices.shape[0]
    if not isinstance(updates, torch.Tensor) or tuple(updates.shape) != (n, *self.shape[1:]):
        _fail(f"updates must have shape {(n, *self.shape[1:])}, got {getattr(updates, 'shape', updates)}")
    if updates.dtype != self.dtype:
        _fail(f"updates dtype {updates.dtype} must match self's {self.dtype}")
    rows = indices[:, 0].long()
    if n and (rows.min() < 0 or rows.max() >= self.shape[0]):
        _fail(f"indices must lie in [0, {self.shape[0]}), got {rows.tolist()}")
    self[rows] = updates
    return self


def npu_dynamic_quant(input, *, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken",
                      dst_type_max=0.0):
    """Symmetric per-row int8: scale = amax(|x|) / 127 (fp32, shape x.shape[:-1]), q = round(x / scale) in -127..127.

    ``smooth_scales`` [x.shape[-1]] multiplies x first. A zero row gets the floor scale float32.tiny and q = 0.
    Only the int8 per-token form is emulated (group_index, dst_type None, quant_mode "pertoken")."""
    x = input
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS or x.dim() < 1:
        _fail(f"x must be a float16/bfloat16 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if group_index is not None or dst_type is not None or quant_mode != "pertoken":
        _fail("only the int8 per-token form is emulated (group_index=None, dst_type=None, quant_mode='pertoken')")
    xf = x.float()
    if smooth_scales is not None:
        if not isinstance(smooth_scales, torch.Tensor) or tuple(smooth_scales.shape) != (x.shape[-1],):
            _fail(f"smooth_scales must have shape ({x.shape[-1]},), got {getattr(smooth_scales, 'shape', None)}")
        xf = xf * smooth_scales.float()
    scale = (xf.abs().amax(dim=-1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(xf / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def _rotary_layout(x, r, rotary_mode):
    """Check the documented (jit_compile=False) limits; 3-D is TND, 4-D is read as BSND (this double's reading)."""
    d = x.shape[-1]
    if d % 2 or d >= ROTARY_MAX_D:
        _fail(f"npu_rotary_mul needs D even and < {ROTARY_MAX_D}, got D = {d}")
    if r.shape[-1] != d:
        _fail(f"r1 / r2 must end in D = {d}, got {list(r.shape)}")
    if x.dim() == 3:
        t, n, _ = x.shape
        allowed = {"T1D": (t, 1, d), "TND": (t, n, d)}
        batch = 1
    else:
        batch, seq, n, _ = x.shape
        allowed = {"1S1D": (1, seq, 1, d), "BS1D": (batch, seq, 1, d), "BSND": (batch, seq, n, d)}
    if rotary_mode == "interleave":
        allowed = dict(list(allowed.items())[:1])  # 1S1D (BSND) / T1D (TND) only
        if batch * n >= ROTARY_LIMIT:
            _fail(f"npu_rotary_mul interleave mode needs B * N < {ROTARY_LIMIT}, got B = {batch}, N = {n} "
                  f"(input {list(x.shape)} read as {'TND' if x.dim() == 3 else 'BSND'})")
    elif batch >= ROTARY_LIMIT or n >= ROTARY_LIMIT:
        _fail(f"npu_rotary_mul half mode needs B < {ROTARY_LIMIT} and N < {ROTARY_LIMIT}, got B = {batch}, N = {n} "
              f"(input {list(x.shape)} read as {'TND' if x.dim() == 3 else 'BSND'})")
    if tuple(r.shape) not in allowed.values():
        _fail(f"{rotary_mode} mode takes r1 / r2 of layout {' / '.join(allowed)} {list(allowed.values())} for input "
              f"{list(x.shape)} ({'TND' if x.dim() == 3 else 'BSND'}), got {list(r.shape)}")


def npu_rotary_mul(input, r1, r2, rotary_mode="half", rotate=None):
    """RoPE as documented for torch_npu.npu_rotary_mul: ``input * r1 + rotate(input) * r2`` with r1 = cos, r2 = sin
    given at full width and broadcast to input. "half": rotate(x) = cat(-x[D/2:], x[:D/2]) (r1, r2 hold each
    angle twice, halves repeated); "interleave": pairs (2i, 2i+1), rotate(x)[2i] = -x[2i+1], rotate(x)[2i+1] = x[2i]
    (r1, r2 hold each angle twice, adjacent). Computed in fp32, returned in input's dtype."""
    if not isinstance(input, torch.Tensor) or input.dim() not in (3, 4):
        _fail(f"input must be a 3-D (TND) or 4-D tensor, got {getattr(input, 'shape', type(input).__name__)}")
    for name, t in (("r1", r1), ("r2", r2)):
        if not isinstance(t, torch.Tensor) or t.dim() != input.dim():
            _fail(f"{name} must be a {input.dim()}-D tensor like input, got {getattr(t, 'shape', type(t).__name__)}")
    if rotary_mode not in ("half", "interleave"):
        _fail(f"rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}")
    if rotate is not None:
        _fail("the rotate matrix form is not emulated: pass rotate=None")
    if r2.shape != r1.shape:
        _fail(f"r1 and r2 must have one shape, got {list(r1.shape)}, {list(r2.shape)}")
    _rotary_layout(input, r1, rotary_mode)
    for name, t in (("r1", r1), ("r2", r2)):
        if not bool((t.float().abs() <= 1).all()):
            _fail(f"{name} must lie in [-1, 1] (it is a cos / sin)")
    x = input.float()
    if rotary_mode == "half":
        a, b = x.chunk(2, dim=-1)
        rotated = torch.cat([-b, a], dim=-1)
    else:
        rotated = torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
    return (x * r1.float() + rotated * r2.float()).to(input.dtype)


FUNCTIONS = {"npu_lightning_indexer": npu_lightning_indexer,
             "npu_quant_lightning_indexer": npu_quant_lightning_indexer,
             "npu_scatter_nd_update_": npu_scatter_nd_update_, "npu_dynamic_quant": npu_dynamic_quant,
             "npu_rotary_mul": npu_rotary_mul}


# ----------------------------------------------------------------------------------------------- real operators

_registered: dict = {}  # release -> (torch.library.Library, namespace, calls list): each namespace is defined once


def _namespace(release: str) -> str:
    return "dsa_npu_test_" + re.sub(r"[^0-9a-zA-Z]+", "_", release).strip("_").lower()


def _kernel(name, schema, calls, release=None):
    """A CPU kernel for ``schema`` that records the bound call (defaults filled in) and runs the double's function
    of the same name, under ``release``'s documented dtype rules (`release_rules`)."""
    fn = FUNCTIONS[name]
    params = inspect.signature(fn).parameters
    arg_names = [a.name for a in schema.arguments]

    defaults = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}

    def kernel(*args, **kwargs):
        # the dispatcher drops trailing arguments equal to their defaults: fill them back in from the schema
        bound = {**defaults, **dict(zip(arg_names, args)), **kwargs}
        calls.append((name, dict(bound)))
        # the schema's first argument is "self" / "input"; the double names it as the documentation does
        if arg_names[0] not in params:
            first = next(iter(params))
            bound[first] = bound.pop(arg_names[0])
        unknown = set(bound) - set(params)
        if unknown:
            _fail(f"{name}: the schema passes {sorted(unknown)}, which this double does not emulate")
        positional = [p for p in params.values() if p.kind != p.KEYWORD_ONLY]
        with release_rules(release or DEFAULT_RELEASE):
            return fn(*[bound.pop(p.name) for p in positional if p.name in bound], **bound)

    return kernel


def schema_ops(release: str = "op-plugin master"):
    """(namespace object of OpOverloadPackets, recorded calls) for the schemas of ``release`` in SCHEMAS, defined
    with torch.library on first use (CPU kernels over this double's functions)."""
    if release not in SCHEMAS["schemas"]:
        raise ValueError(f"release must be one of {sorted(SCHEMAS['schemas'])}, got {release!r}")
    if release not in _registered:
        ns = _namespace(release)
        lib = torch.library.Library(ns, "DEF")
        calls: list = []
        for name, text in SCHEMAS["schemas"][release].items():
            lib.define(text)
            packet = getattr(getattr(torch.ops, ns), name)
            lib.impl(name, _kernel(name, packet.default._schema, calls, release), "CPU")
        _registered[release] = (lib, ns, calls)
    _, ns, calls = _registered[release]
    return getattr(torch.ops, ns), calls


def define_ops(namespace: str, schemas: dict):
    """Extra operators (e.g. a schema the adapter must refuse) in their own namespace, with the double's kernels;
    returns the namespace object. ``schemas``: op name -> schema string."""
    if namespace in _registered:  # a namespace is defined once per process
        return getattr(torch.ops, namespace)
    lib = torch.library.Library(namespace, "DEF")
    calls: list = []
    for name, text in schemas.items():
        lib.define(text)
        packet = getattr(getattr(torch.ops, namespace), name)
        lib.impl(name, _kernel(name, packet.default._schema, calls), "CPU")
    _registered[namespace] = (lib, namespace, calls)
    return getattr(torch.ops, namespace)


class SchemaTorchNpu(types.ModuleType):
    """Stands in for ``torch_npu``: its op attributes are the registered OpOverloadPackets, as torch_npu's are
    ``torch.ops.npu.<op>``. ``calls`` lists (op name, {argument: value}) as the kernels received them."""

    def __init__(self, release="op-plugin master", ops=None, version=None):
        super().__init__("torch_npu", self.__doc__)
        self.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None)
        self.__version__ = version or f"(test operators: {release} schemas)"
        namespace, self.calls = schema_ops(release)
        names = SCHEMAS["schemas"][release] if ops is None else ops
        for name in names:
            setattr(self, name, getattr(namespace, name))


def install_schema_ops(monkeypatch, release="op-plugin master", *, ops=None, available=True,
                       device_name="Ascend910B3", version=None):
    """``import torch_npu`` gives a SchemaTorchNpu (only ``ops`` among the release's ops, if given) and ``torch.npu``
    a NpuDeviceDouble, undone by monkeypatch. The calls list is the release's, shared by all installs: it is cleared
    here."""
    module = SchemaTorchNpu(release, ops, version)
    module.calls.clear()
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    monkeypatch.setattr(torch, "npu", NpuDeviceDouble(available, device_name), raising=False)
    return module


# ----------------------------------------------------------------------------------------------- module and install


class NpuDeviceDouble:
    """Stands in for ``torch.npu``: availability and device name only."""

    def __init__(self, available=True, device_name="Ascend910B3"):
        self.available, self.device_name = available, device_name

    def is_available(self):
        return self.available

    def get_device_name(self, index=0):
        return self.device_name

    def device_count(self):
        return 1 if self.available else 0


class TorchNpuDouble(types.ModuleType):
    """A test double of the ``torch_npu`` module with plain Python functions (the extra form; see the module doc).

    Every call is appended to ``calls`` as (function name, {parameter: value} for the arguments the caller passed,
    positional ones by name); defaults are not filled in."""

    def __init__(self, version=None):
        super().__init__("torch_npu", self.__doc__)
        self.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None)
        self.__version__ = DEFAULT_VERSION if version is None else version
        self.calls: list[tuple[str, dict]] = []
        for name, fn in FUNCTIONS.items():
            setattr(self, name, self._recorded(name, fn))

    def _recorded(self, name, fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)  # inspect.signature(wrapper) is fn's real signature
        def wrapper(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)  # a wrong keyword is a TypeError, as with the real binding
            self.calls.append((name, dict(bound.arguments)))
            return fn(*args, **kwargs)

        wrapper.__name__ = wrapper.__qualname__ = name
        return wrapper


def install(monkeypatch, *, available=True, device_name="Ascend910B3", version=None):
    """Make ``import torch_npu`` give a fresh TorchNpuDouble and ``torch.npu`` a NpuDeviceDouble (undone by
    monkeypatch at the end of the test). Returns the double."""
    double = TorchNpuDouble(version=version)
    monkeypatch.setitem(sys.modules, "torch_npu", double)
    monkeypatch.setattr(torch, "npu", NpuDeviceDouble(available, device_name), raising=False)
    return double
