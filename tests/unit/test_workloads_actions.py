"""The action convention: parsing responses, formatting observations, the registry's errors."""

from __future__ import annotations

import pytest

from workloads import actions as act
from workloads import workload_names


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("Look first.\n```bash\nls -la\n```", act.BashAction("ls -la")),
        ("```sh\ncat calc.py | head\n```\n", act.BashAction("cat calc.py | head")),
        (
            "```bash\nsed -i 's/a/b/' x.py &&\n  python3 -m pytest -q\n```",
            act.BashAction("sed -i 's/a/b/' x.py &&\n  python3 -m pytest -q"),
        ),
        (f"Done.\n```bash\n{act.FINISH_COMMAND}\n```", act.SubmitAction()),
        (f"```bash\n  {act.FINISH_COMMAND}  \n```", act.SubmitAction()),
        ("3 + 4 = 7\nAnswer: 7", act.AnswerAction("7")),
        ("```python\nprint(1)\n```\nAnswer: 1", act.AnswerAction("1")),
    ],
)
def test_valid_responses(text: str, action: object) -> None:
    assert act.parse_action(text) == action


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("```bash\nls\n```\n```bash\npwd\n```", "found 2 ```bash blocks"),
        ("```bash\n\n```", "empty"),
        ("```bash\nls", "closed ```bash block"),
        ("```python\nprint(1)\n```", "closed ```bash block"),
        ("I would list the files.", "no ```bash block"),
        ("", "no ```bash block"),
        ("Answer:", "no ```bash block"),
    ],
)
def test_invalid_responses_say_why(text: str, reason: str) -> None:
    action = act.parse_action(text)
    assert isinstance(action, act.InvalidAction) and reason in action.reason
    assert reason in act.invalid_action_observation(action.reason)


def test_canonical_forms_parse_back() -> None:
    assert act.parse_action(act.format_action("  ls  ")) == act.BashAction("ls")
    assert act.parse_action(act.format_action(act.FINISH_COMMAND)) == act.SubmitAction()
    thought = act.format_action("ls", " I look around first. ")
    assert thought == "THOUGHT: I look around first.\n\n```bash\nls\n```"
    assert act.parse_action(thought) == act.BashAction("ls")
    assert act.format_action("ls", "  ") == act.format_action("ls")
    assert act.parse_action("x\n" + act.format_answer(" 12 ")) == act.AnswerAction("12")
    assert act.parse_answer("Answer: 1\nAnswer: 2") == "2"


def test_observation_format_marks_exit_code_stderr_timeout_and_truncation() -> None:
    assert act.format_observation("ok\n", "", 0, limit_chars=100) == "exit_code: 0\nok\n"
    obs = act.format_observation("out", "boom", 2, limit_chars=100)
    assert obs == "exit_code: 2\nout\n[stderr]\nboom"
    obs = act.format_observation("x" * 500, "", 0, limit_chars=100)
    assert obs.startswith("exit_code: 0\n" + "x" * 87) and "x" * 88 not in obs
    assert obs.endswith("[output truncated: 413 more characters]")
    obs = act.format_observation("partial", "", -1, limit_chars=100, timed_out=True, timeout_s=30)
    assert obs == "exit_code: timeout (killed after 30 s)\npartial"
    assert act.format_observation("a", "", 0, limit_chars=100, truncated=True).endswith(
        "[output truncated: the sandbox capped the output]"
    )


def test_sandbox_command_cds_on_its_own_line() -> None:
    assert act.sandbox_command("/root/repo", "a || b") == (
        "export PYTHONDONTWRITEBYTECODE=1\ncd /root/repo || exit 97\na || b"
    )
    assert "\ncd '/tmp/my dir' || exit 97\n" in act.sandbox_command("/tmp/my dir", "ls")


def test_registry_knows_the_builtin_workloads() -> None:
    assert {"math", "dapo", "swe", "swe-gym"} <= set(workload_names())


def test_a_test_run_observes_the_same_text_however_long_it_took() -> None:
    """pytest's summary clock is the one part of a test run's output that changes from run to
    run; the observation drops it, so a response regenerated after a restore sees what the lost
    one saw (failure transparency), and everything else of the output stays."""
    fast = "..F\nFAILED t.py::test_x - assert 1 == 2\n1 failed, 2 passed in 0.07s\n"
    slow = "..F\nFAILED t.py::test_x - assert 1 == 2\n1 failed, 2 passed in 61.00s (0:01:01)\n"
    a = act.format_observation(fast, "", 1, limit_chars=1000)
    assert a == act.format_observation(slow, "", 1, limit_chars=1000)
    assert a == "exit_code: 1\n..F\nFAILED t.py::test_x - assert 1 == 2\n1 failed, 2 passed\n"
    banner = "===== 3 passed, 1 warning in 0.12s =====\n"
    assert act.format_observation("", banner, 0, limit_chars=1000).endswith(
        "[stderr]\n===== 3 passed, 1 warning =====\n"
    )
    # Text that merely looks like it is left alone.
    assert "passed in time" in act.format_observation("passed in time\n", "", 0, limit_chars=100)
