"""The per-trajectory state machine (pure): the chat-formatted context L_k as token ids, the
loss mask, actions and their prefix index, checkpoints and the recovery choice — a restore
truncates the context to exactly L_k, a failed restore falls back to the previous ready
checkpoint, then to a fresh sandbox with L_0 — and the finish reasons."""

from __future__ import annotations

from pathlib import Path

import pytest

from model.chat import ChatFormat
from model.tokenizer import Tokenizer, load_tokenizer
from services.controller.core import (
    Again,
    Execute,
    Finish,
    Generate,
    Limits,
    Score,
    TrajectoryCore,
    is_agent_timeout,
)
from services.controller.policy import CheckpointPolicy, PolicyConfig, PolicyKind
from tests.unit.model_fixtures import write_small_model

LIMITS = Limits(
    max_turns=20,
    max_invalid_in_row=3,
    max_prompt_tokens=1536,
    max_context_tokens=2048,
    max_response_tokens=64,
    observation_chars=200,
    action_timeout_s=5.0,
    deadline_s=100.0,
)
PROMPT = [("system", "Fix the bug."), ("user", "The test fails.")]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(write_small_model(tmp_path_factory.mktemp("m")))


@pytest.fixture
def chat(tok: Tokenizer) -> ChatFormat:
    return ChatFormat(tok)


def make(
    chat: ChatFormat,
    *,
    sandbox: bool = True,
    limits: Limits = LIMITS,
    policy: PolicyKind = "always",
) -> TrajectoryCore:
    return TrajectoryCore(
        trajectory_id="r1-s0-a0",
        prompt_ids=chat.prompt(PROMPT),
        limits=limits,
        policy=CheckpointPolicy(PolicyConfig(kind=policy)),
        sample_seed=11,
        has_sandbox=sandbox,
        started_at=0.0,
        observation_ids=chat.observation,
    )


def respond(
    core: TrajectoryCore, chat: ChatFormat, text: str, *, now: float = 1.0, resumes: int = 0
):
    """Feed ``text`` as the model's response (ending in <|im_end|>, as the model does)."""
    gen = core.next_generation(now)
    assert isinstance(gen, Generate), gen
    ids = [*chat.tokenizer.encode(text), chat.im_end]
    return core.on_response(
        ids, [-0.5] * len(ids), [3] * len(ids), text, llm_s=0.2, resumes=resumes, now=now
    )


def run_action(core: TrajectoryCore, chat: ChatFormat, command: str, out: str = "ok\n"):
    step = respond(core, chat, f"Let me look.\n```bash\n{command}\n```")
    assert isinstance(step, Execute) and step.command == command
    core.on_observation(stdout=out, stderr="", exit_code=0, env_s=0.1)
    decision, pending = core.decide_checkpoint(step_s=0.1, now=2.0)
    return step, decision, pending


def snapshot(core: TrajectoryCore) -> tuple:
    return (
        list(core.context), list(core.loss_mask), list(core.logprobs),
        list(core.weight_versions), [a.command for a in core.actions], core.turn,
    )  # fmt: skip


def test_chat_layout_matches_the_template_text(chat: ChatFormat) -> None:
    tok = chat.tokenizer
    assert chat.prompt(PROMPT) == tok.encode(chat.render(PROMPT, add_generation_prompt=True))
    response = [*tok.encode("```bash\nls\n```"), chat.im_end]
    whole = "\n<|im_start|>user\nexit_code: 0<|im_end|>\n<|im_start|>assistant\n"
    assert chat.observation(response, "exit_code: 0") == tok.encode(whole)
    cut = tok.encode("```bash\nls")  # cut by max_tokens: closed for the model
    assert chat.observation(cut, "x")[: len(tok.encode("<|im_end|>\n"))] == tok.encode(
        "<|im_end|>\n"
    )


def test_loss_mask_logprobs_and_versions_mark_model_tokens_only(chat: ChatFormat) -> None:
    core = make(chat)
    run_action(core, chat, "ls")
    n = len(core.response_ids)
    assert len(core.loss_mask) == len(core.logprobs) == len(core.weight_versions) == n
    model = [i for i, m in enumerate(core.loss_mask) if m == 1]
    assert model and model == list(range(model[0], model[-1] + 1))  # one response, contiguous
    assert all(core.logprobs[i] == -0.5 and core.weight_versions[i] == 3 for i in model)
    other = [i for i, m in enumerate(core.loss_mask) if m == 0]
    assert other and all(core.logprobs[i] == 0.0 and core.weight_versions[i] == -1 for i in other)
    assert core.response_ids[model[-1]] == chat.im_end
    text = chat.tokenizer.decode(core.response_ids[model[-1] + 1 :])
    assert text.startswith("\n<|im_start|>user\nexit_code: 0\nok")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_actions_record_the_prefix_they_ran_at(chat: ChatFormat) -> None:
    core = make(chat)
    for i, cmd in enumerate(["ls", "cat a", "pytest"]):
        step, _, _ = run_action(core, chat, cmd)
        assert step.prefix == i
    assert [(a.turn, a.prefix, a.command) for a in core.actions] == [
        (1, 0, "ls"), (2, 1, "cat a"), (3, 2, "pytest")
    ]  # fmt: skip


def test_generations_have_distinct_ids_and_seeds(chat: ChatFormat) -> None:
    core = make(chat)
    seen = set()
    for _ in range(3):
        gen = core.next_generation(1.0)
        assert isinstance(gen, Generate)
        seen.add((gen.request_id, gen.seed))
        core.on_response([chat.im_end], [0.0], [1], "```bash\nls\n```", llm_s=0.1)
        core.on_observation(stdout="", stderr="", exit_code=0, env_s=0.0)
    assert len({s for _, s in seen}) == 3 and len({r for r, _ in seen}) == 3
    assert isinstance(gen, Generate)  # held in the loop; mypy forgets it past the loop
    assert gen.request_id == "r1-s0-a0-g3" and gen.prompt_ids == core.context[: len(gen.prompt_ids)]


def test_a_regenerated_turn_draws_the_seed_of_the_turn_it_replaces(chat: ChatFormat) -> None:
    """Failure transparency: after a restore to C_k (or a restart from L_0) the next response
    is the same turn of the same history, so it is seeded as the lost one was (the sampler
    then draws the same tokens); only the request id is new."""
    core = make(chat)
    _, _, p1 = run_action(core, chat, "echo 1 > f")
    assert p1 is not None
    c1 = core.on_checkpoint_ready(p1, "ck1", 0.1, now=2.0)
    lost = core.next_generation(3.0)
    assert isinstance(lost, Generate)
    core.on_response([chat.im_end], [0.0], [1], "```bash\nls\n```", llm_s=0.1)
    core.on_sandbox_failure("exec", "sandbox_error", "container is dead", now=4.0)
    core.on_restored(c1, 0.3, now=5.0)
    again = core.next_generation(6.0)
    assert isinstance(again, Generate)
    assert again.seed == lost.seed and again.prompt_ids == lost.prompt_ids
    assert again.request_id != lost.request_id
    core.on_restarted_from_scratch(0.5, now=7.0, had_checkpoint=True)
    first = core.next_generation(8.0)
    fresh = make(chat).next_generation(1.0)
    assert isinstance(first, Generate) and isinstance(fresh, Generate)
    assert first.seed == fresh.seed and first.prompt_ids == fresh.prompt_ids


def test_restore_truncates_to_exactly_l_k_and_drops_later_checkpoints(chat: ChatFormat) -> None:
    core = make(chat)
    _, d1, p1 = run_action(core, chat, "echo 1 > f")
    assert d1.checkpoint and p1 is not None and p1.prefix == 1
    at_1 = snapshot(core)
    c1 = core.on_checkpoint_ready(p1, "sb-k000001-aaaaaa", 0.2, now=3.0)
    _, _, p2 = run_action(core, chat, "echo 2 >> f")
    at_2 = snapshot(core)
    # the next response arrives before checkpoint 2 is ready: it must not leak into L_2
    step = respond(core, chat, "```bash\nrm f\n```")
    assert isinstance(step, Execute) and step.prefix == 2
    assert p2 is not None
    c2 = core.on_checkpoint_ready(p2, "sb-k000002-bbbbbb", 0.2, now=4.0)
    assert c2.response_len == len(at_2[1])
    # the exec of "rm f" fails (infrastructure): back to C_2 with L_2, exactly
    core.on_sandbox_failure("exec", "sandbox_error", "container is dead", now=5.0)
    assert core.restore_candidate() == c2
    core.on_restored(c2, 0.3, now=5.5)
    assert snapshot(core) == at_2
    assert [a.command for a in core.actions] == ["echo 1 > f", "echo 2 >> f"]
    # keep going, then fail again and restore C_1: C_2 and everything after it are gone
    run_action(core, chat, "echo 3 >> f")
    core.ready = [c1]  # as if C_2 had been rejected
    core.on_restored(c1, 0.3, now=6.0)
    assert snapshot(core) == at_1 and core.ready == [c1]
    rec = core.recovery
    assert (rec.sandbox_failures, rec.restores, rec.checkpoints) == (1, 2, 2)
    assert [e.kind for e in rec.entries].count("restore") == 2


def test_failed_restore_falls_back_then_scratch(chat: ChatFormat) -> None:
    core = make(chat)
    _, _, p1 = run_action(core, chat, "a")
    assert p1 is not None
    c1 = core.on_checkpoint_ready(p1, "ck1", 0.1, now=1.0)
    _, _, p2 = run_action(core, chat, "b")
    assert p2 is not None
    c2 = core.on_checkpoint_ready(p2, "ck2", 0.1, now=1.0)
    core.on_sandbox_failure("exec", "sandbox_error", "dead", now=2.0)
    assert core.restore_candidate() == c2
    core.on_restore_failed(c2, "checkpoint_invalid: bad archive", now=2.1)
    assert core.restore_candidate() == c1
    core.on_restore_failed(c1, "not_found", now=2.2)
    assert core.restore_candidate() is None
    core.on_restarted_from_scratch(0.5, now=3.0, had_checkpoint=True)
    assert core.context == core.prompt_ids and core.response_ids == [] and core.actions == []
    assert core.turn == 0 and core.ready == []
    rec = core.recovery
    assert (
        rec.restore_failures,
        rec.restarts_from_scratch,
        rec.restarts_from_scratch_with_checkpoint,
    ) == (2, 1, 1)
    # the counters and timings survive the truncation
    assert core.timings.llm_s > 0 and core.timings.env_s > 0


def test_a_failure_never_reaches_the_context(chat: ChatFormat) -> None:
    core = make(chat, policy="never")
    run_action(core, chat, "ls")
    step = respond(core, chat, "```bash\nmake\n```")
    assert isinstance(step, Execute)
    core.on_sandbox_failure("exec", "sandbox_error", "OOM killed the container", now=2.0)
    assert core.restore_candidate() is None
    core.on_restarted_from_scratch(0.1, now=2.5, had_checkpoint=False)
    text = chat.tokenizer.decode(core.context)
    assert "OOM" not in text and "make" not in text
    assert core.recovery.restarts_from_scratch_with_checkpoint == 0


def test_unparseable_responses_get_an_observation_then_end_malformed(chat: ChatFormat) -> None:
    core = make(chat)
    step = respond(core, chat, "I think the bug is in line 3.")
    assert isinstance(step, Again)
    tail = chat.tokenizer.decode(core.response_ids)
    assert "Invalid response" in tail and core.loss_mask[-1] == 0
    assert isinstance(respond(core, chat, "```python\nprint(1)\n```"), Again)
    run_action(core, chat, "ls")  # a valid one resets the count
    assert isinstance(respond(core, chat, "hmm"), Again)
    assert isinstance(respond(core, chat, "hmm"), Again)
    last = respond(core, chat, "hmm")
    assert isinstance(last, Score) and last.reason == "malformed"


def test_submit_and_answers(chat: ChatFormat) -> None:
    core = make(chat)
    run_action(core, chat, "ls")
    done = respond(core, chat, "Fixed.\n```bash\nsubmit\n```")
    assert isinstance(done, Score) and done.reason == "answered"
    assert isinstance(respond(make(chat), chat, "Answer: 4"), Again)  # not how a sandbox task ends
    single = make(chat, sandbox=False)
    step = respond(single, chat, "2 + 2 = 4\nAnswer: 4")
    assert isinstance(step, Score) and step.reason == "answered" and "4" in step.detail
    other = respond(make(chat, sandbox=False), chat, "four")
    assert isinstance(other, Score) and other.reason == "malformed"


def test_limits_end_the_trajectory(chat: ChatFormat) -> None:
    core = make(chat, limits=Limits(**{**LIMITS.__dict__, "max_turns": 2}))
    run_action(core, chat, "a")
    run_action(core, chat, "b")
    end = core.next_generation(1.0)
    assert isinstance(end, Score) and end.reason == "max_turns"  # scored as it stands
    late = make(chat)
    end = late.next_generation(100.0)
    assert isinstance(end, Finish) and end.reason == "deadline" and late.finish == end
    short = make(chat, limits=Limits(**{**LIMITS.__dict__, "max_prompt_tokens": 10}))
    end = short.next_generation(1.0)
    assert isinstance(end, Score) and end.reason == "length"
    room = make(
        chat,
        limits=Limits(**{**LIMITS.__dict__, "max_context_tokens": len(chat.prompt(PROMPT)) + 5}),
    )
    gen = room.next_generation(1.0)
    assert isinstance(gen, Generate) and gen.max_tokens == 5


def test_timeouts_of_the_agent_are_observations(chat: ChatFormat) -> None:
    assert is_agent_timeout(
        "timeout", "command ran past its timeout", {"timeout_s": 5.0, "stdout_tail": ""}
    )
    assert not is_agent_timeout(
        "timeout", "no reply in time", {"subject": "belayer.env.exec", "timeout": 35.0}
    )
    assert not is_agent_timeout("sandbox_error", "dead", {})
    core = make(chat)
    respond(core, chat, "```bash\nsleep 100\n```")
    core.on_observation(stdout="partial", stderr="", exit_code=-1, env_s=5.0, timed_out=True)
    assert core.actions[-1].timed_out
    assert "timeout" in chat.tokenizer.decode(core.response_ids)


def test_checkpoint_decisions_are_logged_with_their_inputs(chat: ChatFormat) -> None:
    core = make(chat, policy="risk-aware")
    _, decision, pending = run_action(core, chat, "ls")
    (logged,) = core.recovery.decisions
    assert logged.prefix == 1 and logged.policy == "risk-aware"
    assert logged.checkpoint == decision.checkpoint and logged.reason == decision.reason
    assert logged.regen_cost_s == pytest.approx(0.3) and logged.checkpoint_cost_s == 0.3
    assert (pending is None) == (not decision.checkpoint)


def test_checkpoint_timeout_starts_the_cooldown(chat: ChatFormat) -> None:
    core = make(chat)
    _, _, pending = run_action(core, chat, "ls")
    assert pending is not None
    core.on_checkpoint_failed(pending, "timeout", timed_out=True, seconds=15.0, now=10.0)
    _, decision, again = run_action(core, chat, "ls")
    assert decision.reason == "cooldown" and again is None
    assert core.recovery.checkpoint_failures == 1 and core.ready == []


def test_engine_handovers_are_counted(chat: ChatFormat, tmp_path: Path) -> None:
    core = make(chat)
    respond(core, chat, "```bash\nls\n```", resumes=1)
    assert core.recovery.engine_handovers == 1
    assert core.recovery.entries[-1].kind == "engine_handover"


def test_a_response_outside_the_vocabulary_cannot_be_continued(chat: ChatFormat) -> None:
    vocab = chat.tokenizer.vocab_size
    core = make(chat, limits=Limits(**{**LIMITS.__dict__, "vocab_size": vocab}))
    assert isinstance(core.next_generation(1.0), Generate)
    step = core.on_response([5, vocab + 3, chat.im_end], [0.0] * 3, [1] * 3, "x", llm_s=0.1)
    assert isinstance(step, Score) and step.reason == "malformed" and "vocabulary" in step.detail


def test_steps_are_numbered_over_the_attempt(chat: ChatFormat) -> None:
    """A step that failed and is run again after a restore gets a new number, so a ``p``
    injection draws afresh instead of firing at the same step for ever."""
    core = make(chat)
    assert core.begin_step() == 1
    core.on_sandbox_failure("exec", "sandbox_error", "dead", now=1.0)
    core.on_restarted_from_scratch(0.1, now=1.1, had_checkpoint=False)
    assert core.begin_step() == 2 and core.env_steps == 2
