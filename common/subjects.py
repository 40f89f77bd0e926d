"""Every NATS subject, JetStream stream and KV bucket name Belayer uses, in one place.

Services never build subject strings themselves: they call these functions, so a rename is one
edit and ``docs/protocol.md`` can be checked against this module. Subjects are prefixed
``belayer.``; streams are UPPER_SNAKE, KV buckets lower_snake.
"""

from __future__ import annotations

import re

PREFIX = "belayer"

_TOKEN = re.compile(r"^[A-Za-z0-9_\-]+$")


def check_token(value: str, what: str = "id") -> str:
    """Return ``value`` if it is safe as one subject token (no dots, spaces or wildcards)."""
    if not value or not _TOKEN.fullmatch(value) or len(value) > 128:  # fullmatch: no "x\n"
        raise ValueError(f"{what} {value!r} is not a valid subject token ([A-Za-z0-9_-]{{1,128}})")
    return value


# --- weight store -------------------------------------------------------------------------
def host_prefix(host: str) -> str:
    """Prefix of the subjects one engine host's own weight store and KV arena serve (its
    workers ask them, not the node's): ``belayer.host.<host>``."""
    return f"{PREFIX}.host.{check_token(host, 'host name')}"


def weights_get(host: str = "") -> str:
    """Request: the manifest of the current (or a given) weight version (``host``: that
    engine host's local weight store)."""
    return f"{host_prefix(host)}.weights.get" if host else f"{PREFIX}.weights.get"


def weights_export() -> str:
    """Request: the node's weight store puts a version into the ``BUCKET_WEIGHT_OBJECTS``
    object store (once) and answers its manifest; engine hosts mirror it from there."""
    return f"{PREFIX}.weights.export"


def weights_push() -> str:
    """Request: adopt a new weight version (trainer → weight store)."""
    return f"{PREFIX}.weights.push"


def weights_release() -> str:
    """Publish: a reader stopped using a version (lets the store garbage-collect old ones)."""
    return f"{PREFIX}.weights.release"


# --- KV arena -----------------------------------------------------------------------------
def kv_get(host: str = "") -> str:
    """Request: the arena descriptor of one engine (``host``: that engine host's arena)."""
    return f"{host_prefix(host)}.kv.get" if host else f"{PREFIX}.kv.get"


def kv_flush(host: str = "") -> str:
    """Request: zero an engine's arena (handover step 3; ``host``: that engine host's)."""
    return f"{host_prefix(host)}.kv.flush" if host else f"{PREFIX}.kv.flush"


# --- rollout workers / router -------------------------------------------------------------
def engine_generate(engine_id: str) -> str:
    """Router → worker: submit (or resume) requests on one engine."""
    return f"{PREFIX}.engine.{check_token(engine_id, 'engine id')}.generate"


def engine_abort(engine_id: str) -> str:
    """Router → worker: abort requests on one engine."""
    return f"{PREFIX}.engine.{check_token(engine_id, 'engine id')}.abort"


def engine_ping(engine_id: str) -> str:
    """Request: liveness/health of one engine's worker (answers with its pid and epoch)."""
    return f"{PREFIX}.engine.{check_token(engine_id, 'engine id')}.ping"


def engine_state(engine_id: str) -> str:
    """Request: the worker's copy of given requests (tokens so far, finished or not)."""
    return f"{PREFIX}.engine.{check_token(engine_id, 'engine id')}.state"


def router_generate() -> str:
    """Request (streamed replies): generate tokens for a request."""
    return f"{PREFIX}.router.generate"


def router_register() -> str:
    """Request: a worker registers (engine id, epoch, pid) with the router."""
    return f"{PREFIX}.router.register"


def router_engine_failed() -> str:
    """Request: report that an engine's main worker died or hung (shadow, supervisor)."""
    return f"{PREFIX}.router.engine_failed"


def router_tokens() -> str:
    """Worker → router: one message per engine step with every request's new tokens."""
    return f"{PREFIX}.router.tokens"


def router_status() -> str:
    """Request: the router's view of engines and requests."""
    return f"{PREFIX}.router.status"


def router_cancel() -> str:
    """Request: cancel a request by id."""
    return f"{PREFIX}.router.cancel"


def token_log(request_id: str) -> str:
    """JetStream subject of one request's token log chunks."""
    return f"{PREFIX}.tokenlog.{check_token(request_id, 'request id')}"


TOKEN_LOG_ALL = f"{PREFIX}.tokenlog.>"
"""Every request's token log (stream TOKENS)."""


def request_log(request_id: str) -> str:
    """JetStream subject holding the accepted request itself (so a restarted router can resume)."""
    return f"{PREFIX}.requests.{check_token(request_id, 'request id')}"


REQUEST_LOG_ALL = f"{PREFIX}.requests.>"
"""Every accepted request (stream REQUESTS)."""


# --- environment --------------------------------------------------------------------------
def env(op: str) -> str:
    """Request: environment operation ``op`` (create, exec, checkpoint, restore, destroy, list)."""
    return f"{PREFIX}.env.{check_token(op, 'env op')}"


def env_host(host: str, op: str) -> str:
    """Request: environment operation ``op`` on one environment host (its service's ``node``
    label): how the controller reaches the host it placed a sandbox on. ``env(op)`` reaches
    any one host (a queue group)."""
    return f"{PREFIX}.envhost.{check_token(host, 'env host')}.{check_token(op, 'env op')}"


ENV_HOST_ALL = f"{PREFIX}.envhost.*.*"
"""Every operation of every environment host."""


# --- controller / trainer -----------------------------------------------------------------
def rollout_submit() -> str:
    """Request: submit a rollout (``RolloutRequest``) to the controller."""
    return f"{PREFIX}.rollout.submit"


def rollout_status() -> str:
    """Request: where a rollout stands (``RolloutStatusRequest`` → ``RolloutResult``)."""
    return f"{PREFIX}.rollout.status"


def trajectory(rollout_id: str, trajectory_id: str) -> str:
    """JetStream subject of one finished trajectory (stream TRAJECTORIES)."""
    rollout = check_token(rollout_id, "rollout id")
    return f"{PREFIX}.trajectories.{rollout}.{check_token(trajectory_id, 'trajectory id')}"


def rollout_trajectories(rollout_id: str) -> str:
    """Wildcard: every finished trajectory of one rollout."""
    return f"{PREFIX}.trajectories.{check_token(rollout_id, 'rollout id')}.*"


TRAJECTORIES_ALL = f"{PREFIX}.trajectories.>"
"""Every finished trajectory (stream TRAJECTORIES)."""


def reward(name: str) -> str:
    """Request: a reward service scores one trajectory (``RewardRequest`` → ``RewardReply``);
    any process holding the ``reward`` identity may serve a name, in any language."""
    return f"{PREFIX}.reward.{check_token(name, 'reward service name')}"


REWARD_ALL = f"{PREFIX}.reward.>"


def trainer_status() -> str:
    """Request: where the trainer stands (``TrainerStatusRequest`` → ``TrainerStatus``)."""
    return f"{PREFIX}.trainer.status"


def dead_letter(kind: str) -> str:
    """JetStream subject of records a consumer could not use (``dead_letter("trajectories")``:
    malformed trajectory records the trainer acked), kept in stream DEADLETTER."""
    return f"{PREFIX}.deadletter.{check_token(kind, 'dead-letter kind')}"


DEAD_LETTER_ALL = f"{PREFIX}.deadletter.>"
"""Every dead letter (stream DEADLETTER)."""


# --- events -------------------------------------------------------------------------------
def event(kind: str) -> str:
    """Lifecycle and recovery events (``belayer.events.<kind>``), persisted in EVENTS."""
    return f"{PREFIX}.events.{check_token(kind, 'event kind')}"


EVENTS_ALL = f"{PREFIX}.events.>"


# --- supervisor ---------------------------------------------------------------------------
def supervisor_status() -> str:
    """Request: the node supervisor's process table."""
    return f"{PREFIX}.supervisor.status"


def supervisor_stop() -> str:
    """Request: stop every service of this node (``belayer down``)."""
    return f"{PREFIX}.supervisor.stop"


# --- JetStream streams and KV buckets -----------------------------------------------------
STREAM_TOKENS = "TOKENS"
STREAM_REQUESTS = "REQUESTS"
STREAM_EVENTS = "EVENTS"
STREAM_TRAJECTORIES = "TRAJECTORIES"
STREAM_DEADLETTER = "DEADLETTER"

BUCKET_WEIGHT_VERSION = "weight_version"
BUCKET_ENGINE_EPOCHS = "engine_epochs"
BUCKET_REQUESTS = "request_status"
BUCKET_SANDBOX_PREFIX = "sandbox_prefix"
BUCKET_ROLLOUTS = "rollouts"
BUCKET_TRAJECTORY_PREFIX = "trajectory_prefix"

BUCKET_WEIGHT_OBJECTS = "weight_objects"
"""JetStream Object Store of exported weight versions (object ``weight_object(N)``) and the
model's small files (``model_file_object``): what an engine host mirrors."""


def model_file_object(name: str) -> str:
    """Name of one of the model's small files (``config.json``, the tokenizer's) in
    ``BUCKET_WEIGHT_OBJECTS``: engines and KV arenas read them beside the weights."""
    return f"model/{name}"


def weight_object(version: int) -> str:
    """Name of one version's flat buffer in ``BUCKET_WEIGHT_OBJECTS``."""
    return f"v{int(version)}"


BUCKET_ENV_HOSTS = "env_hosts"
"""Environment hosts' registrations (key: host; value: its capacity and live sandboxes)."""

OBJECT_STORE_CHECKPOINTS = "checkpoints"
"""JetStream Object Store of ready sandbox checkpoints (object name: the checkpoint id), so a
checkpoint outlives the host that took it."""


def object_store_stream(bucket: str) -> str:
    """The stream behind a JetStream Object Store bucket."""
    return f"OBJ_{bucket}"


def object_store_subjects(bucket: str) -> str:
    """Every chunk and metadata subject of an Object Store bucket."""
    return f"$O.{bucket}.>"
