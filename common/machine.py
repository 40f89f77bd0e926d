"""The machine a result was measured or made on: its CPU (model and instruction sets), load,
torch and Python versions. The CPU kernels — MKL's GEMMs, torch's vectorised ``exp`` and
sums — differ between instruction sets, so the same run gives other bits on another CPU
family, and a warm start trained there is another model (docs/training.md). The benchmarks'
JSON, a run's ``report.json`` and a warm start's stamp each say which machine. Imports no torch.
"""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

CPU_FEATURES = ("avx2", "avx512f", "amx_tile")
"""Instruction sets ``cpu_flags`` reports: the CPU kernels (MKL's GEMMs, ``exp``) and so the
engine's numbers differ between them (docs/bench/README.md)."""


def cpu_model(cpuinfo: str | None = None) -> tuple[str | None, list[str]]:
    """The CPU's model name and which of :data:`CPU_FEATURES` it has, from ``/proc/cpuinfo``
    (``cpuinfo``: its text; read when None); ``(None, [])`` where there is none."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None, []
    name: str | None = None
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and name is None:
            name = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return name, [f for f in CPU_FEATURES if f in flags]


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the platform has none)."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def machine_info() -> dict[str, Any]:
    """CPUs (model and instruction sets), load, torch and Python versions: what the numbers
    depend on."""
    try:
        torch_version: str | None = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    model, flags = cpu_model()
    return {
        "cpu_model": model,
        "cpu_flags": flags,
        "cpu_count": os.cpu_count(),
        "sched_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "loadavg": loadavg(),
        "torch": torch_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def cpu_text(machine: dict[str, Any] | None) -> str:
    """``AMD EPYC (avx2)``: a machine's CPU in words (``unknown CPU`` where none is known)."""
    if not machine or not machine.get("cpu_model"):
        return "unknown CPU"
    flags = machine.get("cpu_flags") or []
    return f"{machine['cpu_model']} ({', '.join(flags) or 'no ' + '/'.join(CPU_FEATURES)})"
