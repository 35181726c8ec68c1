"""What an implementation returns, checked against its op's declaration: the result's structure, dtype, shape, device.

Each op declares its fake (meta) result once (`contract.specs.OpDecl.fake`), so the expected metadata of a call
follows from the arguments' shapes, dtypes and scalars alone. The registry wraps every implementation that is not
built in (a plugin's, or one registered in code) with `checked`: a result of the wrong dtype or shape (an int64
top-k, a [rows, k - 1] one) raises naming the implementation and what was expected instead of flowing on. It reads
metadata only: no device work, no host sync, nothing a CUDA graph capture would mind; the expected metadata is
cached per argument signature, so a call costs a tuple build and a dict lookup more. Values are the conformance
check's business (`dsa_indexer.testing.check_implementation`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch


class Meta(NamedTuple):
    """One result tensor as the op declares it."""

    shape: tuple
    dtype: torch.dtype


Expected = Any  # None | Meta | tuple of Meta: what the op's fake returns, as metadata

_UNKNOWN = object()  # no expectation computed yet for this signature
_UNCHECKED = object()  # the declaration's fake cannot read these arguments (a direct call off the schema)
_CACHE_LIMIT = 4096  # distinct argument signatures kept per implementation (prefill lengths vary per step)


class ImplementationResultError(RuntimeError):
    """An implementation returned a result whose structure, dtype, shape or device is not its op's."""


def expected_result(decl, args: tuple) -> Expected:
    """The metadata ``decl``'s fake gives for these (schema-ordered) arguments, computed on meta tensors."""
    meta = tuple(torch.empty_like(a, device="meta") if isinstance(a, torch.Tensor) else a for a in args)
    return _metadata(decl.fake(*meta))


def _metadata(out: Any) -> Expected:
    if out is None:
        return None
    if isinstance(out, torch.Tensor):
        return Meta(tuple(out.shape), out.dtype)
    return tuple(_metadata(o) for o in out)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _shown(shape: tuple, dtype: torch.dtype) -> str:
    return f"{_dtype_name(dtype)} {list(shape)}"


def _tensor_mismatch(what: str, want: Meta, got: Any, device: torch.device | None) -> str | None:
    shape, dtype = want
    if not isinstance(got, torch.Tensor):
        return f"{what} is a {type(got).__name__}; expected a tensor, {_shown(shape, dtype)}"
    if got.dtype != dtype or tuple(got.shape) != shape:
        return f"{what} is {_shown(tuple(got.shape), got.dtype)}; expected {_shown(shape, dtype)}"
    if device is not None and got.device != device:
        return f"{what} is on {got.device}; expected {device} (the inputs' device)"
    return None


def mismatch(expected: Expected, got: Any, device: torch.device | None = None) -> str | None:
    """How ``got`` differs from ``expected`` (structure, dtype, shape, then device), or None when it does not."""
    if expected is None:
        if got is None:
            return None
        return f"a {type(got).__name__}; expected None (the op writes its outputs in place)"
    if not isinstance(expected, Meta):  # a tuple of results
        if not isinstance(got, (tuple, list)) or len(got) != len(expected):
            n = len(got) if isinstance(got, (tuple, list)) else None
            return (f"{'a ' + type(got).__name__ if n is None else f'{n} results'}; expected a tuple of "
                    f"{len(expected)}: {', '.join(_shown(*e) for e in expected)}")
        for i, (want, value) in enumerate(zip(expected, got)):
            found = _tensor_mismatch(f"result {i}", want, value, device)
            if found is not None:
                return found
        return None
    return _tensor_mismatch("the result", expected, got, device)


def _signature(args: tuple) -> tuple:
    return tuple((a.shape, a.dtype) if isinstance(a, torch.Tensor) else a for a in args)


def checked(fn: Callable[..., Any], impl) -> Callable[..., Any]:
    """``fn`` (``impl``'s callable), raising `ImplementationResultError` when a result's metadata is not what the
    op declares. Ops without a declaration (the pipeline strategy) are returned unwrapped."""
    from ..contract.declarations import DECLARED

    decl = DECLARED.get(impl.op)
    if decl is None:
        return fn
    origin = "" if impl.origin == "?" else f" (plugin {impl.origin})"
    expected_by_signature: dict[tuple, Expected] = {}

    def checked_call(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if kwargs or len(args) != len(decl.arguments):  # a direct caller leaving optional arguments out
            named = dict(zip(decl.arguments, args), **kwargs)
            args = tuple(named.get(name) for name in decl.arguments)
        key = _signature(args)
        expected = expected_by_signature.get(key, _UNKNOWN)
        if expected is _UNKNOWN:
            if len(expected_by_signature) >= _CACHE_LIMIT:
                expected_by_signature.clear()
            try:
                expected = expected_result(decl, args)
            except Exception:  # noqa: BLE001 - arguments the declaration cannot read: the op's own calls always can
                expected = _UNCHECKED
            expected_by_signature[key] = expected
        if expected is _UNCHECKED:
            return out
        anchor = next((a for a in args if isinstance(a, torch.Tensor)), None)
        found = mismatch(expected, out, anchor.device if anchor is not None else None)
        if found is not None:
            raise ImplementationResultError(f"{impl.impl_id}{origin} returned a wrong result for {impl.op}: {found} "
                                            f"(as the op declares it; dsa_indexer.testing.check_implementation "
                                            f"checks an implementation against the reference)")
        return out

    checked_call.__wrapped__ = fn  # type: ignore[attr-defined]
    return checked_call
