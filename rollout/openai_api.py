"""The OpenAI wire format of the server: request bodies, their admission checks, response bodies.

Why here: every check a request passes before it reaches the engine is in one place, each a 400
naming the field and the limit (ranges as vLLM's protocol states them: temperature in [0, 2],
below 1e-5 served as greedy; top_p in (0, 1]; top_k -1 or 0 = off, >= 1, clamped to the
vocabulary; min_p in [0, 1]); `max_tokens`, `n` and stop strings are bounded by `ServerLimits`.
Invariants: no text with lone UTF-16 surrogates reaches a tokenizer; replies never hold non-finite
floats (a -inf log-prob is reported as -9999.0, as vLLM does); every error body is
{"error": {"message": one line, "type", "code"}}.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from rollout.engine import Request, SamplingParams
from rollout.engine_worker import SampleResult

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it samples greedily
MIN_LOGPROB = -9999.0  # what a -inf log-prob is reported as
SEED_LIMIT = 2**63  # torch.Generator.manual_seed takes a signed 64-bit seed
_MAX_MESSAGE_CHARS = 1000


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask for. `max_model_len` bounds prompt + max_tokens; `max_n` must stay
    below the engine's sequence slots so one request cannot hold them all."""

    max_model_len: int
    vocab_size: int | None = None
    default_max_tokens: int = 256
    max_tokens_limit: int | None = None  # a per-request cap below the context (fairness)
    max_n: int = 16
    max_stop_strings: int = 64
    max_stop_chars: int = 256
    max_logprobs: int = 20
    max_pending: int = 256  # requests in flight; the next gets a 429

    def __post_init__(self):
        for name in (
            "max_model_len",
            "default_max_tokens",
            "max_n",
            "max_stop_strings",
            "max_stop_chars",
            "max_pending",
        ):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"ServerLimits.{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ValueError(
                f"ServerLimits.max_tokens_limit must be >= 1 or None, got {self.max_tokens_limit}"
            )


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_json(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(error_body(status, message, kind), status_code=status)


def error_body(status: int, message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    message = " ".join(message.split())  # one line
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[:_MAX_MESSAGE_CHARS] + " ... (cut)"
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")  # lone surrogates echoed
    return {"error": {"message": message, "type": kind, "code": status}}


# --------------------------------------------------------------------------------- bodies
class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    stream: bool = False
    return_token_ids: bool = False  # vLLM's extension: prompt and sampled ids in the reply


class CompletionBody(_Body):
    prompt: str | list[int]
    logprobs: int | None = None


class ChatBody(_Body):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    tools: Any = None  # checked by rollout/openai_tools.py, whose messages name the field
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


def check_text(field: str, text: str) -> str:
    """`text` unchanged, or a 400 if it holds a lone UTF-16 surrogate (JSON "\\ud800", or raw
    CESU-8 bytes, which Python's JSON decoder turns into one): no tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise OpenAIError(
            400,
            f"{field}: the text holds a lone UTF-16 surrogate at character {e.start}; "
            "send valid Unicode (pair surrogates, or escape the character)",
        ) from None
    return text


def chat_messages(raw: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
    """Checked messages and whether any holds an image part. Content is a string or a list of
    text / image_url parts; a list of text parts only is joined into a string (the text path); an
    assistant message with `tool_calls` may have none (null: ""). rollout/openai_tools.py checks
    the tool calls and tool messages."""
    if not raw:
        raise OpenAIError(400, "messages is empty")
    messages, has_images = [], False
    shape = "{'type': 'text', 'text': str} or {'type': 'image_url', 'image_url': {'url': str}}"
    for i, m in enumerate(raw):
        if m.get("content") is None and m.get("tool_calls") is not None:
            m = {**m, "content": ""}
        content = m.get("content")
        if not isinstance(m.get("role"), str) or not isinstance(content, str | list):
            raise OpenAIError(
                400,
                f"messages[{i}]: every message needs string 'role' and 'content' (a string or a list of "
                "content parts; null only beside an assistant's tool_calls)",
            )
        check_text(f"messages[{i}].role", m["role"])
        if isinstance(content, list):
            kinds = [p.get("type") if isinstance(p, dict) else None for p in content]
            bad_text = any(k == "text" and not isinstance(p.get("text"), str) for k, p in zip(kinds, content))
            if bad_text or any(k not in ("text", "image_url") for k in kinds):
                raise OpenAIError(400, f"messages[{i}].content: every part must be {shape}")
            for p in content:
                if p["type"] == "text":
                    check_text(f"messages[{i}].content", p["text"])
            if "image_url" in kinds:
                has_images = True
            else:
                m = {**m, "content": "".join(p["text"] for p in content)}
        else:
            check_text(f"messages[{i}].content", content)
        messages.append(m)
    return messages, has_images


# --------------------------------------------------------------------------------- admission
def _in_range(name: str, value: float, lo: float, hi: float, lo_open: bool = False) -> None:
    ok = math.isfinite(value) and (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        raise OpenAIError(400, f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}")


def stop_strings(body: _Body, limits: ServerLimits) -> tuple[str, ...]:
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > limits.max_stop_strings:
        raise OpenAIError(
            400,
            f"stop: {len(stops)} stop strings, the server allows at most "
            f"{limits.max_stop_strings} (max_stop_strings)",
        )
    for i, s in enumerate(stops):
        if not s:
            raise OpenAIError(400, f"stop[{i}]: stop strings must be non-empty")
        if len(s) > limits.max_stop_chars:
            raise OpenAIError(
                400,
                f"stop[{i}]: {len(s)} characters, the server allows at most "
                f"{limits.max_stop_chars} (max_stop_chars)",
            )
        check_text(f"stop[{i}]", s)
    return tuple(stops)


def admit(
    body: _Body,
    prompt_ids: list[int],
    max_tokens: int | None,
    limits: ServerLimits,
    images: tuple = (),
    eos_ids: tuple[int, ...] = (),
) -> tuple[Request, tuple[str, ...]]:
    """The engine request for a validated body (stop strings apart: the server matches them), or
    a 400 naming the field and the limit. `eos_ids` (the tokenizer's) stop it unless `ignore_eos`,
    as they stop the trainer's rollouts."""
    if not prompt_ids:
        raise OpenAIError(400, "prompt is empty")
    _in_range("temperature", body.temperature, 0.0, 2.0)
    _in_range("top_p", body.top_p, 0.0, 1.0, lo_open=True)
    _in_range("min_p", body.min_p, 0.0, 1.0)
    if body.top_k < -1:
        raise OpenAIError(400, f"top_k must be -1 or 0 (off) or >= 1, got {body.top_k}")
    # top_k at or above the vocabulary keeps every token: the same as off (and fits an int64).
    top_k = 0 if body.top_k == -1 or (limits.vocab_size and body.top_k >= limits.vocab_size) else body.top_k
    if not 1 <= body.n <= limits.max_n:
        raise OpenAIError(400, f"n must be in [1, {limits.max_n}] (max_n), got {body.n}")
    if body.seed is not None and not 0 <= body.seed < SEED_LIMIT:
        raise OpenAIError(400, f"seed must be in [0, 2**63), got {body.seed}")
    vocab = limits.vocab_size
    bad_ids = [t for t in body.stop_token_ids or () if t < 0 or (vocab is not None and t >= vocab)]
    if bad_ids:
        raise OpenAIError(400, f"stop_token_ids must be in [0, {vocab}), got {bad_ids[:5]}")
    room = limits.max_model_len - len(prompt_ids)
    if room < 1:
        raise OpenAIError(
            400,
            f"prompt of {len(prompt_ids)} tokens leaves no room in the model's context of "
            f"{limits.max_model_len} tokens",
        )
    cap = min(room, limits.max_tokens_limit or room)
    if max_tokens is None:
        max_tokens = min(limits.default_max_tokens, cap)
    if not 1 <= max_tokens <= cap:
        why = (
            f"the prompt's {len(prompt_ids)} tokens leave {room} of the model's {limits.max_model_len}"
            if cap == room
            else f"the server's max_tokens_limit is {cap}"
        )
        raise OpenAIError(400, f"max_tokens must be in [1, {cap}] ({why}), got {max_tokens}")
    stops = stop_strings(body, limits)
    temperature = 0.0 if body.temperature < GREEDY_BELOW else body.temperature
    params = SamplingParams(
        temperature=temperature,
        top_p=body.top_p,
        top_k=top_k,
        min_p=body.min_p,
        max_tokens=max_tokens,
        stop_token_ids=tuple(body.stop_token_ids or ()) + (() if body.ignore_eos else tuple(eos_ids)),
        ignore_eos=body.ignore_eos,
    )
    return Request(tuple(prompt_ids), params, n=body.n, seed=body.seed, images=images), stops


# --------------------------------------------------------------------------------- replies
def finite(lp: float) -> float | None:
    """A log-prob JSON can carry: -inf -> MIN_LOGPROB, nan -> None."""
    return None if math.isnan(lp) else max(lp, MIN_LOGPROB)


def choice_body(
    r: SampleResult, body: _Body, chat: bool, decode_one, prompt_ids: list[int], reply=None
) -> dict[str, Any]:
    """One non-streamed choice (`token_ids` always, as vLLM's `return_token_ids` gives them). A
    chat choice's message and finish reason are `reply`'s (rollout/openai_tools.ToolReply) if given."""
    choice: dict[str, Any] = {
        "index": r.index,
        "finish_reason": r.finish_reason if reply is None else reply.finish_reason,
        "stop_reason": r.stop_reason,
        "token_ids": r.token_ids,
    }
    lps = [finite(x) for x in r.logprobs]
    if chat:
        choice["message"] = {"role": "assistant", "content": r.text if reply is None else reply.content}
        if reply is not None and reply.tool_calls:
            choice["message"]["tool_calls"] = reply.tool_calls
        if body.logprobs:
            content = [
                {"token": decode_one(t), "logprob": lp, "top_logprobs": []} for t, lp in zip(r.token_ids, lps)
            ]
            choice["logprobs"] = {"content": content}
    else:
        choice["text"] = r.text
        choice["logprobs"] = None
        if body.logprobs is not None:
            choice["logprobs"] = {"tokens": [decode_one(t) for t in r.token_ids], "token_logprobs": lps}
        if body.return_token_ids:
            choice["prompt_token_ids"] = prompt_ids
    return choice


def response_body(
    rid: str,
    created: int,
    body: _Body,
    chat: bool,
    results: list[SampleResult],
    prompt_ids: list[int],
    decode_one,
    replies: list | None = None,
) -> dict[str, Any]:
    gen = sum(len(r.token_ids) for r in results)
    replies = replies or [None] * len(results)
    out = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": body.model,
        "choices": [choice_body(r, body, chat, decode_one, prompt_ids, q) for r, q in zip(results, replies)],
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": gen,
            "total_tokens": len(prompt_ids) + gen,
        },
    }
    if chat and body.return_token_ids:
        out["prompt_token_ids"] = prompt_ids
    return out


def chunk_body(
    rid: str, created: int, body: _Body, chat: bool, index: int, delta: str, finish: str | None, first: bool,
    tool_calls: list[dict[str, Any]] = (),
) -> dict[str, Any]:  # fmt: skip
    """One streamed chunk: a choice's new text (and its finish reason on the last), or its tool
    calls (each whole, with its position as `index`, as OpenAI's deltas number them)."""
    if chat:
        d: dict[str, Any] = {"role": "assistant"} if first else {}
        if tool_calls:
            d["tool_calls"] = [{"index": k, **call} for k, call in enumerate(tool_calls)]
        else:
            d["content"] = delta
        choice = {"index": index, "delta": d, "finish_reason": finish}
    else:
        choice = {"index": index, "text": delta, "finish_reason": finish}
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": body.model, "choices": [choice]}
