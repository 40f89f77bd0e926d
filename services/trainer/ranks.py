"""The trainer's data-parallel ranks (``--procs N``): the trainer service process is rank 0 and
starts ranks 1 … N−1 as its own child processes; together they run every update with
:func:`services.trainer.dp.dp_grpo_step` in one ``torch.distributed`` process group (gloo for
the CPU tensors this trainer trains; nccl where they are on CUDA), each with
``threads`` torch threads. Rank 0 alone talks to the bus, checkpoints and pushes weights.

- **Start** (:meth:`Ranks.start`): a ``TCPStore`` on a free port of 127.0.0.1 (rank 0 is its
  server), the ranks spawned (``multiprocessing`` spawn; each dies with the trainer:
  ``PR_SET_PDEATHSIG``), every rank joining the group; each loads the trainer's latest
  checkpoint, which is rank 0's state (written at the first start, or the one it resumed).
- **Steps** (:meth:`Ranks.grpo_step`, ``update.grpo_step``'s signature): rank 0 sends each
  rank the batch over a pipe (with the weights of older versions the batch's tokens came from),
  then all compute their shares. Idle ranks wait on the pipe, not in a collective, so a trainer
  waiting for trajectories never times a collective out.
- **A rank lost** — killed, or a collective failing — is :class:`RankLost`, a fatal error: the
  trainer exits non-zero (its other ranks die with it), the supervisor starts it again, and it
  resumes from its checkpoint and redoes the planned steps (``journal``), exactly once.
  :meth:`Ranks.wait_lost` notices a rank's death between steps too.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Unpack

import torch
import torch.distributed as dist

from common.errors import FatalError
from model.config import ModelConfig
from model.qwen3 import build_model
from model.training import publishable_state_dict
from schemas.events_training import UpdateMetrics
from services.trainer import journal
from services.trainer.config import TrainerConfig
from services.trainer.core import Sample
from services.trainer.dp import StepAborted, dp_grpo_step
from services.trainer.update import (
    StepOptions,
    TrainState,
    load_state,
    load_weights_file,
)

COLLECTIVE_TIMEOUT_S = 120.0
"""A collective (or the group's start) waiting longer than this fails: a rank hangs."""
_PR_SET_PDEATHSIG = 1


class RankLost(FatalError):
    """A rank of the trainer's process group died or its collective failed."""


@dataclass(frozen=True)
class _RankArgs:
    rank: int
    world: int
    port: int
    parent: int
    config: TrainerConfig
    model: ModelConfig
    checkpoint: Path
    backend: str


@dataclass(frozen=True)
class _Step:
    step: int
    version: int
    samples: list[Sample]
    older: dict[int, dict[str, torch.Tensor] | None]
    """Weights of the older versions the batch's tokens came from (None: gone)."""


def backend() -> str:
    """nccl where the trainer's tensors are on CUDA; this trainer trains on the CPU: gloo."""
    return "gloo"


class Ranks:
    """Rank 0's handle on the group (the module doc)."""

    def __init__(
        self, world: int, procs: Sequence[BaseProcess], conns: list[Any], store: dist.TCPStore
    ) -> None:
        self.world, self.procs, self.conns, self.store = world, procs, conns, store
        self.closing = threading.Event()

    @classmethod
    def spawn(cls, config: TrainerConfig, model: ModelConfig, checkpoint_dir: Path) -> Ranks:
        """Start ranks 1 … ``procs − 1`` from this thread (their death signal is tied to it:
        call it from the main thread); :meth:`join` then makes the group."""
        found = journal.latest_checkpoint(checkpoint_dir)
        if found is None:
            raise FatalError(f"no checkpoint in {checkpoint_dir} for the ranks to start from")
        world = config.procs
        store = dist.TCPStore(
            "127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )  # fmt: skip
        ctx = mp.get_context("spawn")
        procs, conns = [], []
        for rank in range(1, world):
            ours, theirs = ctx.Pipe()
            args = _RankArgs(
                rank, world, store.port, os.getpid(), config, model, found[1], backend()
            )
            proc = ctx.Process(
                target=rank_main, args=(args, theirs), name=f"trainer-rank-{rank}", daemon=True
            )
            proc.start()
            theirs.close()
            procs.append(proc)
            conns.append(ours)
        return cls(world, procs, conns, store)

    def join(self) -> None:
        """Rank 0 joins the group (blocks until every rank has)."""
        _init_group(0, self.world, self.store, backend())

    def grpo_step(
        self, state: TrainState, samples: Sequence[Sample], **options: Unpack[StepOptions]
    ) -> UpdateMetrics:
        """``update.grpo_step`` on the whole group; ``RankLost`` when a rank is gone."""
        generating = options.get("generating")
        versions = {v for s in samples for v in s.model_versions() if v != state.version}
        older = {v: _weights(generating(v) if generating else None) for v in sorted(versions)}
        cmd = _Step(state.step, state.version, list(samples), older)
        try:
            for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), 1):
                if not proc.is_alive():
                    raise RankLost(f"trainer rank {rank} died (exit code {proc.exitcode})")
                conn.send(cmd)
            return dp_grpo_step(state, samples, rank=0, world=self.world, **options)
        except (RuntimeError, OSError) as exc:  # a collective or a pipe to a dead rank
            raise RankLost(f"the trainer's process group failed: {exc}"[:500]) from exc

    def wait_lost(self) -> str:
        """Block until a rank exits (unless :meth:`close` stops it); what happened."""
        sentinels = [p.sentinel for p in self.procs]
        while not self.closing.is_set():
            if mpc.wait(sentinels, timeout=0.5):
                dead = [(r, p) for r, p in enumerate(self.procs, 1) if not p.is_alive()]
                if dead and not self.closing.is_set():
                    return ", ".join(f"rank {r} exited ({p.exitcode})" for r, p in dead)
        return ""

    def close(self) -> None:
        """Stop the ranks (asked over their pipes, then killed) and leave the group (after an
        orderly stop: a group that lost a rank is left to the exiting process)."""
        self.closing.set()
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()
        if dist.is_initialized() and all(p.exitcode == 0 for p in self.procs):
            dist.destroy_process_group()  # orderly; after a loss a step may still hold it


def _weights(model: Any) -> dict[str, torch.Tensor] | None:
    return None if model is None else publishable_state_dict(model)


def _init_group(rank: int, world: int, store: Any, name: str) -> None:
    dist.init_process_group(
        name, store=store, rank=rank, world_size=world,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )  # fmt: skip


def _die_with_parent(parent: int) -> None:
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the trainer died before the death signal was set
        os._exit(1)


def rank_main(args: _RankArgs, conn: Any) -> None:
    """Rank ``args.rank``: join the group, load the checkpoint, then compute its share of every
    step rank 0 sends, until rank 0 says stop or is gone."""
    _die_with_parent(args.parent)
    c = args.config
    torch.set_num_threads(c.threads)
    store = dist.TCPStore(
        "127.0.0.1", args.port, args.world, is_master=False,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )  # fmt: skip
    ref = None
    if c.grpo.beta > 0:
        ref = load_weights_file(Path(c.checkpoint_dir).resolve() / journal.REFERENCE)
    state, _ = load_state(
        args.checkpoint, args.model, c.optim, deterministic=c.deterministic, reference=ref
    )
    _init_group(args.rank, args.world, store, args.backend)  # joined: ready for steps
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            break
        if cmd is None:
            break
        if cmd.step != state.step:
            print(f"trainer rank {args.rank}: at step {state.step}, sent step {cmd.step}",
                  file=sys.stderr)  # fmt: skip
            raise SystemExit(1)
        state.version = cmd.version
        older = {
            v: None if t is None else build_model(args.model, t, deterministic=c.deterministic)
            for v, t in cmd.older.items()
        }
        with contextlib.suppress(StepAborted):  # rank 0 decides what the failure means
            dp_grpo_step(
                state, cmd.samples, group_size=c.group_size, grpo=c.grpo, optim=c.optim,
                pad_id=c.pad_token_id, generating=older.get, rank=args.rank, world=args.world,
            )  # fmt: skip
    dist.destroy_process_group()
