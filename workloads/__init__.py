"""Task libraries the controller loads by name (docs/workloads.md): ``math`` (reasoning-gym),
``dapo`` (DAPO-Math-17k-style files), ``table`` (prompt and answer columns of a user's
dataset), ``swe`` (generated bug-fix repositories), ``swe-bundled`` (the bundled ones) and
``swe-gym`` (SWE-Gym / SWE-bench instance files). Layer: imports schemas/, common/ and model/
only."""

from workloads.actions import (
    FINISH_COMMAND,
    Action,
    AnswerAction,
    BashAction,
    InvalidAction,
    SubmitAction,
    format_action,
    format_answer,
    format_observation,
    invalid_action_observation,
    parse_action,
    parse_answer,
    sandbox_command,
)
from workloads.base import (
    AnswerCheck,
    ChatMessage,
    HiddenTests,
    Outcome,
    ResponseText,
    SandboxHandle,
    SandboxOps,
    SandboxSpec,
    Score,
    Task,
    TaskLimits,
    Workload,
)
from workloads.registry import load_workload, register_workload, workload_names
from workloads.scoring import exact_match, score, score_answer, score_tests

__all__ = [
    "FINISH_COMMAND",
    "Action",
    "AnswerAction",
    "AnswerCheck",
    "BashAction",
    "ChatMessage",
    "HiddenTests",
    "InvalidAction",
    "Outcome",
    "ResponseText",
    "SandboxHandle",
    "SandboxOps",
    "SandboxSpec",
    "Score",
    "SubmitAction",
    "Task",
    "TaskLimits",
    "Workload",
    "exact_match",
    "format_action",
    "format_answer",
    "format_observation",
    "invalid_action_observation",
    "load_workload",
    "parse_action",
    "parse_answer",
    "register_workload",
    "sandbox_command",
    "score",
    "score_answer",
    "score_tests",
    "workload_names",
]
