"""Carrying out injected failures on real things: ``docker kill`` / ``docker pause`` of a
trajectory's sandbox container (the container id comes from ``EnvClient.list``), SIGKILL of a
rollout worker (its pid from ``router.status``), SIGKILL of the controller itself. What fires
when is decided in ``fault_specs.py``."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from nats.aio.client import Client as NATS

from common.errors import BelayerError, NotFound, SandboxError
from common.logging import get_logger
from schemas.serving import RouterStatus
from services.environment.client import EnvClient
from services.router.client import router_status

log = get_logger(component="injector")


NOT_EXITED = "did not receive an exit event"
"""Docker's answer to a kill whose SIGKILL was sent but whose exit it did not see within its
own wait: a container a checkpoint holds frozen dies only once the checkpoint lets go."""


def kill_sent_not_exited(error: str) -> bool:
    """Whether a failed ``docker kill`` (its error text) still delivered the SIGKILL."""
    return NOT_EXITED in error


def docker_fault(kind: str, container_id: str, *, docker_url: str | None = None) -> None:
    """``sandbox-pause``: ``docker pause`` of the container (it hangs); any other ``kind``:
    ``docker kill`` (SIGKILL), waiting (bounded, 10 s) until it is down (a kill Docker reports
    as sent but not exited — :func:`kill_sent_not_exited` — is a kill made). ``docker_url`` is
    dockerd's address (None: the default socket). One function for the controller's injector
    and ``belayer soak``'s sandbox faults."""
    import docker
    import docker.errors

    try:
        client = docker.DockerClient(base_url=docker_url, version="auto", timeout=15)
        try:
            container = client.containers.get(container_id)
            if kind == "sandbox-pause":
                container.pause()
                return
            try:
                container.kill()
            except docker.errors.APIError as exc:
                if not kill_sent_not_exited(str(exc)):
                    raise
                return  # sent; the container exits once what holds it lets go
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline:  # docker kill returns before the exit
                container.reload()
                if container.status != "running":
                    return
                time.sleep(0.02)  # bounded poll of dockerd for the container's exit
        finally:
            client.close()
    except docker.errors.DockerException as exc:
        raise SandboxError(f"{kind} of {container_id[:12]} failed: {exc}") from None


class Injector:
    """Acts on sandboxes, workers and this process."""

    def __init__(self, nc: NATS, env: EnvClient, *, docker_url: str) -> None:
        self.nc = nc
        self.env = env
        self.docker_url = docker_url

    async def container_of(self, sandbox_id: str) -> str:
        """The container id the environment service runs the sandbox in."""
        listing = await self.env.list()
        for sb in listing.sandboxes:
            if sb.id == sandbox_id and sb.container_id:
                return sb.container_id
        raise NotFound("sandbox has no container", sandbox_id=sandbox_id)

    async def sandbox(self, kind: str, sandbox_id: str) -> str:
        """``sandbox-kill``: SIGKILL the container and wait until it is down;
        ``sandbox-pause``: freeze it (``docker pause``: it hangs). Returns the container id."""
        cid = await self.container_of(sandbox_id)
        await asyncio.to_thread(docker_fault, kind, cid, docker_url=self.docker_url)
        return cid

    async def router_status(self) -> RouterStatus:
        return await router_status(self.nc, timeout=5.0)

    async def kill_worker(self) -> tuple[str, int]:
        """SIGKILL the main worker of the up engine running the most requests (ties: the
        first). Returns (engine id, pid). Refused while any engine is down (a second failure
        during a handover would retire the engine)."""
        status = await self.router_status()
        up = [e for e in status.engines if e.healthy and e.worker_pid > 0]
        if not up or len(up) < len(status.engines):
            raise BelayerError("no engine is up for worker-kill (or one is down already)")
        engine = max(up, key=lambda e: (e.running, -int(e.id.lstrip("e") or 0)))
        os.kill(engine.worker_pid, signal.SIGKILL)
        log.warning("worker_killed", engine_id=engine.id, pid=engine.worker_pid)
        return engine.id, engine.worker_pid

    async def wait_engine_back(self, engine_id: str, old_pid: int, timeout: float) -> bool:
        """Until the router lists ``engine_id`` up with a worker other than ``old_pid``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                status = await self.router_status()
                for e in status.engines:
                    if e.id == engine_id and e.healthy and e.worker_pid not in (0, old_pid):
                        return True
            except BelayerError:
                pass
            await asyncio.sleep(0.1)  # bounded poll of the router's registry
        return False

    @staticmethod
    def kill_self() -> None:
        """``controller-kill``: the supervisor restarts the controller, which adopts its
        rollouts from KV."""
        log.warning("controller_killing_itself", pid=os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)
