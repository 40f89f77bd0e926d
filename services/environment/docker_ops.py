"""Docker operations (blocking; the service calls them through ``asyncio.to_thread``).

Docker stays the container manager: containers are created, started (also from a checkpoint),
exec'd into, killed and removed through dockerd's API. Every Docker/requests exception is
translated into ``SandboxError`` here, with "dockerd is not reachable" when the socket is dead.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import struct
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import docker
import docker.errors
import requests.exceptions

from common.errors import Conflict, NotFound, SandboxError
from services.environment.config import EnvConfig
from services.environment.core import Limits
from services.environment.criu_ops import container_freezer, is_frozen, thaw

T = TypeVar("T")

LABEL_SANDBOX = "belayer.sandbox"
LABEL_NODE = "belayer.node"
LABEL_RUN = "belayer.run"
"""Stable owner label (``EnvConfig.run_key``, from the run directory): the same in every run."""
INIT_SLEEP = ("sleep", "1000")
"""The one child PID 1 keeps (its argv)."""
# PID 1 of every sandbox: a shell that reaps orphans and exits on SIGTERM.
INIT_COMMAND = [
    "/bin/sh",
    "-c",
    f"trap 'exit 0' TERM; while :; do {' '.join(INIT_SLEEP)} & wait $!; done",
]
RACE_MARKERS = ("already exists", "content sha256")
NOBODY = 65534
THAW_POLL_S = 0.05
"""How often ``remove`` thaws a frozen container again while Docker removes it."""


@dataclass(frozen=True)
class ExecOutput:
    stdout: bytes
    stderr: bytes
    exit_code: int
    duration_s: float
    truncated: bool
    timed_out: bool


@contextmanager
def translate(op: str, **ctx: Any) -> Iterator[None]:
    """Docker/requests exceptions → Belayer errors."""
    try:
        yield
    except docker.errors.NotFound as exc:
        raise NotFound(f"{op}: no such container or image", error=_explain(exc), **ctx) from None
    except docker.errors.APIError as exc:
        if exc.status_code == 409 and "is paused" in _explain(exc):
            raise Conflict(
                f"{op}: the sandbox is paused (docker pause): unpause it first",
                state="paused",
                **ctx,
            ) from None
        raise SandboxError(f"{op} failed: {_explain(exc)}", **ctx) from None
    except (requests.exceptions.ConnectionError, docker.errors.DockerException, OSError) as exc:
        raise SandboxError(
            f"{op}: dockerd is not reachable ({type(exc).__name__}); is it running? "
            "(deploy/install_env.sh starts it)",
            **ctx,
        ) from None


def _explain(exc: Exception) -> str:
    text = getattr(exc, "explanation", None) or str(exc)
    return str(text)[:500]


class DockerOps:
    """Thin, typed wrapper over the Docker SDK for sandboxes."""

    def __init__(self, config: EnvConfig) -> None:
        self.config = config
        self._client: docker.DockerClient | None = None
        self._root: str | None = None

    @property
    def client(self) -> docker.DockerClient:
        if self._client is None:
            with translate("connect"):
                self._client = docker.DockerClient(
                    base_url=self.config.docker_url,
                    version="auto",
                    timeout=int(self.config.docker_timeout_s),
                )
        return self._client

    @property
    def api(self) -> docker.APIClient:
        return self.client.api

    def ping(self) -> None:
        with translate("ping"):
            self.api.ping()

    def reachable(self) -> bool:
        try:
            self.ping()
        except SandboxError:
            return False
        return True

    def runtimes(self) -> dict[str, dict[str, Any]]:
        """The OCI runtimes dockerd has registered (name → ``{"path": …}``)."""
        with translate("info"):
            return dict(self.api.info().get("Runtimes") or {})

    # --- lifecycle ----------------------------------------------------------------------
    def create(
        self, sandbox_id: str, image: str, limits: Limits, runtime: str | None = None
    ) -> str:
        """Create (not start) a locked-down container (under ``runtime``, default: dockerd's);
        returns its id."""
        host_config = self.api.create_host_config(
            network_mode="none",
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            pids_limit=limits.pids,
            mem_limit=f"{limits.memory_mb}m",
            memswap_limit=f"{limits.memory_mb}m",
            nano_cpus=int(limits.cpus * 1e9),
            log_config={"Type": "none", "Config": {}},
            ipc_mode="private",
            runtime=runtime,
        )
        with translate("create", sandbox_id=sandbox_id, image=image):
            resp = self.api.create_container(
                image,
                command=INIT_COMMAND,
                hostname="sandbox",
                working_dir="/root",
                labels={
                    LABEL_SANDBOX: sandbox_id,
                    LABEL_NODE: self.config.node,
                    LABEL_RUN: self.config.run_key,
                },
                host_config=host_config,
                network_disabled=True,
            )
        return str(resp["Id"])

    def start(self, container_id: str, checkpoint: str | None = None) -> None:
        """Start; with ``checkpoint``, restore from ``<container dir>/checkpoints/<name>``
        (retrying Docker's content-store race, moby#42900)."""
        params = {"checkpoint": checkpoint} if checkpoint else {}
        url = self.api._url("/containers/{0}/start", container_id)

        def go() -> None:
            with translate("start", container_id=container_id):
                self.api._raise_for_status(self.api._post(url, params=params))

        self._retry_race(go)
        self.seal_host_files(container_id)

    def seal_host_files(self, container_id: str) -> None:
        """Make the files Docker bind-mounts from the host (``/etc/hosts``, ``/etc/hostname``,
        ``/etc/resolv.conf``) read-only inside: owned by ``nobody``, mode 0444 — a sandbox's
        root has no capability to override that. They lie outside the writable layer, so a
        write there would reach the host and escape the checkpoint."""
        try:
            info = self.inspect(container_id)
        except (NotFound, SandboxError):
            return
        for key in ("HostsPath", "HostnamePath", "ResolvConfPath"):
            path = info.get(key) or ""
            if path:
                with contextlib.suppress(OSError):
                    os.chown(path, NOBODY, NOBODY)
                    os.chmod(path, 0o444)

    def _retry_race(self, fn: Callable[[], T]) -> T:
        for attempt in range(self.config.docker_race_retries + 1):
            try:
                return fn()
            except SandboxError as exc:
                race = any(m in str(exc) for m in RACE_MARKERS)
                if not race or attempt >= self.config.docker_race_retries:
                    raise
                time.sleep(self.config.docker_race_delay_s)
        raise AssertionError("unreachable")

    def inspect(self, container_id: str) -> dict[str, Any]:
        with translate("inspect", container_id=container_id):
            return dict(self.api.inspect_container(container_id))

    def exists(self, container_id: str) -> bool:
        try:
            self.inspect(container_id)
        except NotFound:
            return False
        return True

    def upper_dir(self, container_id: str) -> str:
        info = self.inspect(container_id)
        upper = info.get("GraphDriver", {}).get("Data", {}).get("UpperDir")
        if not upper:
            raise SandboxError("container has no overlay upper dir", container_id=container_id)
        return str(upper)

    def container_dir(self, container_id: str) -> str:
        """``/var/lib/docker/containers/<id>`` (where Docker expects checkpoints)."""
        if self._root is None:
            with translate("info"):
                self._root = str(self.api.info()["DockerRootDir"])
        return os.path.join(self._root, "containers", container_id)

    def remove(self, container_id: str) -> None:
        """Force-remove (kills first); a missing container is fine. A frozen container is
        thawed by hand first: a ``docker pause`` that lands while an exec is starting leaves
        that exec's ``runc init`` stuck in the frozen cgroup, and Docker's own kill, unpause
        and inspect of the container then wait for it forever. The container goes anyway, so
        whatever the thaw lets run has no effect that outlives it."""
        control = container_freezer(container_id)
        if control is None or not is_frozen(control):
            self._remove(container_id)
            return
        # A pause Docker has queued behind the stuck exec freezes the cgroup again once the
        # exec is through: keep the cgroup thawed until the removal is done.
        removed = threading.Event()

        def keep_thawed() -> None:
            while not removed.is_set():
                if is_frozen(control):
                    thaw(control)
                removed.wait(THAW_POLL_S)

        thawer = threading.Thread(target=keep_thawed, name="thaw-for-remove", daemon=True)
        thawer.start()
        try:
            self._remove(container_id)
        finally:
            removed.set()
            thawer.join()

    def _remove(self, container_id: str) -> None:
        try:
            with translate("remove", container_id=container_id):
                self.api.remove_container(container_id, force=True, v=True)
        except NotFound:
            pass

    def kill(self, container_id: str) -> None:
        with translate("kill", container_id=container_id):
            self.api.kill(container_id)

    def paused(self, container_id: str) -> bool:
        """Whether Docker has the container paused, from its container list (unlike inspect,
        the list answers while an exec caught by the pause holds the container)."""
        with translate("paused", container_id=container_id):
            rows = self.api.containers(all=True, filters={"id": container_id})
        return bool(rows) and rows[0].get("State") == "paused"

    def pause(self, container_id: str) -> None:
        with translate("pause", container_id=container_id):
            self.api.pause(container_id)

    def unpause(self, container_id: str) -> None:
        with translate("unpause", container_id=container_id):
            self.api.unpause(container_id)

    def put_files(self, container_id: str, files: list[tuple[str, bytes, int]]) -> None:
        """Write ``(absolute path, content, mode)`` files into the container's file system."""
        if not files:
            return
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            for path, content, mode in files:
                info = tarfile.TarInfo(path.lstrip("/"))
                info.size = len(content)
                info.mode = mode
                info.mtime = int(time.time())
                tf.addfile(info, io.BytesIO(content))
        with translate("put_files", container_id=container_id):
            self.api.put_archive(container_id, "/", buf.getvalue())

    def labelled(self) -> list[tuple[str, str]]:
        """``(container id, sandbox id)`` of every sandbox container of this run directory
        (``belayer.run``, the same in every run) or of this node (``belayer.node``)."""
        found: dict[str, str] = {}
        for label in (f"{LABEL_RUN}={self.config.run_key}", f"{LABEL_NODE}={self.config.node}"):
            with translate("list"):
                items = self.api.containers(all=True, filters={"label": [label]})
            for c in items:
                found[c["Id"]] = c.get("Labels", {}).get(LABEL_SANDBOX, "")
        return list(found.items())

    # --- Docker's own checkpoint API (the fallback path) --------------------------------
    def checkpoint_create(self, container_id: str, name: str, directory: str) -> None:
        body = {"CheckpointID": name, "CheckpointDir": directory, "Exit": False}
        url = self.api._url("/containers/{0}/checkpoints", container_id)

        def go() -> None:
            with translate("docker checkpoint", container_id=container_id):
                self.api._raise_for_status(self.api._post_json(url, data=body))

        self._retry_race(go)

    # --- exec ---------------------------------------------------------------------------
    def exec(
        self, container_id: str, command: str, *, timeout_s: float, cap: int, workdir: str = ""
    ) -> ExecOutput:
        """Run ``sh -c command`` under GNU ``timeout`` (which kills the command's whole process
        group), reading at most ``cap`` bytes of each stream; past ``4·cap`` bytes the command
        is killed. A host-side deadline bounds the wait even if the stream never closes."""
        argv = ["timeout", "-s", "KILL", f"{timeout_s:.3f}", "sh", "-c", command]
        before = self.procs(container_id)
        start = time.monotonic()
        with translate("exec", container_id=container_id):
            ex = self.api.exec_create(
                container_id, argv, stdout=True, stderr=True, workdir=workdir or None
            )
            sock = self.api.exec_start(ex["Id"], socket=True)
        raw = _raw_socket(sock)
        early = _buffered(sock, raw)
        out, err = bytearray(), bytearray()
        truncated = False
        killed = False
        deadline = start + timeout_s + 5.0
        frozen = container_freezer(container_id)

        def paused() -> bool:  # read on each second of silence: a stat, Docker only if frozen
            return frozen is not None and is_frozen(frozen) and self.paused(container_id)

        try:
            for stream, chunk in _frames(raw, deadline, stop=paused, early=early):
                target = out if stream == 1 else err
                room = cap - len(target)
                if room > 0:
                    target += chunk[:room]
                if len(chunk) > room:
                    truncated = True
                    if not killed:
                        killed = self._kill_exec(ex["Id"])
        finally:
            try:
                sock.close()
            except OSError:
                pass
        if time.monotonic() < deadline and paused():
            # Paused as the command ran (or as it started: its runc init is stuck in the frozen
            # cgroup, and Docker's inspect of it would wait too): the sandbox's failure.
            raise Conflict(
                "exec: the sandbox was paused (docker pause) while the command ran",
                state="paused",
                container_id=container_id,
            )
        with translate("exec_inspect", container_id=container_id):
            info = self.api.exec_inspect(ex["Id"])
            if info.get("Running"):
                self._kill_exec(ex["Id"])
                info = self.api.exec_inspect(ex["Id"])
        duration = time.monotonic() - start
        code = info.get("ExitCode")
        code = -1 if code is None else int(code)
        timed_out = not killed and (code in (124, 137) and duration >= timeout_s * 0.95)
        if time.monotonic() > deadline:
            timed_out = True
        if (timed_out or killed) and before is not None:
            self._kill_new(container_id, before)
        return ExecOutput(bytes(out), bytes(err), code, duration, truncated, timed_out)

    def procs(self, container_id: str) -> set[int] | None:
        """Host pids of every process in the container's pid namespace (``None`` when
        unreadable). The namespace, not the cgroup, so that cgroup v1 and v2 read alike."""
        try:
            init = int(self.inspect(container_id).get("State", {}).get("Pid") or 0)
            ns = os.readlink(f"/proc/{init}/ns/pid") if init > 0 else ""
        except (OSError, NotFound, SandboxError):
            return None
        if not ns:
            return None
        out: set[int] = set()
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.readlink(f"/proc/{entry}/ns/pid") == ns:
                        out.add(int(entry))
                except OSError:
                    pass  # exited while we looked
        return out

    def _kill_new(self, container_id: str, before: set[int]) -> None:
        """SIGKILL every process of the container that a killed exec started: ``timeout``
        kills its process group, but a child that called ``setsid`` (or was reparented to
        the sandbox's init) left that group. Processes from earlier actions stay."""
        for _ in range(3):  # a process forking while we sweep: sweep again
            now = self.procs(container_id)
            new = (now or set()) - before
            if not new:
                return
            for pid in new:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def _kill_exec(self, exec_id: str) -> bool:
        """SIGKILL the exec's process group (the ``timeout`` process leads it)."""
        try:
            pid = int(self.api.exec_inspect(exec_id).get("Pid") or 0)
            if pid > 0:
                os.killpg(pid, signal.SIGKILL)
                return True
        except (ProcessLookupError, PermissionError, docker.errors.APIError):
            pass
        return False


def _raw_socket(sock: Any) -> socket.socket:
    raw = getattr(sock, "_sock", sock)
    return raw


def _buffered(sock: Any, raw: socket.socket) -> bytes:
    """The stream's first bytes, which http.client may already have taken off the socket.

    docker-py hands back the raw socket under the HTTP response, but the response's headers
    were parsed through a buffered reader that reads what the socket holds, up to 8 KiB: a
    command that printed before this thread parsed the headers (a short one, on a loaded
    machine) had its output in that buffer, and reading the raw socket alone lost it — an empty
    observation with exit code 0 (seen in CI: ``cat`` of the repository's files came back
    empty in one run, whole in the other). Read without blocking: what is buffered, or nothing."""
    reader = getattr(
        getattr(getattr(getattr(sock, "_response", None), "raw", None), "_fp", None), "fp", None
    )
    if reader is None or not hasattr(reader, "peek"):
        return b""
    raw.setblocking(False)
    try:
        held = reader.peek()
        return bytes(reader.read(len(held))) if held else b""
    except OSError:
        return b""
    finally:
        raw.setblocking(True)


def _frames(
    sock: socket.socket,
    deadline: float,
    stop: Callable[[], bool] = lambda: False,
    early: bytes = b"",
) -> Iterator[tuple[int, bytes]]:
    """Docker's multiplexed stream: 8-byte header (stream, 0, 0, 0, size BE32) + payload,
    starting with ``early`` (bytes already off the socket, :func:`_buffered`). Ends early when
    ``stop()`` holds after a second of silence."""
    buf = bytearray(early)

    def read(n: int) -> bytes | None:
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            sock.settimeout(min(left, 1.0))
            try:
                data = sock.recv(65536)
            except TimeoutError:
                if stop():
                    return None
                continue
            except OSError:
                return None
            if not data:
                return None
            buf.extend(data)
        chunk = bytes(buf[:n])
        del buf[:n]
        return chunk

    while True:
        header = read(8)
        if header is None:
            return
        stream, size = header[0], struct.unpack(">I", header[4:8])[0]
        payload = read(size)
        if payload is None:
            return
        yield stream, payload
