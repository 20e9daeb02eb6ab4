"""The server under hostile clients (issue 25): real uvicorn on 127.0.0.1, raw HTTP, the real engine.

Every case asserts the status, a JSON error body with one message, and that the server serves a
normal request right after. Loops are bounded in count and time; the only timed assert is the
fairness bound the issue asks for.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from common.tokenizer import ByteTokenizer
from model.config import ModelConfig
from model.modeling import MiniMaxM3ForCausalLM
from rollout.native import NativeEngine
from rollout.server import build_app
from tests.rollout.live_server import free_port, live_server

pytestmark = pytest.mark.reliability
REPO = Path(__file__).resolve().parents[2]


def _strict_json(text: str):
    def refuse(c):
        raise ValueError(f"non-finite float {c} in a JSON reply")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def tiny():
    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield MiniMaxM3ForCausalLM(ModelConfig.preset("tiny")).init_weights(std=0.05, seed=0).eval()
    torch.set_num_threads(n_threads)


def _engine(model, max_pages: int = 512) -> NativeEngine:
    return NativeEngine(model, max_pages=max_pages, max_batch_tokens=256, kv_dtype="fp32", index_dtype="fp32")


@pytest.fixture(scope="module")
def server(tiny):
    engine = _engine(tiny)
    app = build_app(engine, ByteTokenizer(), model_name="tiny", default_max_tokens=8)
    with live_server(app) as url:
        yield url, engine, app


def _post(url: str, path: str, body=None, raw: bytes | None = None, headers=None, timeout=60.0):
    headers = {"content-type": "application/json", **(headers or {})}
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers=headers, timeout=timeout)


def _error(r: httpx.Response, status: int, *words: str) -> str:
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = _strict_json(r.text)["error"]
    msg = err["message"]
    assert "\n" not in msg and err["code"] == status and len(msg) < 4000, msg
    for w in words:
        assert w.lower() in msg.lower(), f"{w!r} not in {msg!r}"
    return msg


def _serves(url: str, headers=None) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0.0}
    r = _post(url, "/v1/completions", body, headers=headers)
    assert r.status_code == 200, r.text[:500]
    assert 1 <= len(_strict_json(r.text)["choices"][0]["token_ids"]) <= 2


def _pages_in_use(app, engine) -> int:
    return app.state.worker.call(lambda: engine.stats().pages_in_use)


def _wait_until(cond, seconds: float = 30.0, what: str = "condition") -> None:
    deadline = time.time() + seconds
    while not cond():
        assert time.time() < deadline, f"{what} not reached within {seconds} s"
        time.sleep(0.05)


# ------------------------------------------------------------------------------- admission
def _raw(fields: str) -> bytes:
    return ('{"model":"tiny","prompt":"hi","max_tokens":4,"temperature":0.0,' + fields + "}").encode()


@pytest.mark.parametrize("top_k", ["9223372036854775808", str(2**70), "512", "100000"])
def test_top_k_beyond_int64_or_the_vocabulary_is_served_as_off(server, top_k):
    url, _, _ = server
    r = _post(url, "/v1/completions", raw=_raw(f'"top_k":{top_k},"temperature":1.0,"seed":3'))
    off = _post(url, "/v1/completions", raw=_raw('"top_k":0,"temperature":1.0,"seed":3'))
    assert r.status_code == off.status_code == 200, r.text[:500]
    assert (
        _strict_json(r.text)["choices"][0]["token_ids"] == _strict_json(off.text)["choices"][0]["token_ids"]
    )
    _serves(url)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ('"top_k":1e30', ["top_k"]),
        ('"top_k":-2', ["top_k", "-1"]),
        ('"top_k":2.5', ["top_k"]),
        ('"temperature":2.5', ["temperature", "2.0"]),
        ('"top_p":0', ["top_p", "(0.0, 1.0]"]),
        ('"min_p":1.5', ["min_p"]),
        ('"max_tokens":1000000000,"n":64,"ignore_eos":true', ["n must be in [1, 16]", "max_n"]),
        ('"max_tokens":1000000000,"ignore_eos":true', ["max_tokens must be in [1, 4093]", "4096"]),
        ('"max_tokens":4094', ["max_tokens", "4093"]),
        ('"max_tokens":1000000000,"stream":true', ["max_tokens"]),
        ('"n":17', ["max_n"]),
        ('"logprobs":21', ["logprobs", "20"]),
        ('"stop_token_ids":[512]', ["stop_token_ids", "512"]),
    ],
)
def test_out_of_range_sampling_parameters_are_400_naming_the_field_and_limit(server, fields, words):
    url, _, _ = server
    _error(_post(url, "/v1/completions", raw=_raw(fields)), 400, *words)
    _serves(url)


def test_chat_max_completion_tokens_beyond_the_context_is_400(server):
    url, _, _ = server
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**9}
    _error(_post(url, "/v1/chat/completions", body), 400, "max_tokens")
    _serves(url)


@pytest.mark.parametrize(
    ("stop", "words"),
    [
        ([f"s{i:05d}" for i in range(10_000)], ["10000 stop strings", "max_stop_strings"]),
        (["x" * 300 + str(i) for i in range(1000)], ["max_stop_strings"]),
        (["y" * 300], ["stop[0]", "300 characters", "max_stop_chars"]),
        ([""], ["stop[0]", "non-empty"]),
    ],
)
def test_stop_strings_beyond_the_server_limits_are_400(server, stop, words):
    url, _, _ = server
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "stop": stop}
    _error(_post(url, "/v1/completions", body), 400, *words)
    _serves(url)


def test_ten_thousand_stop_strings_within_raised_limits_cut_like_the_one_that_matches(tiny):
    app = build_app(
        _engine(tiny), ByteTokenizer(), model_name="tiny", max_stop_strings=10_000, max_stop_chars=300
    )
    with live_server(app) as url:
        body = {"model": "tiny", "prompt": "abc", "max_tokens": 48, "temperature": 0.0, "ignore_eos": True}
        text = _strict_json(_post(url, "/v1/completions", body).text)["choices"][0]["text"]
        assert len(text) >= 8, text
        stop = text[5:8]
        # 10,000 strings that never occur (a control character the tiny model never samples here)
        never = [f"\x01{i:05d}" + "z" * (i % 290) for i in range(9_999)]
        assert not any(s in text for s in never)
        one = _strict_json(_post(url, "/v1/completions", {**body, "stop": [stop]}).text)["choices"][0]
        many = _post(url, "/v1/completions", {**body, "stop": [*never, stop]}, timeout=120)
        assert many.status_code == 200, many.text[:300]
        many = _strict_json(many.text)["choices"][0]
        assert many["text"] == one["text"] == text[: text.find(stop)]
        assert many["finish_reason"] == "stop" and many["stop_reason"] == stop
        streaming = {**body, "stop": [*never, stop], "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=streaming, timeout=120) as r:
            streamed = "".join(
                _strict_json(line[6:])["choices"][0]["text"]
                for line in r.iter_lines()
                if line.startswith("data: {")
            )
        assert streamed == one["text"]
        _serves(url)


# ------------------------------------------------------------------------------- replies
@pytest.mark.parametrize("temperature", [1e-40, 1e-45, 5e-324, 9e-6])
@pytest.mark.parametrize("stream", [False, True])
def test_temperatures_below_epsilon_are_greedy_and_replies_hold_only_finite_floats(
    server, temperature, stream
):
    url, _, _ = server
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 6, "logprobs": 1, "ignore_eos": True}
    greedy = _strict_json(_post(url, "/v1/completions", {**body, "temperature": 0.0}).text)["choices"][0]
    r = _post(url, "/v1/completions", {**body, "temperature": temperature, "stream": stream})
    assert r.status_code == 200, r.text[:500]
    if stream:
        events = [_strict_json(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert "".join(e["choices"][0]["text"] for e in events) == greedy["text"]
    else:
        choice = _strict_json(r.text)["choices"][0]
        assert choice["token_ids"] == greedy["token_ids"]
        assert all(lp is not None and lp >= -9999.0 for lp in choice["logprobs"]["token_logprobs"])
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": temperature, "logprobs": True}  # fmt: skip
    r = _post(url, "/v1/chat/completions", chat)
    assert r.status_code == 200 and _strict_json(r.text)["choices"][0]["logprobs"]["content"]
    _serves(url)


SURROGATES = [  # (path, raw body, words the error names)
    ("/v1/completions", rb'{"model":"tiny","prompt":"\ud800","max_tokens":2}', ["prompt", "surrogate"]),
    ("/v1/completions", b'{"model":"tiny","prompt":"h\xed\xa0\x80i"}', ["prompt", "surrogate"]),
    ("/v1/completions", rb'{"model":"tiny","prompt":"a\udfffb","max_tokens":2}', ["prompt", "surrogate"]),
    ("/v1/completions", rb'{"model":"tiny","prompt":"hi","stop":["\ud800"]}', ["stop[0]", "surrogate"]),
    ("/v1/chat/completions", rb'{"model":"tiny","messages":[{"role":"user","content":"\ud800"}]}',
     ["messages[0].content", "surrogate"]),
    ("/v1/chat/completions", b'{"model":"tiny","messages":[{"role":"user","content":"h\xed\xa0\x80i"}]}',
     ["messages[0].content"]),
    ("/v1/chat/completions",
     rb'{"model":"tiny","messages":[{"role":"user","content":[{"type":"text","text":"\udc00"}]}]}',
     ["messages[0].content"]),
    ("/v1/chat/completions", rb'{"model":"tiny","messages":[{"role":"\ud800","content":"x"}]}',
     ["messages[0].role"]),
]  # fmt: skip


@pytest.mark.parametrize(("path", "raw", "words"), SURROGATES)
def test_lone_surrogates_are_400_naming_the_field(server, path, raw, words):
    url, _, _ = server
    _error(_post(url, path, raw=raw), 400, *words)
    _serves(url)


def test_surrogate_in_the_model_name_is_a_json_404_and_paired_surrogates_are_text(server):
    url, _, _ = server
    _error(_post(url, "/v1/completions", raw=rb'{"model":"\ud800","prompt":"hi"}'), 404, "not found")
    ok = _post(url, "/v1/completions", raw=rb'{"model":"tiny","prompt":"\ud83d\ude00","max_tokens":2}')
    assert ok.status_code == 200 and _strict_json(ok.text)["usage"]["prompt_tokens"] == 5  # bos + 4 bytes
    _serves(url)


def test_health_is_ok_while_the_engine_serves(server):
    url, _, _ = server
    r = httpx.get(f"{url}/health", timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "ok"}


# ------------------------------------------------------------------------------- aborts, fairness
LONG = {
    "model": "tiny",
    "prompt": "hi",
    "max_tokens": 3000,
    "ignore_eos": True,
    "temperature": 1.0,
    "seed": 1,
}


def test_a_dropped_stream_is_aborted_and_its_pages_freed(server):
    url, engine, app = server
    with (
        httpx.Client(timeout=60) as c,
        c.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}) as r,
    ):
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few chunks (and blank separators)
        assert any(line.startswith("data: {") for line in got)
        assert _pages_in_use(app, engine) > 0
        steps = app.state.worker.call(lambda: engine.stats().steps)
        t0 = time.perf_counter()
    # The client is gone: the sequence must leave the engine and give its pages back.
    _wait_until(lambda: _pages_in_use(app, engine) == 0, what="pages freed after the stream was dropped")
    after = app.state.worker.call(lambda: engine.stats().steps) - steps
    print(
        f"dropped stream: pages freed {time.perf_counter() - t0:.3f} s, {after} engine steps after the close"
    )
    assert not app.state.worker.call(engine.has_unfinished)
    _serves(url)


def test_a_dropped_non_streamed_request_is_aborted_and_its_pages_freed(server):
    url, engine, app = server
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps(LONG).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head.encode() + body)
        _wait_until(lambda: _pages_in_use(app, engine) > 0, what="the request running")
    _wait_until(lambda: _pages_in_use(app, engine) == 0, what="pages freed after the client closed")
    assert not app.state.worker.call(engine.has_unfinished)
    _serves(url)


def test_a_long_request_does_not_hold_back_a_short_one(server):
    url, engine, app = server
    short = {"model": "tiny", "prompt": "12+35=", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    alone = []
    for _ in range(2):  # the faster of two: the first may pay a warm-up
        t0 = time.perf_counter()
        assert _post(url, "/v1/completions", short).status_code == 200
        alone.append(time.perf_counter() - t0)
    alone_s = min(alone)
    long_done, started, leave = threading.Event(), threading.Event(), threading.Event()

    def run_long():
        with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "max_tokens": 2000, "stream": True},
                          timeout=600) as r:  # fmt: skip
            for line in r.iter_lines():
                started.set()
                if line == "data: [DONE]":
                    long_done.set()
                if leave.is_set() or long_done.is_set():
                    break  # closing the stream: the server aborts the request

    thread = threading.Thread(target=run_long, daemon=True)
    thread.start()
    assert started.wait(60), "the long request never started"
    t0 = time.perf_counter()
    r = _post(url, "/v1/completions", short)
    with_long_s = time.perf_counter() - t0
    assert r.status_code == 200
    assert not long_done.is_set(), "the long request finished first: the test proves nothing"
    # Generous bound (the issue's): the short request shares steps with the long one instead of
    # waiting for it; 2000 tokens take far longer than this.
    assert with_long_s < 20 * alone_s + 5.0, (with_long_s, alone_s)
    print(f"short request alone {alone_s:.3f} s, beside a 2000-token request {with_long_s:.3f} s")
    leave.set()
    thread.join(timeout=60)
    _wait_until(lambda: _pages_in_use(app, engine) == 0, what="pages freed")
    _serves(url)


def test_requests_beyond_max_pending_get_429_and_are_served_once_there_is_room(tiny):
    engine = _engine(tiny)
    app = build_app(engine, ByteTokenizer(), model_name="tiny", max_pending=1)
    with live_server(app) as url, httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}) as r:
            lines = r.iter_lines()  # kept: a dropped iterator closes the connection
            assert next(lines).startswith("data: {")
            _error(
                _post(url, "/v1/completions", {"model": "tiny", "prompt": "hi"}), 429, "max_pending", "retry"
            )
        _wait_until(lambda: _post(url, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
                    .status_code == 200, what="a request served after the long one was dropped")  # fmt: skip
        _serves(url)


# ------------------------------------------------------------------------------- isolation
def test_a_failing_step_fails_the_requests_in_flight_and_the_engine_keeps_serving(tiny, monkeypatch):
    engine = _engine(tiny)
    app = build_app(engine, ByteTokenizer(), model_name="tiny")
    real = engine.model.forward_cached
    calls = {"n": 0}

    def fails_once(*a, **k):  # an injected fault, as a bug deep in a kernel would raise
        calls["n"] += 1
        if calls["n"] == 3:
            raise IndexError("index 7 is out of bounds (injected)")
        return real(*a, **k)

    monkeypatch.setattr(engine.model, "forward_cached", fails_once)
    with live_server(app) as url:
        r = _post(
            url, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 20, "ignore_eos": True}
        )
        _error(r, 500, "IndexError", "injected", "dropped")
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        assert _pages_in_use(app, engine) == 0
        _serves(url)


# ------------------------------------------------------------------------------- access
def test_api_key_guards_every_route_but_health(tiny):
    app = build_app(_engine(tiny, 64), ByteTokenizer(), model_name="tiny", api_key="s3cret")
    with live_server(app) as url:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
            _error(httpx.get(f"{url}/v1/models", headers=headers, timeout=10), 401, "api key", "Bearer")
            body = {"model": "tiny", "prompt": "hi"}
            _error(_post(url, "/v1/completions", body, headers=headers), 401, "api key")
            _error(httpx.get(f"{url}/v1/nothing", headers=headers, timeout=10), 401, "api key")
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        good = {"authorization": "Bearer s3cret"}
        assert httpx.get(f"{url}/v1/models", headers=good, timeout=10).status_code == 200
        _serves(url, headers=good)


def test_api_key_from_the_environment_in_a_real_server_process(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "ROLLOUT_API_KEY": "from-env"}
    cmd = [sys.executable, "-m", "rollout.serve", "--preset", "tiny", "--device", "cpu", "--port", str(port),
           "--max-pages", "64"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        _wait_until(up, seconds=90, what="the server process answering /health")
        _error(httpx.get(f"{url}/v1/models", timeout=10), 401, "api key")
        ok = httpx.get(f"{url}/v1/models", headers={"authorization": "Bearer from-env"}, timeout=10)
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "tiny"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert list(tmp_path.iterdir()) == []


def _png_bytes() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (90, 20, 200)).save(buf, "PNG")
    return buf.getvalue()


def test_local_image_files_only_from_allowed_directories_with_one_message(tmp_path):
    torch.set_num_threads(1)
    model = MiniMaxM3ForCausalLM(ModelConfig.preset("tiny-vl")).init_weights(std=0.1, seed=0).eval()
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(_png_bytes())
    (allowed / "host").symlink_to("/etc/hostname")
    refused = ["file:///etc/shadow", "/etc/shadow", "/proc/self/environ", "/no/such.png", "file:///no/such.png",
               "a.png", "../../etc/passwd", f"{allowed}/../../etc/passwd", f"{allowed}/host",
               f"{allowed}/missing.png"]  # fmt: skip

    def chat(url, image_url):
        content = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": image_url}}]
        body = {"model": "tiny-vl", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
        return _post(url, "/v1/chat/completions", body)

    for allow in ((), (str(allowed),)):
        app = build_app(_engine(model, 64), ByteTokenizer(), model_name="tiny-vl", allowed_local_media=allow)
        with live_server(app) as url:
            messages = {_error(chat(url, u), 400, "local image files are not served") for u in refused}
            assert len(messages) == 1, messages  # the same words for every refused path
            for u in (f"{allowed}/a.png", f"file://{allowed}/a.png"):
                r = chat(url, u)
                if allow:
                    assert r.status_code == 200, r.text[:300]
                else:
                    _error(r, 400, "local image files are not served")
            body = {"model": "tiny-vl", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert _post(url, "/v1/chat/completions", body).status_code == 200


# ------------------------------------------------------------------------------- slow clients
def test_half_sent_headers_and_bodies_time_out(tiny):
    app = build_app(_engine(tiny, 64), ByteTokenizer(), model_name="tiny", body_timeout_s=1.0)
    with live_server(app, header_timeout_s=1.0) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
            t0 = time.time()
            assert s.recv(1024) == b"", "the server kept a half-sent header open"
            assert time.time() - t0 < 15
        with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"model\":")  # fmt: skip
            reply = b""
            while chunk := s.recv(4096):
                reply += chunk
        head, _, payload = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), reply[:300]
        assert "not received within 1 s" in _strict_json(payload.decode())["error"]["message"]
        _serves(url)


# ------------------------------------------------------------------------------- tool calls
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "object"}}}}}}]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "tool_choice", ["auto", "required", {"type": "function", "function": {"name": "add"}}]
)
def test_a_random_models_tool_calls_come_back_as_content_never_a_500(server, tool_choice, stream):
    """The random model writes no well-formed call after the forced opening: its text is the reply's
    content (opening included), for many seeds and lengths, streamed and not."""
    from common.tool_calls import render_call_opening

    url, _, _ = server
    name = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    opening = "" if tool_choice == "auto" else render_call_opening(name)
    for seed in range(4):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "add 2 and 3"}], "tools": TOOLS,
                "tool_choice": tool_choice, "max_tokens": 4 + 9 * seed, "seed": seed,
                "stream": stream}  # fmt: skip
        r = _post(url, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text[:500]
        if stream:
            events = [_strict_json(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
            finish = events[-1]["choices"][0]["finish_reason"]
        else:
            message = _strict_json(r.text)["choices"][0]["message"]
            content, finish = message["content"], _strict_json(r.text)["choices"][0]["finish_reason"]
            assert "tool_calls" not in message
        assert content.startswith(opening) and finish in ("stop", "length")
    _serves(url)
