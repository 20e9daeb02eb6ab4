"""OpenAI-compatible HTTP server over a rollout engine (for serving exported adapters).

What: `/v1/models`, `/v1/completions` and `/v1/chat/completions` (both with `stream`), backed by
one engine driven by one background thread (`EngineWorker`): HTTP handlers enqueue requests,
the worker adds them between steps and runs `step()` while anything is unfinished, and results
flow back to the handlers' asyncio queues through thread-safe callbacks. `set_adapter` also runs
on the worker between steps, so a swap never lands inside a forward.

Bad input: every malformed request gets an OpenAI-shaped JSON error (400 malformed / out-of-range,
404 unknown model or route, 405 wrong method) whose one-line message names the field, never a 500
and never an echo of a huge input; numbers must be finite, `n` is capped (`max_n`), seeds must fit
torch's generator, and a failure inside the engine thread is delivered to the requests it hit
instead of silently killing the thread (which would hang every later request).

Images: `/v1/chat/completions` accepts OpenAI content parts in user messages ({"type": "text"} and
{"type": "image_url", "image_url": {"url": ...}} with a base64 data URL, a file:// URL or a local
path) when the model has a vision tower; model.vision.chat_to_ids_and_images renders the chat with
the tokenizer's own template, expands each image into its placeholder span and preprocesses it
(off the event loop). A malformed, oversized or unsupported image, too many images, or images sent
to a text-only model is a 400 whose message names the image and the problem. Text-only requests
(string content, or text parts only) take the same path as before.

Conventions: prompts may be text or token ids; `choices[i].token_ids` (an extension, as vLLM's
`return_token_ids`) carries the sampled ids; `logprobs` follows rollout/engine.py (temperature-
scaled, before truncation). Text stops at (and excludes) a matched stop string. Errors are
OpenAI-shaped JSON: 400 for a malformed request, 404 for an unknown model.

Run: `python -m rollout.server --preset tiny --port 8000` (random tiny model, byte tokenizer) or
`--model CKPT [--tokenizer DIR] [--adapter DIR]`. One adapter at a time is served (the engine has
one global adapter): `/v1/models` lists the base and, when loaded, the adapter (with the base as
its parent), and only the adapter answers requests then.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.tokenizer import Tokenizer, load_tokenizer, tokenizer_for
from rollout.engine import Completion, Request, SamplingParams
from rollout.native.engine import NativeEngine


# --------------------------------------------------------------------------------- worker
class EngineWorker:
    """Owns the engine; one thread adds queued requests between steps and steps while busy."""

    def __init__(self, engine: NativeEngine):
        self.engine = engine
        self._inbox: list[Callable[[], None]] = []
        self._cv = threading.Condition()
        self._stop = False
        self._done_cb: dict[str, Callable[[list[Completion]], None]] = {}
        self._error_cb: dict[str, Callable[[Exception], None]] = {}
        self._broken: Exception | None = None  # set when a step fails and the engine cannot drop requests
        self._partial: dict[str, list[Completion]] = {}
        self._n: dict[str, int] = {}
        self._thread = threading.Thread(target=self._loop, name="engine-worker", daemon=True)
        self._thread.start()

    def submit(
        self,
        request: Request,
        on_token: Callable[[int, int, float], None],
        on_done: Callable[[list[Completion]], None],
        on_error: Callable[[Exception], None],
    ) -> None:
        def add():
            if self._broken is not None:
                on_error(RuntimeError(f"the engine failed earlier ({self._broken}); restart the server"))
                return
            try:
                rid = self.engine.add_request(request, on_token)
            except Exception as e:  # invalid for this engine: that request fails, the thread lives on
                on_error(e)
                return
            self._error_cb[rid] = on_error
            self._done_cb[rid] = on_done
            self._partial[rid] = []
            self._n[rid] = request.n

        self._post(add)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the worker between steps and wait for its result."""
        box: dict[str, Any] = {}
        ready = threading.Event()

        def run():
            try:
                box["value"] = fn()
            except Exception as e:  # handed back to the caller's thread
                box["error"] = e
            ready.set()

        self._post(run)
        ready.wait()
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join()

    def _post(self, item: Callable[[], None]) -> None:
        with self._cv:
            self._inbox.append(item)
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._inbox or self._stop or self._busy()):
                    self._cv.wait()
                if self._stop:
                    return
                items, self._inbox = self._inbox, []
            for item in items:
                item()
            if self._busy():
                try:
                    finished = self.engine.step()
                except Exception as e:  # a bug or an engine fault: fail what is in flight, keep serving
                    self._fail_all(e)
                    continue
                for c in finished:
                    group = self._partial[c.request_id]
                    group.append(c)
                    if len(group) == self._n[c.request_id]:
                        del self._partial[c.request_id], self._n[c.request_id]
                        self._error_cb.pop(c.request_id, None)
                        self._done_cb.pop(c.request_id)(sorted(group, key=lambda x: x.sample_index))

    def _busy(self) -> bool:
        return self._broken is None and self.engine.has_unfinished()

    def _fail_all(self, error: Exception) -> None:
        """Deliver `error` to every in-flight request. An engine that can drop them (`abort_request`)
        keeps serving; one that cannot is marked broken (its state is unknown), and later requests
        fail fast with a message saying so instead of hanging."""
        print(f"engine step failed: {type(error).__name__}: {error}", file=sys.stderr)
        abort = getattr(self.engine, "abort_request", None)
        if abort is None:
            self._broken = error
        for rid in list(self._done_cb):
            if abort is not None:
                try:
                    abort(rid)
                except Exception as e:  # the engine cannot drop it: stop trusting the engine
                    self._broken = e
            self._done_cb.pop(rid, None)
            self._partial.pop(rid, None)
            self._n.pop(rid, None)
            self._error_cb.pop(rid)(RuntimeError(f"engine failure: {type(error).__name__}: {error}"))


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of `text` that may still change: a trailing replacement character
    (an incomplete UTF-8 sequence the next token may complete) or text that could become (or
    already holds) a stop string. Streaming sends only what precedes them."""
    hold = len(text) - len(text.rstrip("\ufffd"))
    for s in stops:
        at = text.find(s)
        if at >= 0:
            hold = max(hold, len(text) - at)
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


# --------------------------------------------------------------------------------- API bodies
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


class CompletionBody(_Body):
    prompt: str | list[int]
    logprobs: int | None = None


class ChatBody(_Body):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


_MAX_MESSAGE_CHARS = 1000
_SEED_LIMIT = 2**63  # torch.Generator.manual_seed takes a signed 64-bit seed


def _error_json(status: int, message: str, kind: str) -> JSONResponse:
    message = " ".join(message.split())  # one line
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[:_MAX_MESSAGE_CHARS] + " ... (cut)"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


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


def _chat_messages(raw: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
    """Checked messages and whether any holds an image part. Content is a string or a list of
    text / image_url parts; a list of text parts only is joined into a string (the text path)."""
    messages, has_images = [], False
    shape = "{'type': 'text', 'text': str} or {'type': 'image_url', 'image_url': {'url': str}}"
    for i, m in enumerate(raw):
        content = m.get("content")
        if not isinstance(m.get("role"), str) or not isinstance(content, str | list):
            raise OpenAIError(
                400, "every message needs string 'role' and 'content' (a string or a list of content parts)"
            )
        if isinstance(content, list):
            kinds = [p.get("type") if isinstance(p, dict) else None for p in content]
            bad_text = any(k == "text" and not isinstance(p.get("text"), str) for k, p in zip(kinds, content))
            if bad_text or any(k not in ("text", "image_url") for k in kinds):
                raise OpenAIError(400, f"messages[{i}].content: every part must be {shape}")
            if "image_url" in kinds:
                has_images = True
            else:
                m = {**m, "content": "".join(p["text"] for p in content)}
        messages.append(m)
    return messages, has_images


# --------------------------------------------------------------------------------- app
def build_app(
    engine: NativeEngine,
    tokenizer: Tokenizer,
    model_name: str = "base",
    adapter_name: str | None = None,
    default_max_tokens: int = 256,
    max_n: int = 64,
) -> FastAPI:
    """The FastAPI app; `app.state.worker` is the EngineWorker (close it on shutdown). `max_n` caps
    the samples one request may ask for."""
    app = FastAPI(title="rollout engine")
    worker = EngineWorker(engine)
    app.state.worker = worker
    served = [model_name] + ([adapter_name] if adapter_name else [])

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_: HTTPRequest, exc: RequestValidationError):
        return _error_json(
            400, f"malformed request: {_describe_validation(exc.errors())}", "invalid_request_error"
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: HTTPRequest, exc: StarletteHTTPException):
        messages = {404: f"not found: no route {request.url.path}",
                    405: f"method {request.method} not allowed on {request.url.path}",
                    400: "malformed request: the body cannot be parsed as JSON"}  # fmt: skip
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_json(exc.status_code, messages.get(exc.status_code, str(exc.detail)), kind)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: HTTPRequest, exc: OpenAIError):
        return _error_json(exc.status, exc.message, exc.kind)

    @app.get("/v1/models")
    async def models():
        now = int(time.time())
        data = [{"id": m, "object": "model", "created": now, "owned_by": "rollout"} for m in served]
        if adapter_name:
            data[1]["parent"] = model_name
        return {"object": "list", "data": data}

    def to_request(body: _Body, prompt_ids: list[int], max_tokens: int | None, images: tuple = ()) -> Request:
        if body.model not in served:
            raise OpenAIError(404, f"model {body.model!r} not found; served: {served}", "not_found_error")
        if adapter_name and body.model != adapter_name:
            # One global adapter: the base alone cannot be sampled while it is loaded.
            raise OpenAIError(400, f"the engine serves adapter {adapter_name!r}; ask for that model")
        for name in ("temperature", "top_p", "min_p"):
            if not math.isfinite(getattr(body, name)):
                raise OpenAIError(400, f"{name} must be a finite number, got {getattr(body, name)}")
        if not 1 <= body.n <= max_n:
            raise OpenAIError(400, f"n must be in [1, {max_n}], got {body.n}")
        if body.seed is not None and not 0 <= body.seed < _SEED_LIMIT:
            raise OpenAIError(400, f"seed must be in [0, 2**63), got {body.seed}")
        if max_tokens is not None and max_tokens < 1:
            raise OpenAIError(400, f"max_tokens must be an int >= 1, got {max_tokens}")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        try:
            params = SamplingParams(
                temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                max_tokens=default_max_tokens if max_tokens is None else max_tokens, stop=tuple(stop),
                stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
            )  # fmt: skip
            return Request(tuple(prompt_ids), params, n=body.n, seed=body.seed, images=images)
        except ValueError as e:
            raise OpenAIError(400, str(e)) from e

    async def run(request: Request):
        """Yields ("token", index, id, logprob) events, then ("done", completions)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def put(item):
            loop.call_soon_threadsafe(q.put_nowait, item)

        rid = f"srv-{uuid.uuid4().hex[:12]}"
        request = dataclasses.replace(request, request_id=rid)
        worker.submit(
            request,
            on_token=lambda i, t, lp: put(("token", i, t, lp)),
            on_done=lambda cs: put(("done", cs)),
            on_error=lambda e: put(("error", e)),
        )
        while True:
            item = await q.get()
            if item[0] == "error":  # the engine refused it: say what the request asked for
                p = request.params
                status = 400 if isinstance(item[1], ValueError) else 500  # 500: the engine itself failed
                raise OpenAIError(
                    status, f"{item[1]} (request: prompt of {len(request.prompt_token_ids)} tokens, "
                    f"max_tokens={p.max_tokens}, n={request.n})", "invalid_request_error" if status == 400
                    else "server_error",
                )  # fmt: skip
            yield item
            if item[0] == "done":
                return

    def text_of(c: Completion) -> str:
        text = tokenizer.decode(c.token_ids)
        if isinstance(c.stop_reason, str):
            text = text[: text.find(c.stop_reason)] if c.stop_reason in text else text
        return text

    def usage(cs: list[Completion]) -> dict[str, int]:
        p, g = len(cs[0].prompt_token_ids), sum(len(c.token_ids) for c in cs)
        return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    async def first_event(gen):
        """Pull the first event before the response starts, so request errors become 4xx."""
        try:
            return await gen.__anext__()
        except StopAsyncIteration:
            return None

    async def generate(
        body: _Body, prompt_ids: list[int], max_tokens: int | None, chat: bool, images: tuple = ()
    ):
        request = to_request(body, prompt_ids, max_tokens, images)
        gen = run(request)
        first = await first_event(gen)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:16]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if not body.stream:
            cs = first[1] if first[0] == "done" else None
            async for item in gen:
                if item[0] == "done":
                    cs = item[1]
            choices = []
            for c in cs:
                choice: dict[str, Any] = {"index": c.sample_index, "finish_reason": c.finish_reason,
                                          "token_ids": c.token_ids}  # fmt: skip
                lps = c.logprobs.tolist()
                if chat:
                    choice["message"] = {"role": "assistant", "content": text_of(c)}
                    if body.logprobs:
                        content = [{"token": tokenizer.decode([t]), "logprob": lp, "top_logprobs": []}
                                   for t, lp in zip(c.token_ids, lps)]  # fmt: skip
                        choice["logprobs"] = {"content": content}
                else:
                    choice["text"] = text_of(c)
                    if body.logprobs is not None:
                        toks = [tokenizer.decode([t]) for t in c.token_ids]
                        choice["logprobs"] = {"tokens": toks, "token_logprobs": lps}
                    else:
                        choice["logprobs"] = None
                choices.append(choice)
            return {"id": rid, "object": obj, "created": created, "model": body.model, "choices": choices,
                    "usage": usage(cs)}  # fmt: skip

        async def stream():
            obj_chunk = "chat.completion.chunk" if chat else "text_completion"
            emitted: dict[int, list[int]] = {}
            sent_text: dict[int, str] = {}

            def chunk(index: int, delta: str, finish: str | None):
                if chat:
                    d = (
                        {"role": "assistant", "content": delta}
                        if index not in sent_text
                        else {"content": delta}
                    )
                    choice = {"index": index, "delta": d, "finish_reason": finish}
                else:
                    choice = {"index": index, "text": delta, "finish_reason": finish}
                sent_text.setdefault(index, "")
                return sse({"id": rid, "object": obj_chunk, "created": created, "model": body.model,
                            "choices": [choice]})  # fmt: skip

            item = first
            while item is not None:
                if item[0] == "token":
                    _, i, tok, _ = item
                    emitted.setdefault(i, []).append(tok)
                    text = tokenizer.decode(emitted[i])
                    final = text[: len(text) - _held_back(text, request.params.stop)]
                    if len(final) > len(sent_text.get(i, "")):
                        yield chunk(i, final[len(sent_text.get(i, "")) :], None)
                        sent_text[i] = final
                else:
                    for c in item[1]:
                        full = text_of(c)
                        yield chunk(c.sample_index, full[len(sent_text.get(c.sample_index, "")) :],
                                    c.finish_reason)  # fmt: skip
                    yield "data: [DONE]\n\n"
                    return
                item = await first_event(gen)

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        ids = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        if not ids:
            raise OpenAIError(400, "prompt is empty")
        if body.logprobs is not None and body.logprobs < 0:
            raise OpenAIError(400, f"logprobs must be >= 0 (or null), got {body.logprobs}")
        return await generate(body, ids, body.max_tokens, chat=False)

    vision = getattr(getattr(engine, "model", None), "vision", None)
    vision_config = vision.config if vision is not None else None

    async def image_chat(messages: list[dict[str, Any]]) -> tuple[list[int], tuple]:
        from model.vision import ImageInputError, chat_to_ids_and_images

        if vision_config is None:
            raise OpenAIError(400, "image content parts need a model with a vision tower; this model is "
                                   "text-only: send string content")  # fmt: skip
        if not hasattr(tokenizer, "apply_chat_template"):
            raise OpenAIError(400, "this server's tokenizer cannot render image chats (no chat template)")
        try:  # decoding and resizing images is CPU work: keep it off the event loop
            chat = await asyncio.to_thread(chat_to_ids_and_images, messages, tokenizer, vision_config)
        except ImageInputError as e:
            raise OpenAIError(400, f"bad image input: {e}") from e
        return chat.input_ids, tuple(chat.images)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody):
        if not body.messages:
            raise OpenAIError(400, "messages is empty")
        messages, has_images = _chat_messages(body.messages)
        images: tuple = ()
        if has_images:
            ids, images = await image_chat(messages)
        else:
            ids = tokenizer.chat_prompt(messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await generate(body, ids, max_tokens, chat=True, images=images)

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from model.config import ModelConfig
    from model.modeling import MiniMaxM3ForCausalLM

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
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args(argv)
    if args.model:
        from model.checkpoint import load_model

        model = load_model(args.model, device=args.device)
        tokenizer: Tokenizer = (
            load_tokenizer(args.tokenizer) if args.tokenizer else tokenizer_for(args.model, args.adapter)
        )
        name = args.model.rstrip("/").split("/")[-1]
    else:
        model = MiniMaxM3ForCausalLM(ModelConfig.preset(args.preset)).to(args.device).init_weights()
        tokenizer = load_tokenizer(args.tokenizer or "byte")
        name = args.preset
    adapter_name = None
    if args.adapter:
        from model.adapter import load_adapter

        load_adapter(model, args.adapter)
        adapter_name = args.adapter.rstrip("/").split("/")[-1]
    engine = NativeEngine(model.eval(), args.max_pages, args.max_batch_tokens, detokenize=tokenizer.decode)
    app = build_app(engine, tokenizer, name, adapter_name)
    try:
        uvicorn.run(app, host=args.host, port=args.port)
    finally:
        app.state.worker.close()


if __name__ == "__main__":
    main()
