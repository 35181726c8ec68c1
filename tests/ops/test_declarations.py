"""Each op is declared once (contract/declarations.py): its annotated signature gives the schema, the arguments its
checks return, the fake's and the facts' names, the CLI's typical problem; the public function follows from it."""

import ast
import inspect
import textwrap

import pytest
import torch

from dsa_indexer import ops
from dsa_indexer.cli import DEFAULT_PROBLEMS
from dsa_indexer.contract import validate as v
from dsa_indexer.contract.declarations import DECLARED, OPS


def test_every_declaration_is_a_public_op_and_a_custom_op():
    assert OPS == ops.OPS and len(OPS) == 17
    for name in OPS:
        public = getattr(ops, name)
        assert public is ops.OPERATORS[name].public and public.decl is DECLARED[name]
        assert hasattr(torch.ops.dsa_indexer, name)
        # The public signature is the declaration's, plus the target.
        parameters = list(inspect.signature(public).parameters)
        assert parameters == [*inspect.signature(DECLARED[name].check).parameters, "target"]


@pytest.mark.parametrize("name", OPS)
def test_the_schema_follows_the_signature(name):
    decl = DECLARED[name]
    check = inspect.signature(decl.check)
    assert decl.arguments == tuple(p for p in check.parameters if p not in decl.public_only and p != decl.out)
    schema_names = [part.strip().split(" ")[-1] for part in decl.schema[1:decl.schema.rindex(") ->")].split(",")]
    assert tuple(schema_names) == decl.arguments
    assert decl.schema_with_target().split(") ->")[0].endswith("str? target=None")
    for mutated in decl.mutates:
        assert f"!) {mutated}" in decl.schema  # an alias annotation marks what the op writes
    if decl.out is None:
        assert decl.out_schema is None
    else:  # the <op>_out custom op: the same arguments, then the buffer it writes, and no result
        assert list(check.parameters)[-1] == decl.out
        assert decl.out_schema.startswith(decl.schema[:decl.schema.rindex(") ->")])
        assert decl.out_schema.endswith(f"!) {decl.out}) -> ()")


@pytest.mark.parametrize("name", OPS)
def test_the_checks_return_the_signatures_arguments_in_order(name):
    """Read from the source: every return of a check is a tuple naming each argument once, in the signature's
    order (``float(eps)``, ``x.contiguous()``, ``_fp8_or_target(fp8_dtype)`` name theirs), then the op's ``out``
    buffer where it has one."""
    decl = DECLARED[name]
    returned = decl.arguments + ((decl.out,) if decl.out else ())
    tree = ast.parse(textwrap.dedent(inspect.getsource(decl.check)))
    function = tree.body[0]
    returns = [node for node in ast.walk(function) if isinstance(node, ast.Return)]
    assert returns
    for node in returns:
        assert isinstance(node.value, ast.Tuple), f"{name}: a check returns the arguments as a tuple"
        named = []
        for element in node.value.elts:
            names = [n.id for n in ast.walk(element) if isinstance(n, ast.Name) and n.id in returned]
            named.append(names[0] if names else None)
        assert tuple(named) == returned


@pytest.mark.parametrize("name", OPS)
def test_the_cli_problem_is_the_declarations_example(name):
    assert DEFAULT_PROBLEMS[name] == dict(DECLARED[name].example) and DEFAULT_PROBLEMS[name]
    ops.problem(name, **DEFAULT_PROBLEMS[name])  # every example fact is one of the op's facts


def test_fp8_left_none_is_the_targets_flavour():
    x = torch.randn(4, 256)
    arguments = ops.OPERATORS["quant_fp8_groups"].arguments
    assert arguments(x, target="gfx942")[-1] == torch.float8_e4m3fnuz
    assert arguments(x, target="sm90")[-1] == torch.float8_e4m3fn
    assert arguments(x, fp8_dtype=torch.float8_e4m3fnuz, target="sm90")[-1] == torch.float8_e4m3fnuz
    with pytest.raises(v.IndexerInputError, match="fp8_dtype"):
        arguments(x, fp8_dtype=torch.float16)
    out, scales = ops.quant_fp8_groups(x, target="gfx942")
    assert out.dtype == torch.float8_e4m3fnuz and scales.shape == (4, 2)


def test_a_public_only_argument_reaches_no_implementation():
    logits = torch.randn(2, 100)
    ends = torch.tensor([30, 10], dtype=torch.int32)
    assert "max_len" not in DECLARED["topk_indices"].arguments
    bounded = ops.OPERATORS["topk_indices"].arguments(logits, 4, ends, max_len=40)
    assert len(bounded) == len(DECLARED["topk_indices"].arguments) and bounded[0].shape == (2, 40)
    assert torch.equal(ops.topk_indices(logits, 4, ends, max_len=40), ops.topk_indices(logits, 4, ends))


@pytest.mark.parametrize("values", [[3, 9, 0], list(range(40)) + [99]], ids=["few", "many"])
def test_a_range_check_refuses_a_value_out_of_range_read_either_way(values):
    """Up to 16 CPU values are read as Python numbers, more by one reduction: both name the argument and range."""
    t = torch.tensor(values, dtype=torch.int32)
    v.in_range("ends", t, 0, max(values) + 1, "columns")
    with pytest.raises(v.IndexerInputError, match=rf"ends values must lie in \[0, {max(values)}\).*\[0, {max(values)}\]"):
        v.in_range("ends", t, 0, max(values), "columns")
    with pytest.raises(v.IndexerInputError, match=r"got range \[-1, "):
        v.in_range("ends", torch.tensor([-1, *values], dtype=torch.int32), 0, 1000, "columns")
