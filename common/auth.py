"""Who may do what on the bus: identities (NATS nkeys), one per service role, and the
permissions the nats-server enforces for each.

An *identity* is an Ed25519 nkey pair: its seed lives in one file (``<name>.nk``, mode 0600)
read only by the process that connects with it; its public key goes into the server's
``authorization`` block together with the role's permissions. ``belayer up`` makes one
identity per role of the node (one per engine for the rollout workers) under
``<run dir>/auth`` and starts nats-server with them; ``belayer auth init`` makes the same set
for a deployment across hosts (``docs/security.md``).

Permissions are deny-by-default allow lists (``grant``), derived from what each service's
code publishes and subscribes to. Every connection's reply inbox is private to its identity
(``_INBOX.<public key>.>``): a role may subscribe only to its own inboxes, so nobody reads
another identity's replies. Responders may publish to ``_INBOX.>`` (an inbox name is an
unguessable capability the requester handed them; a restarted router answers callers from
inboxes it read back from its log).

Nothing here logs or formats a seed: errors name the file, never its content.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from common import subjects
from common.errors import Unauthorized
from common.seeds import SEED_SUFFIX as SEED_SUFFIX
from common.seeds import new_seed, public_key_of, seed_file, write_private
from common.seeds import read_seed as read_seed

IDENTITIES_FILE = "identities.json"
"""The auth directory's manifest: name, role, scope and public key of every identity (no
secrets)."""


ROLES = (
    "supervisor",
    "host",
    "weights",
    "kv",
    "router",
    "engine",
    "environment",
    "controller",
    "trainer",
    "reward",
    "client",
    "operator",
    "engine-host",
)
"""Every role. ``host``: the supervisor of a host that joins a deployment (``--role
env-host``), which declares nothing; ``client``: a user's program or CLI (submit work, read
status and events); ``operator``: the node owner's CLI (also sandboxes and ``down``);
``reward``: a reward service (any language) answering ``belayer.reward.<name>``;
``engine-host``: the supervisor, weight store and KV arena of a host that joins a deployment
with rollout engines (``--role engine-host``), scoped to that host's name."""

P = subjects.PREFIX
_INBOX_ALL = "_INBOX.>"


@dataclass(frozen=True)
class BusConfig:
    """How a process reaches the bus besides its URL: its credentials, TLS, and the JetStream
    replica count of what it declares. Nested as ``bus`` in every service's config (flags
    ``--bus-*``); the supervisor fills it per child."""

    creds: str = ""
    """File holding this process's nkey seed (``<name>.nk``); empty: connect without
    authentication (an unsecured server, e.g. a test's)."""
    tls_ca: str = ""
    """CA bundle (PEM) that signed the servers' certificates; set it to connect over TLS."""
    tls_cert: str = ""
    """Client certificate (PEM) for servers that verify clients (with ``tls_key``)."""
    tls_key: str = ""
    """Private key (PEM) of ``tls_cert``."""
    replicas: int = 1
    """JetStream replicas of every stream and KV bucket this process declares (3 on a
    three-server cluster)."""

    def __post_init__(self) -> None:
        if not 1 <= self.replicas <= 5:
            raise ValueError(f"replicas must be 1..5, got {self.replicas}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")


@dataclass(frozen=True)
class Grant:
    """What one identity may publish and subscribe to (NATS subject patterns)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


@dataclass(frozen=True)
class Identity:
    """One identity of the manifest (no secret)."""

    name: str
    """File stem of its seed (``<name>.nk``) and its name in the manifest."""
    role: str
    """One of ``ROLES``."""
    public_key: str
    """The nkey public key (``U…``) the server knows it by."""
    scope: str = ""
    """The engine id of an ``engine`` identity (its only engine); empty otherwise."""


# --- permissions --------------------------------------------------------------------------
def _stream_read(stream: str) -> list[str]:
    """Read a stream with an ordered consumer (``js.subscribe``) and look messages up; no
    acks, no durable consumers (a reader cannot take messages from the trainer)."""
    api = "$JS.API"
    return [
        f"{api}.CONSUMER.CREATE.{stream}",
        f"{api}.CONSUMER.CREATE.{stream}.>",
        f"{api}.CONSUMER.INFO.{stream}.>",
        f"{api}.STREAM.MSG.GET.{stream}",
        f"{api}.DIRECT.GET.{stream}",
        f"{api}.DIRECT.GET.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]


def _stream_consume(stream: str) -> list[str]:
    """Consume a stream with a durable pull consumer and explicit acks (the trainer)."""
    api = "$JS.API"
    return [
        *_stream_read(stream),
        f"{api}.CONSUMER.DURABLE.CREATE.{stream}.>",
        f"{api}.CONSUMER.MSG.NEXT.{stream}.>",
        f"$JS.ACK.{stream}.>",
    ]


def _object_store(bucket: str) -> list[str]:
    """Put, get (an ordered consumer) and delete (purge) objects of one Object Store bucket."""
    stream = subjects.object_store_stream(bucket)
    return [
        subjects.object_store_subjects(bucket),
        f"$JS.API.STREAM.PURGE.{stream}",
        *_stream_read(stream),
    ]


def _kv_read(bucket: str) -> list[str]:
    return _stream_read(f"KV_{bucket}")


def _kv_write(bucket: str, key: str = ">") -> list[str]:
    return [f"$KV.{bucket}.{key}"]


_JS_INFO = ["$JS.API.INFO", "$JS.API.STREAM.INFO.*", "$JS.API.STREAM.NAMES"]
_SERVICE_BASE = [*_JS_INFO, subjects.EVENTS_ALL, _INBOX_ALL]
"""Every service: look streams up (``ensure_jetstream`` checks before declaring), publish its
events, answer requests."""


def _supervisor_grant() -> tuple[list[str], list[str]]:
    """Declares the streams, asks every service for its status, reads the engine epochs;
    answers status and stop; hears every event (the handover and engine-failure ones drive
    promotions; all of them feed the metrics endpoint, ``--metrics-port``)."""
    return (
        [
            "$JS.API.STREAM.CREATE.*",
            "$JS.API.STREAM.UPDATE.*",
            subjects.weights_get(),
            subjects.kv_get(),
            subjects.router_status(),
            subjects.router_engine_failed(),
            f"{P}.envhost.*.ping",
            subjects.rollout_status(),
            subjects.trainer_status(),
            *_kv_read(subjects.BUCKET_ENGINE_EPOCHS),
        ],
        [
            subjects.supervisor_status(),
            subjects.supervisor_stop(),
            subjects.EVENTS_ALL,
        ],
    )


def _host_grant() -> tuple[list[str], list[str]]:
    """The supervisor of a host that joins a deployment (``--role env-host``): pings its
    environment service, its start-up probe (its own host name is chosen at start, so any
    host's ping)."""
    return ([f"{P}.envhost.*.ping"], [])


_WEIGHT_OBJECTS_STREAM = f"OBJ_{subjects.BUCKET_WEIGHT_OBJECTS}"


def _weights_grant() -> tuple[list[str], list[str]]:
    """Writes and reads the weight version, exports versions into the weight object store
    (creates it, puts and deletes objects); answers weight lookups, pushes and exports."""
    return (
        [
            *_kv_write(subjects.BUCKET_WEIGHT_VERSION),
            *_kv_read(subjects.BUCKET_WEIGHT_VERSION),
            f"$JS.API.STREAM.CREATE.{_WEIGHT_OBJECTS_STREAM}",
            f"$JS.API.STREAM.PURGE.{_WEIGHT_OBJECTS_STREAM}",
            f"$O.{subjects.BUCKET_WEIGHT_OBJECTS}.>",
            *_stream_read(_WEIGHT_OBJECTS_STREAM),
        ],
        [subjects.weights_get(), subjects.weights_push(), subjects.weights_export()],
    )


def _engine_host_grant(host: str) -> tuple[list[str], list[str]]:
    """An engine host's supervisor, weight store and KV arena (``--role engine-host``): asks
    the node's store to export versions and reads them from the weight object store, reads
    the weight version and the engine epochs, asks the router about its engines (and reports
    a dead worker), probes its own host's store and arena; answers its own host's weight and
    arena requests, hears every event."""
    return (
        [
            subjects.weights_export(),
            *_stream_read(_WEIGHT_OBJECTS_STREAM),
            *_kv_read(subjects.BUCKET_WEIGHT_VERSION),
            *_kv_read(subjects.BUCKET_ENGINE_EPOCHS),
            subjects.router_status(),
            subjects.router_engine_failed(),
            f"{P}.host.{host}.>",
        ],
        [f"{P}.host.{host}.>", subjects.EVENTS_ALL],
    )


def _kv_grant() -> tuple[list[str], list[str]]:
    """Reads the engine epochs; answers KV lookups and flushes."""
    return (
        [*_kv_read(subjects.BUCKET_ENGINE_EPOCHS)],
        [subjects.kv_get(), subjects.kv_flush()],
    )


def _router_grant() -> tuple[list[str], list[str]]:
    """Drives the engines, writes and reads the token and request logs, reads the engine
    epochs; answers generate, register, tokens, status and cancel."""
    return (
        [
            f"{P}.engine.*.generate",
            f"{P}.engine.*.abort",
            f"{P}.engine.*.ping",
            f"{P}.engine.*.state",
            subjects.TOKEN_LOG_ALL,
            subjects.REQUEST_LOG_ALL,
            *_stream_read(subjects.STREAM_TOKENS),
            *_stream_read(subjects.STREAM_REQUESTS),
            *_kv_read(subjects.BUCKET_ENGINE_EPOCHS),
        ],
        [
            subjects.router_generate(),
            subjects.router_register(),
            subjects.router_engine_failed(),
            subjects.router_tokens(),
            subjects.router_status(),
            subjects.router_cancel(),
        ],
    )


def _engine_grant(engine: str) -> tuple[list[str], list[str]]:
    """A main worker or the shadow of one engine (a shadow becomes its main): registers with
    and streams to the router, asks the KV arena and the weight store, writes its own engine's
    epoch; answers its engine's requests and hears weight updates."""
    ev = subjects.event
    return (
        [
            subjects.router_register(),
            subjects.router_tokens(),
            subjects.router_engine_failed(),
            subjects.kv_get(),
            subjects.kv_flush(),
            subjects.weights_get(),
            f"{P}.host.*.kv.get",
            f"{P}.host.*.kv.flush",
            f"{P}.host.*.weights.get",
            *_kv_write(subjects.BUCKET_ENGINE_EPOCHS, engine),
            *_kv_read(subjects.BUCKET_ENGINE_EPOCHS),
            *_kv_read(subjects.BUCKET_WEIGHT_VERSION),
        ],
        [f"{P}.engine.{engine}.{op}" for op in ("generate", "abort", "ping", "state")]
        + [ev("weights_updated")],
    )


def _environment_grant() -> tuple[list[str], list[str]]:
    """Writes and reads the sandbox ready pointers, keeps checkpoints in their object store,
    registers its host; answers every env request (any host's and its own host's)."""
    return (
        [
            *_kv_write(subjects.BUCKET_SANDBOX_PREFIX),
            *_kv_read(subjects.BUCKET_SANDBOX_PREFIX),
            *_kv_write(subjects.BUCKET_ENV_HOSTS),
            *_object_store(subjects.OBJECT_STORE_CHECKPOINTS),
        ],
        [f"{P}.env.*", subjects.ENV_HOST_ALL],
    )


def _controller_grant() -> tuple[list[str], list[str]]:
    """Uses the environment (placing sandboxes by the hosts' registrations) and the router,
    publishes trajectories, keeps rollout and trajectory state; answers rollout submit and
    status."""
    return (
        [
            f"{P}.env.*",
            subjects.ENV_HOST_ALL,
            *_kv_read(subjects.BUCKET_ENV_HOSTS),
            subjects.router_generate(),
            subjects.router_cancel(),
            subjects.router_status(),
            subjects.REWARD_ALL,
            subjects.TRAJECTORIES_ALL,
            *_stream_read(subjects.STREAM_TRAJECTORIES),
            *_kv_write(subjects.BUCKET_ROLLOUTS),
            *_kv_read(subjects.BUCKET_ROLLOUTS),
            *_kv_write(subjects.BUCKET_TRAJECTORY_PREFIX),
            *_kv_read(subjects.BUCKET_TRAJECTORY_PREFIX),
        ],
        [subjects.rollout_submit(), subjects.rollout_status()],
    )


def _reward_grant() -> tuple[list[str], list[str]]:
    """A reward service: answers ``belayer.reward.<name>`` (its replies go to inboxes)."""
    return ([], [subjects.REWARD_ALL])


def _trainer_grant() -> tuple[list[str], list[str]]:
    """Consumes the trajectories, asks for and pushes weights, publishes dead letters; answers
    its status."""
    return (
        [
            subjects.weights_get(),
            subjects.weights_push(),
            subjects.DEAD_LETTER_ALL,
            *_stream_consume(subjects.STREAM_TRAJECTORIES),
            *_kv_read(subjects.BUCKET_WEIGHT_VERSION),
        ],
        [subjects.trainer_status()],
    )


_GRANTS: dict[str, Callable[[], tuple[list[str], list[str]]]] = {
    "supervisor": _supervisor_grant,
    "host": _host_grant,
    "weights": _weights_grant,
    "kv": _kv_grant,
    "router": _router_grant,
    "environment": _environment_grant,
    "controller": _controller_grant,
    "trainer": _trainer_grant,
    "reward": _reward_grant,
}
"""The grant of each service role but ``engine`` (whose grant depends on its scope)."""


def _service_grant(role: str, scope: str) -> tuple[list[str], list[str]]:
    """(publish, subscribe) of a service role, beyond ``_SERVICE_BASE`` and the inbox."""
    if role == "engine":
        return _engine_grant(scope or "*")
    if role == "engine-host":
        return _engine_host_grant(scope or "*")
    return _GRANTS[role]()


_CLIENT_PUBLISH = [
    subjects.router_generate(),
    subjects.router_cancel(),
    subjects.router_status(),
    subjects.rollout_submit(),
    subjects.rollout_status(),
    subjects.supervisor_status(),
    subjects.trainer_status(),
    *_JS_INFO,
    *_stream_read(subjects.STREAM_EVENTS),
    *_stream_read(subjects.STREAM_TRAJECTORIES),
    *_kv_read(subjects.BUCKET_ENGINE_EPOCHS),
]
"""A user: submit work, read status, follow events and its rollouts' trajectories."""

_READ_ALL = [
    *(
        api
        for stream in (
            subjects.STREAM_TOKENS,
            subjects.STREAM_REQUESTS,
            subjects.STREAM_DEADLETTER,
        )
        for api in _stream_read(stream)
    ),
    *(
        api
        for bucket in (
            subjects.BUCKET_WEIGHT_VERSION,
            subjects.BUCKET_SANDBOX_PREFIX,
            subjects.BUCKET_ROLLOUTS,
            subjects.BUCKET_TRAJECTORY_PREFIX,
            subjects.BUCKET_ENV_HOSTS,
        )
        for api in _kv_read(bucket)
    ),
]
"""What an operator reads beyond a client: every stream and bucket (no writes)."""


def grant(role: str, *, public_key: str, scope: str = "") -> Grant:
    """The permissions of an identity of ``role`` (``scope``: an engine identity's engine)."""
    inbox = f"{inbox_prefix(public_key)}.>"
    if role == "client":
        return Grant(tuple(_CLIENT_PUBLISH), (subjects.EVENTS_ALL, inbox))
    if role == "operator":  # the node's owner: also sandboxes, `down`, and reading everything
        publish = [
            *_CLIENT_PUBLISH,
            f"{P}.env.*",
            subjects.ENV_HOST_ALL,
            subjects.supervisor_stop(),
            subjects.weights_get(),
            *_READ_ALL,
        ]
        return Grant(tuple(publish), (f"{P}.>", inbox))
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r} (one of {', '.join(ROLES)})")
    publish, subscribe = _service_grant(role, scope)
    return Grant(tuple([*_SERVICE_BASE, *publish]), tuple([*subscribe, inbox]))


def inbox_prefix(public_key: str) -> str:
    """The reply-inbox prefix of an identity (``_INBOX.<public key>``)."""
    return f"_INBOX.{public_key}"


def node_identities(engine_ids: list[str] | tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(name, role, scope) of every identity a node uses: one per service role, one per engine
    (its main worker and shadow), the user's client and the operator."""
    out = [(r, r, "") for r in ROLES if r not in ("engine", "host", "engine-host")]
    out += [(f"engine-{subjects.check_token(e, 'engine id')}", "engine", e) for e in engine_ids]
    return out


def engine_host_identities(host: str, engine_ids: list[str]) -> list[tuple[str, str, str]]:
    """(name, role, scope) of the identities of engine host ``host``: its supervisor
    (``host``), weight store and KV arena (each role ``engine-host``, scope ``host``), and
    one per engine."""
    subjects.check_token(host, "host name")
    out = [(name, "engine-host", host) for name in ("host", "weights", "kv")]
    out += [(f"engine-{subjects.check_token(e, 'engine id')}", "engine", e) for e in engine_ids]
    return out


def ensure_identities(auth_dir: Path, wanted: list[tuple[str, str, str]]) -> list[Identity]:
    """Make the identities of ``wanted`` that ``auth_dir`` lacks (seed files 0600, manifest),
    keep those it has; return the whole manifest."""
    auth_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(auth_dir, 0o700)
    known = {i.name: i for i in load_identities(auth_dir, missing_ok=True)}
    for name, role, scope in wanted:
        subjects.check_token(name, "identity name")
        grant(role, public_key="U", scope=scope)  # an unknown role fails here
        path = seed_file(auth_dir, name)
        have = known.get(name)
        if have is not None and have.role == role and have.scope == scope and path.exists():
            continue
        seed = new_seed()
        write_private(path, seed)
        known[name] = Identity(name=name, role=role, public_key=public_key_of(seed), scope=scope)
    manifest = [asdict(i) for i in sorted(known.values(), key=lambda i: i.name)]
    write_private(auth_dir / IDENTITIES_FILE, json.dumps(manifest, indent=2).encode())
    return sorted(known.values(), key=lambda i: i.name)


def load_identities(auth_dir: Path, *, missing_ok: bool = False) -> list[Identity]:
    """The manifest of ``auth_dir``."""
    path = auth_dir / IDENTITIES_FILE
    try:
        rows = json.loads(path.read_text())
    except FileNotFoundError:
        if missing_ok:
            return []
        raise Unauthorized(f"no identities in {auth_dir} (missing {IDENTITIES_FILE})") from None
    except (OSError, ValueError) as exc:
        raise Unauthorized(f"cannot read {path}: {exc}") from None
    return [Identity(**row) for row in rows]


# --- the server's side ----------------------------------------------------------------------
def _conf_list(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(json.dumps(s) for s in items) + "]"


def authorization_conf(identities: list[Identity]) -> str:
    """The nats-server ``authorization`` block: every identity with its permissions; no
    anonymous user, so an unauthenticated connection is refused."""
    users = []
    for ident in identities:
        g = grant(ident.role, public_key=ident.public_key, scope=ident.scope)
        users.append(
            f"    {{ nkey: {json.dumps(ident.public_key)}\n"
            f"      permissions: {{\n"
            f"        publish: {{ allow: {_conf_list(g.publish)} }}\n"
            f"        subscribe: {{ allow: {_conf_list(g.subscribe)} }}\n"
            f"      }} }}"
        )
    return "authorization {\n  timeout: 5\n  users: [\n" + "\n".join(users) + "\n  ]\n}\n"


def role_table() -> list[tuple[str, Grant]]:
    """Every role's grant with a placeholder key (for ``docs/security.md`` and its test)."""
    return [(role, grant(role, public_key="<key>", scope="<id>")) for role in ROLES]


_SEED = re.compile(r"S[UAONC][A-Z2-7]{54,}")
_URL_SECRET = re.compile(r"(\w+://)[^/@\s,]+@")


def redact(text: str) -> str:
    """``text`` with anything that looks like an nkey seed, or a password in a URL, replaced
    (a belt to the braces of never formatting one)."""
    return _URL_SECRET.sub(r"\1<redacted>@", _SEED.sub("<redacted>", text))


def markdown_table() -> str:
    """The roles × subjects table of ``docs/security.md`` (checked against ``grant`` by
    ``tests/unit/test_security_doc.py``): JetStream API grants summarised per stream."""

    def summarise(patterns: tuple[str, ...]) -> str:
        left = list(patterns)
        out: list[str] = []

        def take(group: list[str]) -> bool:
            if all(p in left for p in group):
                for p in group:
                    left.remove(p)
                return True
            return False

        if take(["$JS.API.STREAM.CREATE.*", "$JS.API.STREAM.UPDATE.*"]):
            out.append("declare streams")
        if take(_JS_INFO):
            out.append("stream info")
        streams = [
            subjects.STREAM_TOKENS,
            subjects.STREAM_REQUESTS,
            subjects.STREAM_EVENTS,
            subjects.STREAM_TRAJECTORIES,
            subjects.STREAM_DEADLETTER,
            _WEIGHT_OBJECTS_STREAM,
        ]
        buckets = [
            subjects.BUCKET_WEIGHT_VERSION,
            subjects.BUCKET_ENGINE_EPOCHS,
            subjects.BUCKET_SANDBOX_PREFIX,
            subjects.BUCKET_ROLLOUTS,
            subjects.BUCKET_TRAJECTORY_PREFIX,
            subjects.BUCKET_ENV_HOSTS,
        ]
        if take(_object_store(obj := subjects.OBJECT_STORE_CHECKPOINTS)):
            out.append(f"put/get/delete objects of `{obj}`")
        for s in streams:
            if take(_stream_consume(s)):
                out.append(f"consume `{s}` (durable, acks)")
            elif take(_stream_read(s)):
                out.append(f"read `{s}`")
        for b in buckets:
            if take(_kv_read(b)):
                out.append(f"read KV `{b}`")
        for p in list(left):
            if p.startswith("$KV."):
                left.remove(p)
                _, bucket, key = p.split(".", 2)
                out.append(f"write KV `{bucket}` (`{key}`)")
        out += [f"`{p}`" for p in left]
        return ", ".join(out) or "—"

    rows = ["| role | may publish (requests, streams) | may subscribe (serve, follow) |"]
    rows.append("| --- | --- | --- |")
    for role, g in role_table():
        rows.append(f"| `{role}` | {summarise(g.publish)} | {summarise(g.subscribe)} |")
    return "\n".join(rows) + "\n"
