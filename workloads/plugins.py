"""Workloads from outside the package: a user's module (``my_pkg.tasks:make``, a factory
returning a ``Workload``) or an installed distribution's entry point in the group
``belayer.workloads`` (``name = "my_pkg.tasks:make"``). docs/workloads.md states the contract.

Importing a plugin runs its code, so a service loads only what its operator allowed: entry
points of installed packages (installing is the operator's act) and the module specs named at
``belayer up --workload-plugin``; a spec that arrives in a bus message is not enough
(``services/controller``). Every failure — no such module, an import that raises, no such
attribute, a factory that raises or returns something that is not a workload — is one
``InvalidRequest`` naming the plugin, before anything starts.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common.errors import BelayerError, InvalidRequest, NotFound
from workloads.base import Workload

PLUGIN_GROUP = "belayer.workloads"
"""The entry-point group installed packages declare their workloads in."""

PLUGIN_API_VERSION = 1
"""The plugin contract's version (docs/workloads.md, "Your own workload"): a plugin may check
``workloads.plugins.PLUGIN_API_VERSION`` and refuse a version it does not know."""

_SPEC = re.compile(r"^(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<attr>[A-Za-z_]\w*)\Z")

_METHODS = ("tasks", "held_out", "task", "reward")
"""What a workload must have besides a ``name`` (``workloads.base.Workload``)."""


@dataclass(frozen=True)
class Found:
    """A workload a service could load: its name, where it comes from, what it runs."""

    name: str
    source: str
    """``built-in``, ``entry point (<distribution> <version>)`` or ``module``."""
    target: str
    """``module:attribute`` of its factory."""


def is_spec(name: str) -> bool:
    """Whether ``name`` is a ``module:factory`` plugin spec (not a registered name)."""
    return ":" in name


def parse_spec(spec: str, what: str = "workload plugin") -> tuple[str, str]:
    """(module, attribute) of ``module.path:factory``; ``InvalidRequest`` if malformed."""
    m = _SPEC.match(spec)
    if m is None:
        raise InvalidRequest(f"a {what} is `package.module:attribute`", plugin=spec)
    return m["module"], m["attr"]


def import_factory(spec: str) -> Callable[..., Any]:
    """The factory ``spec`` names, imported. ``InvalidRequest`` naming what went wrong."""
    return import_callable(spec, "workload plugin")


def import_callable(spec: str, what: str) -> Callable[..., Any]:
    """The callable ``spec`` (``module:attribute``) names, imported; every failure is one
    ``InvalidRequest`` saying what (``what``: "workload plugin", "reward function") failed."""
    module_name, attr = parse_spec(spec, what)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise InvalidRequest(
            f"cannot import the {what}'s module (is it installed, or on PYTHONPATH?)",
            plugin=spec,
            error=str(exc),
        ) from None
    except Exception as exc:  # the plugin's own code failed while importing: say so, no trace
        raise InvalidRequest(
            f"the {what}'s module raised while importing",
            plugin=spec,
            error=f"{type(exc).__name__}: {exc}",
        ) from None
    found = getattr(module, attr, None)
    if found is None or not callable(found):
        raise InvalidRequest(
            f"the {what}'s module has no such callable", plugin=spec, attribute=attr
        )
    return found


def make(spec: str, factory: Callable[..., Any], options: dict[str, Any]) -> Workload:
    """Call a plugin's factory and check what it returns looks like a ``Workload``."""
    try:
        made = factory(**options)
    except BelayerError:
        raise
    except Exception as exc:  # the plugin's code: one clear error, no traceback
        raise InvalidRequest(
            "the workload plugin's factory raised",
            plugin=spec,
            error=f"{type(exc).__name__}: {exc}",
        ) from None
    missing = [m for m in _METHODS if not callable(getattr(made, m, None))]
    if not isinstance(getattr(made, "name", None), str):
        missing.insert(0, "name")
    if missing:
        raise InvalidRequest(
            "the workload plugin's factory did not return a workload",
            plugin=spec,
            returned=type(made).__name__,
            missing=missing,
        )
    return made  # structurally checked just above


def entry_points() -> dict[str, Found]:
    """The workloads installed packages declare (group ``belayer.workloads``), by name."""
    out: dict[str, Found] = {}
    for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        dist = getattr(ep, "dist", None)
        source = f"entry point ({dist.name} {dist.version})" if dist is not None else "entry point"
        out.setdefault(ep.name, Found(ep.name, source, ep.value))
    return out


def entry_point_target(name: str) -> str:
    """The ``module:factory`` an installed package registered as ``name``; ``NotFound``."""
    found = entry_points().get(name)
    if found is None:
        raise NotFound("no installed package declares this workload", workload=name)
    return found.target
