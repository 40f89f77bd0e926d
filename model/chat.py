"""The chat layout of a trajectory as token ids: Qwen's ChatML, as the tiny model's
``chat_template`` writes it (no tools, no thinking blocks), built piece by piece so a context
is kept as token ids and never re-tokenized.

    <|im_start|>system\\n{system}<|im_end|>\\n          (prompt turns, loss mask 0)
    <|im_start|>user\\n{task}<|im_end|>\\n
    <|im_start|>assistant\\n                          (generation header, mask 0)
    {model tokens … <|im_end|>}                        (model response, mask 1)
    \\n<|im_start|>user\\n{observation}<|im_end|>\\n   (observation turn, mask 0)
    <|im_start|>assistant\\n                          (next generation header, mask 0)
    …

Each piece is encoded on its own. Special tokens delimit every piece, and a byte-level BPE
never merges across a special token, so the ids equal those of encoding the whole template
text at once (what the warm start's demonstrations use) — except inside a model response,
which is whatever the model produced. A response cut by ``max_tokens`` (no ``<|im_end|>``) is
closed with ``<|im_end|>`` before the next turn (mask 0: the model did not write it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from model.tokenizer import Tokenizer

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"


@dataclass(frozen=True)
class ChatFormat:
    """Token pieces of the ChatML layout for one tokenizer."""

    tokenizer: Tokenizer

    @property
    def im_end(self) -> int:
        """Id of ``<|im_end|>`` (ends every turn; an EOS of the tiny model)."""
        token = self.tokenizer.token_to_id(IM_END)
        if token is None:
            raise ValueError("the tokenizer has no <|im_end|> token (not a ChatML model)")
        return token

    def turn(self, role: str, content: str) -> list[int]:
        """One complete turn: ``<|im_start|>{role}\\n{content}<|im_end|>\\n``."""
        return self.tokenizer.encode(f"{IM_START}{role}\n{content}{IM_END}\n")

    def generation_header(self) -> list[int]:
        """``<|im_start|>assistant\\n``: what the model continues."""
        return self.tokenizer.encode(f"{IM_START}assistant\n")

    def prompt(self, messages: Iterable[tuple[str, str]]) -> list[int]:
        """L_0: every (role, content) turn, then the generation header."""
        ids: list[int] = []
        for role, content in messages:
            ids += self.turn(role, content)
        return ids + self.generation_header()

    def close_response(self, response: Sequence[int]) -> list[int]:
        """What follows a model response before the next turn: ``\\n`` after its
        ``<|im_end|>``, or ``<|im_end|>\\n`` when it has none (cut by ``max_tokens``)."""
        if response and response[-1] == self.im_end:
            return self.tokenizer.encode("\n")
        return self.tokenizer.encode(f"{IM_END}\n")

    def observation(self, response: Sequence[int], text: str) -> list[int]:
        """The tokens appended after ``response``: its closing, the user turn holding
        ``text``, and the next generation header (all mask 0)."""
        return self.close_response(response) + self.turn("user", text) + self.generation_header()

    def render(self, messages: Iterable[tuple[str, str]], *, add_generation_prompt: bool) -> str:
        """The same layout as text (``chat_template`` semantics), for demonstrations."""
        text = "".join(f"{IM_START}{role}\n{content}{IM_END}\n" for role, content in messages)
        return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")
