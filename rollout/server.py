"""OpenAI-compatible HTTP server over a rollout engine (serving exported adapters).

What: `/v1/models`, `/v1/completions`, `/v1/chat/completions` (both with `stream`; chat with OpenAI
tools, rollout/openai_tools.py) and `/health`, over one engine owned by one thread
(rollout/engine_worker.py); the wire format and every admission check are in rollout/openai_api.py.
Each handler below is a module-level function reading the app's `ServeState`. Hostile clients: a
disconnected client's request is aborted before the next step; at most `max_pending` requests are
in flight (then 429); half-sent headers or bodies time out; `--api-key` (or ROLLOUT_API_KEY) guards
every route but `/health`; local image files are read only under `--allowed-local-media`
directories. Run: `python -m rollout.serve --preset tiny` or
`--model CKPT [--adapter DIR]` (the tokenizer is the one they record).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import torch
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.tokenizer import Tokenizer, load_tokenizer, tokenizer_for
from rollout.engine import Request
from rollout.engine_worker import Broken, Busy, EngineWorker
from rollout.http_guards import BodyTimeout, RequireAPIKey, uvicorn_config
from rollout.openai_api import (
    ChatBody,
    CompletionBody,
    OpenAIError,
    ServerLimits,
    _Body,
    admit,
    chat_messages,
    check_text,
    chunk_body,
    error_body,
    error_json,
    response_body,
)
from rollout.openai_tools import (
    NO_TOOLS,
    ToolCallStream,
    ToolPlan,
    check_tool_messages,
    check_tools,
    reply_for,
)

API_KEY_ENV = "ROLLOUT_API_KEY"


@dataclass
class ServeState:
    """What the handlers share (app.state.serve)."""

    worker: EngineWorker
    tokenizer: Tokenizer
    limits: ServerLimits
    model_name: str
    adapter_name: str | None = None
    vision_config: Any = None
    allowed_media: tuple[Path, ...] = ()  # directories local image files may come from

    @property
    def served(self) -> list[str]:
        return [self.model_name] + ([self.adapter_name] if self.adapter_name else [])


# --------------------------------------------------------------------------------- prompts
def completion_prompt_ids(body: CompletionBody, tokenizer: Tokenizer) -> list[int]:
    if isinstance(body.prompt, str):
        return tokenizer.encode(check_text("prompt", body.prompt)) if body.prompt else []
    return list(body.prompt)


def chat_prompt_ids(
    messages: list[dict[str, Any]], tokenizer: Tokenizer, plan: ToolPlan = NO_TOOLS
) -> list[int]:
    """The prompt ids of a text chat: exactly what the trainer feeds (common/tokenizer.py), then the
    opening of a call when `tool_choice` forces one."""
    try:
        ids = tokenizer.chat_prompt(messages, plan.tools)
    except ValueError as e:  # tools a template cannot render, a chat it refuses
        raise OpenAIError(400, f"messages / tools: {e}") from None
    return ids + (tokenizer.encode(plan.opening, add_special_tokens=False) if plan.opening else [])


def local_image_parts(messages: list[dict[str, Any]], allowed: tuple[Path, ...]) -> list[dict[str, Any]]:
    """Messages whose local image paths (file:// or bare, absolute) name files under an allowed
    directory, rewritten to the resolved path; every other local path gets the same 400, whether
    it exists or not, so a client cannot probe the server's files."""
    out = []
    for m in messages:
        if isinstance(m["content"], list):
            parts = []
            for p in m["content"]:
                if p.get("type") == "image_url":
                    p = _allowed_image(p, allowed)
                parts.append(p)
            m = {**m, "content": parts}
        out.append(m)
    return out


def _allowed_image(part: dict[str, Any], allowed: tuple[Path, ...]) -> dict[str, Any]:
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or url.startswith("data:"):
        return part
    scheme = urlparse(url).scheme.lower()
    if scheme not in ("", "file"):
        return part  # http(s) and unknown schemes: refused downstream with their own message
    path = Path(unquote(urlparse(url).path) if scheme == "file" else url)
    resolved = path.resolve() if path.is_absolute() else None
    inside = resolved is not None and any(resolved.is_relative_to(d) for d in allowed)
    if not (inside and resolved.is_file()):
        raise OpenAIError(
            400,
            "local image files are not served: send the image inline as "
            "'data:image/png;base64,...' (a server started with --allowed-local-media "
            "DIR reads absolute paths under DIR)",
        )
    return {**part, "image_url": {"url": str(resolved)}}


async def image_chat_ids(state: ServeState, messages: list[dict[str, Any]]) -> tuple[list[int], tuple]:
    from model.vision import ImageInputError, chat_to_ids_and_images

    if state.vision_config is None:
        raise OpenAIError(
            400,
            "image content parts need a model with a vision tower; this model is "
            "text-only: send string content",
        )
    if not hasattr(state.tokenizer, "apply_chat_template"):
        raise OpenAIError(400, "this server's tokenizer cannot render image chats (no chat template)")
    messages = local_image_parts(messages, state.allowed_media)
    try:  # decoding and resizing images is CPU work: keep it off the event loop
        chat = await asyncio.to_thread(chat_to_ids_and_images, messages, state.tokenizer, state.vision_config)
    except ImageInputError as e:
        raise OpenAIError(400, f"bad image input: {e}") from e
    return chat.input_ids, tuple(chat.images)


# --------------------------------------------------------------------------------- handlers
async def models(http: HTTPRequest):
    state: ServeState = http.app.state.serve
    now = int(time.time())
    data = [{"id": m, "object": "model", "created": now, "owned_by": "rollout"} for m in state.served]
    if state.adapter_name:
        data[1]["parent"] = state.model_name
    return {"object": "list", "data": data}


async def health(http: HTTPRequest):
    problem = http.app.state.serve.worker.health()
    if problem is not None:
        return error_json(503, f"the engine cannot serve: {problem}", "server_error")
    return {"status": "ok"}


async def completions(body: CompletionBody, http: HTTPRequest):
    state: ServeState = http.app.state.serve
    if body.logprobs is not None and not 0 <= body.logprobs <= state.limits.max_logprobs:
        raise OpenAIError(
            400, f"logprobs must be in [0, {state.limits.max_logprobs}] (or null), got {body.logprobs}"
        )
    ids = completion_prompt_ids(body, state.tokenizer)
    return await generate(state, http, body, ids, body.max_tokens, chat=False)


async def chat_completions(body: ChatBody, http: HTTPRequest):
    state: ServeState = http.app.state.serve
    plan = check_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    messages, has_images = chat_messages(body.messages)
    has_tool_turns = check_tool_messages(messages)
    images: tuple = ()
    if has_images:
        if plan.tools or has_tool_turns:
            raise OpenAIError(400, "tools and tool messages are served for text chats only: drop the images")
        ids, images = await image_chat_ids(state, messages)
    else:
        ids = chat_prompt_ids(messages, state.tokenizer, plan)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return await generate(state, http, body, ids, max_tokens, chat=True, images=images, plan=plan)


def check_model(state: ServeState, name: str) -> None:
    if name not in state.served:
        raise OpenAIError(404, f"model {name!r} not found; served: {state.served}", "not_found_error")
    if state.adapter_name and name != state.adapter_name:
        # One global adapter: the base alone cannot be sampled while it is loaded.
        raise OpenAIError(400, f"the engine serves adapter {state.adapter_name!r}; ask for that model")


async def generate(
    state: ServeState,
    http: HTTPRequest,
    body: _Body,
    prompt_ids: list[int],
    max_tokens: int | None,
    chat: bool,
    images: tuple = (),
    plan: ToolPlan = NO_TOOLS,
):
    check_model(state, body.model)
    eos = tuple(getattr(state.tokenizer, "stop_token_ids", ()))
    request, stops = admit(body, prompt_ids, max_tokens, state.limits, images, eos)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:16]
    events = submit(state, dataclasses.replace(request, request_id=rid), stops, body.stream, plan.kept_stops)
    created = int(time.time())
    decode_one = lambda t: state.tokenizer.decode([t])
    first = await next_event(state, http, rid, events)  # request errors become 4xx before any byte
    if not body.stream:
        while first[0] != "done":
            first = await next_event(state, http, rid, events)
        prompt_ids = list(request.prompt_token_ids)
        results = first[1]
        replies = [reply_for(plan.opening + r.text, r.finish_reason, plan) for r in results] if chat else None
        return response_body(rid, created, body, chat, results, prompt_ids, decode_one, replies)
    chunks = stream_events(state, rid, body, chat, first, events, created, plan)
    return StreamingResponse(chunks, media_type="text/event-stream")


def submit(state: ServeState, request: Request, stops: tuple[str, ...], stream: bool,
           kept: tuple[str, ...] = ()) -> asyncio.Queue:  # fmt: skip
    """Hand `request` to the worker; its events arrive on the returned queue."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    emit = lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev)
    try:
        state.worker.submit(request, stops, emit, stream, kept)
    except Busy as e:
        raise OpenAIError(429, f"server busy: {e}; retry later", "rate_limit_error") from None
    except Broken as e:
        raise OpenAIError(503, f"the engine cannot serve: {e}; restart the server", "server_error") from None
    return queue


async def next_event(state: ServeState, http: HTTPRequest, rid: str, events: asyncio.Queue) -> tuple:
    """The request's next event ("delta" or "done"); its error as an OpenAIError. Aborts the
    request if the client leaves meanwhile."""
    got = asyncio.ensure_future(events.get())
    gone = asyncio.ensure_future(_disconnected(http))
    try:
        await asyncio.wait({got, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not got.done():
        got.cancel()
        state.worker.abort(rid)
        raise OpenAIError(499, "client disconnected")  # nobody reads it
    ev = got.result()
    if ev[0] == "error":
        raise OpenAIError(ev[1], ev[2], "invalid_request_error" if ev[1] < 500 else "server_error")
    return ev


async def _disconnected(http: HTTPRequest) -> None:
    """Returns when the client closes the connection (the body was read: `receive` waits for that)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def stream_events(state: ServeState, rid: str, body: _Body, chat: bool, first: tuple,
                        events: asyncio.Queue, created: int, plan: ToolPlan = NO_TOOLS):  # fmt: skip
    """SSE chunks from `first` on; the request is aborted if the client leaves before the end
    (starlette cancels this generator then). An error after the headers went out is sent as an
    error event. A chat choice's text goes through its ToolCallStream: content as it is safe to
    send, tool calls when the sample ends."""
    finished, started, ev = False, set(), first
    assemblers: dict[int, ToolCallStream] = {}

    def chunk(index: int, text: str, finish: str | None, calls=()) -> str:
        out = chunk_body(rid, created, body, chat, index, text, finish, index not in started, calls)
        started.add(index)
        return _sse(out)

    try:
        while True:
            if ev[0] == "delta":
                _, index, text, finish = ev
                if chat:
                    stream = assemblers.setdefault(index, ToolCallStream(plan))
                    text = stream.feed(text)
                    if finish is not None:
                        rest, reply = stream.finish(finish)
                        text, finish = text + rest, reply.finish_reason
                        if reply.tool_calls:
                            if text:
                                yield chunk(index, text, None)
                            yield chunk(index, "", None, reply.tool_calls)
                            text = ""
                if text or finish is not None:
                    yield chunk(index, text, finish)
            elif ev[0] == "error":
                finished = True
                kind = "server_error" if ev[1] >= 500 else "invalid_request_error"
                yield _sse(error_body(ev[1], ev[2], kind))
                yield "data: [DONE]\n\n"
                return
            else:
                finished = True
                yield "data: [DONE]\n\n"
                return
            ev = await events.get()
    finally:
        if not finished:
            state.worker.abort(rid)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, allow_nan=False)}\n\n"


# --------------------------------------------------------------------------------- errors
async def _bad_body(_: HTTPRequest, exc: RequestValidationError):
    return error_json(400, f"malformed request: {_describe_validation(exc.errors())}")


async def _http_error(request: HTTPRequest, exc: StarletteHTTPException):
    messages = {
        404: f"not found: no route {request.url.path}",
        405: f"method {request.method} not allowed on {request.url.path}",
        400: "malformed request: the body cannot be parsed as JSON",
    }
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_json(exc.status_code, messages.get(exc.status_code, str(exc.detail)), kind)


async def _openai_error(_: HTTPRequest, exc: OpenAIError):
    return error_json(exc.status, exc.message, exc.kind)


async def _unexpected(_: HTTPRequest, exc: Exception):
    print(f"request failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    return error_json(500, f"request failed: {type(exc).__name__}: {exc}", "server_error")


def _describe_validation(errors: list[dict[str, Any]]) -> str:
    """pydantic errors -> 'field: problem; ...' naming each field once, without echoing the input."""
    by_field: dict[str, list[str]] = {}
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        # union members show up as loc parts like 'str' / 'list[int]': keep the field, drop the member
        field = ".".join(x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int"))
        if err.get("type") == "json_invalid":
            field, msg = "body", f"invalid JSON ({err.get('ctx', {}).get('error', 'cannot decode')})"
        else:
            msg = str(err.get("msg", "invalid"))
        by_field.setdefault(field or "body", [])
        if msg not in by_field[field or "body"]:
            by_field[field or "body"].append(msg)
    return "; ".join(f"{f}: {' or '.join(m)}" for f, m in by_field.items())


# --------------------------------------------------------------------------------- app
def build_app(
    engine,
    tokenizer: Tokenizer,
    model_name: str = "base",
    adapter_name: str | None = None,
    limits: ServerLimits | None = None,
    api_key: str | None = None,
    allowed_local_media: tuple[str, ...] = (),
    body_timeout_s: float = 30.0,
    **limit_overrides,
):
    """The ASGI app; `app.state.serve.worker` is the EngineWorker (close it on shutdown). `limits`
    default to the engine's context and vocabulary; keyword overrides (e.g. `max_n=4`) replace
    single fields."""
    cfg = getattr(engine, "config", None)
    if limits is None:
        limits = ServerLimits(
            max_model_len=getattr(cfg, "max_position_embeddings", 2**31),
            vocab_size=getattr(cfg, "vocab_size", None),
        )
    limits = dataclasses.replace(limits, **limit_overrides)
    slots = getattr(getattr(engine, "scheduler", None), "max_num_seqs", None)
    if slots is not None and limits.max_n >= slots:
        raise ValueError(
            f"max_n={limits.max_n} must be below the engine's max_num_seqs={slots}, so that one "
            "request cannot hold every sequence slot"
        )
    vision = getattr(getattr(engine, "model", None), "vision", None)
    state = ServeState(
        worker=EngineWorker(engine, tokenizer.decode, limits.max_pending),
        tokenizer=tokenizer,
        limits=limits,
        model_name=model_name,
        adapter_name=adapter_name,
        vision_config=vision.config if vision else None,
        allowed_media=tuple(Path(d).resolve() for d in allowed_local_media),
    )
    app = FastAPI(title="rollout engine")
    app.state.serve = state
    app.state.worker = state.worker
    app.add_exception_handler(RequestValidationError, _bad_body)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(Exception, _unexpected)
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_middleware(BodyTimeout, seconds=body_timeout_s)
    if api_key:
        app.add_middleware(RequireAPIKey, key=api_key)
    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from model.config import ModelConfig
    from model.modeling import MiniMaxM3ForCausalLM
    from rollout.native.engine import NativeEngine

    ap = argparse.ArgumentParser(description="OpenAI-compatible server over the native engine")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory (model/checkpoint.py layout)")
    src.add_argument("--preset", help="random-initialised preset (smoke tests)")
    ap.add_argument(
        "--tokenizer",
        help="'byte' or a Hugging Face tokenizer directory (default: the one the "
        "adapter or checkpoint records; presets: byte)",
    )
    ap.add_argument("--adapter", help="LoRA adapter directory (model/adapter.py layout)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-pages", type=int, default=1024)
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-n", type=int, default=16, help="samples per request (< --max-num-seqs)")
    ap.add_argument(
        "--max-tokens-limit", type=int, help="cap on max_tokens per request (default: the context)"
    )
    ap.add_argument("--max-pending", type=int, default=256, help="requests in flight before 429")
    ap.add_argument("--max-stop-strings", type=int, default=64)
    ap.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; none: open)",
    )
    ap.add_argument(
        "--allowed-local-media",
        action="append",
        default=[],
        metavar="DIR",
        help="directory local image files may be read from (repeatable; default: none)",
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args(argv)
    if args.model:
        from model.checkpoint import load_model

        model = load_model(args.model, device=args.device)
        tok = load_tokenizer(args.tokenizer) if args.tokenizer else tokenizer_for(args.model, args.adapter)
        name = args.model.rstrip("/").split("/")[-1]
    else:
        model = MiniMaxM3ForCausalLM(ModelConfig.preset(args.preset)).to(args.device).init_weights()
        tok = load_tokenizer(args.tokenizer or "byte")
        name = args.preset
    adapter_name = None
    if args.adapter:
        from model.adapter import load_adapter

        load_adapter(model, args.adapter)
        adapter_name = args.adapter.rstrip("/").split("/")[-1]
    engine = NativeEngine(model.eval(), args.max_pages, args.max_batch_tokens, args.max_num_seqs)
    app = build_app(
        engine,
        tok,
        name,
        adapter_name,
        api_key=args.api_key,
        allowed_local_media=tuple(args.allowed_local_media),
        max_n=args.max_n,
        max_tokens_limit=args.max_tokens_limit,
        max_pending=args.max_pending,
        max_stop_strings=args.max_stop_strings,
    )
    try:
        uvicorn.Server(uvicorn_config(app, args.host, args.port)).run()
    finally:
        app.state.worker.close()


if __name__ == "__main__":
    main()
