"""The layer rules of docs/architecture.md, checked on every import of every module (including
imports inside functions):

    schemas/  →  common/  →  model/  →  workloads/  →  services/<name>/  →  services/rl/
              →  services/cli, bench/

Imports point down only. A service reaches another service only through that service's
``client.py``; so does ``services/rl`` (the RL loop library: not a service, above them all),
which only the CLI and the benchmarks import. Pure modules (service cores, the model, the
inference engine, the checkpoint policy) do no bus or event-loop I/O. Nothing imports
``deploy/``; nothing but the CLI imports the benchmarks (it registers their commands), and
nothing imports the CLI — the benchmarks drive the RL loop through ``services/rl``, never
through a CLI module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = ("schemas", "common", "model", "workloads", "services", "belayer", "bench", "deploy")
TOPS = ("services.cli", "bench")
CLI = "services.cli"
LIBRARY = "services.rl"
"""The RL loop library: above every service, below the CLI and the benchmarks."""
API = "belayer"
"""The Python API: above the RL library and the services' clients, below the CLI and bench."""

#: What each layer may import of ours (besides itself).
ALLOWED: dict[str, tuple[str, ...]] = {
    "schemas": (),
    "common": ("schemas",),
    "model": ("schemas", "common"),
    "workloads": ("schemas", "common", "model"),
}

#: Modules that must stay free of bus and event-loop I/O.
PURE_GLOBS = (
    "services/*/core.py",
    "services/*/policy.py",
    "model/**/*.py",
    "services/worker/engine/**/*.py",
)
IO_MODULES = ("nats", "asyncio")


def python_files() -> Iterator[Path]:
    for top in OURS:
        base = ROOT / top
        if base.is_dir():
            yield from (p for p in sorted(base.rglob("*.py")) if ".venv" not in p.parts)


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module) of every import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            yield node.lineno, mod
            for alias in node.names:  # `from services.x import client` names a module
                yield node.lineno, f"{mod}.{alias.name}"


def within(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


def layer_violation(src: str, dst: str) -> str | None:
    """Why ``src`` may not import ``dst`` (None when it may)."""
    dst_top = dst.split(".")[0]
    if dst_top not in OURS or (within(dst, src.split(".")[0]) and dst_top != "services"):
        return None
    if dst_top == "deploy":
        return "nothing imports deploy/ (it only runs things)"
    if any(within(dst, t) for t in TOPS):
        if within(src, CLI):
            return None  # the CLI is the very top: it registers the benchmarks' commands
        if within(src, "bench") and within(dst, CLI):
            return "the benchmarks import no CLI module (the RL loop lives in services/rl)"
        if within(src, "bench"):
            return None
        return "nothing imports the CLI or the benchmarks"
    if within(dst, API) and not within(src, API):
        if within(src, CLI) or within(src, "bench"):
            return None
        return "the Python API (belayer/) is imported only by the CLI and the benchmarks"
    if within(src, API):
        if dst_top != "services" or within(dst, LIBRARY) or dst.split(".")[-1] == "client":
            return None
        if within(dst, ".".join(dst.split(".")[:2]) + ".client"):
            return None
        return "the Python API reaches the services through their client.py and services/rl"
    ok_above = within(src, LIBRARY) or within(src, API) or any(within(src, t) for t in TOPS)
    if within(dst, LIBRARY) and not ok_above:
        return "services/rl is above the services: only the CLI and the benchmarks import it"
    src_top = src.split(".")[0]
    if src_top in ALLOWED:
        if dst_top in ALLOWED[src_top]:
            return None
        return f"{src_top}/ may import only {ALLOWED[src_top] or 'nothing of ours'}"
    if src_top == "deploy" or any(within(src, t) for t in TOPS):
        return None
    # src is a service: lower layers freely, itself freely, other services via client.py only.
    if dst_top != "services":
        return None
    src_service = ".".join(src.split(".")[:2])
    parts = dst.split(".")
    if len(parts) < 2 or within(dst, src_service):
        return None
    dst_service = ".".join(parts[:2])
    if within(dst, f"{dst_service}.client") or dst == dst_service:
        return None
    return f"another service is reached only through its client.py ({dst_service}.client)"


def test_every_import_points_down() -> None:
    problems = []
    for path in python_files():
        src = module_name(path)
        for line, dst in imports_of(path):
            why = layer_violation(src, dst)
            if why:
                problems.append(f"{path.relative_to(ROOT)}:{line}: imports {dst}: {why}")
    assert not problems, "\n".join(sorted(set(problems)))


def test_pure_modules_do_no_bus_or_loop_io() -> None:
    pure = sorted({p for g in PURE_GLOBS for p in ROOT.glob(g)})
    assert pure, "the pure-module globs match no file"
    problems = [
        f"{p.relative_to(ROOT)}:{line}: imports {mod}"
        for p in pure
        for line, mod in imports_of(p)
        if any(within(mod, io) for io in IO_MODULES)
    ]
    assert not problems, "\n".join(problems)


def test_no_module_hands_out_names_lazily() -> None:
    """A module-level ``__getattr__`` (PEP 562) lets ``from services.x.client import Y`` reach a
    module the import rules forbid without naming it; every name a module offers is imported
    where the rules can see it."""
    problems = [
        f"{p.relative_to(ROOT)}:{node.lineno}: module-level __getattr__"
        for p in python_files()
        for node in ast.parse(p.read_text(), filename=str(p)).body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "__getattr__"
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("src", "dst", "ok"),
    [
        ("schemas.base", "common.errors", False),
        ("common.bus", "schemas.base", True),
        ("common.shm", "model.qwen3", False),
        ("common.bus", "services.router.client", False),
        ("model.qwen3", "services.worker.engine.sequence", False),
        ("services.worker.shadow", "services.worker.service", True),
        ("services.supervisor.service", "services.worker.shadow", False),
        ("services.supervisor.service", "services.worker.client", True),
        ("services.router.service", "services.router.core", True),
        ("services.router.service", "services.cli.main", False),
        ("services.cli.main", "services.environment.core", True),
        ("bench.env", "services.environment.manager", True),
        ("bench.train", "services.cli.run_loop", False),
        ("bench.train", "services.cli.model_cmd", False),
        ("bench.train", "services.cli", False),
        ("bench.train", "bench.report", True),
        ("bench.train", "services.rl.loop", True),
        ("services.cli.main", "bench.train", True),
        ("services.cli.run", "services.rl.loop", True),
        ("services.rl.loop", "services.cli.run", False),
        ("belayer.api", "services.rl.run", True),
        ("belayer.api", "services.router.client", True),
        ("belayer.api", "services.router.core", False),
        ("belayer.api", "services.cli.run", False),
        ("services.rl.run", "belayer.api", False),
        ("services.router.service", "belayer", False),
        ("services.cli.main", "belayer", True),
        ("services.rl.warm", "bench.report", False),
        ("services.rl.loop", "services.controller.client", True),
        ("services.rl.loop", "services.controller.core", False),
        ("services.rl.loop", "services.rl.records", True),
        ("services.rl.node", "common.node", True),
        ("services.controller.service", "services.rl.loop", False),
        ("workloads.episode", "services.rl.loop", False),
        ("services.kv.service", "deploy.demo_requests", False),
    ],
)
def test_rules_catch_what_they_should(src: str, dst: str, ok: bool) -> None:
    assert (layer_violation(src, dst) is None) is ok


def test_no_test_module_imports_another() -> None:
    """Tests stand alone: what two test modules share lives in a helpers module or a conftest,
    never in a test module (importing one runs its module-level setup and ties the two)."""
    problems = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for line, mod in imports_of(path):
            if mod.split(".")[-1].startswith("test_") and mod.startswith("tests."):
                problems.append(f"{path.relative_to(ROOT)}:{line}: imports {mod}")
    assert not problems, "\n".join(problems)


API_CALLS = {
    "services.router.client.generate": "AsyncNode.generate_request",
    "services.controller.client.submit": "AsyncNode.rollout_request",
    "services.controller.client.wait": "AsyncNode.rollout_request",
    "services.rl.run.execute": "belayer.api.train",
}
"""The library calls the Python API makes for its users, and the API method the CLI reaches
them through."""
CLI_COMMANDS = ("generate", "rollout", "run", "node")
"""The CLI modules of `belayer generate`, `rollout`, `run`, `status` and `events`."""


def test_the_cli_commands_are_built_on_the_python_api() -> None:
    """`belayer generate|rollout|run|status|events` call `belayer.AsyncNode` (over the CLI's
    own bus connection) and `belayer.api.train`, not the clients behind them: the CLI is a
    thin layer over the Python API, so the two cannot drift."""
    problems = []
    for name in CLI_COMMANDS:
        path = ROOT / "services" / "cli" / f"{name}.py"
        mods = {mod for _, mod in imports_of(path)}
        problems += [
            f"{path.relative_to(ROOT)} imports {mod}: use {via}"
            for mod, via in API_CALLS.items()
            if mod in mods
        ]
        if "belayer.api.AsyncNode" not in mods and "belayer.api.train" not in mods:
            problems.append(f"{path.relative_to(ROOT)} does not use the Python API")
    assert not problems, "\n".join(problems)
