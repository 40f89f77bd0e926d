"""The Python API on a real node (``import belayer``): ``belayer.Node`` starts one, generates
(greedy twice: the same tokens), rolls out math, follows events as typed objects through a
worker SIGKILL (the handover arrives on ``node.events``), and a second ``Node`` attaches to the
running node without starting or stopping it; ``belayer.AsyncNode`` does the same from
asyncio; errors are typed ``belayer.BelayerError``s, never a traceback's worth of internals."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

import belayer
from common.machine import cpu_model, cpu_text
from schemas.events import HandoverComplete

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def api_node(tmp_path_factory: pytest.TempPathFactory, warm_model) -> Iterator[belayer.Node]:
    """One node for the module, started through the API: a trainer of 2 tasks × 2 samples on
    the warm-started math model."""
    run_dir = tmp_path_factory.mktemp("api") / "node"
    node = belayer.Node(run_dir, training=True, model=warm_model("math"), tasks=2, n=2)
    with node:
        assert node.started and (run_dir / "node.json").exists()
        yield node
    assert not (run_dir / "node.json").exists()  # the Node that started it stopped it


def test_node_generates_rolls_out_and_follows_a_handover(api_node: belayer.Node) -> None:
    node, run_dir = api_node, api_node.run_dir
    a = node.generate("Once upon a time", max_tokens=24, temperature=0, ignore_eos=True)
    b = node.generate("Once upon a time", max_tokens=24, temperature=0, ignore_eos=True)
    assert isinstance(a, belayer.GenerateResult) and len(a.token_ids) == 24
    assert a.token_ids == b.token_ids and a.text == b.text

    streamed: list[int] = []
    c = node.generate("Once upon a time", max_tokens=24, temperature=0, ignore_eos=True,
                      on_tokens=streamed.extend)  # fmt: skip
    assert streamed == c.token_ids == a.token_ids

    result = node.rollout("math", tasks=2, n=2, max_tokens=16)
    assert isinstance(result, belayer.RolloutResult)
    assert result.summary.trajectories_completed == 4 == len(result.rows)

    with belayer.Node(run_dir, start=False) as attached:  # the same node, not a new one
        assert not attached.started
        assert attached.status()["run_id"] == node.status()["run_id"]
    assert (run_dir / "node.json").exists()  # still running: the attached one left it

    before = node.status()
    worker = next(p for p in before["procs"] if p["name"] == "worker-e0")
    seen = node.events(kinds=["handover_complete"], timeout=60)
    os.kill(worker["pid"], signal.SIGKILL)  # the subscription is live from here on
    ev = next(seen)
    assert isinstance(ev, belayer.EventBase) and ev.kind == "handover_complete"
    assert isinstance(ev, HandoverComplete) and ev.engine_id == "e0"
    assert ev.old_pid == worker["pid"]
    after = node.generate("Once upon a time", max_tokens=24, temperature=0, ignore_eos=True)
    assert after.token_ids == a.token_ids  # the shadow serves the same weights

    # what `belayer status --json` and `belayer events --no-follow` print, from the API
    status = node.status()
    assert status["ready"] and status["state"] == "ready"
    (engine,) = status["engines"]
    assert engine["id"] == "e0" and engine["worker_pid"] != worker["pid"]
    assert engine["epoch"] > before["engines"][0]["epoch"]
    stored = list(node.history("handover_complete"))
    assert [e.old_pid for e in stored if isinstance(e, HandoverComplete)] == [worker["pid"]]


def test_errors_are_typed(tmp_path: Path) -> None:
    with pytest.raises(belayer.NotFound, match="no node is running here"):
        belayer.Node(tmp_path / "none", start=False).open()


def test_async_node_attaches(api_node: belayer.Node) -> None:
    async def main() -> tuple[list[int], list[str]]:
        async with belayer.AsyncNode(api_node.run_dir, start=False) as node:
            assert not node.started
            out = await node.generate("Once upon a time", max_tokens=8, temperature=0)
            with pytest.raises(belayer.InvalidRequest):
                await node.run("math", steps=1, no_such_option=1)
            return list(out.token_ids), [p["name"] for p in (await node.status())["procs"]]

    tokens, procs = asyncio.run(main())
    assert len(tokens) >= 1 and "router" in procs


def test_node_run_trains_one_step_and_returns_the_report(
    api_node: belayer.Node, tmp_path: Path
) -> None:
    """``node.run`` on the training node the API started: one GRPO step of math, the report
    as ``belayer run --json`` prints it."""
    report = api_node.run("math", steps=1, tasks=2, n=2, held_out=2, out=tmp_path / "run")
    assert report["steps"] == 1 and report["errors"] == []
    assert report["trajectories_completed"] == 4 and report["trajectories_lost"] == 0
    assert Path(report["run_dir"]) == (tmp_path / "run").resolve()
    assert (tmp_path / "run" / "report.json").exists()
    # Which CPU it ran on: another CPU family gives other numbers.
    assert (report["machine"]["cpu_model"], report["machine"]["cpu_flags"]) == cpu_model()
    assert (
        f"Machine: {cpu_text(report['machine'])}, torch "
        in (tmp_path / "run" / "report.md").read_text()
    )
