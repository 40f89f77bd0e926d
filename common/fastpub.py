"""A minimal, synchronous NATS publisher for one hot thread (the engine loop).

The rollout worker produces one ``StepBatch`` per engine step (hundreds per second). Handing
each to the asyncio client costs a thread hop and several event-loop turns per step, which on a
2-core machine steals the engine thread's CPU. This publisher speaks the NATS client protocol
(``CONNECT``/``PUB``/``PING``/``PONG``) over its own TCP connection, used only from the thread
that owns it: a publish is one ``sendall``. Everything else stays on nats-py.
"""

from __future__ import annotations

import base64
import json
import socket
import ssl
import time
from pathlib import Path
from urllib.parse import urlparse

from common.auth import BusConfig, read_seed, redact
from common.bus import tls_context
from common.errors import BusUnavailable, Unauthorized
from common.logging import get_logger

log = get_logger(component="fastpub")

_WOULD_BLOCK = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


def _sign(creds: str | Path, nonce: str) -> dict[str, str]:
    """The CONNECT fields that authenticate as the nkey in ``creds``: its public key and its
    signature of the server's nonce (the seed is read, used and dropped here)."""
    import nkeys

    kp = nkeys.from_seed(bytearray(read_seed(creds)))
    try:
        sig = base64.urlsafe_b64encode(kp.sign(nonce.encode())).rstrip(b"=").decode()
        return {"nkey": kp.public_key.decode(), "sig": sig}
    finally:
        kp.wipe()


class FastPublisher:
    """Publish-only NATS connection. Not thread-safe: one owner thread calls every method.
    Authenticates as ``bus.creds`` (signing the server's nonce with the nkey), speaks TLS when
    the server or ``bus`` asks for it, and fails over between the comma-separated servers of
    ``url``."""

    def __init__(
        self, url: str, *, name: str, bus: BusConfig | None = None, timeout: float = 5.0
    ) -> None:
        self.url = url
        self.servers = [u.strip() for u in url.split(",") if u.strip()]
        self.name = name
        self.bus = bus or BusConfig()
        self.timeout = timeout
        self.sock: socket.socket | None = None
        self._buf = b""
        self._next = 0
        self.connect()

    def connect(self) -> None:
        """Connect to the first server of the list (from the one after the last used) that
        answers; ``Unauthorized`` if one refuses the credentials."""
        errors: list[str] = []
        for i in range(len(self.servers)):
            url = self.servers[(self._next + i) % len(self.servers)]
            try:
                self.sock = self._connect_one(url)
                self._next = (self._next + i) % len(self.servers)
                return
            except BusUnavailable as exc:
                errors.append(str(exc))
        self._next = (self._next + 1) % max(1, len(self.servers))
        raise BusUnavailable(errors[-1] if errors else "no NATS URL given", url=self.url)

    def _connect_one(self, url: str) -> socket.socket:
        u = urlparse(url)
        host, port = u.hostname or "127.0.0.1", u.port or 4222
        try:
            sock: socket.socket = socket.create_connection((host, port), timeout=self.timeout)
            line = self._read_line(sock)
            if not line.startswith(b"INFO "):
                raise BusUnavailable(
                    "unexpected NATS greeting", got=line[:40].decode(errors="replace")
                )
            info = json.loads(line[5:])
            if (
                self.bus.tls_ca
                or self.bus.tls_cert
                or u.scheme == "tls"
                or info.get("tls_required")
            ):
                sock = tls_context(self.bus).wrap_socket(sock, server_hostname=host)
            opts: dict[str, object] = {"verbose": False, "pedantic": False, "name": self.name,
                    "lang": "python-fastpub", "version": "1", "protocol": 1, "headers": False,
                    "no_responders": False}  # fmt: skip
            if self.bus.creds:
                opts.update(_sign(self.bus.creds, str(info.get("nonce", ""))))
            sock.sendall(b"CONNECT " + json.dumps(opts).encode() + b"\r\nPING\r\n")
            reply = self._read_line(sock)
            if reply != b"PONG":
                text = reply.decode(errors="replace")
                if "authorization" in text.lower():
                    raise Unauthorized(f"NATS at {url} refused this connection's credentials")
                raise BusUnavailable("NATS refused the connection", reply=text)
        except (OSError, ValueError) as exc:
            raise BusUnavailable(f"cannot reach NATS at {url}: {exc}", url=url) from None
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

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
                self._next = (self._next + 1) % max(1, len(self.servers))  # fail over
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
            except _WOULD_BLOCK:
                if time.monotonic() > deadline:
                    raise TimeoutError("NATS socket stayed full") from None
                time.sleep(0.0005)  # kernel buffer full: wait for the server to read

    def poll(self) -> None:
        """Answer the server's keep-alive PINGs; call it every loop turn (non-blocking)."""
        if self.sock is None:
            return
        try:
            data = self.sock.recv(65536)
        except _WOULD_BLOCK:
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
            elif line.startswith(b"-ERR"):
                text = redact(line.decode(errors="replace"))
                if "permissions violation" in text.lower():
                    log.warning("bus_permission_denied", connection=self.name, error=text)
                else:
                    log.warning("nats_server_error", connection=self.name, error=text)

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None
