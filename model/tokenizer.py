"""A thin, fast tokenizer wrapper over ``tokenizers`` (no transformers import)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from model.config import token_ids

# Used only when neither generation_config.json nor config.json names an EOS token.
_FALLBACK_EOS = ("<|im_end|>", "<|endoftext|>")


class Tokenizer:
    """Text ↔ token ids for one model directory."""

    def __init__(self, tokenizer: _HFTokenizer, eos_token_ids: tuple[int, ...]) -> None:
        self._tok = tokenizer
        self.eos_token_ids = eos_token_ids
        """Tokens that end generation (from ``generation_config.json``, then ``config.json``)."""

    @property
    def vocab_size(self) -> int:
        """Number of tokenizer entries, special tokens included (≤ the model's vocab)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it map to their ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``."""
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def text(self, ids: list[int]) -> str:
        """The text the model meant by ``ids``: special tokens (``<|im_end|>``, …) dropped.
        What is scored, parsed for an action or shown as a response."""
        return self._tok.decode(ids, skip_special_tokens=True)

    @property
    def id_limit(self) -> int:
        """One past the largest id the tokenizer has (its entries need not be dense)."""
        return max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string (e.g. ``"<|im_end|>"``), or None if unknown."""
        return self._tok.token_to_id(token)


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load ``<model_dir>/tokenizer.json`` and the model's EOS ids."""
    root = Path(model_dir)
    tok = _HFTokenizer.from_file(str(root / "tokenizer.json"))
    eos: tuple[int, ...] = ()
    for name in ("generation_config.json", "config.json"):
        path = root / name
        if path.exists():
            eos = token_ids(json.loads(path.read_text()).get("eos_token_id"))
            if eos:
                break
    if not eos:
        eos = tuple(i for t in _FALLBACK_EOS if (i := tok.token_to_id(t)) is not None)
    return Tokenizer(tok, eos)
