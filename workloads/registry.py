"""Workloads by name: ``load_workload("math")``, ``load_workload("dapo", path=...)``.

A workload is registered as a factory taking keyword options; an unknown name is a
``NotFound``, an unknown or ill-typed option an ``InvalidRequest`` (both before anything is
generated or any sandbox starts).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from common.errors import InvalidRequest, NotFound
from workloads.base import Workload

Factory = Callable[..., Workload]
"""Makes a workload from keyword options."""


def _math(**options: Any) -> Workload:
    from workloads.math_tasks import MathWorkload

    return MathWorkload(**options)


def _dapo(**options: Any) -> Workload:
    from workloads.math_tasks import DapoWorkload

    return DapoWorkload(**options)


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
    """Every registered name."""
    return sorted(_REGISTRY)


def load_workload(name: str, **options: Any) -> Workload:
    """The workload registered as ``name``, made with ``options``. ``NotFound`` for an unknown
    name; ``InvalidRequest`` for an option the workload does not take or a bad value."""
    factory = _REGISTRY.get(name)
    if factory is None:
        raise NotFound("unknown workload", workload=name, known=workload_names())
    target: Callable[..., Any] = _target(name) if name in _BUILTIN else factory
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]  # a builtin without a signature: no parameters known
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if not takes_any:
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
    try:
        return factory(**options)
    except TypeError as exc:  # a wrongly typed option deep inside
        raise InvalidRequest("bad workload option", workload=name, error=str(exc)) from None
