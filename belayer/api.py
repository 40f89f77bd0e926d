"""``belayer.Node`` and ``belayer.AsyncNode``: a node to use from Python — attach to the one
running from a run directory or start one, then generate, roll out, train and follow events
over its bus, as the CLI does (the same library calls: ``services/rl``, the services' clients).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from belayer.observe import UnknownEvent, event_history, node_status
from common import subjects
from common.codec import decode
from common.errors import BelayerError, InvalidRequest, NotFound
from common.node import read_node
from schemas.events import AnyEvent, EventBase
from schemas.rollout import RolloutAccepted, RolloutRequest, RolloutResult
from schemas.serving import GenerateRequest, GenerateResult, SamplingParams, TokenDelta
from services.controller.client import parse_inject, submit, wait
from services.rl.node import NodeHandle, launch, open_bus, running_node, shut_down
from services.rl.options import RunOptions
from services.rl.run import execute, run_paths
from services.router.client import generate as router_generate
from services.supervisor.client import SupervisorConfig
from workloads.table import dataset_workload

T = TypeVar("T")


def dataset_path(workload: str, dataset: str | Path, prompt_column: str, answer_column: str) -> str:
    """``dataset`` as the controller reads it (absolute: its working directory is not ours);
    ``InvalidRequest`` for columns without a dataset or for a sandbox workload."""
    path = str(Path(dataset).resolve()) if dataset else ""
    dataset_workload(workload, path, prompt_column, answer_column)
    return path


class AsyncNode:
    """A Belayer node, used from asyncio code (``async with AsyncNode(...) as node``).

    ``run_dir``: the node's run directory (default ``$BELAYER_HOME``, else ``./.belayer``).
    A node already running there is attached to and left running; otherwise, with ``start``
    (the default), one is started with the other arguments (``belayer up``'s) and stopped on
    exit unless ``keep``. With ``training``, its trainer trains ``tasks`` × ``n`` trajectories
    per step (default: the trainer's, 2 × 4), the shape ``run`` must then use."""

    def __init__(
        self,
        run_dir: str | Path | None = None,
        *,
        start: bool = True,
        keep: bool = False,
        engines: int = 1,
        model: str | Path | None = None,
        training: bool = False,
        n: int | None = None,
        tasks: int | None = None,
        environment: bool = False,
        workload_plugins: Sequence[str] = (),
        reward_functions: Sequence[str] = (),
        timeout: float = 300.0,
    ) -> None:
        self.paths = run_paths(Path(run_dir) if run_dir else None)
        self.start, self.keep, self.timeout = start, keep, timeout
        base = SupervisorConfig()
        self.config = dataclasses.replace(
            base, run_dir=str(self.paths.root), engines=engines,
            model_dir=str(Path(model).resolve()) if model else "", training=training,
            environment=environment, ready_timeout_s=timeout,
            trainer=dataclasses.replace(
                base.trainer, group_size=n or base.trainer.group_size,
                groups_per_step=tasks or base.trainer.groups_per_step,
            ),
            controller=dataclasses.replace(
                base.controller, workload_plugins=tuple(workload_plugins),
                reward_functions=tuple(reward_functions),
            ),
        )  # fmt: skip
        self.handle: NodeHandle | None = None
        self.nc: Any = None
        self.url = ""
        self._borrowed = False

    @classmethod
    def over(cls, nc: Any, *, url: str = "", run_dir: str | Path | None = None) -> AsyncNode:
        """A node reached over a bus connection the caller opened (``url``, with its own
        credentials) and closes: this object starts, stops and disconnects nothing. The CLI's
        commands are built on it."""
        node = cls(run_dir, start=False)
        node.nc, node.url, node._borrowed = nc, url, True
        return node

    # --- lifetime ---------------------------------------------------------------------------
    async def open(self) -> AsyncNode:
        """Attach to the running node or start one; connect to its bus."""
        info = running_node(self.paths)
        ours = False
        if info is None:
            if not self.start:
                raise NotFound("no node is running here", run_dir=str(self.paths.root))
            # Not kept: the node stops itself if this process dies without closing it.
            config = dataclasses.replace(self.config, owner_pid=0 if self.keep else os.getpid())
            info = await asyncio.to_thread(launch, config, self.paths, self.timeout)
            ours = True
        self.handle = NodeHandle(self.paths, info, ours=ours)
        self.nc, self.url = await open_bus(self.handle), info.nats_url
        return self

    async def close(self) -> None:
        """Disconnect; stop the node if this object started it (and ``keep`` is off)."""
        if self.nc is not None and not self._borrowed:
            await self.nc.drain()
        self.nc = None
        if self.handle is not None and self.handle.ours and not self.keep:
            await asyncio.to_thread(shut_down, self.paths, timeout=60.0, keep=False)
        self.handle = None

    async def __aenter__(self) -> AsyncNode:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def started(self) -> bool:
        """Whether this object started the node (rather than attaching to a running one)."""
        return bool(self.handle and self.handle.ours)

    def _bus(self) -> Any:
        if self.nc is None:
            raise InvalidRequest("the node is not open: use `with belayer.Node(...)` or open()")
        return self.nc

    # --- work -------------------------------------------------------------------------------
    async def status(self) -> dict[str, Any]:
        """The node's readiness, processes (name, pid, alive, restarts), engines (id, epoch,
        worker pid, health …) and router (``belayer status --json``: ``belayer.observe.
        node_status``); while its router restarts, ``state`` is ``degraded``, not an error."""
        return await node_status(self._bus(), url=self.url, node=read_node(self.paths))

    async def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        request_id: str | None = None,
        on_tokens: Any = None,
        timeout: float = 300.0,
        engine: str | None = None,
    ) -> GenerateResult:
        """Generate from a text prompt or token ids; rides through worker and router failures
        (the same request id is resumed, never generated twice). ``on_tokens(token_ids)``
        receives each new piece as it streams; ``engine`` pins the request to that engine."""
        sampling = SamplingParams(
            temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed,
            ignore_eos=ignore_eos,
        )  # fmt: skip
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, list(prompt))
        req = GenerateRequest(
            request_id=request_id or f"py-{uuid.uuid4().hex[:16]}", prompt=text,
            prompt_token_ids=ids, sampling=sampling, stream=on_tokens is not None,
            engine_id=engine,
        )  # fmt: skip

        def delta(d: TokenDelta) -> None:
            on_tokens(list(d.token_ids))

        return await self.generate_request(
            req, timeout=timeout, on_delta=delta if on_tokens else None
        )

    async def generate_request(
        self,
        req: GenerateRequest,
        *,
        timeout: float = 300.0,
        on_delta: Callable[[TokenDelta], None] | None = None,
    ) -> GenerateResult:
        """``generate`` for a request the caller built (``belayer generate`` builds one from
        its flags): the router's answer, ``on_delta`` called with each streamed piece."""
        return await router_generate(self._bus(), req, timeout=timeout, on_delta=on_delta)

    async def rollout(
        self,
        workload: str,
        *,
        tasks: int = 4,
        n: int = 1,
        seed: int = 0,
        temperature: float = 1.0,
        max_tokens: int = 256,
        max_turns: int = 20,
        inject: str = "",
        rewards: Sequence[str] = (),
        reward_weights: Sequence[float] = (),
        timeout: float = 3600.0,
        dataset: str | Path = "",
        prompt_column: str = "",
        answer_column: str = "",
    ) -> RolloutResult:
        """Run ``tasks`` × ``n`` trajectories of ``workload`` on the node's controller and wait
        for them (``belayer rollout``; ``dataset`` and its columns as ``--dataset``,
        ``--prompt-column``, ``--answer-column``)."""
        try:
            faults = parse_inject(inject)
        except ValueError as exc:
            raise InvalidRequest(f"inject: {exc}") from None
        path = dataset_path(workload, dataset, prompt_column, answer_column)
        req = RolloutRequest(
            workload=workload, tasks=tasks, n=n, seed=seed, max_turns=max_turns, inject=faults,
            dataset=path, prompt_column=prompt_column, answer_column=answer_column,
            sampling=SamplingParams(temperature=temperature, max_tokens=max_tokens),
            rewards=list(rewards), reward_weights=list(reward_weights),
        )  # fmt: skip
        return await self.rollout_request(req, timeout=timeout)

    async def rollout_request(
        self,
        req: RolloutRequest,
        *,
        timeout: float = 3600.0,
        on_accepted: Callable[[RolloutAccepted], None] | None = None,
        on_progress: Callable[[RolloutResult], None] | None = None,
    ) -> RolloutResult:
        """``rollout`` for a request the caller built (``belayer rollout`` builds one from its
        flags: recovery policy, task ids, deadlines …): submitted (idempotent by
        ``rollout_id``), then followed to its end, ``on_progress`` called as it changes."""
        nc = self._bus()
        accepted = await submit(nc, req)
        if on_accepted is not None:
            on_accepted(accepted)
        return await wait(nc, accepted.rollout_id, timeout=timeout, on_progress=on_progress)

    async def run(self, workload: str, *, steps: int = 20, **options: Any) -> dict[str, Any]:
        """A GRPO training run on this node (``belayer run``: ``options`` are ``RunOptions``'
        fields — ``tasks``, ``n``, ``seed``, ``inject``, ``held_out``, ``out`` …); returns the
        report (the run's ``report.json``). The node must have been started with
        ``training=True``."""
        fields = {f.name for f in dataclasses.fields(RunOptions)}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise InvalidRequest("unknown run option", unknown=unknown, known=sorted(fields))
        opts = RunOptions(workload=workload, steps=steps, node_dir=self.paths.root, **options)
        report, _ = await asyncio.to_thread(train, opts)
        return report

    def events(self, kinds: Sequence[str] | None = None) -> EventStream:
        """Every event published from now on (``kinds``: only these, e.g.
        ``handover_complete``, ``failure_recovered``) as typed objects: ``async for ev in
        node.events(...)`` subscribes at the first iteration; ``async with node.events(...) as
        stream`` subscribes at once (nothing published after that is missed)."""
        return EventStream(self._bus(), kinds)

    def history(
        self, kind: str = "", *, follow: bool = False, duration: float = 0.0
    ) -> AsyncIterator[EventBase | UnknownEvent]:
        """The node's events from the start of its ``EVENTS`` stream (``belayer events``):
        ``kind`` only that kind; ``follow``: then the new ones, for ``duration`` seconds (0:
        until the caller stops). An event this version cannot decode comes as an
        ``UnknownEvent``."""
        return event_history(self._bus(), kind=kind, follow=follow, duration=duration)


def train(
    options: RunOptions, *, say: Callable[[str], object] = lambda _line: None, ui: Any = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A GRPO training run as ``options`` say (``belayer run``; ``AsyncNode.run`` on a node):
    on the node of ``options.node_dir`` (or ``$BELAYER_HOME`` / ``./.belayer``), else one it
    starts for the run. Returns the report and the per-step records; ``say`` gets progress
    lines, ``ui`` the per-phase progress (``services.rl.run.execute``'s)."""
    return execute(options, say=say, ui=ui)


class EventStream:
    """A live subscription to the node's events (``AsyncNode.events``)."""

    def __init__(self, nc: Any, kinds: Sequence[str] | None) -> None:
        self.nc, self.kinds = nc, list(kinds or ())
        self.queue: asyncio.Queue[EventBase] = asyncio.Queue()
        self.subs: list[Any] | None = None

    async def start(self) -> EventStream:
        """Subscribe (once)."""
        if self.subs is None:
            wanted = [subjects.event(k) for k in self.kinds] or [subjects.EVENTS_ALL]
            self.subs = [await self.nc.subscribe(subject, cb=self._on) for subject in wanted]
        return self

    async def _on(self, msg: Any) -> None:
        try:
            self.queue.put_nowait(decode(msg.data, AnyEvent))
        except BelayerError:
            pass  # a kind this version does not know

    async def close(self) -> None:
        for sub in self.subs or []:
            await sub.unsubscribe()
        self.subs = []

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> EventBase:
        await self.start()
        return await self.queue.get()

    async def __aenter__(self) -> EventStream:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class Node:
    """``AsyncNode`` for synchronous code (scripts, notebooks): the same arguments and methods,
    run on a private event loop thread. ``events`` is a plain iterator (``timeout``: stop after
    that long without an event)."""

    def __init__(self, run_dir: str | Path | None = None, **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="belayer-node", daemon=True
        )
        self._thread.start()
        self._node = AsyncNode(run_dir, **options)
        self._streams: set[EventStream] = set()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if not self._loop.is_running():
            coro.close()
            raise InvalidRequest("this belayer.Node is closed")
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result()

    def open(self) -> Node:
        try:
            self._call(self._node.open())
        except BaseException:
            self.close()  # nothing to attach to: the private loop ends too
            raise
        return self

    def close(self) -> None:
        """Close the event streams still open, disconnect, stop the node if this object
        started it; then the private loop ends."""
        if not self._loop.is_running():
            return
        try:
            for stream in list(self._streams):
                self._call(stream.close())
            self._call(self._node.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()

    def __enter__(self) -> Node:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def started(self) -> bool:
        return self._node.started

    @property
    def run_dir(self) -> Path:
        return self._node.paths.root

    def status(self) -> dict[str, Any]:
        return self._call(self._node.status())

    def generate(self, prompt: str | Sequence[int], **options: Any) -> GenerateResult:
        return self._call(self._node.generate(prompt, **options))

    def rollout(self, workload: str, **options: Any) -> RolloutResult:
        return self._call(self._node.rollout(workload, **options))

    def run(self, workload: str, **options: Any) -> dict[str, Any]:
        return self._call(self._node.run(workload, **options))

    def history(
        self, kind: str = "", *, follow: bool = False, duration: float = 0.0
    ) -> Iterator[EventBase | UnknownEvent]:
        """``AsyncNode.history`` as a plain iterator."""
        events = self._node.history(kind, follow=follow, duration=duration)

        async def step() -> EventBase | UnknownEvent:
            return await anext(events)

        while True:
            try:
                yield self._call(step())
            except StopAsyncIteration:
                return

    def events(
        self, kinds: Sequence[str] | None = None, *, timeout: float | None = None
    ) -> Iterator[EventBase]:
        """The events from this call on (subscribed before it returns), as a plain iterator;
        it ends after ``timeout`` seconds without an event (None: never)."""
        stream = self._call(self._node.events(kinds).start())
        self._streams.add(stream)

        def iterate() -> Iterator[EventBase]:
            try:
                while True:
                    try:
                        yield self._call(asyncio.wait_for(stream.queue.get(), timeout))
                    except TimeoutError:
                        return
            finally:
                self._streams.discard(stream)
                if self._loop.is_running():
                    self._call(stream.close())

        return iterate()
