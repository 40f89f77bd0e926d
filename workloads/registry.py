"""Workloads by name: ``load_workload("math")``, ``load_workload("dapo", path=...)``,
``load_workload("table", path=..., prompt_column=..., answer_column=...)``, and a
user's own: ``load_workload("my_pkg.tasks:make")`` or an installed package's entry point
(``workloads.plugins``).

A workload is registered as a factory taking keyword options; an unknown name is a
``NotFound``, an unknown or ill-typed option an ``InvalidRequest`` (both before anything is
generated or any sandbox starts).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from common.errors import InvalidRequest, NotFound
from workloads import plugins
from workloads.base import Workload

Factory = Callable[..., Workload]
"""Makes a workload from keyword options."""


def _math(**options: Any) -> Workload:
    from workloads.math_tasks import MathWorkload

    return MathWorkload(**options)


def _dapo(**options: Any) -> Workload:
    from workloads.math_tasks import DapoWorkload

    return DapoWorkload(**options)


def _table(**options: Any) -> Workload:
    from workloads.table import TableWorkload

    return TableWorkload(**options)


def _swe(**options: Any) -> Workload:
    from workloads.swe import SweWorkload

    return SweWorkload(**options)


def _swe_bundled(**options: Any) -> Workload:
    from workloads.swe import SweWorkload

    return SweWorkload(**options, generated=False)


def _swe_gym(**options: Any) -> Workload:
    from workloads.swe_gym import SweGymWorkload

    return SweGymWorkload(**options)


def _target(name: str) -> Callable[..., Any]:
    """The class behind a built-in factory (for option checking)."""
    if name in ("math", "dapo"):
        from workloads import math_tasks

        return math_tasks.MathWorkload if name == "math" else math_tasks.DapoWorkload
    if name == "table":
        from workloads.table import TableWorkload

        return TableWorkload
    if name == "swe":
        from workloads.swe import SweWorkload

        return SweWorkload
    if name == "swe-bundled":
        from workloads.swe import bundled_options

        return bundled_options
    from workloads.swe_gym import SweGymWorkload

    return SweGymWorkload


_REGISTRY: dict[str, Factory] = {
    "math": _math,
    "dapo": _dapo,
    "table": _table,
    "swe": _swe,
    "swe-bundled": _swe_bundled,
    "swe-gym": _swe_gym,
}
_BUILTIN = frozenset(_REGISTRY)


def register_workload(name: str, factory: Factory) -> None:
    """Make ``factory`` loadable as ``name`` (``InvalidRequest`` if the name is taken)."""
    if not name or name in _REGISTRY:
        raise InvalidRequest("workload name empty or already registered", name=name)
    _REGISTRY[name] = factory


def workload_names() -> list[str]:
    """Every registered name and every installed package's workload (``belayer.workloads``)."""
    return sorted(set(_REGISTRY) | set(plugins.entry_points()))


def available() -> list[plugins.Found]:
    """Every workload a name loads, with where it comes from (``belayer workloads ls``)."""
    out = []
    for name, factory in sorted(_REGISTRY.items()):
        target = _target(name) if name in _BUILTIN else factory
        source = "built-in" if name in _BUILTIN else "registered"
        out.append(plugins.Found(name, source, f"{target.__module__}:{target.__qualname__}"))
    out += [f for n, f in sorted(plugins.entry_points().items()) if n not in _REGISTRY]
    return out


def load_workload(name: str, **options: Any) -> Workload:
    """The workload ``name`` names, made with ``options``: a registered name, an installed
    package's entry point (group ``belayer.workloads``) or a ``module:factory`` plugin spec
    (``workloads.plugins``). ``NotFound`` for an unknown name; ``InvalidRequest`` for an option
    the workload does not take, a bad value, or a plugin that cannot be loaded."""
    factory = _REGISTRY.get(name)
    if factory is None:
        spec = name if plugins.is_spec(name) else _installed(name)
        plugin = plugins.import_factory(spec)
        _check_options(name, plugin, options)
        return plugins.make(spec, plugin, options)
    _check_options(name, _target(name) if name in _BUILTIN else factory, options)
    try:
        return factory(**options)
    except TypeError as exc:  # a wrongly typed option deep inside
        raise InvalidRequest("bad workload option", workload=name, error=str(exc)) from None


def _installed(name: str) -> str:
    found = plugins.entry_points().get(name)
    if found is None:
        raise NotFound("unknown workload", workload=name, known=workload_names())
    return found.target


def _check_options(name: str, target: Callable[..., Any], options: dict[str, Any]) -> None:
    """``InvalidRequest`` for an option ``target`` does not take or a required one missing."""
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        params = {}  # a builtin without a signature: no parameters known
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if takes_any:
        return
    unknown = sorted(set(options) - set(params))
    if unknown:
        raise InvalidRequest(
            "unknown workload option", workload=name, unknown=unknown, known=sorted(params)
        )
    required = [
        p.name
        for p in params.values()
        if p.default is inspect.Parameter.empty
        and p.kind is inspect.Parameter.KEYWORD_ONLY
        and p.name not in options
    ]
    if required:
        raise InvalidRequest("missing workload option", workload=name, missing=required)
