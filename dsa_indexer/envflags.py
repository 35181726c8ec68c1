"""Boolean environment variables (``DSA_INDEXER_STRICT``, ``DSA_INDEXER_CHECK_RANGES``, ...) read by one parser.

Accepted, case-insensitive and with surrounding blanks ignored: ``1 / true / yes / on`` and ``0 / false / no / off``;
unset or empty means the default. Anything else raises naming the variable: a typo such as ``DSA_INDEXER_STRICT=ture``
must not silently pick a mode. Imports nothing from the package, so every layer may use it.
"""

from __future__ import annotations

import os

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

_parsed: dict[tuple[str, str], bool] = {}  # (name, raw value) -> flag: the hot path is two dict lookups


class EnvironmentFlagError(ValueError):
    """A boolean environment variable holds a value that is not one of the accepted words."""


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
