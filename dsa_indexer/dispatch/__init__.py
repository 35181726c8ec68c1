"""Dispatch: decides which implementation runs (targets, environment facts, the registry, plugins), and binds it."""

from .bind import Bound, bind
from .environment import Environment
from .plugins import default_registry, hookimpl, load_plugins
from .problem import Problem, token_bucket
from .platform import Platform, register_platform
from .registry import Candidate, Implementation, NoImplementationError, Registry, Resolution
from .target import Target, detect_target, parse_target

__all__ = ["Bound", "Candidate", "Environment", "Implementation", "NoImplementationError", "Platform", "Problem",
           "Registry", "Resolution", "Target", "bind", "default_registry", "detect_target", "hookimpl",
           "load_plugins", "parse_target", "register_platform", "token_bucket"]
