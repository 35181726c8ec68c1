"""A test double of the Ascend ``torch_npu`` indexer ops, in plain torch (CPU). It is NOT torch_npu.

The library's CPU tests use it to run the NPU adapter end to end without an Ascend device: ``install`` puts a
``TorchNpuDouble`` into ``sys.modules["torch_npu"]`` and a small ``torch.npu`` stand-in onto ``torch``.

The double is written from the documented semantics of the torch_npu functions, independently of the adapter:

* ``npu_lightning_indexer`` / ``npu_quant_lightning_indexer``: per query token t and visible key s, the score
  ``sum_h w[t,h] * relu(q[t,h] . k[s])`` (quant: ``relu(q_scale[t,h] * k_scale[s] * (q_int8[t,h] . k_int8[s]))``),
  in fp32; output the ``sparse_count`` best visible positions, request-local, best first, padded with -1.
* ``npu_quant_lightning_indexer_metadata``: an opaque int32 tensor the quant indexer checks against its arguments.
* ``npu_scatter_nd_update_`` and ``npu_dynamic_quant``: the cache write and the per-row int8 quantization.
* ``npu_rotary_mul``: RoPE with full-width cos / sin, "half" (rotate-half) or "interleave" pairs.

Choices where torch_npu documents nothing (the tests pin them):

* ties in score are broken by the LOWER key position (torch_npu does not document its tie order);
* ``npu_dynamic_quant`` uses the symmetric range -127..127 (never -128) and rounds half to even (torch.round);
* ``key_dequant_scale`` may be ``key.shape[:-1]`` ([block_count, block_size, 1] for PA_BSND) or ``key.shape[:-2]``
  ([block_count, block_size]);
* with layout_query BSND and per-batch query counts, rows past a batch's count are all -1 (values -inf);
* only the block_table entries a request uses are range-checked (callers pad the rest with anything);
* ``pre_tokens``/``next_tokens`` are accepted and ignored: the mask is set by ``sparse_mode`` alone;
* cmp_ratio 4 needs layout_key PA_BSND (or BSND); ragged TND keys are cmp_ratio 1 only;
* a block_table passed with a layout_key other than PA_BSND is an error (it would be silently unused).
"""

import functools
import importlib.machinery
import inspect
import math
import sys
import types

import torch

__all__ = ["DEFAULT_VERSION", "NpuDeviceDouble", "TorchNpuDouble", "install"]

DEFAULT_VERSION = "2.7.1.post1"
MAX_SPARSE_COUNT = 2048
HEADS_Q, HEADS_K, HEAD_DIM = 64, 1, 128
NO_LIMIT = 2**63 - 1
_FLOATS = (torch.bfloat16, torch.float16)
_LAYOUTS_Q = ("BSND", "TND")
_LAYOUTS_K = ("BSND", "TND", "PA_BSND")
_METADATA_MAGIC = 0x4E505544  # "NPUD": marks a tensor made by this double's metadata function


def _fail(message: str):
    raise RuntimeError(f"torch_npu double: {message}")


# ----------------------------------------------------------------------------------------------- argument checks


def _check_tensor(name, t, dtypes, ndim):
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        _fail(f"{name} has dtype {t.dtype}; supported: {', '.join(map(str, dtypes))}")
    if t.dim() != ndim:
        _fail(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        _fail(f"{name} must be contiguous (non-contiguous input is not supported)")


def _check_heads_dim(name, t, heads):
    if t.shape[-2] != heads:
        _fail(f"{name} must have {heads} head(s) (N{1 if heads == HEADS_Q else 2} = {heads}), got {t.shape[-2]}")
    if t.shape[-1] != HEAD_DIM:
        _fail(f"{name} head dim D must be {HEAD_DIM}, got {t.shape[-1]}")


def _check_attrs(layout_query, layout_key, count_name, sparse_count, sparse_mode, cmp_ratio=1):
    if layout_query not in _LAYOUTS_Q:
        _fail(f"layout_query must be one of {_LAYOUTS_Q}, got {layout_query!r}")
    if layout_key not in _LAYOUTS_K:
        _fail(f"layout_key must be one of {_LAYOUTS_K}, got {layout_key!r}")
    if isinstance(sparse_count, bool) or not isinstance(sparse_count, int) or not 1 <= sparse_count <= MAX_SPARSE_COUNT:
        _fail(f"{count_name} must be an int in [1, {MAX_SPARSE_COUNT}], got {sparse_count!r}")
    if sparse_mode not in (0, 3):
        _fail(f"sparse_mode must be 0 (no mask) or 3 (bottom-right causal), got {sparse_mode!r}")
    if cmp_ratio not in (1, 4):
        _fail(f"cmp_ratio must be 1 or 4, got {cmp_ratio!r}")
    if cmp_ratio != 1 and layout_key == "TND":
        _fail("cmp_ratio 4 needs layout_key PA_BSND or BSND (this double keeps ragged TND keys to cmp_ratio 1)")


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


def _key_rows(layout, key, lengths, block_table, batch, cmp_ratio=1):
    """-> (per-request flat row indices of its cache entries in key.reshape(-1, D), original key lengths L)."""
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
        counts = _counts("actual_seq_lengths_key", lengths, batch, s2 * cmp_ratio)
        return [b * s2 + torch.arange(n // cmp_ratio) for b, n in enumerate(counts)], counts
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
        pos = torch.arange(n // cmp_ratio)
        need = -(-len(pos) // block_size)
        if need > block_table.shape[1]:
            _fail(f"block_table is too narrow: request {b} needs {need} blocks, it has {block_table.shape[1]} columns")
        used = block_table[b, :need].long()
        if need and (used.min() < 0 or used.max() >= block_count):
            _fail(f"block_table row {b} has entries outside [0, {block_count}): {used.tolist()}")
        rows.append(used[pos // block_size] * block_size + pos % block_size)
    return rows, counts


def _visible(n, length, cmp_ratio, sparse_mode):
    """How many cache entries each of a request's n queries sees (sparse_mode 3: bottom-right-aligned causal)."""
    if sparse_mode == 0:
        return torch.full((n,), length // cmp_ratio, dtype=torch.long)
    ends = (length - n + 1 + torch.arange(n)).clamp(0, length)
    return torch.div(ends, cmp_ratio, rounding_mode="floor")


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


def _run(spans, key_rows, lengths, out_prefix, k, sparse_mode, cmp_ratio, score, return_value):
    rows = math.prod(out_prefix)  # the trailing N2 axis is 1
    indices = torch.full((rows, k), -1, dtype=torch.int32)
    values = torch.full((rows, k), float("-inf"))
    for (start, n), kr, length in zip(spans, key_rows, lengths):
        if n == 0:
            continue
        q_rows = torch.arange(start, start + n)
        idx, val = _top(score(q_rows, kr), _visible(n, length, cmp_ratio, sparse_mode), k)
        indices[q_rows], values[q_rows] = idx, val
    indices = indices.reshape(*out_prefix, k)
    return indices, (values.reshape(*out_prefix, k) if return_value else torch.empty(0))


# ----------------------------------------------------------------------------------------------- the ops


def _lightning_indexer(query, key, weights, aslq, aslk, block_table, layout_query, layout_key,
                       count_name, sparse_count, sparse_mode, return_value):
    _check_attrs(layout_query, layout_key, count_name, sparse_count, sparse_mode)
    q_dim = 3 if layout_query == "TND" else 4
    _check_tensor("query", query, _FLOATS, q_dim)
    for name, t in (("key", key), ("weights", weights)):
        if isinstance(t, torch.Tensor) and t.dtype != query.dtype:
            _fail(f"{name} dtype {t.dtype} must match query dtype {query.dtype}")
    _check_tensor("key", key, _FLOATS, 3 if layout_key == "TND" else 4)
    _check_tensor("weights", weights, _FLOATS, q_dim - 1)
    _check_heads_dim("query", query, HEADS_Q)
    _check_heads_dim("key", key, HEADS_K)
    if weights.shape != query.shape[:-1]:
        _fail(f"weights must have shape {tuple(query.shape[:-1])} (query without D), got {tuple(weights.shape)}")
    spans, out_prefix = _query_spans(layout_query, query, aslq)
    key_rows, lengths = _key_rows(layout_key, key, aslk, block_table, len(spans))
    q = query.reshape(-1, HEADS_Q, HEAD_DIM).float()
    w = weights.reshape(-1, HEADS_Q).float()
    k = key.reshape(-1, HEAD_DIM).float()

    def score(q_rows, k_rows):
        logits = torch.relu(torch.einsum("thd,sd->ths", q[q_rows], k[k_rows]))
        return (w[q_rows, :, None] * logits).sum(dim=1)

    return _run(spans, key_rows, lengths, out_prefix, sparse_count, sparse_mode, 1, score, return_value)


def npu_lightning_indexer_sparse_count(query, key, weights, *, actual_seq_lengths_query=None,
                                       actual_seq_lengths_key=None, block_table=None, layout_query="BSND",
                                       layout_key="BSND", sparse_count=2048, sparse_mode=3, pre_tokens=NO_LIMIT,
                                       next_tokens=NO_LIMIT, return_value=False):
    """The current signature (``sparse_count``)."""
    return _lightning_indexer(query, key, weights, actual_seq_lengths_query, actual_seq_lengths_key, block_table,
                              layout_query, layout_key, "sparse_count", sparse_count, sparse_mode, return_value)


def npu_lightning_indexer_selected_count(query, key, weights, *, actual_seq_lengths_query=None,
                                         actual_seq_lengths_key=None, block_table=None, layout_query="BSND",
                                         layout_key="BSND", selected_count=2048, sparse_mode=3, pre_tokens=NO_LIMIT,
                                         next_tokens=NO_LIMIT, return_value=False):
    """An older signature: the top-k keyword is ``selected_count``, and ``sparse_count`` is not accepted."""
    return _lightning_indexer(query, key, weights, actual_seq_lengths_query, actual_seq_lengths_key, block_table,
                              layout_query, layout_key, "selected_count", selected_count, sparse_mode, return_value)


_METADATA_FIELDS = ("num_heads_q", "num_heads_k", "head_dim", "query_quant_mode", "key_quant_mode",
                    "layout_query", "layout_key", "sparse_count", "sparse_mode", "cmp_ratio", "batch_size",
                    "max_seqlen_q", "max_seqlen_k", "actual_seq_lengths_query", "actual_seq_lengths_key")
_LENGTH_FIELDS = ("actual_seq_lengths_query", "actual_seq_lengths_key")  # lists (None when not given)


def npu_quant_lightning_indexer_metadata(num_heads_q, num_heads_k, head_dim, query_quant_mode, key_quant_mode, *,
                                         actual_seq_lengths_query=None, actual_seq_lengths_key=None, batch_size=0,
                                         max_seqlen_q=0, max_seqlen_k=0, layout_query="BSND", layout_key="BSND",
                                         sparse_count=2048, sparse_mode=3, pre_tokens=NO_LIMIT, next_tokens=NO_LIMIT,
                                         cmp_ratio=1, device="npu:0"):
    """An opaque int32 tensor (on CPU: this double has no NPU) that encodes what the quant indexer checks.

    batch_size 0 means "from the length tensors"; max_seqlen_q/k 0 mean "no bound", otherwise the indexer checks
    every request's query count / key length (original tokens) fits under them. pre_tokens/next_tokens are not
    encoded (they are ignored, see the module doc)."""
    _check_attrs(layout_query, layout_key, "sparse_count", sparse_count, sparse_mode, cmp_ratio)
    if query_quant_mode != 0 or key_quant_mode != 0:
        _fail(f"query_quant_mode/key_quant_mode must be 0 (per-token-head), got {query_quant_mode}/{key_quant_mode}")
    if (num_heads_q, num_heads_k, head_dim) != (HEADS_Q, HEADS_K, HEAD_DIM):
        _fail(f"num_heads_q/num_heads_k/head_dim must be {HEADS_Q}/{HEADS_K}/{HEAD_DIM}, "
              f"got {num_heads_q}/{num_heads_k}/{head_dim}")
    aslq = None if actual_seq_lengths_query is None else _lengths("actual_seq_lengths_query", actual_seq_lengths_query)
    aslk = None if actual_seq_lengths_key is None else _lengths("actual_seq_lengths_key", actual_seq_lengths_key)
    for name, given in (("actual_seq_lengths_query", aslq), ("actual_seq_lengths_key", aslk)):
        if given is not None:
            if batch_size and len(given) != batch_size:
                _fail(f"{name} has {len(given)} entries but batch_size is {batch_size}")
            batch_size = len(given)
    values = (num_heads_q, num_heads_k, head_dim, query_quant_mode, key_quant_mode, _LAYOUTS_Q.index(layout_query),
              _LAYOUTS_K.index(layout_key), sparse_count, sparse_mode, cmp_ratio, batch_size, max_seqlen_q,
              max_seqlen_k, aslq, aslk)
    flat = [_METADATA_MAGIC]  # then each field; a length list as its size then its entries, None as -1
    for value in values:
        flat += [-1] if value is None else ([len(value)] + value if isinstance(value, list) else [int(value)])
    return torch.tensor(flat, dtype=torch.int32)


def _decode_metadata(metadata) -> dict:
    if not isinstance(metadata, torch.Tensor) or metadata.dtype != torch.int32 or metadata.dim() != 1:
        _fail("metadata must be the int32 tensor returned by npu_quant_lightning_indexer_metadata")
    flat, fields, at = metadata.tolist(), {}, 1
    if not flat or flat[0] != _METADATA_MAGIC:
        _fail("metadata was not produced by npu_quant_lightning_indexer_metadata")
    try:
        for name in _METADATA_FIELDS:
            if name in _LENGTH_FIELDS:
                n = flat[at]
                fields[name], at = (None, at + 1) if n < 0 else (flat[at + 1: at + 1 + n], at + 1 + n)
            else:
                fields[name], at = flat[at], at + 1
        fields["layout_query"] = _LAYOUTS_Q[fields["layout_query"]]
        fields["layout_key"] = _LAYOUTS_K[fields["layout_key"]]
    except IndexError:
        _fail("metadata is truncated or corrupt")
    if at != len(flat):
        _fail("metadata has trailing entries")
    return fields


def _check_metadata(metadata, expected, q_counts, k_lengths):
    got = _decode_metadata(metadata)
    bounds = {"max_seqlen_q": max(q_counts, default=0), "max_seqlen_k": max(k_lengths, default=0)}
    for name, want in expected.items():
        if name in bounds:
            if got[name] and bounds[name] > got[name]:
                _fail(f"stale metadata: {name} is {got[name]} but a request has {bounds[name]}")
        elif name == "batch_size":
            if got[name] and got[name] != want:
                _fail(f"stale metadata: batch_size is {got[name]}, the call has {want} requests")
        elif got[name] != want:
            _fail(f"stale metadata: {name} was {got[name]} when the metadata was built, the call has {want}")


def npu_quant_lightning_indexer(query, key, weights, query_dequant_scale, key_dequant_scale,
                                actual_seq_lengths_query=None, actual_seq_lengths_key=None, block_table=None,
                                metadata=None, *, query_quant_mode=0, key_quant_mode=0, layout_query="BSND",
                                layout_key="PA_BSND", sparse_count=2048, sparse_mode=3, pre_tokens=NO_LIMIT,
                                next_tokens=NO_LIMIT, cmp_ratio=1, return_value=False):
    """Per-token-head int8 indexer. cmp_ratio 4: actual_seq_lengths_key counts original tokens L, the cache holds
    L // 4 entries per request and indices are entry numbers. ``metadata``, when given, must match the call."""
    _check_attrs(layout_query, layout_key, "sparse_count", sparse_count, sparse_mode, cmp_ratio)
    if query_quant_mode != 0 or key_quant_mode != 0:
        _fail(f"query_quant_mode/key_quant_mode must be 0 (per-token-head), got {query_quant_mode}/{key_quant_mode}")
    q_dim = 3 if layout_query == "TND" else 4
    _check_tensor("query", query, (torch.int8,), q_dim)
    _check_tensor("key", key, (torch.int8,), 3 if layout_key == "TND" else 4)
    _check_tensor("weights", weights, (torch.float16,), q_dim - 1)
    _check_tensor("query_dequant_scale", query_dequant_scale, (torch.float16,), q_dim - 1)
    _check_heads_dim("query", query, HEADS_Q)
    _check_heads_dim("key", key, HEADS_K)
    for name, t in (("weights", weights), ("query_dequant_scale", query_dequant_scale)):
        if t.shape != query.shape[:-1]:
            _fail(f"{name} must have shape {tuple(query.shape[:-1])} (query without D), got {tuple(t.shape)}")
    if not isinstance(key_dequant_scale, torch.Tensor) or key_dequant_scale.shape not in (key.shape[:-1],
                                                                                         key.shape[:-2]):
        got = tuple(key_dequant_scale.shape) if isinstance(key_dequant_scale, torch.Tensor) else key_dequant_scale
        _fail(f"key_dequant_scale must have shape {tuple(key.shape[:-1])} or {tuple(key.shape[:-2])}, got {got}")
    _check_tensor("key_dequant_scale", key_dequant_scale, (torch.float16,), key_dequant_scale.dim())
    for name, t in (("query_dequant_scale", query_dequant_scale), ("key_dequant_scale", key_dequant_scale)):
        if not bool((t >= 0).all()):  # also rejects NaN
            _fail(f"{name} must be >= 0 (it is a dequantization scale)")
    spans, out_prefix = _query_spans(layout_query, query, actual_seq_lengths_query)
    key_rows, lengths = _key_rows(layout_key, key, actual_seq_lengths_key, block_table, len(spans), cmp_ratio)
    if metadata is not None:
        aslq, aslk = (None if t is None else t.tolist() for t in (actual_seq_lengths_query, actual_seq_lengths_key))
        expected = dict(zip(_METADATA_FIELDS, (
            query.shape[-2], key.shape[-2], query.shape[-1], query_quant_mode, key_quant_mode, layout_query,
            layout_key, sparse_count, sparse_mode, cmp_ratio, len(spans), None, None, aslq, aslk)))
        _check_metadata(metadata, expected, [n for _, n in spans], lengths)
    # int8 . int8 over D = 128 is at most 2**21 in magnitude: exact in fp32 whatever the summation order.
    q = query.reshape(-1, HEADS_Q, HEAD_DIM).float()
    k = key.reshape(-1, HEAD_DIM).float()
    w = weights.reshape(-1, HEADS_Q).float()
    qs = query_dequant_scale.reshape(-1, HEADS_Q).float()
    ks = key_dequant_scale.reshape(-1).float()

    def score(q_rows, k_rows):
        dots = torch.einsum("thd,sd->ths", q[q_rows], k[k_rows])
        logits = torch.relu(qs[q_rows, :, None] * ks[k_rows][None, None, :] * dots)
        return (w[q_rows, :, None] * logits).sum(dim=1)

    return _run(spans, key_rows, lengths, out_prefix, sparse_count, sparse_mode, cmp_ratio, score, return_value)


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


def npu_dynamic_quant(x, smooth_scales=None):
    """Symmetric per-row int8: scale = amax(|x|) / 127 (fp32, shape x.shape[:-1]), q = round(x / scale) in -127..127.

    ``smooth_scales`` [x.shape[-1]] multiplies x first. A zero row gets the floor scale float32.tiny and q = 0."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS or x.dim() < 1:
        _fail(f"x must be a float16/bfloat16 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    xf = x.float()
    if smooth_scales is not None:
        if not isinstance(smooth_scales, torch.Tensor) or tuple(smooth_scales.shape) != (x.shape[-1],):
            _fail(f"smooth_scales must have shape ({x.shape[-1]},), got {getattr(smooth_scales, 'shape', None)}")
        xf = xf * smooth_scales.float()
    scale = (xf.abs().amax(dim=-1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(xf / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def npu_rotary_mul(input, r1, r2, rotary_mode="half"):
    """RoPE as documented for torch_npu.npu_rotary_mul: ``input * r1 + rotate(input) * r2`` with r1 = cos, r2 = sin
    given at full width and broadcast to input (4-D). "half": rotate(x) = cat(-x[D/2:], x[:D/2]) (r1, r2 hold each
    angle twice, halves repeated); "interleave": pairs (2i, 2i+1), rotate(x)[2i] = -x[2i+1], rotate(x)[2i+1] = x[2i]
    (r1, r2 hold each angle twice, adjacent). Computed in fp32, returned in input's dtype."""
    for name, t in (("input", input), ("r1", r1), ("r2", r2)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            _fail(f"{name} must be a 4-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
    if rotary_mode not in ("half", "interleave"):
        _fail(f"rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}")
    if input.shape[-1] % 2 or r1.shape[-1] != input.shape[-1] or r2.shape != r1.shape:
        _fail(f"r1 / r2 must match input's last dim {input.shape[-1]} (even), got {list(r1.shape)}, {list(r2.shape)}")
    x = input.float()
    if rotary_mode == "half":
        a, b = x.chunk(2, dim=-1)
        rotated = torch.cat([-b, a], dim=-1)
    else:
        rotated = torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
    return (x * r1.float() + rotated * r2.float()).to(input.dtype)


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
    """A test double of the ``torch_npu`` module (plain torch on CPU), not torch_npu.

    ``variant`` picks the npu_lightning_indexer signature: "sparse_count" (current) or "selected_count" (older).
    Every call is appended to ``calls`` as (function name, {parameter: value} for the arguments the caller passed,
    positional ones by name); defaults are not filled in."""

    def __init__(self, variant="sparse_count", version=None):
        super().__init__("torch_npu", self.__doc__)
        indexers = {"sparse_count": npu_lightning_indexer_sparse_count,
                    "selected_count": npu_lightning_indexer_selected_count}
        if variant not in indexers:
            raise ValueError(f"variant must be one of {sorted(indexers)}, got {variant!r}")
        self.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None)
        self.__version__ = DEFAULT_VERSION if version is None else version
        self.variant = variant
        self.calls: list[tuple[str, dict]] = []
        for name, fn in (("npu_lightning_indexer", indexers[variant]),
                         ("npu_quant_lightning_indexer", npu_quant_lightning_indexer),
                         ("npu_quant_lightning_indexer_metadata", npu_quant_lightning_indexer_metadata),
                         ("npu_scatter_nd_update_", npu_scatter_nd_update_),
                         ("npu_dynamic_quant", npu_dynamic_quant),
                         ("npu_rotary_mul", npu_rotary_mul)):
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


def install(monkeypatch, *, variant="sparse_count", available=True, device_name="Ascend910B3", version=None):
    """Make ``import torch_npu`` give a fresh TorchNpuDouble and ``torch.npu`` a NpuDeviceDouble (undone by
    monkeypatch at the end of the test). Returns the double."""
    double = TorchNpuDouble(variant=variant, version=version)
    monkeypatch.setitem(sys.modules, "torch_npu", double)
    monkeypatch.setattr(torch, "npu", NpuDeviceDouble(available, device_name), raising=False)
    return double
