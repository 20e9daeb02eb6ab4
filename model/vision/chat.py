"""Chat messages with images -> token ids with image placeholders, and the processed images.

What: `chat_to_ids_and_images(messages, tokenizer, config)` takes OpenAI-style messages (string
content or text / image_url parts) and returns prompt ids in which image i is written as
[vision_start] + num_tokens_i x [image_token_id] + [vision_end] (upstream's layout; no brackets when
the config has none), plus the `ProcessedImage`s in order. Each image part becomes a private-use
sentinel, the tokenizer's own chat template renders the messages, and the text pieces between
sentinels are encoded separately, so it works for any tokenizer (the byte tokenizer's ids 0-258
never reach the tiny vision preset's placeholder ids 500-503).

Invariants: placeholder ids equal the images' token counts, in image order, so `merge_image_features`
places rows directly; text can never produce a placeholder id (such text is refused).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from model.vision.config import VisionConfig
from model.vision.preprocess import (
    ImageInputError,
    ProcessedImage,
    check_image_count,
    image_bytes_from_part,
    preprocess_image,
)

# U+E000..U+E002 (private use): no tokenizer's chat template writes these on its own.
SENTINEL = "\ue000\ue001image\ue002"


class ChatTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> str: ...


@dataclass(frozen=True)
class ChatInputs:
    input_ids: list[int]
    images: list[ProcessedImage]

    @property
    def num_image_tokens(self) -> int:
        return sum(im.num_tokens for im in self.images)


def flatten_messages(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, str]], list[Mapping]]:
    """String-content messages with one SENTINEL per image part, and the image parts in order."""
    flat, images = [], []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping) or "content" not in msg:
            raise ImageInputError(f"messages[{i}] must be a mapping with 'role' and 'content'")
        content = msg["content"]
        if isinstance(content, str):
            text = content
        elif isinstance(content, Sequence):
            pieces = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    pieces.append(part["text"])
                elif kind == "image_url":
                    pieces.append(SENTINEL)
                    images.append(part)
                else:
                    raise ImageInputError(
                        f"messages[{i}].content[{j}]: unsupported part {kind!r}; use "
                        "{'type': 'text', 'text': ...} or {'type': 'image_url', 'image_url': {'url': ...}}"
                    )
            text = "".join(pieces)
        else:
            raise ImageInputError(f"messages[{i}].content must be a string or a list of parts")
        if SENTINEL in text and isinstance(content, str):
            raise ImageInputError(f"messages[{i}] contains the reserved image sentinel text")
        flat.append({**{k: v for k, v in msg.items() if k != "content"}, "content": text})
    return flat, images


def chat_to_ids_and_images(
    messages: Sequence[Mapping[str, Any]],
    tokenizer: ChatTokenizer,
    config: VisionConfig,
    add_special_tokens: bool = True,
) -> ChatInputs:
    """Render, tokenize and expand image parts (see the module docstring). Image limits are
    checked before any image is read; malformed images raise ImageInputError."""
    flat, parts = flatten_messages(messages)
    check_image_count(len(parts), config)
    text = tokenizer.apply_chat_template(flat)
    pieces = text.split(SENTINEL)
    if len(pieces) != len(parts) + 1:
        raise ImageInputError(
            f"the chat template rendered {len(pieces) - 1} image markers for {len(parts)} image parts; "
            "the template must keep message text verbatim"
        )
    images = [
        preprocess_image(image_bytes_from_part(p, config, f"image {i}"), config, f"image {i}")
        for i, p in enumerate(parts)
    ]
    reserved = {config.image_token_id, config.video_token_id, config.vision_start_token_id,
                config.vision_end_token_id} - {None}  # fmt: skip
    ids: list[int] = []
    for k, piece in enumerate(pieces):
        special = add_special_tokens and k == 0  # bos (if any) once, at the very start
        piece_ids = tokenizer.encode(piece, add_special_tokens=special) if piece or special else []
        bad = reserved.intersection(piece_ids)
        if bad:
            raise ImageInputError(
                f"message text tokenizes to reserved vision token ids {sorted(bad)}; remove image "
                "placeholder text from the prompt and send images as image_url parts"
            )
        ids.extend(piece_ids)
        if k < len(images):
            ids.extend(placeholder_ids(images[k].num_tokens, config))
    return ChatInputs(ids, images)


def placeholder_ids(num_tokens: int, config: VisionConfig) -> list[int]:
    """The ids one image occupies: [start] + num_tokens x [image] + [end] (brackets if configured)."""
    body = [config.image_token_id] * num_tokens
    if config.vision_start_token_id is None:
        return body
    return [config.vision_start_token_id, *body, config.vision_end_token_id]


def check_placeholders(
    prompt_ids: Sequence[int], images: Sequence[ProcessedImage], config: VisionConfig
) -> None:
    """Raise ImageInputError unless `prompt_ids` hold exactly the placeholders `images` fill (one
    image token per feature row, in image order) and every image is self-consistent. Host-side
    and cheap: engines call it before any compute."""
    check_image_count(len(images), config)
    for i, im in enumerate(images):
        t, h, w = im.grid_thw
        rows = t * h * w
        shape = tuple(im.pixel_values.shape)
        if shape != (rows, config.patch_dim) or im.num_tokens * config.merge_unit != rows:
            raise ImageInputError(
                f"image {i}: pixel_values {shape}, grid {im.grid_thw} and num_tokens {im.num_tokens} "
                f"disagree for this vision config (expected [{rows}, {config.patch_dim}] and "
                f"{rows // config.merge_unit} tokens); preprocess it with this model's vision config"
            )
    if config.video_token_id in prompt_ids:
        raise ImageInputError(
            f"prompt holds video placeholder id {config.video_token_id}; video inputs are not supported"
        )
    have = sum(1 for t in prompt_ids if t == config.image_token_id)
    want = sum(im.num_tokens for im in images)
    if have != want:
        raise ImageInputError(
            f"prompt holds {have} image placeholder tokens (id {config.image_token_id}) but its "
            f"{len(images)} image(s) need {want}; build prompt ids and images together with "
            "chat_to_ids_and_images"
        )
