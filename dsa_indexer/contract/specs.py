"""What an op is, declared once: `OpDecl` (its public signature and checks, the custom-op schema inferred from that
signature, the problem facts it derives, what it mutates, its fake result, a typical problem), and `DECLARED`,
every op declared so far.

`contract/declarations.py` declares each op with `declare` on its annotated public signature; from that one
declaration come the ``dsa_indexer::<op>`` custom op and its fake (for `torch.compile`) and the public function that
checks, binds (`dispatch.bind`) and calls (`dsa_indexer.ops`), the facts table the CLI and the plugin loader read
(`PROBLEM_KEYS`) and the CLI's typical problems (`OpDecl.example`). An implementation takes the schema's arguments,
positionally, in the schema's order (the reference functions in `backends/reference/kernels.py` show each).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

PIPELINE_OP = "indexer_pipeline"  # the pipeline strategy is resolved like an op (problem: tokens, decode, q_lora_quant)
# The registry info key of an implementation that writes a caller's output buffer: it takes ``out=`` (a tensor of
# the result's dtype and shape, contiguous, checked by the op) as a keyword, writes every element of it and returns
# it. An implementation without it (a plugin's, a vendor call that allocates) still serves an op called with
# ``out=``: the dispatch layer copies its result into the buffer (`call_into`).
WRITES_OUT_INFO = "writes_out"


def writes_out(info: Mapping[str, Any]) -> bool:
    """Whether an implementation with registry ``info`` takes ``out=`` and writes its result there."""
    return bool(info.get(WRITES_OUT_INFO, False))


def call_into(fn: Callable[..., Any], info: Mapping[str, Any], args: Sequence[Any], out: Any) -> Any:
    """``fn(*args)``'s result in the caller's buffer ``out``, returned: an implementation that declares
    ``writes_out`` in its ``info`` receives ``out=`` and writes it, another's result is copied in (one copy)."""
    if not writes_out(info):
        return out.copy_(fn(*args))
    result = fn(*args, out=out)
    return result if result is out else out.copy_(result)  # a path inside it that allocated after all (a fallback)


class _Fp8Names(dict):
    def __missing__(self, dtype: torch.dtype) -> str:
        return "fn"


FP8_NAMES = _Fp8Names({torch.float8_e4m3fnuz: "fnuz", torch.float8_e4m3fn: "fn"})


def fp8_name(dtype: torch.dtype) -> str:
    """The problem fact naming an fp8 flavour: "fnuz" (gfx942's e4m3fnuz) or "fn" (e4m3fn everywhere else)."""
    return FP8_NAMES[dtype]


# Names a fact expression may use besides the op's arguments. In a fact, ``fp8_name`` is the table's own lookup
# (a C call: building a problem runs no Python function but the generated one).
FACT_HELPERS: dict[str, Any] = {"fp8_name": FP8_NAMES.__getitem__, "torch": torch}


@dataclass(frozen=True)
class OpDecl:
    """One op, declared once by its public signature (`declare`). ``check``: the public function without the target,
    annotated; it checks and normalizes the caller's arguments and returns them in its signature's order, less
    ``public_only`` ones (what implementations take: `arguments`). The custom-op schema is inferred from those
    annotations as `torch.library.custom_op` infers it (`schema`; every op also takes a trailing ``str? target``).
    ``facts``: each fact of the op's `Problem` (what may change which implementation serves a call) as a Python
    expression over the arguments, e.g. ``{"width": "x.shape[-1]", "fp8": "fp8_name(x.dtype)"}``, compiled once into
    one function (`facts_function`), so building a call's problem stays a tuple and a dict lookup. ``fake``: the meta
    result; given naming only the arguments it reads (``**_`` for the rest), held called positionally.
    ``mutates``: the arguments written in place. ``example``: a typical problem (`dsa-indexer explain`'s and the
    arch matrix's), a subset of the facts. ``target_fp8``: the argument that, left None, takes the target's fp8
    flavour (the target is known above the contract: `dsa_indexer.ops` fills it). ``results``: what implementations
    return where the public function returns something else (`rmsnorm_quant_fp8` wraps its quant). ``out``: the
    keyword-only last argument that names a caller's buffer for the result (``out=``, None: the op allocates); the
    checks validate it and return it last, after the implementation arguments; it is not one of them (an
    implementation that declares `WRITES_OUT_INFO` receives it as ``out=``) and the op's schema leaves it out:
    the buffer is written by a second custom op, ``<name>_out`` (`out_schema`: the arguments, then
    ``Tensor(a!) out``, returning nothing, as a custom op may not return an alias of its input)."""

    name: str
    check: Callable[..., tuple]
    facts: Mapping[str, str]
    fake: Callable[..., Any]
    mutates: tuple[str, ...] = ()
    example: Mapping[str, Any] = field(default_factory=dict)
    public_only: tuple[str, ...] = ()
    target_fp8: str | None = None
    results: Any = None
    doc: str = ""
    out: str | None = None
    arguments: tuple[str, ...] = field(init=False)
    schema: str = field(init=False)
    out_schema: str | None = field(init=False)

    def __post_init__(self) -> None:
        signature = inspect.signature(self.check, eval_str=True)
        parameters = [p for p in signature.parameters.values()
                      if p.name not in self.public_only and p.name != self.out]
        object.__setattr__(self, "arguments", tuple(p.name for p in parameters))
        for what, names in (("mutates", self.mutates), ("public_only", self.public_only),
                            ("target_fp8", (self.target_fp8,) if self.target_fp8 else ()),
                            ("out", (self.out,) if self.out else ())):
            unknown = set(names) - set(signature.parameters)
            if unknown:
                raise ValueError(f"op {self.name}: {what} names {sorted(unknown)}, which are not arguments")
        if self.out is not None:
            last = list(signature.parameters.values())[-1]
            if last.name != self.out or last.kind is not inspect.Parameter.KEYWORD_ONLY or last.default is not None:
                raise ValueError(f"op {self.name}: out={self.out!r} must be the last argument, keyword-only, "
                                 "default None")
        unknown = set(self.example) - set(self.facts)
        if unknown:
            raise ValueError(f"op {self.name}: example names {sorted(unknown)}, which are not facts")
        # Implementations take every argument positionally, in order: the prototype has no defaults, no keyword-only.
        prototype = _prototype([inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                  annotation=p.annotation) for p in parameters],
                               signature.return_annotation if self.results is None else self.results)
        object.__setattr__(self, "schema", torch.library.infer_schema(prototype, mutates_args=self.mutates))
        out_schema = None
        if self.out is not None:
            buffer = inspect.Parameter(self.out, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=torch.Tensor)
            into = _prototype([*prototype.__signature__.parameters.values(), buffer], None)  # type: ignore[attr-defined]
            out_schema = torch.library.infer_schema(into, mutates_args=(*self.mutates, self.out))
        object.__setattr__(self, "out_schema", out_schema)
        object.__setattr__(self, "fake", _positional(self.fake, self.arguments))

    @property
    def problem_keys(self) -> tuple[str, ...]:
        return tuple(self.facts)

    def schema_with_target(self, schema: str | None = None) -> str:
        """``schema`` (default: the op's; `out_schema` for its ``<name>_out`` op) with the trailing target."""
        head, _, results = (schema or self.schema).rpartition(") ->")
        return f"{head}{', ' if head != '(' else ''}str? target=None) ->{results}"

    def facts_function(self) -> Callable[..., tuple]:
        """``f(*arguments) -> tuple of fact values`` in the order of `facts` (generated source, compiled once)."""
        body = ", ".join(f"({expression})" for expression in self.facts.values())
        source = f"def facts({', '.join(self.arguments)}):\n    return ({body}{',' if self.facts else ''})\n"
        namespace: dict[str, Any] = dict(FACT_HELPERS)
        exec(compile(source, f"<facts of {self.name}>", "exec"), namespace)  # noqa: S102 - our own declarations
        return namespace["facts"]


def _prototype(parameters: list[inspect.Parameter], results: Any) -> Callable[..., Any]:
    """A function with this signature and nothing else: what `torch.library.infer_schema` reads."""
    def prototype(*args: Any) -> Any:
        raise TypeError("a schema prototype is not called")

    prototype.__signature__ = inspect.Signature(parameters, return_annotation=results)  # type: ignore[attr-defined]
    return prototype


def _positional(fake: Callable[..., Any], arguments: tuple[str, ...]) -> Callable[..., Any]:
    """``fake`` (which names only the arguments it reads, ``**_`` for the rest) called with the arguments in order."""
    def positional_fake(*args: Any) -> Any:
        return fake(**dict(zip(arguments, args)))

    return positional_fake


DECLARED: dict[str, OpDecl] = {}


def declare(*, facts: Mapping[str, str], fake: Callable[..., Any], mutates: tuple[str, ...] = (),
            example: Mapping[str, Any] | None = None, public_only: tuple[str, ...] = (), target_fp8: str | None = None,
            results: Any = None, out: str | None = None) -> Callable[[Callable[..., tuple]], OpDecl]:
    """Declare the op named like the decorated function, its public signature and checks (see `OpDecl`); the
    decorated name becomes its `OpDecl`, entered in `DECLARED`."""
    def wrap(check: Callable[..., tuple]) -> OpDecl:
        name = check.__name__
        if name in DECLARED:
            raise ValueError(f"op {name!r} is declared twice")
        decl = OpDecl(name, check, dict(facts), fake, tuple(mutates), dict(example or {}), tuple(public_only),
                      target_fp8, results, (check.__doc__ or "").strip(), out)
        DECLARED[name] = decl
        return decl

    return wrap


class _ProblemKeys(Mapping[str, tuple[str, ...]]):
    """op -> its problem facts, read live from `DECLARED` (the CLI's and the plugin loader's table)."""

    def __getitem__(self, op: str) -> tuple[str, ...]:
        return DECLARED[op].problem_keys

    def __iter__(self) -> Iterator[str]:
        return iter(DECLARED)

    def __len__(self) -> int:
        return len(DECLARED)


PROBLEM_KEYS: Mapping[str, tuple[str, ...]] = _ProblemKeys()
