"""The library's environment variables (``DSA_INDEXER_*``), each read by one parser.

Booleans (``DSA_INDEXER_STRICT``, ``DSA_INDEXER_CHECK_RANGES``, ...) accept, case-insensitive and with surrounding
blanks ignored, ``1 / true / yes / on`` and ``0 / false / no / off``; unset or empty means the default. Anything else
raises naming the variable: a typo such as ``DSA_INDEXER_STRICT=ture`` must not silently pick a mode. The counts, the
SM limit and the ``op=impl`` list of ``DSA_INDEXER_FORCE`` are parsed as strictly (`VARIABLES` lists every one).

Most variables are read lazily, where a code path needs them, and some paths never run on a given device (the range
checks always run on the CPU, so ``DSA_INDEXER_CHECK_RANGES`` is never read there; the dual-stream knobs are read on
NVIDIA only). So `check_environment` validates every set variable at once, when the library first reads its
environment (the default registry calls it as it is built): a bad value is an error on any device, and a misspelled
variable name warns. Imports nothing from the package, so every layer may use it.
"""

from __future__ import annotations

import os
import warnings
from typing import Callable, Mapping

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
PREFIX = "DSA_INDEXER_"

_parsed: dict[tuple[str, str], bool] = {}  # (name, raw value) -> flag: the hot path is two dict lookups


class EnvironmentFlagError(ValueError):
    """An environment variable of the library holds a value it does not accept (the message names both)."""


def parse_flag(name: str, raw: str | None, default: bool = False) -> bool:
    """``raw`` (the variable's value, None when unset) as a bool; raises `EnvironmentFlagError` naming ``name``."""
    if raw is None:
        return default
    key = (name, raw)
    flag = _parsed.get(key)
    if flag is not None:
        return flag
    word = raw.strip().lower()
    if word == "":
        flag = default
    elif word in TRUE_WORDS:
        flag = True
    elif word in FALSE_WORDS:
        flag = False
    else:
        raise EnvironmentFlagError(f"{name}={raw!r} is not a boolean: use one of {', '.join(TRUE_WORDS)} (on) or "
                                   f"{', '.join(FALSE_WORDS)} (off), case-insensitive; unset means "
                                   f"{'on' if default else 'off'}")
    _parsed[key] = flag
    return flag


def env_flag(name: str, default: bool = False) -> bool:
    """The boolean environment variable ``name`` (see the module docstring)."""
    return parse_flag(name, os.environ.get(name), default)


def parse_count(name: str, raw: str | None) -> int | None:
    """A positive integer variable (``DSA_INDEXER_DUAL_STREAM_MAX_TOKENS=512``); None when unset or empty."""
    text = (raw or "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise EnvironmentFlagError(f"{name}={raw!r} is not an integer: use a whole number >= 1, or unset it for "
                                   f"the default") from None
    if value < 1:
        raise EnvironmentFlagError(f"{name}={value} must be >= 1 (or unset for the default)")
    return value


SM_LIMIT_OFF = ("", "0", "off", "no", "false")


def parse_sm_limit(name: str, raw: str | None) -> int | str | None:
    """An SM count for a GEMM (``DSA_INDEXER_DUAL_STREAM_GEMM_SMS``): a positive integer, ``half``, or off (None:
    unset, empty, ``0``, ``off``, ``no``, ``false``)."""
    text = (raw or "").strip().lower()
    if text in SM_LIMIT_OFF:
        return None
    if text == "half":
        return "half"
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise EnvironmentFlagError(f"{name}={raw!r} is not an SM limit: use a positive SM count such as 66, 'half', "
                                   f"or off ({', '.join(repr(w) for w in SM_LIMIT_OFF[1:])}, or unset)")
    return value


def parse_assignments(name: str, raw: str | None) -> dict[str, str]:
    """``"op=impl,op2=impl2"`` (``DSA_INDEXER_FORCE``) -> ``{op: impl}``. A malformed entry, or an op named twice
    with different implementations (one of them would be dropped), is an error naming it."""
    found: dict[str, str] = {}
    for entry in (raw or "").split(","):
        entry = entry.strip()
        if not entry:
            continue
        key, sep, value = entry.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise EnvironmentFlagError(f"{name} entry {entry!r} must read 'op=impl_id'")
        if found.get(key, value) != value:
            raise EnvironmentFlagError(f"{name} names op {key!r} twice ({found[key]!r} and {value!r}); give one "
                                       f"implementation per op")
        found[key] = value
    return found


def _any_text(name: str, raw: str) -> None:
    return None


# Every variable the library reads -> the parser that validates it. The target is parsed by dispatch.target (it
# needs the platforms); paths and plugin names are free text.
VARIABLES: Mapping[str, Callable[[str, str], object]] = {
    "DSA_INDEXER_STRICT": parse_flag,
    "DSA_INDEXER_CHECK_RANGES": parse_flag,
    "DSA_INDEXER_DISABLE_PLUGIN_AUTOLOAD": parse_flag,
    "DSA_INDEXER_DUAL_STREAM": lambda name, raw: parse_flag(name, raw, default=True),
    "DSA_INDEXER_DUAL_STREAM_MAX_TOKENS": parse_count,
    "DSA_INDEXER_DUAL_STREAM_GEMM_SMS": parse_sm_limit,
    "DSA_INDEXER_PDL": parse_flag,
    "DSA_INDEXER_FORCE": parse_assignments,
    "DSA_INDEXER_TARGET": _any_text,
    "DSA_INDEXER_PLUGINS": _any_text,
    "DSA_INDEXER_CACHE_DIR": _any_text,
    "DSA_INDEXER_CCBIN": _any_text,
}

_unknown_warned: set[str] = set()


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Validate every ``DSA_INDEXER_*`` variable that is set (``environ``: default ``os.environ``). Bad values raise
    one `EnvironmentFlagError` naming each variable and what it accepts; a name the library does not read (a typo
    such as ``DSA_INDEXER_STRCT``) warns once, listing the names it reads."""
    environ = os.environ if environ is None else environ
    errors = []
    unknown = []
    for name in sorted(environ):
        if not name.startswith(PREFIX):
            continue
        parser = VARIABLES.get(name)
        if parser is None:
            unknown.append(name)
            continue
        try:
            parser(name, environ[name])
        except EnvironmentFlagError as exc:
            errors.append(str(exc))
    fresh = [name for name in unknown if name not in _unknown_warned]
    if fresh:
        _unknown_warned.update(fresh)
        warnings.warn(f"dsa_indexer: {', '.join(fresh)} {'is' if len(fresh) == 1 else 'are'} not read by the "
                      f"library (misspelled?); it reads {', '.join(VARIABLES)}", RuntimeWarning, stacklevel=2)
    if errors:
        raise EnvironmentFlagError("; ".join(errors))
