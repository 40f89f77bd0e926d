"""``belayer top``'s view without a node: which rollouts it follows (from controller events)
and the rollouts panel it draws from the controller's answers."""

from __future__ import annotations

import io

from rich.console import Console

from schemas.events import EngineRegistered
from schemas.events_training import RolloutStarted, TrajectoryRestored
from schemas.rollout import RolloutResult, RolloutSummary
from services.cli.top import ROLLOUTS_SHOWN, View, render


def started(rid: str) -> RolloutStarted:
    return RolloutStarted(rollout_id=rid, workload="math", trajectories=4, policy="risk")


def text(view: View) -> str:
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(render(view))
    return console.export_text()


def test_controller_events_name_the_rollouts_followed() -> None:
    view = View()
    view.saw(EngineRegistered(engine_id="e0", epoch=1, pid=7))
    assert view.rollouts == {}
    assert "rollouts: none seen yet" in text(view)
    for i in range(ROLLOUTS_SHOWN + 2):
        view.saw(started(f"r{i}"))
    restored = TrajectoryRestored(
        rollout_id="r5", trajectory_id="t", sandbox_id="sb", prefix=2, checkpoint_id="ck",
        context_tokens=10, seconds=0.5, from_scratch=False,
    )  # fmt: skip
    view.saw(restored)  # already followed: no new row
    assert list(view.rollouts) == [f"r{i}" for i in range(2, ROLLOUTS_SHOWN + 2)]
    assert len(view.events) == ROLLOUTS_SHOWN + 4


def test_the_rollouts_panel_shows_the_controller_answers() -> None:
    view = View()
    view.saw(started("r-old"))
    view.saw(started("r-new"))
    summary = RolloutSummary(
        trajectories=8, trajectories_completed=5, running=3, trajectories_failed=1,
        env_restores=2, restarts_from_scratch=1, checkpoints=9, engine_handovers=4,
    )  # fmt: skip
    view.rollouts["r-new"] = RolloutResult(
        rollout_id="r-new", state="running", summary=summary, workload="swe"
    )
    lines = text(view).splitlines()
    row = next(ln for ln in lines if "r-new" in ln)
    assert row.strip() == (
        "r-new (swe) running: 5/8 trajectories done, 3 running, 1 failed attempts, "
        "2 restores, 1 from scratch, 9 checkpoints, 4 handovers"
    )
    old = next(ln for ln in lines if "r-old" in ln)
    assert old.strip() == "r-old: no answer from the controller"
    assert lines.index(row) < lines.index(old)  # the latest first


def test_a_short_terminal_keeps_the_newest_events_on_screen() -> None:
    view = View(title="belayer top — n0")
    for i in range(12):
        view.saw(EngineRegistered(engine_id=f"e{i}", epoch=i + 1, pid=100 + i))
    console = Console(width=80, height=24, record=True, file=io.StringIO())
    console.print(render(view, console))
    lines = console.export_text().splitlines()
    assert len(lines) <= 24
    assert any(" e11 " in ln for ln in lines)  # the newest event
    assert any("└" in ln for ln in lines[-2:])  # the events table ends on screen
    assert sum(" e11 " in ln or " e0 " in ln for ln in text(view).splitlines()) == 2  # --once: all
