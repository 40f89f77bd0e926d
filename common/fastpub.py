"""A minimal, synchronous NATS publisher for one hot thread (the engine loop).

The rollout worker produces one ``StepBatch`` per engine step (hundreds per second). Handing
each to the asyncio client costs a thread hop and several event-loop turns per step, which on a
2-core machine steals the engine thread's CPU. This publisher speaks the NATS client protocol
(``CONNECT``/``PUB``/``PING``/``PONG``) over its own TCP connection, used only from the thread
that owns it: a publish is one ``sendall``. Everything else stays on nats-py.
"""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlparse

from common.errors import BusUnavailable


class FastPublisher:
    """Publish-only NATS connection. Not thread-safe: one owner thread calls every method."""

    def __init__(self, url: str, *, name: str, timeout: float = 5.0) -> None:
        self.url = url
        self.name = name
        self.timeout = timeout
        self.sock: socket.socket | None = None
        self._buf = b""
        self.connect()

    def connect(self) -> None:
        u = urlparse(self.url)
        host, port = u.hostname or "127.0.0.1", u.port or 4222
        try:
            sock = socket.create_connection((host, port), timeout=self.timeout)
            info = self._read_line(sock)
            if not info.startswith(b"INFO "):
                raise BusUnavailable(
                    "unexpected NATS greeting", got=info[:40].decode(errors="replace")
                )
            opts = {"verbose": False, "pedantic": False, "name": self.name, "lang": "python-fastpub",
                    "version": "1", "protocol": 1, "headers": False, "no_responders": False}  # fmt: skip
            sock.sendall(b"CONNECT " + json.dumps(opts).encode() + b"\r\nPING\r\n")
            reply = self._read_line(sock)
            if reply != b"PONG":
                raise BusUnavailable(
                    "NATS refused the connection", reply=reply.decode(errors="replace")
                )
        except OSError as exc:
            raise BusUnavailable(f"cannot reach NATS at {self.url}: {exc}", url=self.url) from None
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock

    @staticmethod
    def _read_line(sock: socket.socket) -> bytes:
        data = b""
        while not data.endswith(b"\r\n"):
            chunk = sock.recv(4096)
            if not chunk:
                raise BusUnavailable("NATS closed the connection")
            data += chunk
        return data.split(b"\r\n", 1)[0]

    def publish(self, subject: str, payload: bytes) -> None:
        """Send one message (reconnects once if the connection broke)."""
        frame = b"PUB %s %d\r\n%s\r\n" % (subject.encode(), len(payload), payload)
        for attempt in (0, 1):
            try:
                if self.sock is None:
                    self.connect()
                assert self.sock is not None
                self._send(frame)
                return
            except (OSError, BusUnavailable):
                self.close()
                if attempt:
                    raise
                time.sleep(0.05)  # one bounded retry after a broken connection

    def _send(self, frame: bytes) -> None:
        assert self.sock is not None
        view = memoryview(frame)
        deadline = time.monotonic() + self.timeout
        while view:
            try:
                n = self.sock.send(view)
                view = view[n:]
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError("NATS socket stayed full") from None
                time.sleep(0.0005)  # kernel buffer full: wait for the server to read

    def poll(self) -> None:
        """Answer the server's keep-alive PINGs; call it every loop turn (non-blocking)."""
        if self.sock is None:
            return
        try:
            data = self.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            self.close()
            return
        if not data:
            self.close()
            return
        self._buf += data
        while b"\r\n" in self._buf:
            line, self._buf = self._buf.split(b"\r\n", 1)
            if line == b"PING":
                self._send(b"PONG\r\n")

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None
