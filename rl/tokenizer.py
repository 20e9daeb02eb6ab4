"""Tokenizers for the RL loop: a dependency-free byte tokenizer and local Hugging Face ones.

What: `load_tokenizer(spec)` returns an object with one small interface used by rollout workers,
the learner and the warm-up script: `encode(text, add_special_tokens=True) -> list[int]`,
`decode(ids, skip_special_tokens=True) -> str`, `apply_chat_template(messages) -> str`,
`pad_token_id`, `bos_token_id`, `eos_token_id`, `stop_token_ids`, `vocab_size`.

Why a byte tokenizer: the tiny presets (vocab 512) have no trained tokenizer; UTF-8 bytes need none,
cover any text, and keep the synthetic arithmetic prompts a few tokens long.

ByteTokenizer ids: 0 = pad, 1 = bos, 2 = eos, 3 + b for byte b (vocab 259, which must not exceed
the model's vocab_size). Ids the model may sample above 258 are not bytes; they decode to U+FFFD.
Its chat template (also used for Hugging Face tokenizers that ship none) drops roles and writes
each message's content followed by a newline: [{"role": "user", "content": "12+35="}] -> "12+35=\n".
The completion then follows directly ("Answer: 47" + eos).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
NUM_SPECIAL = 3
_SPECIAL_TEXT = {PAD_ID: "<pad>", BOS_ID: "<s>", EOS_ID: "</s>"}


def plain_chat_template(messages: Sequence[Mapping[str, str]]) -> str:
    """Roles dropped, each message's content followed by one newline (see the module docstring)."""
    return "".join(f"{m['content']}\n" for m in messages)


class ByteTokenizer:
    """UTF-8 bytes offset by 3 special ids (pad 0, bos 1, eos 2)."""

    pad_token_id = PAD_ID
    bos_token_id = BOS_ID
    eos_token_id = EOS_ID
    vocab_size = 256 + NUM_SPECIAL
    name = "byte"

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (EOS_ID,)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """[bos] + bytes (+3); bos only when `add_special_tokens`. eos is never added: the model
        writes it."""
        ids = [b + NUM_SPECIAL for b in text.encode("utf-8")]
        return [BOS_ID, *ids] if add_special_tokens else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        out, buf = [], bytearray()
        for i in ids:
            i = int(i)
            if NUM_SPECIAL <= i < self.vocab_size:
                buf.append(i - NUM_SPECIAL)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            if i in _SPECIAL_TEXT:
                if not skip_special_tokens:
                    out.append(_SPECIAL_TEXT[i])
            else:
                out.append("\ufffd")
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> str:
        return plain_chat_template(messages)


class HFTokenizer:
    """A `transformers` tokenizer behind the same interface as ByteTokenizer."""

    def __init__(self, tok: Any, name: str):
        self.tok, self.name = tok, name
        self.bos_token_id = tok.bos_token_id
        self.eos_token_id = tok.eos_token_id
        self.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.vocab_size = len(tok)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return () if self.eos_token_id is None else (self.eos_token_id,)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # A chat template usually writes the bos text itself: adding it again would double it.
        bos = self.tok.bos_token
        if add_special_tokens and bos and text.startswith(bos):
            add_special_tokens = False
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> str:
        if not getattr(self.tok, "chat_template", None):
            return plain_chat_template(messages)
        return self.tok.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
        )


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(spec: str) -> Tokenizer:
    """'byte' -> ByteTokenizer; anything else is a local directory (or a name already in the local
    Hugging Face cache) for `transformers.AutoTokenizer`. The hub is never contacted."""
    if spec == "byte":
        return ByteTokenizer()
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError) as e:
        where = (
            "directory exists but holds no loadable tokenizer" if Path(spec).is_dir() else "not found locally"
        )
        raise FileNotFoundError(
            f"tokenizer {spec!r}: {where} ({type(e).__name__}). Fix: set model.tokenizer=byte (the tiny "
            "presets) or to a local directory with tokenizer.json / tokenizer_config.json (usually the "
            "checkpoint directory); the hub is not used."
        ) from e
    return HFTokenizer(tok, name=spec)
