"""`dsa-indexer`: info (what is here), explain (why an implementation was chosen), matrix (every op on every arch),
run (the main job)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Sequence

import torch

from . import __version__
from .versions import package_versions
from .contract.declarations import DECLARED
from .contract.specs import PIPELINE_OP
from .dispatch.plugins import default_registry
from .dispatch.problem import Problem
from .dispatch.environment import default_probes
from .dispatch.target import detect_target, known_targets, parse_target

# The problem each op is explained and put in the matrix with: every declaration's typical one
# (`contract.specs.OpDecl.example`), and the pipeline strategy's (it is resolved like an op but not declared as one).
PIPELINE_PROBLEM = dict(tokens=32, decode=True, q_lora_quant=False)
DEFAULT_PROBLEMS = {**{name: dict(decl.example) for name, decl in DECLARED.items()}, PIPELINE_OP: PIPELINE_PROBLEM}
# Facts that follow the target's platform unless given: the cache layout it allocates (V3.2), and its key format.
PLAIN_FORMATS = {"paged64_bf16": "bf16", "paged64_int8": "int8"}


def _problem_for(op: str, target, overrides: dict) -> Problem:
    from .dispatch.platform import platform_of

    facts = dict(DEFAULT_PROBLEMS.get(op, {}))
    if "fp8" in facts and target.fp8_dtype == torch.float8_e4m3fnuz:
        facts["fp8"] = "fnuz"  # the target's own flavour, as its platform says
    layout = platform_of(target.vendor).cache_layout(1)
    if op == PIPELINE_OP:
        facts["cache"] = layout  # the layout Indexer.allocate_cache picks on this target
    if "format" in facts and layout in PLAIN_FORMATS:
        facts["format"] = PLAIN_FORMATS[layout]
    facts.update(overrides)
    from . import ops

    return ops.problem(op, **facts) if op in ops.PROBLEM_KEYS else Problem(**facts)


def _parse_facts(items: Sequence[tuple[str, object]]) -> dict:
    """The ``--problem`` facts (each parsed by `_problem_fact`); a fact given twice with two values is an error."""
    facts: dict = {}
    for key, value in items:
        if key in facts and facts[key] != value:
            raise ValueError(f"--problem names {key} twice ({facts[key]} and {value}); give each fact once")
        facts[key] = value
    return facts


def _simulated_target(args):
    return detect_target(override=parse_target(args.target, "--target") if args.target else None)


def _vendor_lines(environment) -> list[str]:
    """Per vendor library of the registered platforms: importable from where, and the probe's verdict (what the
    installed version provides, or why it is not used)."""
    from .dispatch.platform import vendor_libraries
    from .dispatch.vendor import LIBRARIES, importable_from

    lines = []
    for fact, module in sorted(vendor_libraries().items()):
        where = importable_from(module)
        if where is None:
            lines.append(f"  {fact}: not importable")
            continue
        missing = environment.missing(fact)
        library = LIBRARIES.get(module)
        verdict = (f"not used: {missing}" if missing is not None
                   else f"usable: {library.description() or module}" if library is not None else "usable")
        lines.append(f"  {fact}: importable from {where}; {verdict}")
    return lines


def cmd_info(args) -> int:
    registry = default_registry()
    target = _simulated_target(args)
    env = _environment(args.assume, registry)
    strict = registry.is_strict()
    rows = []
    for op in registry.ops():
        res = registry.resolve_runnable(op, target, _problem_for(op, target, {}), environment=env)
        rows.append(res)
    simulated = bool(args.target or os.environ.get("DSA_INDEXER_TARGET"))
    if args.json:
        report = {"dsa_indexer": __version__, "target": str(target), "simulated_target": simulated,
                  "environment": (env or registry.environment).name, "strict": strict, "versions": package_versions(),
                  "plugins_loaded": list(registry.plugins_loaded), "plugins_failed": list(registry.plugins_failed),
                  "plugins_warned": list(registry.plugins_warned),
                  "implementations_failed": registry.failed_implementations(),
                  "forced": registry.forced(), "resolutions": [res.to_dict() for res in rows]}
        _write_json(report, args.json)
        return 0
    print(f"dsa_indexer {__version__}")
    print(f"target: {target} (vendor {target.vendor}, fp8 {str(target.fp8_dtype).replace('torch.', '')})"
          + ("  [simulated]" if simulated else ""))
    if env is not None:
        print(f"environment: {env.name}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in package_versions().items() if v))
    print("not installed (no distribution metadata): " + ", ".join(k for k, v in package_versions().items() if not v))
    if env is None:
        print("vendor libraries:")
        for line in _vendor_lines(registry.environment):
            print(line)
    print(f"plugins loaded: {', '.join(registry.plugins_loaded) or '-'}")
    print(f"plugins failed: {'; '.join(registry.plugins_failed) or '-'}")
    if registry.plugins_warned:
        print(f"plugins warned: {'; '.join(registry.plugins_warned)}")
    failed = registry.failed_implementations()
    print(f"implementations failed: {'; '.join(f'{i}: {why}' for i, why in sorted(failed.items())) or '-'}")
    forced = registry.forced()
    print(f"forced: {', '.join(f'{op}={impl}' for op, impl in sorted(forced.items())) or '-'}")
    print(f"strict mode: {'on (DSA_INDEXER_STRICT): a reference fallback below raises' if strict else 'off'}")
    print(f"\nresolution on {target}:")
    width = max(len(res.op) for res in rows)
    chosen_width = max(len(res.chosen.impl_id) if res.chosen else 4 for res in rows)
    for res in rows:
        chosen = res.chosen.impl_id if res.chosen else "NONE"
        note = ""
        if res.is_fallback:
            note = "  (reference fallback: strict mode refuses it)" if strict else "  (reference fallback)"
        print(f"  {res.op:<{width}} -> {chosen:<{chosen_width}}{note}".rstrip())
    return 0


def _write_json(report: dict, path: str) -> None:
    """``--json FILE`` or ``--json -`` (stdout)."""
    if path == "-":
        json.dump(report, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
        return
    with open(path, "w") as handle:
        json.dump(report, handle, indent=2, default=str)


def known_facts(registry) -> list[str]:
    """Facts `--assume` may name: the environment's probes and every fact a registration requires."""
    return sorted(set(default_probes()) | registry.required_facts())


def _environment(assume: Sequence[tuple[str, bool]], registry=None):
    """None (the detected environment) or a simulated one from ``--assume gpu=yes triton=yes deep_gemm=no``."""
    if not assume:
        return None
    from .dispatch.environment import Environment

    facts = {}
    known = known_facts(registry or default_registry())
    for fact, present in assume:
        if fact not in known:
            raise ValueError(f"--assume: unknown fact {fact!r}; known facts: {', '.join(known)}")
        facts[fact] = present
    return Environment.simulated(**facts)


def cmd_explain(args) -> int:
    registry = default_registry()
    target = _simulated_target(args)
    env = _environment(args.assume, registry)
    ops = registry.ops() if args.op == "all" else [args.op]
    results = []
    for op in ops:
        if op not in registry.ops():
            print(f"unknown op {op!r}; known ops: {', '.join(registry.ops())}", file=sys.stderr)
            return 2
        results.append(registry.resolve_runnable(op, target, _problem_for(op, target, _parse_facts(args.problem)),
                                                 environment=env))
    if args.json:
        _write_json({"strict": registry.is_strict(), "resolutions": [res.to_dict() for res in results]}, args.json)
        return 0
    for res in results:
        print(res.explain())
        print()
    return 0


def matrix_registry(with_plugins: bool):
    """The registry the matrix is read from: the built-in backends alone (what docs/matrix.md shows, whatever is
    installed), or the process's, with the installed third-party backends too."""
    if with_plugins:
        return default_registry()
    from .dispatch.environment import Environment
    from .dispatch.plugins import load_plugins
    from .dispatch.registry import Registry

    registry = Registry(environment=Environment.simulated())
    load_plugins(registry, entry_points=False)
    return registry


def matrix_targets(with_plugins: bool):
    """Every arch the platforms list: the built-in platforms' alone unless third-party ones are asked for."""
    from .dispatch import discovery
    from .dispatch.platform import PLATFORM_ENTRY_POINT_GROUP

    builtin = {entry.name for entry in discovery.builtin_entries(PLATFORM_ENTRY_POINT_GROUP)}
    return tuple(t for t in known_targets() if with_plugins or t.vendor in builtin)


def build_arch_matrix(assume: Sequence[tuple[str, bool]] = (), with_plugins: bool = False):
    """The matrix `dsa-indexer matrix` prints: every fact a registration requires assumed present, unless
    ``assume`` names the facts (then those not named are absent, as for info and explain)."""
    from .dispatch.matrix import build_matrix

    registry = matrix_registry(with_plugins)
    if assume:
        _environment(assume, registry)  # an unknown fact's name is refused here, naming the known ones
        assumed = dict(assume)
    else:
        assumed = {fact: True for fact in sorted(registry.required_facts())}
    return build_matrix(registry, matrix_targets(with_plugins), lambda op, target: _problem_for(op, target, {}),
                        assumed)


def cmd_matrix(args) -> int:
    from .dispatch import matrix as arch_matrix

    matrix = build_arch_matrix(args.assume, args.plugins)
    if args.json:
        _write_json({"dsa_indexer": __version__, **matrix.to_dict()}, args.json)
        return 0
    if args.markdown:
        sys.stdout.write(arch_matrix.to_markdown(matrix))
    else:
        print(arch_matrix.to_text(matrix))
    return 0


class _Progress:
    """One updating line on a terminal, a line per 10% otherwise."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.tty = total, label, sys.stderr.isatty()
        self.start = time.perf_counter()
        self.last_decile = -1

    def update(self, done: int) -> None:
        elapsed = time.perf_counter() - self.start
        eta = elapsed / done * (self.total - done) if done else 0.0
        text = f"{self.label}: {done}/{self.total} ({elapsed:.1f}s, eta {eta:.1f}s)"
        if self.tty:
            print("\r" + text, end="" if done < self.total else "\n", file=sys.stderr, flush=True)
        elif done * 10 // self.total != self.last_decile:
            self.last_decile = done * 10 // self.total
            print(text, file=sys.stderr, flush=True)


def cmd_run(args) -> int:
    from .runner import RunSettings, run_main_job

    default_registry().check_forced()  # an entry for an op this run never reaches is still a mistake: say it now

    settings = RunSettings(model=args.model, device=args.device, batch=args.batch, context=args.context,
                           steps=args.steps, prefill_tokens=args.prefill_tokens, next_n=args.next_n, seed=args.seed,
                           verify=not args.no_verify, warmup=False if args.no_warmup else None,
                           target=parse_target(args.target, "--target") if args.target else None)
    json_stdout = args.json == "-"
    stdout = sys.stdout
    # With --json -, stdout carries the JSON only (as for bench): the report's text goes to stderr meanwhile.
    with contextlib.redirect_stdout(sys.stderr) if json_stdout else contextlib.nullcontext():
        report = run_main_job(settings, progress=_Progress)
    if args.json:
        report = {"command": "dsa-indexer " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("dsa-indexer")
                  else "dsa-indexer run ...", **report}
        if json_stdout:
            json.dump(report, stdout, indent=2, default=str)
            stdout.write("\n")
        else:
            with open(args.json, "w") as handle:
                json.dump(report, handle, indent=2, default=str)
    return 0 if report["verified"] in (True, None) else 1


EXIT_OK, EXIT_MISMATCH, EXIT_ERROR, EXIT_USAGE = 0, 1, 2, 2  # argparse's usage errors exit 2 too
SUITE_CHOICES = ("decode", "topk", "prefill", "ops")  # dsa_indexer.bench.SUITES
# Problem facts by kind, as the typical problems give them: sizes are positive integers, flags true or false.
INT_FACTS = {key for facts in DEFAULT_PROBLEMS.values() for key, value in facts.items() if type(value) is int}
BOOL_FACTS = {key for facts in DEFAULT_PROBLEMS.values() for key, value in facts.items() if type(value) is bool}
ASSUME_WORDS = {"yes": True, "1": True, "true": True, "on": True, "no": False, "0": False, "false": False,
                "off": False}


def _fact_words() -> dict[str, tuple[str, ...]]:
    """The facts that take one of a few words, with those words (the library's own tables)."""
    from .contract.declarations import KEY_FORMATS, NORMS
    from .contract.quant import SCALE_FMTS
    from .contract.specs import FP8_NAMES

    return {"fp8": tuple(sorted(set(FP8_NAMES.values()))), "norm": NORMS, "format": KEY_FORMATS,
            "scale_fmt": SCALE_FMTS, "keys": ("fp8", "fp4")}


def _problem_fact(text: str) -> tuple[str, object]:
    """``--problem KEY=VALUE``, checked by the fact's kind before any work: sizes positive integers, flags true or
    false, the worded facts one of their words; other keys keep their text (ops.problem names unknown ones)."""
    key, sep, value = text.partition("=")
    key, value = key.strip(), value.strip()
    if not sep or not key or not value:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE such as heads=32, got {text!r}")
    low = value.lower()
    if key in INT_FACTS:
        if not value.isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(f"{key} must be a positive integer, got {value!r}")
        return key, int(value)
    if key in BOOL_FACTS:
        if low not in ("true", "false"):
            raise argparse.ArgumentTypeError(f"{key} must be true or false, got {value!r}")
        return key, low == "true"
    words = _fact_words().get(key)
    if words is not None:
        if value not in words:
            raise argparse.ArgumentTypeError(f"{key} must be one of {', '.join(words)}, got {value!r}")
        return key, value
    return key, True if low == "true" else False if low == "false" else int(value) if value.lstrip("-").isdigit() \
        else value


def _assumed_fact(text: str) -> tuple[str, bool]:
    """``--assume FACT=yes|no``: the form is checked here (exit 2); the fact's name against the registry later."""
    fact, sep, value = text.partition("=")
    if not sep or not fact.strip() or value.strip().lower() not in ASSUME_WORDS:
        raise argparse.ArgumentTypeError(f"entries must read FACT=yes|no (also 1/0, true/false, on/off), got "
                                         f"{text!r}")
    return fact.strip(), ASSUME_WORDS[value.strip().lower()]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _writable_json_path(text: str) -> str:
    """``--json FILE`` ('-': stdout), checked before the run: a path that is a folder, whose folder does not exist or
    cannot be written fails now with one line (exit 2), not after minutes of work with a traceback."""
    import pathlib

    if text == "-":
        return text
    path = pathlib.Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file name inside it")
    folder = path.resolve().parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"the folder {str(folder)!r} does not exist")
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {exc.strerror or exc}") from None
    if not existed:
        path.unlink()  # only the check: the report is written after the run
    return text


def _progress_style(text: str) -> str:
    """``--progress``: checked before the run (a bar library that is asked for by name must import)."""
    from .bench import PROGRESS_STYLES, importable

    if text not in PROGRESS_STYLES:
        raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from {', '.join(PROGRESS_STYLES)})")
    if text in ("rich", "tqdm") and not importable(text):
        raise argparse.ArgumentTypeError(f"{text} is not installed (pip install {text}; or use auto or plain)")
    return text


def _prefill_shape(text: str) -> tuple[int, int]:
    """``--prefill-shapes QUERIESxKEYS``: causal rows, so 1 <= queries <= keys."""
    queries, sep, keys = text.lower().partition("x")
    if not sep or not queries.strip().isdigit() or not keys.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected QUERIESxKEYS such as 4096x4096, got {text!r}")
    q, k = int(queries), int(keys)
    if not 1 <= q <= k:
        raise argparse.ArgumentTypeError(f"need 1 <= queries <= keys (causal rows), got {q}x{k}")
    return q, k


def _readable_file(text: str) -> str:
    import pathlib

    if not pathlib.Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file")
    return text


def _plots_folder(text: str) -> str:
    """``--plots DIR``: created now and checked writable (a plot folder that cannot be written fails before the run)."""
    import pathlib
    import tempfile

    path = pathlib.Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".dsa-indexer-check-"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write plots into {text!r}: {exc.strerror or exc}") from None
    return text


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value:g}")
    return value


def _bench_command(args) -> list[str]:
    """The command line that reproduces this run, rebuilt from the parsed arguments (however it was invoked)."""
    command = ["dsa-indexer", "bench", "--suite", *args.suite]
    for flag, value in (("--device", args.device), ("--repeats", args.repeats), ("--batch", args.batch),
                        ("--context", args.context), ("--budget-s", args.budget_s), ("--json", args.json),
                        ("--plots", args.plots)):
        if value is not None:
            command += [flag, *map(str, value if isinstance(value, list) else [value])]
    if args.prefill_shapes:
        command += ["--prefill-shapes", *(f"{q}x{k}" for q, k in args.prefill_shapes)]
    if args.inference_mode:
        command.append("--inference-mode")
    return command


def _saved_report(text: str):
    """``--from-json FILE`` as a `BenchReport`; a file that is not a saved report is refused naming it."""
    import pathlib

    from . import bench
    from .config import read_json_object

    path = pathlib.Path(text)
    try:
        data = read_json_object(path, "a dsa-indexer bench report (what bench --json saves)")
    except ValueError as exc:
        raise ValueError(f"--from-json {exc}") from None
    try:
        return bench.report_from_json(data)
    except ValueError as exc:
        raise ValueError(f"--from-json {path} is {exc}") from None


def cmd_bench(args) -> int:
    import contextlib

    from . import bench

    if not args.from_json:
        default_registry().check_forced()  # the forced op may be one no suite reaches: say it before measuring
    device = torch.device(args.device) if args.device else None
    if device is not None and device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: this torch sees no CUDA/ROCm GPU")
    if args.plots:
        bench.require_matplotlib()  # before the run, not after minutes of it
    if args.from_json:  # re-render a saved run: no measurement
        report = _saved_report(args.from_json)
        print(bench.format_table(report))
        for path in bench.write_plots(report, args.plots) if args.plots else []:
            print(f"plot: {path}")
        return 0
    json_stdout = args.json == "-"
    stdout = sys.stdout
    # With --json -, stdout carries the JSON only: anything else printed meanwhile goes to stderr.
    with contextlib.redirect_stdout(sys.stderr) if json_stdout else contextlib.nullcontext():
        report = bench.run_bench(args.suite, device=device, repeats=args.repeats,
                                 progress=bench.progress_factory(args.progress), batches=args.batch,
                                 contexts=args.context, prefill=args.prefill_shapes, budget_s=args.budget_s,
                                 inference_mode=args.inference_mode)
        plots = bench.write_plots(report, args.plots) if args.plots else []
        if not json_stdout:
            print(bench.format_table(report))
        for path in plots:
            print(f"plot: {path}")
    if args.json:
        bench.write_json(report, args.json, stream=stdout, command=_bench_command(args))
    if report.errors:
        print(f"dsa-indexer bench: {len(report.errors)} measurement(s) failed (listed in the table and in the "
              "JSON's errors)", file=sys.stderr)
        return EXIT_MISMATCH
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsa-indexer", description=__doc__)
    parser.add_argument("--version", action="version", version=f"dsa-indexer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="detected target, versions, vendor libraries, plugins, the resolution of "
                                       "every op")
    known = ", ".join(str(t) for t in known_targets())
    assume_help = ("simulate the machine instead of probing it: any fact a registration requires, e.g. gpu, triton, "
                   "deep_gemm, cuda_jit, flashinfer, aiter, torch_npu (facts not named are absent); `dsa-indexer "
                   "explain all --assume` lists none unknown")
    info.add_argument("--target", help=f"simulate a target ({known})")
    info.add_argument("--assume", nargs="*", type=_assumed_fact, default=[], metavar="FACT=yes|no",
                      help=assume_help)
    info.add_argument("--json", type=_writable_json_path, metavar="FILE",
                      help="write the report as JSON to FILE ('-': stdout) instead of the text")
    info.set_defaults(func=cmd_info)

    explain = sub.add_parser("explain", help="the full resolution trace of an op ('all' for every op)")
    explain.add_argument("op", help="op name, e.g. paged_mqa_logits, or 'all'")
    explain.add_argument("--target", help=f"simulate a target ({known})")
    explain.add_argument("--problem", nargs="*", type=_problem_fact, default=[], metavar="KEY=VALUE",
                         help="problem facts, e.g. heads=32 next_n=2 (defaults: the V3.2 decode shape)")
    explain.add_argument("--assume", nargs="*", type=_assumed_fact, default=[], metavar="FACT=yes|no",
                         help=assume_help)
    explain.add_argument("--json", type=_writable_json_path, metavar="FILE",
                         help="write the traces as JSON to FILE ('-': stdout) instead of the text")
    explain.set_defaults(func=cmd_explain)

    matrix = sub.add_parser(
        "matrix", help="every op on every arch: the implementation chosen (native, fallback or refused, with the "
                       "reason) and how that cell was verified",
        description="Every op on every arch the built-in platforms list, resolved for the op's default problem with "
                    "every vendor library assumed present (--assume to change that): the implementation chosen, "
                    "whether it is native, the reference fallback or refused, the candidates of that arch that said "
                    "no with their reasons, and how the chosen implementation was verified on that arch (hardware "
                    "run with commit and date, interpreter, vendor schemas, test double, or only read). "
                    "docs/matrix.md is the --markdown output.")
    matrix.add_argument("--assume", nargs="*", type=_assumed_fact, default=[], metavar="FACT=yes|no",
                        help="the facts instead of all present (facts not named are absent)")
    matrix.add_argument("--plugins", action="store_true",
                        help="include the installed third-party backends and platforms (default: the built-in ones)")
    output = matrix.add_mutually_exclusive_group()
    output.add_argument("--json", type=_writable_json_path, metavar="FILE",
                        help="write the matrix as JSON to FILE ('-': stdout)")
    output.add_argument("--markdown", action="store_true", help="print the matrix as Markdown (docs/matrix.md)")
    matrix.set_defaults(func=cmd_matrix)

    run = sub.add_parser("run", help="run the default indexer on synthetic decode and prefill batches, verify, time")
    run.add_argument("--model", default="deepseek-v3.2", choices=("deepseek-v3.2", "deepseek-v4-flash"))
    run.add_argument("--target", help="simulate a target for resolution (kernels still run on --device)")
    run.add_argument("--device", default=None, help="cuda, cpu ... (default: the accelerator if present)")
    run.add_argument("--batch", type=_positive_int, default=None, help="decode requests (default 32 on GPU, 4 on CPU)")
    run.add_argument("--context", type=_positive_int, default=None, help="tokens per request (default 8192 GPU, 4096 CPU)")
    run.add_argument("--steps", type=_positive_int, default=None, help="decode steps to time (default 20 GPU, 3 CPU)")
    run.add_argument("--prefill-tokens", type=_positive_int, default=None, help="new tokens of the prefill request")
    run.add_argument("--next-n", type=_positive_int, default=1, help="query tokens per request per step (MTP verify: 2)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--no-verify", action="store_true", help="skip the check against the reference backend")
    run.add_argument("--no-warmup", action="store_true",
                     help="skip the untimed first-use compile / warm-up phase (on by default on an accelerator): "
                          "first-call compiles then land in the timed phases")
    run.add_argument("--json", type=_writable_json_path, metavar="FILE",
                     help="also write the report as JSON to this file (its folder must exist; '-': stdout, which "
                          "then holds the JSON only). Exit codes: 0 verified, 1 top-k mismatch against the "
                          "reference, 2 usage or runtime error")
    run.set_defaults(func=cmd_run)

    bench = sub.add_parser(
        "bench", help="every accepted implementation side by side, with measured ceilings",
        description="Every implementation that resolution accepts on this device, forced in turn and timed side by "
                    "side (CUDA-graph replays timed by CUDA events, warm-up excluded, L2 flushed, medians; on a CPU "
                    "the wall clock at small sizes: CPU numbers, not GPU numbers), with the device's copy bandwidth "
                    "and matmul rate measured in the same run. Exit codes: 0 done; 1 some measurement raised (the "
                    "others still ran; listed as FAILED and in the JSON's errors); 2 usage or runtime error (bad "
                    "arguments, --device cuda without a GPU, --plots without matplotlib).")
    bench.add_argument("--suite", nargs="+", default=["decode"], choices=SUITE_CHOICES,
                       help="decode (B x context: lightning_indexer, and the whole V3.2 indexer step per pipeline "
                            "strategy, single / dual stream, with and without q_lora reuse), topk (with "
                            "torch.topk), prefill (query x key lengths), ops (those suites' three ops at one size "
                            "each: lightning_indexer, topk_indices, ragged_mqa_logits, in rows labelled decode, "
                            "topk, prefill; not the whole step); default decode")
    bench.add_argument("--device", default=None, help="cuda, cpu ... (default: the accelerator if present)")
    bench.add_argument("--repeats", type=_positive_int, default=None, help="samples per median (25 GPU, 5 CPU)")
    bench.add_argument("--batch", type=_positive_int, nargs="+", default=None, metavar="B",
                       help="decode / topk batch sizes (default 1 32 64 128 on GPU, 1 4 on CPU)")
    bench.add_argument("--context", type=_positive_int, nargs="+", default=None, metavar="TOKENS",
                       help="decode / topk context lengths (default 8192 32768 131072 on GPU, 1024 4096 on CPU)")
    bench.add_argument("--prefill-shapes", type=_prefill_shape, nargs="+", default=None, metavar="QxK",
                       help="prefill queries x keys, causal (default 4096x4096 2048x32768 on GPU, 128x1024 on CPU)")
    bench.add_argument("--budget-s", type=_positive_seconds, default=None, metavar="SECONDS",
                       help="start no new item after this many seconds (the rest is listed as skipped)")
    bench.add_argument("--inference-mode", action="store_true",
                       help="run every measurement under torch.inference_mode(), as vLLM and SGLang run their models "
                            "(recorded in the JSON's settings; default: plain eager mode)")
    bench.add_argument("--json", type=_writable_json_path, metavar="FILE",
                       help="write the results as JSON to this file ('-': stdout, instead of the table; stdout then "
                            "holds the JSON only)")
    bench.add_argument("--from-json", type=_readable_file, default=None, metavar="FILE",
                       help="render the table (and --plots) of a saved --json report instead of measuring")
    bench.add_argument("--plots", type=_plots_folder, default=None, metavar="DIR",
                       help="PNG plots into DIR: latency vs context, bandwidth as %% of the measured copy bandwidth, "
                            "the pipeline strategies accepted here, top-k vs torch.topk, prefill (needs matplotlib: "
                            "the 'bench' extra)")
    bench.add_argument("--progress", type=_progress_style, default="auto", metavar="STYLE",
                       help="auto (a rich or tqdm bar on a terminal when installed, else a line per item), rich, "
                            "tqdm, plain, none; always on stderr")
    bench.set_defaults(func=cmd_bench)
    return parser


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """Warnings as the CLI prints them: ``warning: <message>``, without Python's file:line and source line."""
    return f"warning: {message}\n"


def main(argv: Sequence[str] | None = None) -> int:
    import warnings

    saved_format = warnings.formatwarning
    warnings.formatwarning = _one_line_warning
    try:
        return _main(argv)
    finally:
        warnings.formatwarning = saved_format


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `dsa-indexer info | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"dsa-indexer {args.command}: error: {exc}", file=sys.stderr)
        return 2


# --- benchmarks/bench_*.py: thin callers of the command --------------------------------------------------------------
def script_main(name: str, suites: Sequence[str], argv: Sequence[str] | None, *, quick: Sequence[str] = (),
                doc: str = "", only: Sequence[str] = ()) -> int:
    """What ``benchmarks/bench_<name>.py --out DIR [--quick] [--repeats N] [--budget-s S]`` runs:
    ``dsa-indexer bench --suite SUITES --json DIR/<name>.json`` (plus ``--plots DIR/<name>_plots`` when matplotlib
    imports); ``--quick`` adds ``quick`` (smaller GPU sweeps; a CPU run is small anyway). ``only``: the suites
    ``--only`` may pick one of."""
    import argparse
    from pathlib import Path

    from .bench import importable

    parser = argparse.ArgumentParser(description=doc or f"dsa-indexer bench --suite {' '.join(suites)}",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help=f"folder for {name}.json (created)")
    parser.add_argument("--quick", action="store_true", help="smaller sweeps: " + " ".join(quick))
    parser.add_argument("--repeats", type=int, default=None, help="samples per median (default 25 GPU, 5 CPU)")
    parser.add_argument("--budget-s", type=float, default=None, help="start no new item after this many seconds")
    if only:
        parser.add_argument("--only", choices=(*only, "all"), default="all", help="one suite of " + ", ".join(only))
    args = parser.parse_args(argv)
    picked = list(suites) if not only or args.only == "all" else [args.only]
    args.out.mkdir(parents=True, exist_ok=True)
    command = ["bench", "--suite", *picked, "--json", str(args.out / f"{name}.json")]
    if args.repeats:
        command += ["--repeats", str(args.repeats)]
    if args.budget_s is not None:
        command += ["--budget-s", str(args.budget_s)]
    if args.quick and torch.cuda.is_available():  # the CPU sizes are small already
        command += list(quick)
    if importable("matplotlib"):
        command += ["--plots", str(args.out / f"{name}_plots")]
    else:
        print("matplotlib does not import: no plots (pip install 'dsa-indexer[bench]')", file=sys.stderr)
    print("dsa-indexer " + " ".join(command), file=sys.stderr, flush=True)
    return main(command)


if __name__ == "__main__":
    sys.exit(main())
