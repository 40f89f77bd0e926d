"""The discrete-event simulation behind ``belayer bench scale``: one GRPO step (a rollout and its
update) at the paper's scale, on a simulated clock, with the production cores deciding.

Nothing here talks to a bus, a container or a GPU. What is simulated: time (an event heap), the
engines' token output (a decode rate per sequence, a prefill rate), the environment steps'
durations, and failure arrivals (Poisson processes per engine and per sandbox). What decides is
the code the services run:

* ``services.router.core.RouterCore`` places every request, resumes interrupted ones after a
  handover (token-level: prompt + held tokens) or, in ``baseline`` recovery, resubmits them
  from the prompt and drops the regenerated tokens by index;
* ``services.controller.core.TrajectoryCore`` (the ``workloads.episode.Episode`` state machine
  with the checkpoint chain) runs every trajectory: turns, context, limits, the restore to the
  latest ready prefix or the restart from scratch;
* ``services.controller.policy.CheckpointPolicy`` (Algorithm 1, ``risk-aware``; ``never`` for
  the restart-from-scratch baseline) decides every checkpoint, learning λ from the failures it
  sees and q from the response times;
* ``services.trainer.core.Batcher`` and ``group_advantages`` batch the finished trajectories.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.limits import ServingLimits
from schemas.serving import GenerateResult, SamplingParams, SeqDelta, StepBatch
from services.controller.core import Execute, Generate, Limits, Pending, Score, TrajectoryCore
from services.controller.policy import CheckpointPolicy, PolicyConfig, PolicyStats
from services.router.config import RouterConfig
from services.router.core import RouterCore
from services.router.state import AbortOnEngine, Action, SendToCaller, SubmitToEngine

MASK = (1 << 64) - 1
TURNS, LENGTH, ENV, REWARD = range(4)
"""What a keyed draw is for (``Sim.uniform``)."""
BASH, SUBMIT = 3, 2
"""The last token of a response: an ordinary command, or the ``submit`` that ends the task."""
TEXT = {BASH: "```bash\nls\n```", SUBMIT: "```bash\nsubmit\n```"}


@dataclass(frozen=True)
class Measured:
    """This machine's measured costs (the README's ``bench env`` and ``bench handover`` runs)."""

    checkpoint_s: float = 0.331
    """``full_checkpoint`` of a 256 MB sandbox (``bench env``, median)."""
    restore_s: float = 0.428
    """``full_restore`` of the same sandbox."""
    fresh_sandbox_s: float = 0.400
    """A fresh container from the base image (143–400 ms; the upper end)."""
    handover_s: float = 0.068
    """A worker SIGKILL to the first resumed token with a shadow (``bench handover``, p50)."""
    shadow_overhead: float = 0.002
    """Decode throughput an idle shadow costs its engine (``bench handover``: 0.20 %)."""


@dataclass(frozen=True)
class ScaleConfig:
    """One simulated step: its size, speeds, failure rates and cost factors."""

    prompts: int = 64
    samples: int = 8
    engines: int = 32
    max_num_seqs: int = 16
    max_turns: int = 20
    min_turns: int = 10
    """A trajectory submits after a number of turns drawn from ``min_turns .. max_turns``."""
    max_response_tokens: int = 4096
    mean_response_tokens: int = 1200
    """Response lengths: exponential with this mean, at least 64, at most the maximum."""
    prompt_tokens: int = 2048
    observation_tokens: int = 300
    max_context_tokens: int = 32768
    decode_tps: float = 100.0
    """Decode tokens per second of one sequence (an engine at batch 16: 1600 tok/s)."""
    prefill_tps: float = 20000.0
    """Prefill tokens per second (each request prefills its whole context: no prefix cache)."""
    mean_env_step_s: float = 5.0
    """Environment step durations: exponential with this mean, at least 0.2 s."""
    sandbox_p: float = 0.0
    """Sandbox failure probability per environment step of average length (the Poisson rate
    per second of exposure is −ln(1 − p) / ``mean_env_step_s``)."""
    engine_failures_per_hour: float = 0.0
    """Failures per engine per hour (Poisson)."""
    checkpoint_factor: float = 4.0
    restore_factor: float = 4.0
    handover_factor: float = 10.0
    heartbeat_detect_s: float = 30.0
    """Baseline: failure detection through the heartbeat (the paper's Qwen3-32B setup)."""
    cold_restart_s: float = 38.5
    """Baseline: reconstructing the rollout engine (the paper's Qwen3-32B setup)."""
    train_tps: float = 50000.0
    """Trainer tokens per second (model and observation tokens of the batch)."""
    weight_sync_s: float = 20.0
    token_block: int = 16
    """Real tokens one simulated token id stands for: every token count (prompt, response,
    observation, limits) is divided by it before the cores see it, and every time is computed
    from the real count, so the cores' decisions are those of the real lengths at a 16th of
    the bookkeeping."""
    measured: Measured = field(default_factory=Measured)

    def ids(self, tokens: int) -> int:
        """Simulated token ids for ``tokens`` real tokens (at least 1)."""
        return max(1, -(-tokens // self.token_block))

    @property
    def checkpoint_s(self) -> float:
        return self.measured.checkpoint_s * self.checkpoint_factor

    @property
    def restore_s(self) -> float:
        return self.measured.restore_s * self.restore_factor

    @property
    def handover_s(self) -> float:
        return self.measured.handover_s * self.handover_factor

    @property
    def sandbox_rate(self) -> float:
        """Failures per second of environment exposure."""
        p = min(max(self.sandbox_p, 0.0), 0.999)
        return -math.log(1.0 - p) / self.mean_env_step_s


@dataclass
class SimEngine:
    """One engine as the simulation runs it: its current epoch, running and queued requests."""

    id: str
    epoch: int = 1
    up: bool = True
    running: dict[str, tuple[float, int, int]] = field(default_factory=dict)
    """request id → (decode start, generated offset, target tokens)."""
    queue: deque[tuple[str, int, int, int]] = field(default_factory=deque)
    """(request id, context tokens, offset, target) waiting for a slot."""

    @property
    def pid(self) -> int:
        return 1000 + self.epoch


@dataclass
class Traj:
    """One trajectory: its core and what the simulation tracks around it."""

    core: TrajectoryCore
    index: int
    turns: int
    submitted_at: float = 0.0
    response_at: float = 0.0
    target: int = 0
    step_s: float = 0.0
    pending: Pending | None = None
    pending_ready_at: float = 0.0
    waiting_step: bool = False
    done_at: float | None = None
    reward: float = 0.0


class Sim:
    """One rollout of ``prompts × samples`` trajectories through the production cores."""

    def __init__(self, cfg: ScaleConfig, *, belayer: bool, seed: int) -> None:
        self.cfg, self.belayer, self.seed = cfg, belayer, seed
        self.now = 0.0
        self.heap: list[tuple[float, int, str, Any]] = []
        self.seq = 0
        self.fail_rng = random.Random(seed)
        """Failure arrivals (one stream: a run's failures depend on its seed and its events)."""
        limits = ServingLimits(
            max_prompt_tokens=cfg.ids(cfg.max_context_tokens),
            max_new_tokens=cfg.ids(cfg.max_response_tokens),
            max_queued=64,
            max_prompt_bytes=1 << 20,
        )
        ids = tuple(f"e{i}" for i in range(cfg.engines))
        rcfg = RouterConfig(
            limits=limits, engine_ids=ids, finished_cache=1024,
            recovery="belayer" if belayer else "baseline",
        )  # fmt: skip
        self.router = RouterCore(rcfg, self.decode)
        self.engines = {e: SimEngine(e) for e in ids}
        policy = PolicyConfig(kind="risk-aware" if belayer else "never")
        self.stats = PolicyStats(policy)
        self.trajs: dict[str, Traj] = {}
        self.by_request: dict[str, Traj] = {}
        shadow = 1.0 - cfg.measured.shadow_overhead if belayer else 1.0
        self.rate = cfg.decode_tps * shadow / cfg.token_block
        """Simulated token ids decoded per second per sequence."""
        self.left = cfg.prompts * cfg.samples
        self.counts = dict.fromkeys(("engine_failures", "persisted_chunks", "events"), 0)

    # --- the clock ----------------------------------------------------------------------------
    def at(self, t: float, kind: str, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, payload))

    def run(self) -> float:
        """Run the rollout to its last trajectory; returns the rollout time in seconds."""
        for eng in self.engines.values():
            self.do(self.router.register(eng.id, eng.epoch, eng.pid,
                                         max_num_seqs=self.cfg.max_num_seqs, now=0.0))  # fmt: skip
            self.schedule_engine_failure(eng, 0.0)
        for i in range(self.cfg.prompts * self.cfg.samples):
            self.start_trajectory(i)
        handlers: dict[str, Callable[[Any], None]] = {
            "gen_done": self.on_gen_done, "env_done": self.on_env_done,
            "ckpt_ready": self.on_ckpt_ready, "sandbox_fail": self.on_sandbox_fail,
            "recovered": self.on_recovered, "engine_fail": self.on_engine_fail,
            "engine_detected": self.on_engine_detected, "engine_up": self.on_engine_up,
        }  # fmt: skip
        while self.heap and self.left:
            self.now, _, kind, payload = heapq.heappop(self.heap)
            handlers[kind](payload)
        if self.left:
            raise RuntimeError(f"simulation stalled with {self.left} trajectories unfinished")
        return max(t.done_at or 0.0 for t in self.trajs.values())

    # --- trajectories -------------------------------------------------------------------------
    def uniform(self, *key: int) -> float:
        """A uniform draw in [0, 1) that is a function of the seed and ``key`` alone (splitmix64
        of the key's hash: ints hash the same in every process), so a regenerated turn draws
        what it drew the first time."""
        z = (hash((self.seed, *key)) + 0x9E3779B97F4A7C15) & MASK
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return ((z ^ (z >> 31)) >> 11) / float(1 << 53)

    def exponential(self, mean: float, *key: int) -> float:
        return -mean * math.log(1.0 - self.uniform(*key))

    def start_trajectory(self, i: int) -> None:
        cfg = self.cfg
        limits = Limits(
            max_turns=cfg.max_turns, max_invalid_in_row=3,
            max_prompt_tokens=cfg.ids(cfg.max_context_tokens),
            max_context_tokens=cfg.ids(cfg.max_context_tokens),
            max_response_tokens=cfg.ids(cfg.max_response_tokens), observation_chars=10_000,
            action_timeout_s=600.0, deadline_s=math.inf,
        )  # fmt: skip
        obs = [4] * cfg.ids(cfg.observation_tokens)
        core = TrajectoryCore(
            trajectory_id=f"t{i}", prompt_ids=[1] * cfg.ids(cfg.prompt_tokens), limits=limits,
            sample_seed=self.seed * 100_000 + i, has_sandbox=True, started_at=0.0,
            observation_ids=lambda _r, _t: obs, policy=CheckpointPolicy(
                self.stats.config, self.stats, image=f"task-{i // cfg.samples}"),
        )  # fmt: skip
        span = cfg.max_turns - cfg.min_turns + 1
        turns = cfg.min_turns + int(self.uniform(TURNS, i) * span)
        traj = Traj(core, i, turns)
        self.trajs[core.trajectory_id] = traj
        self.next_turn(traj)

    def next_turn(self, traj: Traj) -> None:
        step = traj.core.next_generation(self.now)
        if isinstance(step, Generate):
            mean = self.cfg.mean_response_tokens
            real = max(64, round(self.exponential(mean, LENGTH, traj.index, traj.core.turn)))
            length = min(step.max_tokens, self.cfg.ids(real))
            traj.target = length
            traj.submitted_at = self.now
            self.by_request[step.request_id] = traj
            sampling = SamplingParams(temperature=1.0, max_tokens=step.max_tokens, seed=step.seed)
            self.do(self.router.submit(step.request_id, step.prompt_ids, sampling,
                                       inbox=traj.core.trajectory_id, stream=False,
                                       identity=step.request_id))  # fmt: skip
        elif isinstance(step, Score):
            self.finish(traj, step)
        else:  # deadline (none is set): cannot happen here
            raise RuntimeError(f"unexpected step {step!r}")

    def finish(self, traj: Traj, step: Score) -> None:
        traj.reward = float(self.uniform(REWARD, traj.index) < 0.3)
        traj.core.finished(step.reason, step.detail, traj.reward)
        traj.done_at = self.now
        self.left -= 1

    def on_result(self, result: GenerateResult) -> None:
        traj = self.by_request.pop(result.request_id)
        step = traj.core.on_response(
            result.token_ids, result.logprobs, result.token_weight_versions, result.text,
            llm_s=self.now - traj.submitted_at, resumes=result.resumes, now=self.now,
        )  # fmt: skip
        if isinstance(step, Execute):
            if traj.pending is not None:
                traj.response_at = self.now
                traj.waiting_step = True  # the next action waits for the checkpoint
                return
            self.start_step(traj)
        elif isinstance(step, Score):
            self.finish(traj, step)
        else:
            raise RuntimeError(f"unexpected step {step!r}")

    def start_step(self, traj: Traj) -> None:
        mean = self.cfg.mean_env_step_s
        traj.step_s = d = max(0.2, self.exponential(mean, ENV, traj.index, traj.core.turn))
        traj.core.begin_step()
        rate = self.cfg.sandbox_rate
        x = self.fail_rng.expovariate(rate) if rate > 0 else math.inf
        if x < d:
            traj.core.timings.env_s += x
            self.at(self.now + x, "sandbox_fail", traj)
        else:
            self.at(self.now + d, "env_done", traj)

    def on_env_done(self, traj: Traj) -> None:
        core, d = traj.core, traj.step_s
        core.on_observation(stdout="", stderr="", exit_code=0, env_s=d)
        _, pending = core.decide_checkpoint(step_s=d, now=self.now)
        if pending is not None:
            traj.pending = pending
            traj.pending_ready_at = self.now + self.cfg.checkpoint_s
            self.at(traj.pending_ready_at, "ckpt_ready", traj)
        self.next_turn(traj)

    def on_ckpt_ready(self, traj: Traj) -> None:
        pending, traj.pending = traj.pending, None
        assert pending is not None
        cid = f"{traj.core.trajectory_id}-c{traj.core.recovery.checkpoints}"
        traj.core.on_checkpoint_ready(pending, cid, self.cfg.checkpoint_s, self.now)
        if traj.waiting_step:
            traj.waiting_step = False
            traj.core.on_checkpoint_wait(self.now - traj.response_at)
            self.start_step(traj)

    def on_sandbox_fail(self, traj: Traj) -> None:
        core = traj.core
        core.on_sandbox_failure("exec", "sandbox_error", "container killed", self.now)
        ready = core.restore_candidate()
        cost = self.cfg.restore_s if ready is not None else self.cfg.measured.fresh_sandbox_s
        self.at(self.now + cost, "recovered", (traj, ready, cost))

    def on_recovered(self, payload: Any) -> None:
        traj, ready, cost = payload
        if ready is not None:
            traj.core.on_restored(ready, cost, self.now)
        else:
            traj.core.on_restarted_from_scratch(cost, self.now, had_checkpoint=False)
        self.next_turn(traj)

    # --- engines ------------------------------------------------------------------------------
    def decode(self, ids: list[int]) -> str:
        return TEXT[SUBMIT if ids and ids[-1] == SUBMIT else BASH]

    def do(self, actions: list[Action]) -> None:
        """Execute what the router core asks."""
        for a in actions:
            if isinstance(a, SubmitToEngine):
                self.engine_submit(a)
            elif isinstance(a, SendToCaller):
                if isinstance(a.message, GenerateResult):
                    self.on_result(a.message)
            elif isinstance(a, AbortOnEngine):
                eng = self.engines[a.engine_id]
                for rid in a.request_ids:
                    eng.running.pop(rid, None)
            else:
                self.counts[
                    "persisted_chunks" if type(a).__name__ == "PersistChunk" else "events"
                ] += 1

    def engine_submit(self, a: SubmitToEngine) -> None:
        eng = self.engines[a.engine_id]
        if not eng.up or a.epoch != eng.epoch:
            return  # a dead worker: the request is lost until the router resumes it
        for er in a.requests:
            traj = self.by_request.get(er.request_id)
            if traj is None:
                continue
            eng.queue.append((er.request_id, len(er.token_ids), er.generated_offset, traj.target))
        self.fill(eng)

    def fill(self, eng: SimEngine) -> None:
        while eng.queue and len(eng.running) < self.cfg.max_num_seqs:
            rid, context, offset, target = eng.queue.popleft()
            start = self.now + context * self.cfg.token_block / self.cfg.prefill_tps
            eng.running[rid] = (start, offset, target)
            done = start + max(0, target - offset) / self.rate
            self.at(done, "gen_done", (eng.id, eng.epoch, rid))

    def tokens(self, rid: str, target: int) -> list[int]:
        traj = self.by_request[rid]
        last = SUBMIT if traj.core.turn + 1 >= traj.turns else BASH
        return [5] * (target - 1) + [last]

    def batch(self, eng: SimEngine, deltas: list[SeqDelta]) -> StepBatch:
        return StepBatch(
            engine_id=eng.id, epoch=eng.epoch, worker_pid=eng.pid, step=0, weight_version=0,
            deltas=deltas, running=len(eng.running), waiting=len(eng.queue),
        )  # fmt: skip

    def on_gen_done(self, payload: tuple[str, int, str]) -> None:
        eid, epoch, rid = payload
        eng = self.engines[eid]
        if epoch != eng.epoch or not eng.up or rid not in eng.running:
            return
        _, offset, target = eng.running.pop(rid)
        toks = self.tokens(rid, target)[offset:]
        delta = SeqDelta(request_id=rid, token_ids=toks, logprobs=[0.0] * len(toks),
                         finished=True, finish_reason="stop", start=offset)  # fmt: skip
        self.do(self.router.on_step(self.batch(eng, [delta])))
        self.fill(eng)

    def schedule_engine_failure(self, eng: SimEngine, after: float) -> None:
        rate = self.cfg.engine_failures_per_hour / 3600.0
        if rate > 0:
            self.at(after + self.fail_rng.expovariate(rate), "engine_fail", (eng.id, eng.epoch))

    def on_engine_fail(self, payload: tuple[str, int]) -> None:
        eid, epoch = payload
        eng = self.engines[eid]
        if epoch != eng.epoch or not eng.up:
            return
        self.counts["engine_failures"] += 1
        # the tokens streamed before the failure reached the router
        deltas = []
        for rid, (start, offset, target) in eng.running.items():
            made = min(target - 1, offset + max(0, int((self.now - start) * self.rate)))
            if made > offset:
                toks = self.tokens(rid, target)[offset:made]
                deltas.append(SeqDelta(request_id=rid, token_ids=toks,
                                       logprobs=[0.0] * len(toks), start=offset))  # fmt: skip
        if deltas:
            self.do(self.router.on_step(self.batch(eng, deltas)))
        eng.up = False
        eng.running.clear()
        eng.queue.clear()
        if self.belayer:  # the shadow detects it at once and takes over
            self.do(self.router.engine_failed(eid, self.now, reason="exited", epoch=epoch))
            self.at(self.now + self.cfg.handover_s, "engine_up", eid)
        else:
            self.at(self.now + self.cfg.heartbeat_detect_s, "engine_detected", eid)

    def on_engine_detected(self, eid: str) -> None:
        eng = self.engines[eid]
        self.do(self.router.engine_failed(eid, self.now, reason="heartbeat", epoch=eng.epoch))
        self.at(self.now + self.cfg.cold_restart_s, "engine_up", eid)

    def on_engine_up(self, eid: str) -> None:
        eng = self.engines[eid]
        eng.epoch += 1
        eng.up = True
        self.do(self.router.register(eid, eng.epoch, eng.pid,
                                     max_num_seqs=self.cfg.max_num_seqs, now=self.now))  # fmt: skip
        self.schedule_engine_failure(eng, self.now)
