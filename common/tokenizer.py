"""Tokenizers and the one chat template, shared by the trainer, the engines and the server.

What: `load_tokenizer(spec)` ("byte" or a local Hugging Face directory) returns an object with
`encode`, `decode`, `apply_chat_template(messages) -> str`, `chat_prompt(messages) -> ids`, the
special ids and `vocab_size`; `tokenizer_for(checkpoint, adapter)` finds the one a checkpoint or
an exported adapter records, so serving needs no flag. Why a byte tokenizer: the tiny presets have
no trained one; UTF-8 bytes need none (ids: 0 pad, 1 bos, 2 eos, 3 + byte; 259 in all).
Invariant: a chat's prompt ids are `chat_prompt(messages, tools)` everywhere (training, rollouts,
serving). The plain template (byte tokenizer, or an HF tokenizer without one) drops roles and ends
each message's content with a newline: [{"role": "user", "content": "12+35="}] -> "12+35=\n"; with
tools, tool calls or tool results it is common/tool_calls.py's `render_plain_chat`. An HF template
gets `tools=` only if it renders them (else a ValueError: tools must never vanish silently).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
NUM_SPECIAL = 3
_SPECIAL_TEXT = {PAD_ID: "<pad>", BOS_ID: "<s>", EOS_ID: "</s>"}


def plain_chat_template(messages: Sequence[Mapping[str, str]]) -> str:
    """Roles dropped, each message's content followed by one newline (see the module docstring)."""
    return "".join(f"{m['content']}\n" for m in messages)


def _plain_chat(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> str:
    # Imported here: common/tool_calls.py builds on plain_chat_template above, so a module-level
    # import would be circular. Without tools it is byte-identical to plain_chat_template.
    from common.tool_calls import render_plain_chat

    return render_plain_chat(messages, tools)


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

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()
    ) -> str:
        return _plain_chat(messages, tools)

    def chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()
    ) -> list[int]:
        """The prompt ids of a chat: bos + the plain template's bytes."""
        return self.encode(self.apply_chat_template(messages, tools))


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

    def template_reads(self, name: str) -> bool:
        """Whether the tokenizer's own chat template (the tool-use one, if it has several) reads
        the variable or key `name` ("tools", "tool_calls"); the plain template reads both."""
        if not getattr(self.tok, "chat_template", None):
            return True
        try:
            return name in self.tok.get_chat_template(tools=[])
        except ValueError:  # several named templates and no default: apply_chat_template says so
            return False

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()
    ) -> str:
        """The template's text (generation prompt added). Tool calls in assistant messages reach an
        HF template with dict arguments (transformers' convention; OpenAI sends a JSON string).
        ValueError for tools the template would drop or a chat the template refuses."""
        if not getattr(self.tok, "chat_template", None):
            return _plain_chat(messages, tools)
        for name, used in (
            ("tools", bool(tools)),
            ("tool_calls", any(m.get("tool_calls") for m in messages)),
        ):
            if used and not self.template_reads(name):
                raise ValueError(
                    f"the chat template of tokenizer {self.name!r} does not render {name}; serve a "
                    f"model whose template reads `{name}`, or send them as text"
                )
        from jinja2 import TemplateError

        try:
            return self.tok.apply_chat_template(
                [_hf_message(m) for m in messages], tools=list(tools) or None, tokenize=False,
                add_generation_prompt=True,
            )  # fmt: skip
        except TemplateError as e:  # the template's raise_exception: a chat it does not accept
            raise ValueError(f"the chat template refuses this chat: {e}") from None

    def chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()
    ) -> list[int]:
        """The prompt ids of a chat: the rendered template, encoded (bos added once)."""
        return self.encode(self.apply_chat_template(messages, tools))


def _hf_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """`message` for an HF template: tool-call arguments decoded from JSON text to a dict."""
    out = dict(message)
    if out.get("tool_calls"):
        calls = []
        for call in out["tool_calls"]:
            fn = dict(call.get("function", {}))
            if isinstance(fn.get("arguments"), str):
                fn["arguments"] = json.loads(fn["arguments"] or "{}")
            calls.append({**call, "function": fn})
        out["tool_calls"] = calls
    return out


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


# ------------------------------------------------------------------ what a directory records
RECORD_FILE = "tokenizer_record.json"  # {"tokenizer": "byte"} beside a checkpoint's config.json
_HF_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def write_tokenizer_record(directory: str | Path, spec: str) -> None:
    """Record in `directory` (a checkpoint) which tokenizer it was built with: "byte", or a Hugging
    Face spec (its files are saved there too, so the checkpoint is self-contained)."""
    directory = Path(directory)
    if spec != "byte":
        load_tokenizer(spec).tok.save_pretrained(str(directory))
    (directory / RECORD_FILE).write_text(json.dumps({"tokenizer": "byte" if spec == "byte" else "hf"}) + "\n")


def recorded_tokenizer(directory: str | Path) -> str | None:
    """The spec `directory` records: "byte", the directory itself for Hugging Face files, or None."""
    directory = Path(directory)
    record = directory / RECORD_FILE
    if record.is_file():
        kind = json.loads(record.read_text()).get("tokenizer")
        return "byte" if kind == "byte" else str(directory)
    meta = directory / "adapter_metadata.json"  # an exported adapter (model/adapter.py)
    if meta.is_file():
        spec = json.loads(meta.read_text()).get("tokenizer")
        if spec:
            return spec
    return str(directory) if any((directory / f).is_file() for f in _HF_FILES) else None


def tokenizer_for(checkpoint: str | Path, adapter: str | Path | None = None) -> Tokenizer:
    """The tokenizer an adapter (first) or its base checkpoint records; a clear error if neither does."""
    for where in (adapter, checkpoint):
        spec = recorded_tokenizer(where) if where is not None else None
        if spec is None:
            continue
        try:
            return load_tokenizer(spec)
        except FileNotFoundError:  # an HF path of the training machine: try the base checkpoint next
            if where == checkpoint:
                raise
    raise FileNotFoundError(
        f"no tokenizer recorded in {checkpoint}" + (f" or {adapter}" if adapter else "") + " (no "
        f"{RECORD_FILE} and no tokenizer files). Fix: pass --tokenizer byte (the tiny presets) or "
        "--tokenizer DIR (a local Hugging Face tokenizer directory)."
    )
