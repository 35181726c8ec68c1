"""Dispatch: decides which implementation runs (targets, environment facts, the registry, plugins)."""

from .environment import Environment
from .plugins import default_registry, hookimpl, load_plugins
from .problem import Problem, token_bucket
from .registry import Candidate, Implementation, NoImplementationError, Registry, Resolution
from .target import CPU, Target, detect_target, parse_target

__all__ = ["CPU", "Candidate", "Environment", "Implementation", "NoImplementationError", "Problem", "Registry",
           "Resolution", "Target", "default_registry", "detect_target", "hookimpl", "load_plugins", "parse_target",
           "token_bucket"]
