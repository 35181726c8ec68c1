"""The public ops: each declaration of `contract/declarations.py` made a function that checks, binds and calls.

From one `contract.specs.OpDecl` (the op's annotated public signature and checks, its facts and fake) this module
makes, per op:
- the ``dsa_indexer::<op>`` custom op with its fake, so a model that calls the indexer traces under `torch.compile`
  (resolution then runs inside the op at run time, cached, never at trace time);
- the op body (``run``): the interned `Problem` of the call (a tuple and a dict lookup), the target, the op bound
  for them (`dispatch.bind`, one cached lookup) and called;
- the public function: the declaration's checks, an ``fp8_dtype`` left None filled with the target's flavour,
  then the op body directly in eager mode (per-call overhead: benchmarks/dispatch_overhead.py) or the custom op
  while compiling;
- for an op declared with ``out`` (the top-k ops' caller-owned int32 buffer), the body that writes it
  (``run_out``) and the ``dsa_indexer::<op>_out`` custom op that mutates it: an implementation that declares
  ``writes_out`` (`contract.specs.WRITES_OUT_INFO`) receives ``out=`` and writes it; any other is called as
  usual and its result copied in, so an implementation (a plugin's) without ``out`` support still serves.
Adding an op: one declared function in `contract/declarations.py`, its reference implementation in
`backends/reference/kernels.py`, and its public name below (docs/architecture.md, "How to add an op").
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

from .contract import validate as v
from .contract.declarations import KEY_FORMATS, NORMS  # noqa: F401 (re-exported: the CLI's fact words)
from .contract.quant import PRODUCER_ROUNDED, Fp8GroupLayout, QuantizedActivation, scale_format  # noqa: F401
from .contract.specs import DECLARED, PIPELINE_OP, PROBLEM_KEYS, OpDecl, fp8_name  # noqa: F401 (re-exported)
from .contract.specs import call_into
from .dispatch.bind import bind
from .dispatch.plugins import default_registry
from .dispatch.problem import Problem
from .dispatch.registry import Bound
from .dispatch.target import Target, parse_target, target_of_tensor

_PARSED: dict[str, Target] = {}  # a plain dict, not functools.lru_cache: torch.compile traces the public ops


_compiling = torch.compiler.is_compiling  # the function itself (Dynamo knows it), not a wrapper: one call less


def _parsed(name: str) -> Target:
    target = _PARSED.get(name)
    if target is None:
        default_registry()  # plugins loaded first: an arch a plugin registers is known, not warned about
        target = _PARSED[name] = parse_target(name, "target=")
    return target


def _target_arg(target: Target | str | None) -> Target | str | None:
    """The explicit target as an op body takes it: the `Target` itself in eager mode (no round trip through its
    name), its parseable arch name while torch.compile traces (the custom ops' schema carries a str)."""
    if target is None or isinstance(target, str):
        return target
    if not isinstance(target, Target):
        raise v.IndexerInputError(f"target must be a Target, an arch name such as 'sm90', or None; got "
                                  f"{type(target).__name__}")
    return str(target) if _compiling() else target


def _target_for(anchor: torch.Tensor, target: Target | str | None) -> Target:
    if isinstance(target, Target):
        return target
    return target_of_tensor(anchor, _parsed(target) if target is not None else None)


_TARGET_PARAMETER = inspect.Parameter("target", inspect.Parameter.KEYWORD_ONLY, default=None,
                                      annotation="Target | str | None")


class DeclaredOp:
    """What this module makes of one declaration: the op body (``run``), the problem of a call (``problem``,
    ``facts``), the custom op, ``arguments`` (a public call's implementation arguments: checked, normalized, the
    target's fp8 flavour filled) and ``public``, the public function."""

    def __init__(self, decl: OpDecl, finish: Callable[[Any, tuple, Any], Any] | None = None) -> None:
        self.decl = decl
        name, check, facts, keys = decl.name, decl.check, decl.facts_function(), decl.problem_keys
        fp8_at = decl.arguments.index(decl.target_fp8) if decl.target_fp8 else None
        problems: dict[tuple, Problem] = {}

        def problem_of(*args: Any) -> Problem:
            """The interned Problem of a call with these (schema-ordered) arguments: a fresh one costs ~2 us."""
            values = facts(*args)
            found = problems.get(values)
            return found if found is not None else problems.setdefault(values, Problem(**dict(zip(keys, values))))

        def bound_for(args: tuple, target: Target | str | None) -> Bound:
            """The op bound for this call's target and interned problem."""
            found = problems.get(facts(*args))
            key = (name, target if type(target) is Target else
                   target_of_tensor(args[0]) if target is None else _target_for(args[0], target),
                   found if found is not None else problem_of(*args))
            bound = default_registry().bindings.get(key)  # `bind`'s own cache, read here: a call less per op
            return bound if bound is not None else bind(*key)

        def run(*args: Any, target: Target | str | None = None) -> Any:
            """The op body: the call's interned problem and its target, then the op bound for them, called."""
            return bound_for(args, target).fn(*args)

        def run_out(*args: Any, target: Target | str | None = None) -> torch.Tensor:
            """The op body with the caller's buffer last in ``args``: the bound implementation writes it (``out=``)
            where it declares ``writes_out``, else its result is copied in; -> the buffer itself."""
            *args, out = args
            bound = bound_for(args, target)
            return call_into(bound.fn, bound.info, args, out)

        def arguments(*args: Any, target: Target | str | None = None, **kwargs: Any) -> tuple:
            """The implementation's arguments of this public call: the declaration's checks and normalization, then
            an ``fp8_dtype`` left None set to the target's flavour (e4m3fnuz on gfx942). An op's ``out`` buffer is
            checked, and not among them."""
            out = check(*args, **kwargs)
            if decl.out is not None:
                out = out[:-1]
            if fp8_at is not None and out[fp8_at] is None:
                out = (*out[:fp8_at], _target_for(out[0], target).fp8_dtype, *out[fp8_at + 1:])
            return out

        self.custom_op = torch.library.custom_op(f"dsa_indexer::{name}", run, mutates_args=decl.mutates,
                                                 schema=decl.schema_with_target())
        fake = decl.fake
        self.custom_op.register_fake(lambda *args, target=None: fake(*args))
        compiled = getattr(torch.ops.dsa_indexer, name)
        self.custom_op_out = compiled_out = None
        if decl.out is not None:
            # A second op that writes the caller's buffer: a custom op may not return an alias of an input, so this
            # one returns nothing and the public function returns the buffer (torch.compile functionalizes it).
            def write_out(*args: Any, target: Target | str | None = None) -> None:
                run_out(*args, target=target)

            self.custom_op_out = torch.library.custom_op(f"dsa_indexer::{name}_out", write_out,
                                                         mutates_args=(*decl.mutates, decl.out),
                                                         schema=decl.schema_with_target(decl.out_schema))
            self.custom_op_out.register_fake(lambda *args, target=None: None)
            compiled_out = getattr(torch.ops.dsa_indexer, f"{name}_out")

        # The previous public call's binding, for a call with the same target and problem (a layer loop calls one
        # op with one problem over and over): identity tests instead of hashing the (op, target, problem) key.
        last_bound: list[tuple | None] = [None]

        @functools.wraps(check)
        def public(*args: Any, target: Target | str | None = None, **kwargs: Any) -> Any:
            explicit = None if target is None else _target_arg(target)
            # As `arguments`, inline: this is the per-call path (an empty ``**kwargs`` passed on costs a dict merge).
            args = check(*args, **kwargs) if kwargs else check(*args)
            if fp8_at is not None and args[fp8_at] is None:
                args = (*args[:fp8_at], _target_for(args[0], explicit).fp8_dtype, *args[fp8_at + 1:])
            if compiled_out is not None:  # the checks returned the caller's buffer (or None) after the arguments
                if args[-1] is not None:
                    if _compiling():
                        compiled_out(*args, target=explicit)
                        return args[-1]
                    return run_out(*args, target=explicit)
                args = args[:-1]
            if _compiling():
                out = compiled(*args, target=explicit)
            elif explicit is None:  # `run` for the tensor's own target, inline: one call less on the usual path
                found = problems.get(facts(*args))
                target_now, bindings = target_of_tensor(args[0]), default_registry().bindings
                last = last_bound[0]  # (target, problem, bindings, bound) of the previous call, one atomic read
                if last is not None and last[0] is target_now and last[1] is found and last[2] is bindings:
                    out = last[3].fn(*args)  # the same interned target and problem, the registry unchanged since
                else:  # (the registry replaces its bindings dict on every change)
                    key = (name, target_now, found if found is not None else problem_of(*args))
                    bound = bindings.get(key)
                    if bound is None:
                        bound = bind(*key)
                    last_bound[0] = (key[1], key[2], bindings, bound)
                    out = bound.fn(*args)
            else:
                out = run(*args, target=explicit)
            return out if finish is None else finish(out, args, explicit)

        signature = inspect.signature(check)
        public.__signature__ = signature.replace(parameters=[*signature.parameters.values(), _TARGET_PARAMETER])
        public.decl, public.run, public.problem, public.facts = decl, run, problem_of, facts
        public.custom_op, public.custom_op_out = self.custom_op, self.custom_op_out
        public.run_out = run_out if decl.out is not None else None
        self.run, self.problem, self.facts, self.arguments, self.public = run, problem_of, facts, arguments, public
        self.run_out = public.run_out


def _producer_tagged(out: tuple, arguments: tuple, target: Target | str | None
                     ) -> tuple[torch.Tensor, QuantizedActivation]:
    """`rmsnorm_quant_fp8`'s public result: which implementation made the quant decides its producer tag (the
    bound implementation's ``info``)."""
    normed, x_fp8, scales = out
    x, _, _, group_size, ue8m0, fp8 = arguments
    bound = bind("rmsnorm_quant_fp8", _target_for(x, target), OPERATORS["rmsnorm_quant_fp8"].problem(*arguments))
    layout = Fp8GroupLayout(group_size=group_size, ue8m0=ue8m0, rows=x.shape[0], fp8_dtype=fp8,
                            producer=bound.info.get("producer", PRODUCER_ROUNDED))
    return normed, QuantizedActivation(x_fp8, scales, layout)


_FINISH = {"rmsnorm_quant_fp8": _producer_tagged}  # public results that are not the implementations' own
OPERATORS: dict[str, DeclaredOp] = {name: DeclaredOp(decl, _FINISH.get(name)) for name, decl in DECLARED.items()}
OPS = tuple(OPERATORS)

# The public functions, one per declaration (tests/ops/test_declarations.py checks that none is missing).
quant_fp8_groups = OPERATORS["quant_fp8_groups"].public
rmsnorm_quant_fp8 = OPERATORS["rmsnorm_quant_fp8"].public
q_prologue = OPERATORS["q_prologue"].public
q_prologue_fp4 = OPERATORS["q_prologue_fp4"].public
k_prologue_store = OPERATORS["k_prologue_store"].public
gemm_fp8_blockscale = OPERATORS["gemm_fp8_blockscale"].public
ragged_mqa_logits = OPERATORS["ragged_mqa_logits"].public
paged_mqa_logits = OPERATORS["paged_mqa_logits"].public
topk_indices = OPERATORS["topk_indices"].public
lightning_indexer = OPERATORS["lightning_indexer"].public
ragged_mqa_topk = OPERATORS["ragged_mqa_topk"].public
c4_compress_pool = OPERATORS["c4_compress_pool"].public
q_prologue_plain = OPERATORS["q_prologue_plain"].public
k_prologue_store_plain = OPERATORS["k_prologue_store_plain"].public
lightning_indexer_ragged = OPERATORS["lightning_indexer_ragged"].public
x_projections = OPERATORS["x_projections"].public
decode_metadata = OPERATORS["decode_metadata"].public


def problem(op: str, **facts) -> Problem:
    """A Problem of ``op`` from named facts, each one of the op's `PROBLEM_KEYS` (a subset is fine)."""
    unknown = set(facts) - set(PROBLEM_KEYS.get(op, ()))
    if op not in PROBLEM_KEYS or unknown:
        raise v.IndexerInputError(f"op {op!r} has problem keys {PROBLEM_KEYS.get(op)}; got unknown {sorted(unknown)}")
    return Problem(**facts)


def gemm_problem(weight: torch.Tensor, out_dtype: torch.dtype, scale_fmt: str = "fp32") -> Problem:
    """The `gemm_fp8_blockscale` problem of a GEMM with this fp8 weight [N, K] and ``scale_fmt`` (what the op itself
    builds)."""
    return gemm_fp8_blockscale.problem(None, None, weight, None, out_dtype, scale_fmt)
