"""Supervised warm start of a tiny model on demonstrations (the model layer's half: no
workloads, no services — the demonstrations come in as chat transcripts).

A random tiny model emits no valid actions; a few minutes of supervised training on
demonstrations in the action convention give it a policy that acts, so rollouts exercise the
whole loop and GRPO gets a signal. The pieces:

- :class:`Demonstration`: a whole chat transcript (the task's prompt turns, then assistant
  turns alternating with user turns, ending on an assistant turn), stored one JSON object a
  line (:func:`write_demonstrations` / :func:`read_demonstrations`).
- :func:`encode_demonstration`: token ids and a loss mask, built from the same
  :class:`model.chat.ChatFormat` pieces the controller appends at rollout time — the prompt
  (L_0), each response (``encode(content) + <|im_end|>``, mask 1), each observation turn and
  the next generation header (mask 0) — so a demonstration is byte-identical to the context
  the controller would have built had the model produced those responses.
- :func:`train_sft`: AdamW steps of :func:`model.training.train_step` on the mean negative
  log-likelihood of the assistant tokens, with :func:`model.train_forward.dense_hidden`
  (logits computed at the assistant positions only).
- :func:`init_base_model`: a random tiny Qwen3 (:func:`model.tiny.init_tiny_model`) whose
  byte-level BPE is trained on the demonstrations' text, digits one per token.
- :func:`train_model_dir`: that base model trained, its weights and a stamp
  (:data:`STAMP_FILE`) written; ``<|im_end|>`` made an EOS of ``config.json``.
- :func:`cache_key` / :func:`cached_model_dir` / :func:`install`: the directory is cached
  under a key of the demonstrations, the settings and the base model's shape; a second
  request with the same inputs copies the cached directory instead of training.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import random
import re
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer

from common.machine import machine_info
from common.training_config import OptimConfig
from model.chat import IM_END, IM_START, ChatFormat
from model.config import load_model_config
from model.loader import load_safetensors
from model.qwen3 import Qwen3ForCausalLM
from model.tiny import SPECIAL_TOKENS, init_tiny_model, train_bpe
from model.tokenizer import load_tokenizer
from model.train_forward import build_trainable_model, dense_hidden
from model.training import make_optimizer, seed_everything, threads, train_step

STAMP_FILE = "warm_start.json"
"""What a warm-started model directory records about how it was made (its cache key first)."""

RECIPE_VERSION = 2
"""Bumped whenever the training code changes what a given key would produce (2: the
learning-rate schedule, ``SftConfig.decay``)."""

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Demonstration:
    """One supervised example: a chat transcript in the action convention."""

    task_id: str
    """The task it demonstrates (provenance)."""
    messages: tuple[tuple[str, str], ...]
    """``(role, content)`` turns: the task's prompt (system/user), then assistant turns
    alternating with user (observation) turns, the last one an assistant turn."""
    variant: str = ""
    """Which recipe made it (e.g. ``reference``, ``look-first``)."""

    def to_json(self) -> str:
        return json.dumps(
            {"task_id": self.task_id, "variant": self.variant, "messages": self.messages},
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, line: str) -> Demonstration:
        raw = json.loads(line)
        return cls(
            task_id=str(raw["task_id"]),
            messages=tuple((str(r), str(c)) for r, c in raw["messages"]),
            variant=str(raw.get("variant", "")),
        )


def write_demonstrations(path: Path, demos: Sequence[Demonstration]) -> Path:
    """Write ``demos`` as JSON lines, atomically (a temporary file, then ``rename``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(d.to_json() + "\n" for d in demos))
    os.replace(tmp, path)
    return path


def read_demonstrations(path: Path) -> list[Demonstration]:
    """The demonstrations of a JSON-lines file."""
    return [Demonstration.from_json(x) for x in Path(path).read_text().splitlines() if x.strip()]


def demonstrations_digest(demos: Sequence[Demonstration]) -> str:
    """sha256 of the demonstrations' canonical JSON lines."""
    h = hashlib.sha256()
    for d in demos:
        h.update(d.to_json().encode() + b"\n")
    return h.hexdigest()


# --- encoding ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Example:
    """A demonstration as the model sees it."""

    ids: list[int]
    """The whole transcript's token ids."""
    mask: list[int]
    """1 on the tokens the model is trained to produce (its responses, each ``<|im_end|>``
    included), 0 on the prompt, the observations and the generation headers."""


def split_transcript(
    messages: Sequence[tuple[str, str]],
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(the prompt turns, the turns from the first assistant turn on); ``ValueError`` unless
    the rest alternates assistant/user and ends on an assistant turn."""
    roles = [r for r, _ in messages]
    bad = [r for r in roles if r not in ROLES]
    if bad:
        raise ValueError(f"unknown roles {bad}")
    if "assistant" not in roles:
        raise ValueError("a demonstration needs at least one assistant turn")
    first = roles.index("assistant")
    if first == 0:
        raise ValueError("a demonstration starts with the task's prompt turns")
    rest = list(messages[first:])
    for i, (role, _) in enumerate(rest):
        want = "assistant" if i % 2 == 0 else "user"
        if role != want:
            raise ValueError(f"turn {first + i} is {role!r}, expected {want!r}")
    if rest[-1][0] != "assistant":
        raise ValueError("a demonstration ends on an assistant turn")
    return list(messages[:first]), rest


def render_text(messages: Sequence[tuple[str, str]]) -> str:
    """The transcript as ChatML text (``chat_template`` semantics, no generation prompt):
    :func:`encode_demonstration`'s ids decode to it, less its final newline."""
    return "".join(f"{IM_START}{role}\n{content}{IM_END}\n" for role, content in messages)


def encode_demonstration(chat: ChatFormat, messages: Sequence[tuple[str, str]]) -> Example:
    """Token ids and loss mask of a transcript, from the controller's own pieces:
    ``chat.prompt`` (L_0), then per response ``encode(content) + <|im_end|>`` (mask 1) and
    per observation ``chat.observation(response, text)`` (mask 0)."""
    prompt, rest = split_transcript(messages)
    ids = chat.prompt(prompt)
    mask = [0] * len(ids)
    response: list[int] = []
    for role, content in rest:
        if role == "assistant":
            response = [*chat.tokenizer.encode(content), chat.im_end]
            ids += response
            mask += [1] * len(response)
        else:
            turn = chat.observation(response, content)
            ids += turn
            mask += [0] * len(turn)
    return Example(ids, mask)


# --- training ---------------------------------------------------------------------------
@dataclass(frozen=True)
class SftConfig:
    """How the warm start trains (all of it is part of the cache key)."""

    steps: int = 600
    """Optimiser steps."""
    batch_size: int = 32
    """Examples per step (drawn as shuffled epochs over the examples)."""
    lr: float = 3e-3
    """Peak AdamW learning rate."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    decay: Literal["constant", "cosine"] = "constant"
    """After the warm-up: the peak ``lr`` throughout, or a cosine decay to
    ``min_lr_ratio · lr`` at the last step."""
    min_lr_ratio: float = 0.0
    """The cosine decay's floor, as a fraction of ``lr``."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip of each step."""
    micro_batch_tokens: int = 8192
    """Padded tokens per forward/backward pass (a step's batch is split to fit; gradients
    accumulate, so the update is the same)."""
    max_tokens: int = 2048
    """Longest example (longer ones are refused)."""
    seed: int = 0
    """Seed of the initial weights' training order and torch's RNG."""
    loss_on: Literal["responses", "all"] = "responses"
    """The tokens the loss is taken on: the model's ``responses`` (``Example.mask``), or
    ``all`` of a transcript — the prompt and the observations too, which teaches a small model
    to read what it is shown (a name in an observation is the name it must write later)."""
    threads: int = 2
    """torch intra-op threads while training (not part of what is learnt; kept in the key
    anyway: float sums depend on it)."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.micro_batch_tokens < 1:
            raise ValueError("steps, batch_size and micro_batch_tokens must be >= 1")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.loss_on not in ("responses", "all"):
            raise ValueError(f"loss_on must be responses or all, got {self.loss_on!r}")
        if self.decay not in ("constant", "cosine") or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(
                f"decay must be constant or cosine and 0 <= min_lr_ratio <= 1, got "
                f"{self.decay!r}, {self.min_lr_ratio}"
            )


@dataclass
class SftResult:
    """What :func:`train_sft` did."""

    steps: int = 0
    """Optimiser steps taken."""
    seconds: float = 0.0
    """Wall time of the training."""
    losses: list[float] = field(default_factory=list)
    """Mean assistant-token NLL of every step."""
    lrs: list[float] = field(default_factory=list)
    """Learning rate of every step."""

    @property
    def final_loss(self) -> float:
        """Mean loss of the last tenth of the steps."""
        tail = self.losses[-max(1, len(self.losses) // 10) :]
        return sum(tail) / len(tail) if tail else float("nan")


def _batches(n: int, cfg: SftConfig) -> Iterator[list[int]]:
    """Indices of each step's examples: shuffled epochs, concatenated, cut in batches."""
    rng = random.Random(cfg.seed)
    order: list[int] = []
    while True:
        while len(order) < cfg.batch_size:
            epoch = list(range(n))
            rng.shuffle(epoch)
            order += epoch
        yield order[: cfg.batch_size]
        order = order[cfg.batch_size :]


def _micro_batches(examples: list[Example], budget: int) -> list[list[Example]]:
    """Split a batch (sorted by length) into groups whose padded size fits ``budget``."""
    groups: list[list[Example]] = []
    current: list[Example] = []
    for ex in sorted(examples, key=lambda e: len(e.ids)):
        if current and (len(current) + 1) * len(ex.ids) > budget:
            groups.append(current)
            current = []
        current.append(ex)
    if current:
        groups.append(current)
    return groups


def _pad(group: list[Example]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(e.ids) for e in group)
    ids = torch.zeros(len(group), width, dtype=torch.long)
    attn = torch.zeros(len(group), width, dtype=torch.long)
    mask = torch.zeros(len(group), width, dtype=torch.bool)
    for i, e in enumerate(group):
        ids[i, : len(e.ids)] = torch.tensor(e.ids)
        attn[i, : len(e.ids)] = 1
        mask[i, : len(e.ids)] = torch.tensor(e.mask, dtype=torch.bool)
    return ids, attn, mask


def masked_nll(
    model: Qwen3ForCausalLM, ids: torch.Tensor, attn: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Summed negative log-likelihood of the tokens where ``mask`` is 1 (each predicted from
    the tokens before it) and their count. Logits are computed at those positions only."""
    hidden = dense_hidden(model, ids, attn)[:, :-1]
    target = mask[:, 1:]
    picked = hidden[target]
    logits = model.compute_logits(picked).float()
    loss = F.cross_entropy(logits, ids[:, 1:][target], reduction="sum")
    return loss, int(target.sum())


def lr_factor(cfg: SftConfig, step: int) -> float:
    """The learning rate of optimiser step ``step`` (0-based) as a fraction of ``cfg.lr``:
    linear warm-up, then constant or a cosine down to ``cfg.min_lr_ratio`` at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return 1.0
    span = max(1, cfg.steps - 1 - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def train_sft(
    model: Qwen3ForCausalLM,
    examples: Sequence[Example],
    cfg: SftConfig,
    *,
    progress: Callable[[int, float], None] | None = None,
) -> SftResult:
    """Train ``model`` in place: ``cfg.steps`` AdamW steps, each on ``cfg.batch_size``
    examples, loss = mean NLL over the batch's assistant tokens."""
    if not examples:
        raise ValueError("no demonstrations to train on")
    long = [len(e.ids) for e in examples if len(e.ids) > cfg.max_tokens]
    if long:
        raise ValueError(f"{len(long)} demonstrations exceed {cfg.max_tokens} tokens: {long[:3]}")
    if any(not any(e.mask) for e in examples):
        raise ValueError("a demonstration has no assistant token")
    if cfg.loss_on == "all":
        examples = [Example(e.ids, [0] + [1] * (len(e.ids) - 1)) for e in examples]
    optim = OptimConfig(
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        warmup_steps=cfg.warmup_steps,
        seed=cfg.seed,
    )
    seed_everything(cfg.seed)
    optimizer = make_optimizer(model, optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(cfg, step))
    result = SftResult()
    t0 = time.perf_counter()
    batches = _batches(len(examples), cfg)
    with threads(cfg.threads):
        for step in range(cfg.steps):
            batch = [examples[i] for i in next(batches)]
            total = sum(sum(e.mask) for e in batch)
            groups = [_pad(g) for g in _micro_batches(batch, cfg.micro_batch_tokens)]

            def loss_fn(
                micro: tuple[torch.Tensor, torch.Tensor, torch.Tensor], total: int = total
            ) -> torch.Tensor:
                loss, _ = masked_nll(model, *micro)
                return loss / total

            result.lrs.append(float(optimizer.param_groups[0]["lr"]))
            stats = train_step(
                model, optimizer, scheduler, [groups], loss_fn, max_grad_norm=cfg.max_grad_norm
            )
            result.losses.append(stats.loss)
            result.steps = step + 1
            if progress is not None:
                progress(step + 1, stats.loss)
    model.eval()
    result.seconds = time.perf_counter() - t0
    return result


# --- the base model ---------------------------------------------------------------------
def train_chat_tokenizer(
    texts: Sequence[str], vocab_size: int, seed: int = 0, unmerged: Sequence[str] = ()
) -> Tokenizer:
    """A byte-level BPE for the demonstrations' text: the tiny model's special tokens (same
    ids), digits split one per token (as Qwen's tokenizer does: arithmetic stays learnable),
    merges learnt from ``texts`` (any other text still encodes, byte by byte at worst).

    ``unmerged``: words whose letters teach no merge (cut out of the corpus wherever no letter
    touches them — ``scale_nanet`` loses ``nanet`` — in any case): names
    a task draws at random then split into the short pieces any other name splits into, so a
    name the model never saw is as easy to copy as one it did."""
    corpus = list(texts)
    if unmerged:
        words = "|".join(re.escape(w) for w in sorted(set(unmerged), key=len, reverse=True))
        pattern = re.compile(f"(?<![a-z])(?:{words})(?![a-z])", re.IGNORECASE)
        corpus = [pattern.sub(" ", t) for t in corpus]
    random.Random(seed).shuffle(corpus)
    return train_bpe(corpus, vocab_size, split_digits=True)


def init_base_model(
    out_dir: Path,
    demos: Sequence[Demonstration],
    tiny: dict[str, Any],
    unmerged: Sequence[str] = (),
) -> Path:
    """A random tiny Qwen3 (``model.tiny.init_tiny_model(**tiny)``) whose tokenizer is
    trained on the demonstrations' text (shorter sequences: a faster warm start), learning no
    merge from the ``unmerged`` words (``train_chat_tokenizer``)."""
    root = init_tiny_model(out_dir, **tiny)
    vocab = int(tiny.get("vocab_size", 4096))
    texts = [render_text(d.messages) for d in demos]
    tok = train_chat_tokenizer(texts, vocab, int(tiny.get("seed", 0)), unmerged)
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"special token {name} got id {tok.token_to_id(name)}, not {i}")
    tok.save(str(root / "tokenizer.json"))
    return root


# --- model directories and their cache --------------------------------------------------
KEY_LATER: dict[str, Any] = {"loss_on": "responses"}
"""``SftConfig`` fields added after models were cached, with their defaults (``cache_key``)."""


def cache_key(demos: Sequence[Demonstration], cfg: SftConfig, base: dict[str, Any]) -> str:
    """What a warm-started directory depends on: the demonstrations, the training settings,
    the base model's settings (shape, seed) and the recipe version. A setting added after
    models were cached (``KEY_LATER``) counts only when it is not at its default, so their keys
    stay valid."""
    sft = {k: v for k, v in asdict(cfg).items() if KEY_LATER.get(k, object()) != v}
    payload = json.dumps(
        {
            "recipe": RECIPE_VERSION,
            "demonstrations": demonstrations_digest(demos),
            "sft": sft,
            "base": base,
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def read_stamp(model_dir: Path) -> dict[str, Any] | None:
    """The stamp of a warm-started directory, or None (not one, or unreadable)."""
    try:
        stamp: dict[str, Any] = json.loads((Path(model_dir) / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def _eos_with_im_end(model_dir: Path) -> None:
    """Make ``<|im_end|>`` an EOS of ``config.json`` (as Qwen's chat models have it), so an
    engine that reads the config stops where a chat response ends."""
    tok = load_tokenizer(model_dir)
    im_end = ChatFormat(tok).im_end
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    eos = config.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    config["eos_token_id"] = [im_end, *[i for i in ids if i != im_end]]
    path.write_text(json.dumps(config, indent=2) + "\n")


def train_model_dir(
    out_dir: Path,
    demos: Sequence[Demonstration],
    cfg: SftConfig,
    init: Callable[[Path], Path],
    *,
    key: str = "",
    info: dict[str, Any] | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> SftResult:
    """Write a base model with ``init(out_dir)``, train it on ``demos``, overwrite its weights
    and write the stamp (``key``, the settings, the loss, the time)."""
    root = init(Path(out_dir))
    chat = ChatFormat(load_tokenizer(root))
    examples = [encode_demonstration(chat, d.messages) for d in demos]
    model = build_trainable_model(load_model_config(root), load_safetensors(root))
    result = train_sft(model, examples, cfg, progress=progress)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(root / "model.safetensors"))
    _eos_with_im_end(root)
    stamp = {
        "key": key,
        "recipe": RECIPE_VERSION,
        "sft": asdict(cfg),
        "demonstrations": len(demos),
        "demonstrations_digest": demonstrations_digest(demos),
        "assistant_tokens": sum(sum(e.mask) for e in examples),
        "tokens": sum(len(e.ids) for e in examples),
        "steps": result.steps,
        "seconds": round(result.seconds, 2),
        "first_loss": round(result.losses[0], 4),
        "final_loss": round(result.final_loss, 4),
        "machine": machine_info(),  # another CPU family trains another model from the same data
        **(info or {}),
    }
    (root / STAMP_FILE).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
    return result


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached_model_dir(
    cache_root: Path,
    key: str,
    build: Callable[[Path], Any],
) -> tuple[Path, bool]:
    """``<cache_root>/<key>``, built with ``build(tmp_dir)`` if it is not there yet (under a
    file lock, so concurrent callers build it once; into a temporary directory renamed into
    place, so a reader never sees half of one). Returns (the directory, whether it was
    built now)."""
    final = Path(cache_root) / key
    if read_stamp(final) is not None:
        return final, False
    with _locked(Path(cache_root) / f"{key}.lock"):
        if read_stamp(final) is not None:
            return final, False
        for stale in Path(cache_root).glob(f"{key}.tmp-*"):  # a killed builder's (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(cache_root) / f"{key}.tmp-{os.getpid()}"
        try:
            build(tmp)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final, True


def install(cached: Path, out_dir: Path) -> Path:
    """Copy a cached model directory's files into ``out_dir`` (created if needed); a
    directory already holding the same key is left as it is."""
    out = Path(out_dir)
    stamp = read_stamp(cached) or {}
    have = read_stamp(out)
    if have is not None and have.get("key") == stamp.get("key"):
        return out
    out.mkdir(parents=True, exist_ok=True)
    (out / STAMP_FILE).unlink(missing_ok=True)  # an older stamp must not vouch for a half copy
    for src in sorted(Path(cached).iterdir()):
        if src.is_file() and src.name != STAMP_FILE:
            shutil.copy2(src, out / src.name)
    shutil.copy2(Path(cached) / STAMP_FILE, out / STAMP_FILE)  # last: marks the copy complete
    return out
