"""``belayer bench scale``: the simulation at the paper's scale, on small configurations.

The simulation is seeded and runs on a simulated clock, so every assertion here is exact."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from bench.scale import figures, main, simulate
from bench.scale_sim import ScaleConfig, Sim

SMALL = ScaleConfig(
    prompts=4,
    samples=4,
    engines=2,
    max_num_seqs=8,
    min_turns=4,
    max_turns=8,
    mean_response_tokens=600,
    max_context_tokens=16384,
)
"""16 trajectories on 2 engines: milliseconds."""


def test_a_seed_gives_the_same_numbers_every_time() -> None:
    cfg = dataclasses.replace(SMALL, sandbox_p=0.1, engine_failures_per_hour=20.0)
    for belayer in (True, False):
        first = simulate(cfg, belayer=belayer, seed=7)
        assert simulate(cfg, belayer=belayer, seed=7) == first
    assert simulate(cfg, belayer=True, seed=8) != simulate(cfg, belayer=True, seed=7)


def test_without_failures_nothing_is_recovered() -> None:
    for belayer in (True, False):
        r = simulate(SMALL, belayer=belayer, seed=1)
        for key in (
            "sandbox_failures", "restores", "restarts_from_scratch", "engine_failures",
            "resumed_requests", "regenerated_tokens",
        ):  # fmt: skip
            assert r[key] == 0, (belayer, key)
        assert r["trained_samples"] == SMALL.prompts * SMALL.samples
    sim = Sim(SMALL, belayer=True, seed=1)
    sim.run()
    assert sum(t.core.timings.recovery_s for t in sim.trajs.values()) == 0.0


def test_a_higher_failure_rate_costs_the_baseline_more_than_belayer() -> None:
    cfg = dataclasses.replace(SMALL, prompts=8, min_turns=8, max_turns=12)

    def cost(p: float, belayer: bool) -> float:
        run = dataclasses.replace(cfg, sandbox_p=p)
        return sum(simulate(run, belayer=belayer, seed=s)["trajectory_s"] for s in range(3))

    added_belayer = cost(0.1, True) - cost(0.0, True)
    added_baseline = cost(0.1, False) - cost(0.0, False)
    assert added_baseline > 0
    assert added_baseline > 2 * added_belayer


def test_the_production_cores_decide() -> None:
    cfg = dataclasses.replace(SMALL, sandbox_p=0.1)
    sim = Sim(cfg, belayer=True, seed=2)
    sim.run()
    cores = [t.core for t in sim.trajs.values()]
    steps = sum(c.env_steps for c in cores)
    failures = sum(c.recovery.sandbox_failures for c in cores)
    # the policy (Algorithm 1) was asked after every completed environment step
    decisions = [d for c in cores for d in c.recovery.decisions]
    assert len(decisions) == steps - failures > 0
    assert {d.policy for d in decisions} == {"risk-aware"}
    assert sum(c.recovery.checkpoints for c in cores) == sum(d.checkpoint for d in decisions)
    # every failure went back to a ready prefix or to L_0, as the trajectory core chose
    restored = sum(c.recovery.restores + c.recovery.restarts_from_scratch for c in cores)
    assert failures > 0 and restored == failures
    assert sum(c.recovery.restarts_from_scratch_with_checkpoint for c in cores) == 0
    # the router placed every request the episodes asked for
    assert sim.router.metrics()["requests"] == sum(c.generations for c in cores)
    assert {e.id for e in sim.router.engine_infos() if e.running == 0} == set(sim.engines)
    baseline = Sim(cfg, belayer=False, seed=2)
    baseline.run()
    decisions = [d for t in baseline.trajs.values() for d in t.core.recovery.decisions]
    assert {d.reason for d in decisions} == {"policy_never"}
    assert sum(t.core.recovery.restores for t in baseline.trajs.values()) == 0


def test_an_engine_failure_resumes_by_token_on_belayer_and_regenerates_on_the_baseline() -> None:
    cfg = dataclasses.replace(SMALL, engines=4, max_num_seqs=4, engine_failures_per_hour=40.0)
    found = {}
    for belayer in (True, False):
        r = simulate(cfg, belayer=belayer, seed=3)
        assert r["engine_failures"] > 0 and r["resumed_requests"] > 0, r
        found[belayer] = r
    assert found[True]["regenerated_tokens"] == 0  # token-level resume: nothing generated twice
    assert found[False]["regenerated_tokens"] > 0  # the baseline restarts from the prompt
    assert found[False]["rollout_s"] > found[True]["rollout_s"]


def test_main_writes_a_simulation_result(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "scale.json"
    result = main(out, seeds=2, jobs=1, config=SMALL)
    written = json.loads(out.read_text())
    assert written["simulation"] is True and "simulation" in written["note"]
    assert written["values"] == pytest.approx(result["values"])
    assert set(written["intervals"]) == set(result["values"])
    assert written["intervals"]["step_overhead"]["n"] == 2
    assert "SIMULATION" in capsys.readouterr().out
    assert figures(result["runs"]) == pytest.approx(result["values"])
