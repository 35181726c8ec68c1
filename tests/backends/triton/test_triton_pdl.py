"""Programmatic dependent launch of the Triton kernels (`backends/triton/pdl.py`), on the CPU.

What can be checked without a GPU: when launches use PDL (never on the CPU, in the interpreter, on ROCm, below
compute capability 9.0 or with ``DSA_INDEXER_PDL`` off; a bad value is an error naming the variable), that every
kernel launched with the PDL options waits for its predecessor before anything else (a kernel that loaded first
could read its predecessor's output early), and that the wait compiles to ``griddepcontrol.wait`` ahead of every
global load and store in the PTX for sm90. The bit-identity of a decode step with PDL on and off, and its timing,
need the GPU: tests/gpu/test_pdl_gpu.py and benchmarks/.
"""

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not importable")

from dsa_indexer.backends.triton import pdl  # noqa: E402
from dsa_indexer.envflags import EnvironmentFlagError, check_environment  # noqa: E402

TRITON_DIR = Path(pdl.__file__).parent


@pytest.fixture
def fresh_decisions():
    pdl.forget_decisions()
    yield
    pdl.forget_decisions()


def test_no_pdl_on_the_cpu_even_when_asked(monkeypatch, fresh_decisions):
    monkeypatch.setenv(pdl.PDL_ENV, "1")
    assert pdl.pdl_options(torch.device("cpu")) == {}


def test_when_a_cuda_device_uses_pdl(monkeypatch, fresh_decisions):
    cuda = torch.device("cuda", 0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.version, "hip", None)
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    assert not pdl.uses_pdl(cuda), "off by default (not yet timed)"
    monkeypatch.setenv(pdl.PDL_ENV, "off")
    assert not pdl.uses_pdl(cuda)
    monkeypatch.setenv(pdl.PDL_ENV, "1")
    if not pdl.triton_has_pdl():
        pytest.skip(f"Triton {triton.__version__} cannot launch with PDL (checked below with a stand-in)")
    assert pdl.uses_pdl(cuda)
    assert pdl.pdl_options(cuda) == {"PDL": True, "launch_pdl": True}
    capability[0] = (8, 0)
    assert not pdl.uses_pdl(cuda), "Ampere has no programmatic dependent launch"
    capability[0] = (10, 0)
    assert pdl.uses_pdl(cuda)
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert not pdl.uses_pdl(cuda), "ROCm's Triton launches without PDL"
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.uses_pdl(cuda), "the interpreter has no grids to overlap"
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(pdl, "triton_has_pdl", lambda: False)
    with pytest.raises(RuntimeError, match="DSA_INDEXER_PDL=1 needs a Triton with programmatic dependent launch"):
        pdl.uses_pdl(cuda)


def test_decisions_are_kept_per_device(monkeypatch, fresh_decisions):
    monkeypatch.setenv(pdl.PDL_ENV, "1")
    cpu = torch.device("cpu")
    assert pdl.pdl_options(cpu) == {}
    monkeypatch.setattr(pdl, "uses_pdl", lambda device: pytest.fail("decided twice for one device"))
    assert pdl.pdl_options(cpu) == {}


def test_a_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(pdl.PDL_ENV, "sometimes")
    with pytest.raises(EnvironmentFlagError, match=pdl.PDL_ENV):
        check_environment()


def _kernels_and_launches():
    """Per module of the Triton backend: its @triton.jit kernels (name -> FunctionDef) and the kernels it launches
    with the PDL options (``kernel[grid](..., **pdl_options(...))`` or ``**<a name bound to pdl_options(...)>``)."""
    found = {}
    for path in sorted(TRITON_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        kernels = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)
                   and any("jit" in ast.unparse(d) for d in node.decorator_list)}
        pdl_names = {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                     and "pdl_options(" in ast.unparse(node.value) for target in node.targets
                     if isinstance(target, ast.Name)}
        launched = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) \
                    and isinstance(node.func.value, ast.Name):
                spread = [ast.unparse(kw.value) for kw in node.keywords if kw.arg is None]
                launched[node.func.value.id] = any("pdl_options(" in s or s in pdl_names for s in spread)
        found[path.name] = (kernels, launched)
    return found


def _first_statement(fn: ast.FunctionDef) -> str:
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):  # the docstring
        body = body[1:]
    return ast.unparse(body[0])


# The kernels of a decode or prefill step on NVIDIA (the top-k: the CUDA backend's, or Triton's where that one is not
# built, e.g. sm120): each must take part.
STEP_MODULES = ("quant.py", "gemm.py", "xproj.py", "prologue.py", "logits.py", "logits_fp4.py", "metadata.py",
                "compressor.py", "topk.py")


def test_every_pdl_launch_waits_first_and_every_step_kernel_takes_part():
    found = _kernels_and_launches()
    checked = 0
    for module, (kernels, launched) in found.items():
        for name, with_pdl in launched.items():
            if name not in kernels:
                continue
            fn = kernels[name]
            params = {a.arg: a for a in fn.args.args}
            if with_pdl:
                assert "PDL" in params, f"{module}: {name} is launched with PDL but has no PDL constexpr"
                assert _first_statement(fn) == "wait_for_predecessor(PDL)", (
                    f"{module}: {name} must wait for its predecessor before anything else, not "
                    f"{_first_statement(fn)!r}")
                defaults = dict(zip([a.arg for a in fn.args.args][-len(fn.args.defaults):], fn.args.defaults))
                assert ast.unparse(defaults.get("PDL", ast.Constant(None))) == "False", (
                    f"{module}: {name}'s PDL must default to False (launches without the options stay as they were)")
                checked += 1
            elif module in STEP_MODULES:
                pytest.fail(f"{module}: {name} is a step kernel launched without the PDL options")
    assert checked >= 19, f"only {checked} kernels launch with PDL: the scan no longer sees the launches"


PTX_PROBE = textwrap.dedent('''
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dsa_indexer.backends.triton import metadata
    kernel = metadata._decode_metadata_kernel
    types = ["*i64", "*i32", "*i64", "*i32", "*i64", "*i64", "*i64", "i32", "i32", "i32"]
    signature = dict(zip(kernel.arg_names, types + ["constexpr"] * 5))
    for flag in (False, True):
        source = ASTSource(fn=kernel, signature=signature,
                           constexprs={"NEXT_N": 1, "RATIO": 1, "PAGE": 64, "BLOCK": 64, "PDL": flag})
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        lines = [l.strip() for l in ptx.splitlines()]
        def first(op):  # the first line issuing ``op`` (predicated lines start with "@%p")
            return next((i for i, l in enumerate(lines) if op in l.split()[:2]
                         or any(w.startswith(op + ".") for w in l.split()[:2])), None)
        print(flag, first("griddepcontrol.wait"), first("griddepcontrol.launch_dependents"),
              first("ld.global"), first("st.global"))
''')


def test_the_wait_compiles_ahead_of_every_memory_access_for_sm90():
    if not pdl.triton_has_pdl():
        pytest.skip(f"Triton {triton.__version__} has no programmatic dependent launch")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    run = subprocess.run([sys.executable, "-c", PTX_PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {line.split()[0]: [None if v == "None" else int(v) for v in line.split()[1:]]
            for line in run.stdout.splitlines() if line.startswith(("True", "False"))}
    off, on = rows["False"], rows["True"]
    assert off[0] is None and off[1] is None, "PDL off must compile no grid dependency control"
    wait, launch, load, store = on
    assert wait is not None and launch is not None
    assert wait < launch < load and wait < store, f"wait {wait}, launch {launch}, first load {load}, store {store}"
