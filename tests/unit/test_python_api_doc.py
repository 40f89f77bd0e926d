"""docs/python-api.md's example must stay runnable as the API changes: it parses, and every
keyword it passes to ``belayer.Node``, ``generate``, ``rollout``, ``events`` and ``run`` is one
the API takes (``run``'s: ``RunOptions`` fields). Running it needs a node: the API itself is
exercised end to end by tests/integration/test_python_api.py."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import belayer
from services.rl.options import RunOptions

DOC = Path(__file__).resolve().parents[2] / "docs" / "python-api.md"


def example() -> ast.Module:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert blocks, "docs/python-api.md has no python example"
    return ast.parse(blocks[0])


def accepted(method: str) -> set[str]:
    if method == "run":
        return {f.name for f in dataclasses.fields(RunOptions)} | {"steps"}
    target = belayer.AsyncNode.__init__ if method == "Node" else getattr(belayer.AsyncNode, method)
    return set(inspect.signature(target).parameters) - {"self"} | (
        {"timeout"} if method == "events" else set()  # Node.events' own keyword
    )


def test_the_example_passes_only_keywords_the_api_takes() -> None:
    calls = [n for n in ast.walk(example()) if isinstance(n, ast.Call)]
    checked = set()
    for call in calls:
        name = call.func.attr if isinstance(call.func, ast.Attribute) else ""
        if name not in {"Node", "generate", "rollout", "events", "run"}:
            continue
        given = {k.arg for k in call.keywords if k.arg}
        assert given <= accepted(name), (name, sorted(given - accepted(name)))
        checked.add(name)
    assert checked == {"Node", "generate", "rollout", "events", "run"}


def test_the_example_runs_with_the_trainer_shape_it_starts() -> None:
    """``node.run`` on a running node must ask for the trainer's tasks × n (or leave them out):
    the example's Node and run agree."""
    calls = {
        c.func.attr: {k.arg: ast.literal_eval(k.value) for k in c.keywords if k.arg}
        for c in ast.walk(example())
        if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
        if c.func.attr in {"Node", "run"}
    }
    node, run = calls["Node"], calls["run"]
    assert node.get("training") is True
    for key in ("tasks", "n"):
        assert run.get(key, node.get(key)) == node.get(key)
