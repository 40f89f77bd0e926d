"""Configuration of the controller: one frozen dataclass, every field documented (its fields are
the flags of ``python -m services.controller``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.service import ServiceConfig
from services.controller.policy import PolicyConfig
from workloads.episode import MAX_CONTEXT_TOKENS, MAX_INVALID_IN_ROW, MAX_PROMPT_TOKENS


@dataclass(frozen=True)
class ControllerConfig(ServiceConfig):
    """Everything the controller needs; loaded once in ``__main__``."""

    model_dir: str = ""
    """Model directory whose tokenizer formats the chat (the node's model)."""
    max_trajectories: int = 8
    """Trajectory attempts running at once on this controller, over all rollouts."""
    default_concurrency: int = 8
    """Attempts of one rollout running at once when the request says 0."""
    reward_functions: tuple[str, ...] = ()
    """``module:function`` reward functions a rollout request may name (``belayer up
    --reward-function``): importing one runs its code, so each is enabled here first."""
    reward_timeout_s: float = 10.0
    """Deadline of one try of a reward service (``service:<name>``)."""
    reward_attempts: int = 3
    """Tries of a reward service before that trajectory's reward fails."""
    workload_plugins: tuple[str, ...] = ()
    """``module:factory`` workload plugins a rollout request may name (``belayer up
    --workload-plugin``). Importing one runs its code, so a spec in a request is not enough;
    installed packages' entry points (``belayer.workloads``) need no listing."""
    max_invalid_in_row: int = MAX_INVALID_IN_ROW
    """Unparseable responses in a row before a trajectory ends as ``malformed``."""
    max_prompt_tokens: int = MAX_PROMPT_TOKENS
    """Longest context sent as a prompt (the router's ``max_prompt_tokens``); longer ends the
    trajectory as ``length``."""
    max_context_tokens: int = MAX_CONTEXT_TOKENS
    """Prompt + response tokens the model takes (its ``max_position_embeddings``)."""
    recovery_attempts: int = 6
    """Restore / restart tries after one sandbox failure before the attempt ends ``failed``."""
    recovery_backoff_s: float = 0.5
    """First wait between recovery tries (the environment service may be restarting);
    doubles up to ``recovery_backoff_max_s``."""
    recovery_backoff_max_s: float = 4.0
    """Longest wait between recovery tries."""
    checkpoint_timeout_s: float = 15.0
    """Deadline of one ``full_checkpoint`` (past it: the policy's cooldown)."""
    probe_timeout_s: float = 5.0
    """After the agent's command timed out, a ``true`` in the sandbox must answer within this
    (else the sandbox hangs: an infrastructure failure)."""
    env_timeout_s: float = 30.0
    """Bus deadline of one environment call beyond its own timeout."""
    keep_ready: int = 3
    """Ready checkpoints remembered per trajectory (the environment keeps 3 per sandbox)."""
    publish_timeout_s: float = 60.0
    """How long publishing a finished trajectory into ``TRAJECTORIES`` is retried (a NATS
    server of a cluster died and the stream is electing a leader) before the attempt fails."""
    recovery_wait_s: float = 60.0
    """How long an injected worker kill may take to be recovered (engine up again)."""
    docker_url: str = "unix:///var/run/docker.sock"
    """dockerd's API socket: the injector kills and pauses sandbox containers through it, and
    a request's images are checked there before any sandbox starts."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """Node-wide defaults of the checkpoint policy, its λ prior among them (the request picks
    the policy, and may fix λ or hand it an oracle probability)."""

    def __post_init__(self) -> None:
        if self.max_trajectories < 1 or self.default_concurrency < 1:
            raise ValueError("max_trajectories and default_concurrency must be >= 1")
        if self.recovery_attempts < 1:
            raise ValueError("recovery_attempts must be >= 1")
