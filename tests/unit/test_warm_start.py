"""The warm start's demonstrations and training (pure parts, real tiny torch models): the loss
mask covers exactly the assistant turns; a demonstration's token ids are the very context the
controller builds when the model produces those responses; math and SWE transcripts follow
the action convention; training lowers the loss on assistant tokens only; the model cache
builds once."""

from __future__ import annotations

import itertools
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from model.chat import ChatFormat
from model.config import load_model_config
from model.loader import load_safetensors
from model.tokenizer import load_tokenizer
from model.train_forward import build_trainable_model, token_logprobs
from model.warm_start import (
    STAMP_FILE,
    Demonstration,
    SftConfig,
    cache_key,
    cached_model_dir,
    encode_demonstration,
    install,
    lr_factor,
    masked_nll,
    read_demonstrations,
    read_stamp,
    render_text,
    split_transcript,
    train_chat_tokenizer,
    train_model_dir,
    train_sft,
    write_demonstrations,
)
from services.controller.core import Execute, Generate, Limits, Score, TrajectoryCore
from services.controller.policy import CheckpointPolicy, PolicyConfig
from services.rl.demonstrations import (
    MATH_DEMOS,
    MATH_DIRECT_SHARE,
    READ_COMMAND,
    SWE_DEMO_SEED,
    SWE_NAMED_SHARE,
    TEST_COMMAND,
    THOUGHTS,
    copy_drills,
    edited_module,
    general_actions,
    long_episode,
    math_demonstrations,
    math_response,
    math_working,
    named_actions,
    swe_transcript,
    swe_variant,
)
from services.rl.warm import SFT
from tests.unit.model_fixtures import write_small_model
from workloads import (
    FINISH_COMMAND,
    AnswerAction,
    BashAction,
    SubmitAction,
    format_observation,
    load_workload,
    parse_action,
)

SYSTEM = "You fix a bug. One ```bash block per response."
TASK = "calc.clamp is wrong. Fix calc.py."
# (command, stdout, exit code) of a small episode, then the submit.
STEPS = [("ls", "calc.py\ntests\n", 0), ("sed -i 's/lo)/hi)/' calc.py", "", 0), ("false", "", 1)]
OBS_CHARS = 1000


def observation(stdout: str, exit_code: int) -> str:
    return format_observation(stdout, "", exit_code, limit_chars=OBS_CHARS)


def transcript() -> tuple[tuple[str, str], ...]:
    turns: list[tuple[str, str]] = [("system", SYSTEM), ("user", TASK)]
    for command, out, code in STEPS:
        turns += [("assistant", f"```bash\n{command}\n```"), ("user", observation(out, code))]
    return (*turns, ("assistant", f"```bash\n{FINISH_COMMAND}\n```"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_small_model(tmp_path_factory.mktemp("m"))


@pytest.fixture(scope="module")
def chat(model_dir: Path) -> ChatFormat:
    return ChatFormat(load_tokenizer(model_dir))


def test_mask_is_one_exactly_on_the_assistant_turns_and_their_end_token(chat: ChatFormat) -> None:
    messages = transcript()
    ex = encode_demonstration(chat, messages)
    assert len(ex.ids) == len(ex.mask)
    # The masked runs, decoded, are the assistant turns (each closed by <|im_end|>), in order.
    runs: list[list[int]] = []
    for i, (tok, m) in enumerate(zip(ex.ids, ex.mask, strict=True)):
        if m and (i == 0 or not ex.mask[i - 1]):
            runs.append([])
        if m:
            runs[-1].append(tok)
    wanted = [c for r, c in messages if r == "assistant"]
    assert [chat.tokenizer.decode(r) for r in runs] == [f"{c}<|im_end|>" for c in wanted]
    assert all(r[-1] == chat.im_end for r in runs)
    # Nothing of the prompt or of an observation is masked in.
    unmasked = chat.tokenizer.decode([t for t, m in zip(ex.ids, ex.mask, strict=True) if not m])
    for role, content in messages:
        if role != "assistant":
            assert content in unmasked
    assert "sed -i" not in unmasked and FINISH_COMMAND not in unmasked


def test_demonstration_ids_are_the_whole_template_text_encoded(chat: ChatFormat) -> None:
    messages = transcript()
    ex = encode_demonstration(chat, messages)
    text = chat.render(messages, add_generation_prompt=False)
    assert render_text(messages) == text
    # The template text ends with "<|im_end|>\n"; the demonstration ends at the <|im_end|>.
    assert ex.ids + chat.tokenizer.encode("\n") == chat.tokenizer.encode(text)


def test_demonstration_is_byte_identical_to_the_controllers_context(chat: ChatFormat) -> None:
    """Drive the controller's trajectory state machine with the demonstration's responses and
    observations: its context and loss mask are the demonstration's ids and mask."""
    limits = Limits(
        max_turns=20, max_invalid_in_row=3, max_prompt_tokens=1536, max_context_tokens=2048,
        max_response_tokens=256, observation_chars=OBS_CHARS, action_timeout_s=30.0,
        deadline_s=100.0,
    )  # fmt: skip
    core = TrajectoryCore(
        trajectory_id="r1-s0-a0",
        prompt_ids=chat.prompt([("system", SYSTEM), ("user", TASK)]),
        limits=limits,
        policy=CheckpointPolicy(PolicyConfig(kind="never")),
        sample_seed=1,
        has_sandbox=True,
        started_at=0.0,
        observation_ids=chat.observation,
    )
    for command, out, code in [*STEPS, (FINISH_COMMAND, "", 0)]:
        gen = core.next_generation(1.0)
        assert isinstance(gen, Generate)
        ids = [*chat.tokenizer.encode(f"```bash\n{command}\n```"), chat.im_end]
        text = chat.tokenizer.decode(ids, skip_special_tokens=True)
        step = core.on_response(ids, [0.0] * len(ids), [0] * len(ids), text, llm_s=0.1)
        if command == FINISH_COMMAND:
            assert isinstance(step, Score)
            break
        assert isinstance(step, Execute) and step.command == command
        core.on_observation(stdout=out, stderr="", exit_code=code, env_s=0.1)
    ex = encode_demonstration(chat, transcript())
    assert core.context == ex.ids
    assert [0] * len(core.prompt_ids) + core.loss_mask == ex.mask


def test_transcripts_that_break_the_turn_order_are_refused() -> None:
    with pytest.raises(ValueError, match="assistant turn"):
        split_transcript([("system", "s"), ("user", "u")])
    with pytest.raises(ValueError, match="expected 'user'"):
        split_transcript([("user", "u"), ("assistant", "a"), ("assistant", "b")])
    with pytest.raises(ValueError, match="ends on an assistant"):
        split_transcript([("user", "u"), ("assistant", "a"), ("user", "o")])
    with pytest.raises(ValueError, match="prompt turns"):
        split_transcript([("assistant", "a")])
    with pytest.raises(ValueError, match="unknown roles"):
        split_transcript([("tool", "t"), ("assistant", "a")])


def test_math_demonstrations_answer_in_the_convention(tmp_path: Path) -> None:
    math = load_workload("math")
    for task in math.tasks(200, seed=3):
        response = math_response(task)
        action = parse_action(response)
        assert isinstance(action, AnswerAction) and action.answer == task.reference_answer
        assert response.splitlines()[-1] == f"Answer: {task.reference_answer}"
    assert math_working("66 - 15 - 90") == (["66 - 15 = 51", "51 - 90 = -39"], -39)
    assert math_working("5 + 10") == (["5 + 10 = 15"], 15)
    # The recipe trains two and a half passes over the demonstrations.
    assert 2 * SFT["math"]["steps"] * SFT["math"]["batch_size"] == 5 * MATH_DEMOS
    demos = math_demonstrations(tmp_path, count=400)
    assert len({d.task_id for d in demos}) == 400
    # About MATH_DIRECT_SHARE answer at once, the rest work the sum out; each answers right.
    direct = [d for d in demos if d.variant == "direct"]
    assert abs(len(direct) / len(demos) - MATH_DIRECT_SHARE) < 0.08
    assert all(d.messages[-1][1].startswith("Answer: ") for d in direct)
    assert all(d.messages[-1][1].count("\n") >= 2 for d in demos if d.variant == "working")
    tasks = {t.id: t for t in math.tasks(400, seed=0)}
    for d in demos:
        answer = parse_action(d.messages[-1][1])
        assert isinstance(answer, AnswerAction)
        assert answer.answer == tasks[d.task_id].reference_answer
    held = {t.prompt[-1].content for t in math.held_out(256)}
    assert not held & {d.messages[-2][1] for d in demos}


def test_swe_transcript_acts_then_submits() -> None:
    swe = load_workload("swe", check_image=False)
    task = swe.task("kv_daemon")
    actions = list(task.reference_actions)
    observations = [f"exit_code: {i}" for i in range(len(actions))]
    turns = swe_transcript(task, actions, observations)
    assert turns[: len(task.prompt)] == tuple((m.role, m.content) for m in task.prompt)
    replies = [c for r, c in turns if r == "assistant"]
    assert [parse_action(r) for r in replies[:-1]] == [BashAction(a) for a in actions]
    assert parse_action(replies[-1]) == SubmitAction()
    assert [c for r, c in turns[len(task.prompt) :] if r == "user"] == observations


def test_long_episodes_explore_fix_and_test_with_a_thought_before_each_action() -> None:
    swe = load_workload("swe", check_image=False)
    for task in swe.tasks(len(swe.train)):  # type: ignore[attr-defined]  # train: not in the Workload protocol
        steps = long_episode(task)
        commands = [c for _, c in steps]
        module = edited_module(task)
        assert commands[:6] == [
            "ls", "ls tests", "cat tests/*.py", "python3 -m pytest -q", f"cat {module}",
            "grep -n 'def ' *.py",
        ]  # fmt: skip
        assert commands[6:-1] == list(task.reference_actions)
        assert commands[-1] == "python3 -m pytest -q"
        assert all(thought in THOUGHTS.values() for thought, _ in steps)
        observations = [f"exit_code: {i}" for i in range(len(steps))]
        turns = swe_transcript(
            task, commands, observations, [t for t, _ in steps], THOUGHTS["submit"]
        )
        replies = [c for r, c in turns if r == "assistant"]
        assert all(r.startswith("THOUGHT: ") for r in replies)
        assert [parse_action(r) for r in replies[:-1]] == [BashAction(c) for c in commands]
        assert parse_action(replies[-1]) == SubmitAction()
    assert edited_module(swe.task("kv_daemon")) == "kvd.py"


def test_demonstrations_round_trip_through_jsonl(tmp_path: Path) -> None:
    demos = [Demonstration("t1", transcript(), "reference"), Demonstration("t2", transcript())]
    path = write_demonstrations(tmp_path / "d.jsonl", demos)
    assert read_demonstrations(path) == demos


def test_the_loss_counts_only_the_assistant_tokens(model_dir: Path, chat: ChatFormat) -> None:
    model = build_trainable_model(load_model_config(model_dir), load_safetensors(model_dir))
    ex = encode_demonstration(chat, transcript())
    ids = torch.tensor([ex.ids])
    attn = torch.ones_like(ids)
    mask = torch.tensor([ex.mask], dtype=torch.bool)
    loss, count = masked_nll(model, ids, attn, mask)
    assert count == sum(ex.mask[1:])
    with torch.no_grad():
        lp = token_logprobs(model, ids, attn)
    expected = -(lp * mask[:, 1:]).sum()
    assert torch.allclose(loss.detach(), expected, rtol=1e-4)


def test_training_memorises_demonstrations(model_dir: Path, chat: ChatFormat) -> None:
    model = build_trainable_model(load_model_config(model_dir), load_safetensors(model_dir))
    examples = [encode_demonstration(chat, transcript())]
    cfg = SftConfig(steps=30, batch_size=2, lr=1e-2, warmup_steps=2, threads=1)
    result = train_sft(model, examples, cfg)
    assert result.steps == 30 and len(result.losses) == 30
    assert result.losses[-1] < 0.2 * result.losses[0], result.losses


def test_the_stamp_says_which_machine_trained_the_model(model_dir: Path, tmp_path: Path) -> None:
    from common.machine import cpu_model

    def init(out: Path) -> Path:
        shutil.copytree(model_dir, out)
        return out

    demo = Demonstration(task_id="t0", messages=transcript())
    cfg = SftConfig(steps=2, batch_size=1, lr=1e-3, warmup_steps=1, threads=1)
    train_model_dir(tmp_path / "out", [demo], cfg, init, key="k")
    stamp = read_stamp(tmp_path / "out")
    assert stamp is not None and stamp["key"] == "k" and stamp["steps"] == 2
    name, flags = cpu_model()
    assert (stamp["machine"]["cpu_model"], stamp["machine"]["cpu_flags"]) == (name, flags)
    assert stamp["machine"]["torch"] == torch.__version__


def test_the_learning_rate_warms_up_then_decays_by_cosine() -> None:
    cfg = SftConfig(steps=11, warmup_steps=2, decay="cosine", min_lr_ratio=0.1)
    factors = [lr_factor(cfg, s) for s in range(cfg.steps)]
    assert factors[:3] == [0.5, 1.0, 1.0]  # warm-up, then the peak at the decay's start
    assert factors[-1] == pytest.approx(0.1)  # the floor at the last step
    assert all(a >= b for a, b in itertools.pairwise(factors[2:]))
    assert factors[2 + 9 // 2] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 8)))
    constant = SftConfig(steps=11, warmup_steps=2)
    assert [lr_factor(constant, s) for s in range(11)] == [0.5] + [1.0] * 10
    with pytest.raises(ValueError, match="decay"):
        SftConfig(decay="linear")  # type: ignore[arg-type]  # an unknown decay, on purpose
    with pytest.raises(ValueError, match="min_lr_ratio"):
        SftConfig(decay="cosine", min_lr_ratio=1.5)


def test_training_follows_the_schedule(model_dir: Path, chat: ChatFormat) -> None:
    model = build_trainable_model(load_model_config(model_dir), load_safetensors(model_dir))
    examples = [encode_demonstration(chat, transcript())]
    cfg = SftConfig(
        steps=6, batch_size=1, lr=1e-3, warmup_steps=1, decay="cosine", min_lr_ratio=0.2,
        threads=1,
    )  # fmt: skip
    result = train_sft(model, examples, cfg)
    assert result.lrs == pytest.approx([1e-3 * lr_factor(cfg, s) for s in range(6)])


def test_chat_tokenizer_keeps_special_ids_and_splits_digits(tmp_path: Path) -> None:
    tok = train_chat_tokenizer([render_text(transcript())] * 4 + ["12 + 345 = 357"], 600)
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [
        0, 1, 2,
    ]  # fmt: skip
    enc = tok.encode("answer 357")
    assert enc.tokens[-3:] == ["3", "5", "7"]
    text = render_text(transcript())
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_copy_drills_repeat_training_names_exactly_and_are_deterministic() -> None:
    from workloads.swe_families import HELD_OUT_POOLS

    drills = copy_drills(200, seed=3)
    assert drills == copy_drills(200, seed=3) != copy_drills(200, seed=4)
    held = set(HELD_OUT_POOLS.nouns + HELD_OUT_POOLS.words)
    for d in drills:
        (role, ask), (role2, answer) = d.messages
        assert (role, role2, d.variant) == ("user", "assistant", "drill")
        assert ask == "Repeat exactly:\n" + answer and 3 <= len(answer.split("\n")) <= 8
        assert not set(re.findall(r"[a-z]+", answer.lower())) & held, answer
    assert len({d.messages[1][1] for d in drills}) == 200


def test_unmerged_names_split_into_pieces_and_the_rest_still_merges() -> None:
    text = "def scale_nanet(lal):\n    return lal * NANET\n```bash\ncat nanet.py\n```\n"
    plain = train_chat_tokenizer([text] * 50, 600)
    cut = train_chat_tokenizer([text] * 50, 600, unmerged=("nanet", "lal"))
    assert len(plain.encode(" nanet").ids) == 1  # a name seen often is one token …
    assert len(cut.encode(" nanet").ids) > 1  # … unless its letters teach no merge
    assert len(cut.encode("lal").ids) > 1 and len(cut.encode("NANET").ids) > 1  # any case
    for word in ("bash", " return", "def"):  # words around them merge as before
        assert len(cut.encode(word).ids) == len(plain.encode(word).ids) == 1, word
    assert cut.decode(cut.encode(text).ids) == text


def test_loss_on_all_tokens_trains_the_observations_too(model_dir: Path, chat: ChatFormat) -> None:
    with pytest.raises(ValueError, match="loss_on"):
        SftConfig(loss_on="prompt")  # type: ignore[arg-type]  # unknown, on purpose
    ex = encode_demonstration(chat, transcript())
    ids, attn = torch.tensor([ex.ids]), torch.ones(1, len(ex.ids), dtype=torch.long)
    context = torch.tensor([[0] + [1 - m for m in ex.mask[1:]]], dtype=torch.bool)
    after = {}
    for loss_on in ("responses", "all"):
        model = build_trainable_model(load_model_config(model_dir), load_safetensors(model_dir))
        cfg = SftConfig(steps=20, batch_size=1, lr=1e-2, warmup_steps=2, threads=1, loss_on=loss_on)
        train_sft(model, [ex], cfg)
        with torch.no_grad():
            loss, count = masked_nll(model, ids, attn, context)
        after[loss_on] = float(loss) / count
    assert after["all"] < 0.5 * after["responses"], after


def test_the_model_cache_builds_once_and_installs_copies(tmp_path: Path) -> None:
    builds: list[Path] = []

    def build(d: Path) -> None:
        builds.append(d)
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        (d / STAMP_FILE).write_text('{"key": "k1"}')

    first, built = cached_model_dir(tmp_path / "cache", "k1", build)
    again, built_again = cached_model_dir(tmp_path / "cache", "k1", build)
    assert (first, built) == (again, True) and not built_again and len(builds) == 1
    out = install(first, tmp_path / "out")
    assert read_stamp(out) == {"key": "k1"} and (out / "config.json").read_text() == "{}"
    assert not list((tmp_path / "cache").glob("*.tmp-*"))


def test_the_cache_key_follows_every_input() -> None:
    demos = [Demonstration("t1", transcript())]
    base = {"tiny": {"hidden_size": 64}}
    key = cache_key(demos, SftConfig(), base)
    assert key == cache_key(list(demos), SftConfig(), dict(base))
    assert key != cache_key(demos, SftConfig(steps=7), base)
    assert key != cache_key(demos, SftConfig(loss_on="all"), base)
    assert key != cache_key(demos, SftConfig(), {"tiny": {"hidden_size": 128}})
    other = [Demonstration("t1", (*transcript()[:-1], ("assistant", "x")))]
    assert key != cache_key(other, SftConfig(), base)


def test_each_swe_demonstration_writes_its_fix_with_names_or_without() -> None:
    """One recipe per demonstrated task (``swe_variant``, a hash of the id): the same test run
    and read, then the reference ``sed`` with the instance's names (``named``) or the
    family's name-free ``sed -E`` (``pattern``) — in about ``SWE_NAMED_SHARE`` / the rest."""
    swe = load_workload("swe", check_image=False)
    tasks = swe.tasks(330, seed=SWE_DEMO_SEED)
    named = sum(swe_variant(t) == "named" for t in tasks) / len(tasks)
    assert abs(named - SWE_NAMED_SHARE) < 0.08
    assert [swe_variant(t) for t in tasks] == [swe_variant(t) for t in tasks]  # stable
    for task in tasks[:22]:
        plain, with_names = general_actions(task), named_actions(task)
        assert plain[:2] == with_names[:2] == [TEST_COMMAND, READ_COMMAND]
        assert plain[3] == with_names[3] == TEST_COMMAND
        assert (
            plain[2] == task.metadata["pattern_fix"] and with_names[2] == task.reference_actions[0]
        )
        assert task.metadata["module"] in with_names[2]
        assert task.metadata["module"] not in plain[2] and plain[2].startswith("find . -name")
