"""What an op is, declared once: `OpDecl` (name, custom-op schema, the problem facts it derives, what it mutates,
its fake result), and `DECLARED`, every op declared so far.

`dsa_indexer.ops` declares each op with `dsa_indexer.ops.declare` on its public function; from that one declaration
come the ``dsa_indexer::<op>`` custom op and its fake (for `torch.compile`), the op body that builds the interned
`Problem` and calls the registry, and the facts table the CLI and the plugin loader read (`PROBLEM_KEYS`). An
implementation takes the schema's arguments, positionally, in the schema's order (the reference functions in
`backends/reference/kernels.py` show each).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch

PIPELINE_OP = "indexer_pipeline"  # the pipeline strategy is resolved like an op (problem: tokens, decode, q_lora_quant)


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

_ARG = re.compile(r"^\s*(?P<type>[\w\[\]?]+)(?:\((?P<alias>[a-z!]+)\))?\s+(?P<name>\w+)\s*(?:=.*)?$")


def schema_argument_names(schema: str) -> tuple[str, ...]:
    """The argument names of a custom-op schema ``"(Tensor x, int n) -> Tensor"``, in order."""
    inner = schema.strip()
    if not inner.startswith("(") or ") ->" not in inner:
        raise ValueError(f"schema {schema!r} must read '(<arguments>) -> <results>'")
    arguments = inner[1:inner.index(") ->")]
    names = []
    for part in (p for p in arguments.split(",") if p.strip()):
        match = _ARG.match(part)
        if match is None:
            raise ValueError(f"schema argument {part.strip()!r} of {schema!r} is not '<type> <name>'")
        names.append(match.group("name"))
    return tuple(names)


@dataclass(frozen=True)
class OpDecl:
    """One op. ``schema``: the custom op's arguments and results without the target (every op takes a trailing
    ``str? target=None``). ``facts``: each fact of its `Problem` (what may change which implementation serves a
    call) as a Python expression over the arguments, e.g. ``{"width": "x.shape[-1]", "fp8": "fp8_name(x.dtype)"}``;
    compiled once into one function (`facts_function`), so building a call's problem stays a tuple and a dict
    lookup. ``mutates``: the arguments written in place. ``fake``: the meta result, same arguments as the schema."""

    name: str
    schema: str
    facts: Mapping[str, str]
    fake: Callable[..., Any]
    mutates: tuple[str, ...] = ()
    doc: str = ""
    arguments: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "arguments", schema_argument_names(self.schema))
        unknown = set(self.mutates) - set(self.arguments)
        if unknown:
            raise ValueError(f"op {self.name}: mutates names {sorted(unknown)}, which are not arguments")

    @property
    def problem_keys(self) -> tuple[str, ...]:
        return tuple(self.facts)

    def schema_with_target(self) -> str:
        head, _, results = self.schema.partition(") ->")
        return f"{head}{', ' if self.arguments else ''}str? target=None) ->{results}"

    def facts_function(self) -> Callable[..., tuple]:
        """``f(*arguments) -> tuple of fact values`` in the order of `facts` (generated source, compiled once)."""
        body = ", ".join(f"({expression})" for expression in self.facts.values())
        source = f"def facts({', '.join(self.arguments)}):\n    return ({body}{',' if self.facts else ''})\n"
        namespace: dict[str, Any] = dict(FACT_HELPERS)
        exec(compile(source, f"<facts of {self.name}>", "exec"), namespace)  # noqa: S102 - our own declarations
        return namespace["facts"]


DECLARED: dict[str, OpDecl] = {}


def declare(decl: OpDecl) -> OpDecl:
    if decl.name in DECLARED:
        raise ValueError(f"op {decl.name!r} is declared twice")
    DECLARED[decl.name] = decl
    return decl


class _ProblemKeys(Mapping[str, tuple[str, ...]]):
    """op -> its problem facts, read live from `DECLARED` (the CLI's and the plugin loader's table)."""

    def __getitem__(self, op: str) -> tuple[str, ...]:
        return DECLARED[op].problem_keys

    def __iter__(self) -> Iterator[str]:
        return iter(DECLARED)

    def __len__(self) -> int:
        return len(DECLARED)


PROBLEM_KEYS: Mapping[str, tuple[str, ...]] = _ProblemKeys()
