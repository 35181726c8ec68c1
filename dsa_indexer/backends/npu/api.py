"""What this torch_npu offers, read from its operators' schemas (argument names and types, never version strings).

torch_npu exports its kernels as operator objects: ``torch_npu.<op>`` IS ``torch.ops.npu.<op>``, an
``OpOverloadPacket`` (Ascend/pytorch ``torch_npu/_init/core/_exports.py``). ``inspect.signature`` on one says only
``(*args, **kwargs)``, so every feature is read from its overloads' ``_schema``: which arguments are positional,
their names and types, how many results. A plain Python function (a wrapper, a test double) is read from its
signature, which has no types. An op is used only when its schema takes every argument the adapter passes, under
the name, position and type the adapter passes it; otherwise it is left out and ``NpuApi.missing`` says which
argument did not fit. The adapters call the overload whose schema was checked, so a call that the schema does not
accept raises in the binding instead of running.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable

import torch

INDEXER = "npu_lightning_indexer"
QUANT_INDEXER = "npu_quant_lightning_indexer"
SCATTER = "npu_scatter_nd_update_"
ROTARY = "npu_rotary_mul"
DYNAMIC_QUANT = "npu_dynamic_quant"


@dataclass(frozen=True)
class Param:
    name: str
    type: str | None  # the schema's type without "?" ("Tensor", "str", "int", "int[]"...); None: a Python signature
    keyword_only: bool


@dataclass(frozen=True)
class OpSignature:
    source: str  # "schema" or "python signature"
    text: str  # the schema string or the Python signature, for messages
    params: tuple[Param, ...]
    returns: int | None  # the number of results (None: unknown, a Python function)

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)

    @property
    def positional(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params if not p.keyword_only)


# What each adapter passes: (name or None for "any name", type) positionally, in order, then (name, type) by keyword.
_INDEXER_KEYWORDS = (("actual_seq_lengths_query", "Tensor"), ("actual_seq_lengths_key", "Tensor"),
                     ("block_table", "Tensor"), ("layout_query", "str"), ("layout_key", "str"),
                     ("sparse_count", "int"), ("sparse_mode", "int"))
CALLS = {
    INDEXER: ((("query", "Tensor"), ("key", "Tensor"), ("weights", "Tensor")), _INDEXER_KEYWORDS),
    QUANT_INDEXER: ((("query", "Tensor"), ("key", "Tensor"), ("weights", "Tensor"), ("query_dequant_scale", "Tensor"),
                     ("key_dequant_scale", "Tensor"), ("query_quant_mode", "int"), ("key_quant_mode", "int")),
                    _INDEXER_KEYWORDS),
    ROTARY: (((None, "Tensor"), ("r1", "Tensor"), ("r2", "Tensor")), ()),
    DYNAMIC_QUANT: (((None, "Tensor"),), ()),
    SCATTER: (((None, "Tensor"), ("indices", "Tensor"), ("updates", "Tensor")), ()),
}
RESULTS = {QUANT_INDEXER: 1, DYNAMIC_QUANT: 2, ROTARY: 1}  # results the adapter reads (the indexer: its first one)


def _type_name(t) -> str:
    if t.kind() == "OptionalType":
        t = t.getElementType()
    if t.kind() == "ListType":
        return _type_name(t.getElementType()) + "[]"
    return {"TensorType": "Tensor", "StringType": "str", "IntType": "int", "BoolType": "bool",
            "FloatType": "float"}.get(t.kind(), str(t))


def schema_signature(schema) -> OpSignature:
    params = tuple(Param(a.name, _type_name(a.type), bool(a.kwarg_only)) for a in schema.arguments)
    return OpSignature("schema", str(schema), params, len(schema.returns))


def python_signature(fn: Callable) -> OpSignature | None:
    """The Python signature of ``fn``; None when it hides its parameters (``*args, **kwargs`` only) or has none."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    named = [p for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if not named:
        return None
    params = tuple(Param(p.name, None, p.kind == p.KEYWORD_ONLY) for p in named)
    return OpSignature("python signature", f"{getattr(fn, '__name__', 'fn')}{sig}", params, None)


def _overloads(fn) -> list[tuple[Callable, OpSignature]]:
    """(callable, signature) candidates of an operator object: each overload of a packet, or the overload itself."""
    if isinstance(fn, torch._ops.OpOverloadPacket):
        return [(getattr(fn, name), schema_signature(getattr(fn, name)._schema)) for name in fn.overloads()]
    if isinstance(fn, torch._ops.OpOverload):
        return [(fn, schema_signature(fn._schema))]
    return []


def mismatch(op: str, sig: OpSignature) -> str | None:
    """Why the adapter's call of ``op`` does not fit ``sig`` (None: it fits)."""
    positional, keywords = CALLS[op]
    given = sig.positional
    for i, (name, typ) in enumerate(positional):
        if i >= len(given):
            return f"takes {len(given)} positional arguments, the adapter passes {len(positional)}"
        p = given[i]
        if name is not None and p.name != name:
            return f"positional argument {i} is {p.name!r}, the adapter passes {name!r} there"
        if p.type is not None and p.type != typ:
            return f"argument {p.name!r} is {p.type}, the adapter passes {typ}"
    for name, typ in keywords:
        p = sig.param(name)
        if p is None:
            return f"has no argument {name!r}"
        if p.type is not None and p.type != typ:
            return f"argument {name!r} is {p.type}, the adapter passes {typ}"
    want = RESULTS.get(op)
    if want is not None and sig.returns is not None and sig.returns != want:
        return f"returns {sig.returns} results, the adapter reads {want}"
    return None


def resolve(module: ModuleType, op: str) -> tuple[Callable | None, OpSignature | None, str | None]:
    """(the callable to use, its signature, None) or (None, None, why not) for ``module.<op>``."""
    fn = getattr(module, op, None)
    if fn is None:
        return None, None, f"has no {op}"
    candidates = _overloads(fn)
    if not candidates:
        sig = python_signature(fn)
        if sig is None:  # a wrapper hiding its parameters: the registered operator's schema, if there is one
            packet = getattr(getattr(torch.ops, "npu", None), op, None) if hasattr(torch.ops, "npu") else None
            candidates = [(fn, s) for _, s in _overloads(packet)] if packet is not None else []
            if not candidates:
                return None, None, f"{op} hides its parameters and no torch.ops.npu.{op} schema describes them"
        else:
            candidates = [(fn, sig)]
    reasons = []
    for call, sig in candidates:
        reason = mismatch(op, sig)
        if reason is None:
            return call, sig, None
        reasons.append(f"{sig.text}: {reason}")
    return None, None, f"{op} does not take the adapter's call ({'; '.join(reasons)})"


# The Ascend product, from the device name's prefix as torch_npu's own test helper (``SupportedDevices``, used by
# op-plugin's tests of these ops) reads it. It decides what the indexers take (op-plugin's docs, per product).
PRODUCT_PREFIXES = (("Ascend950", "950"), ("Ascend910_93", "a3"), ("Ascend910B", "a2"))
PRODUCT_NAMES = {"950": "Ascend 950PR / 950DT", "a3": "Atlas A3", "a2": "Atlas A2"}


def product_of(device_name: str | None) -> str | None:
    """"950", "a3", "a2" or None (another or an unknown product)."""
    name = device_name or ""
    return next((product for prefix, product in PRODUCT_PREFIXES if name.startswith(prefix)), None)


def _device() -> tuple[str | None, torch.device]:
    """(the NPU's device name, the device the probe's checks run on); a torch.npu without devices (or one that
    fails) gives (None or its name, the CPU)."""
    npu = getattr(torch, "npu", None)
    try:
        name = str(npu.get_device_name(0)) if npu is not None else None
    except Exception:  # noqa: BLE001 - an unreadable name is an unknown product
        name = None
    try:
        device = torch.device("npu", npu.current_device())
    except Exception:  # noqa: BLE001 - no torch.npu device API (e.g. a test double of the ops on the CPU)
        device = torch.device("cpu")
    return name, device


@dataclass(frozen=True)
class NpuApi:
    version: str
    indexer: Callable | None  # npu_lightning_indexer (bf16 / fp16 keys): the overload whose schema fits
    quant_indexer: Callable | None  # npu_quant_lightning_indexer (int8 keys)
    scatter: Callable | None  # npu_scatter_nd_update_
    rotary: Callable | None  # npu_rotary_mul
    rotary_interleave: bool  # it takes a str rotary_mode (its "interleave" mode: V4's RoPE pairs)
    dynamic_quant: Callable | None  # npu_dynamic_quant (symmetric per-row int8)
    signatures: dict = field(default_factory=dict, compare=False)  # op -> OpSignature of what is used
    missing: dict = field(default_factory=dict, compare=False)  # op -> why it is not used
    device_name: str | None = None  # torch.npu.get_device_name(0)
    device: torch.device = field(default=torch.device("cpu"), compare=False)  # where the one-time checks run
    checks: dict = field(default_factory=dict, compare=False)  # the adapters' one-time checks' answers, by key

    @property
    def product(self) -> str | None:
        return product_of(self.device_name)

    def describe(self) -> str:
        return f"torch_npu {self.version}" + (f" on {self.device_name}" if self.device_name else "")

    def why_not(self, op: str) -> str:
        return f"{self.describe()}: {self.missing.get(op, f'has no {op}')}"


def detect(module: ModuleType) -> NpuApi:
    found, signatures, missing = {}, {}, {}
    for op in CALLS:
        call, sig, reason = resolve(module, op)
        found[op] = call
        if call is None:
            missing[op] = reason
        else:
            signatures[op] = sig
    rotary_sig = signatures.get(ROTARY)
    mode = rotary_sig.param("rotary_mode") if rotary_sig is not None else None
    device_name, device = _device()
    return NpuApi(version=str(getattr(module, "__version__", "?")), indexer=found[INDEXER],
                  device_name=device_name, device=device,
                  quant_indexer=found[QUANT_INDEXER], scatter=found[SCATTER], rotary=found[ROTARY],
                  rotary_interleave=mode is not None and mode.type in (None, "str"),
                  dynamic_quant=found[DYNAMIC_QUANT], signatures=signatures, missing=missing)
