"""OpenAI-compatible server: the `openai` client against a live server over the tiny model."""

from __future__ import annotations

import openai
import pytest
import torch

from common.tokenizer import ByteTokenizer
from model.config import ModelConfig
from model.modeling import MiniMaxM3ForCausalLM
from rollout.engine import Request, SamplingParams
from rollout.native import NativeEngine
from rollout.server import build_app
from tests.rollout.live_server import live_server


@pytest.fixture(scope="module")
def served():
    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops; threads only contend on a shared CPU
    model = MiniMaxM3ForCausalLM(ModelConfig.preset("tiny")).init_weights(std=0.05, seed=0).eval()
    tok = ByteTokenizer()
    engine = NativeEngine(model, max_pages=64, max_batch_tokens=128, kv_dtype="fp32", index_dtype="fp32",
                          detokenize=tok.decode)  # fmt: skip
    app = build_app(engine, tok, model_name="tiny")
    with live_server(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0), model, tok
    torch.set_num_threads(n_threads)


def test_models_lists_the_served_model(served):
    client, _, _ = served
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion_matches_engine_and_streaming_matches_non_streaming(served):
    client, model, tok = served
    kw = dict(
        model="tiny", prompt="Hello there", max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True}
    )
    full = client.completions.create(**kw, logprobs=1)
    ref = NativeEngine(model, max_pages=16, kv_dtype="fp32", index_dtype="fp32").generate(
        [
            Request(
                tuple(tok.encode("Hello there")),
                SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
            )
        ]
    )[0]
    choice = full.choices[0]
    assert choice.model_extra["token_ids"] == ref.token_ids
    assert choice.text == tok.decode(ref.token_ids) and choice.finish_reason == "length"
    torch.testing.assert_close(torch.tensor(choice.logprobs.token_logprobs), ref.logprobs, atol=1e-5, rtol=0)
    assert full.usage.completion_tokens == 12
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_completion_with_n_samples_and_streaming(served):
    client, _, _ = served
    msgs = [{"role": "user", "content": "hi"}]
    out = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, n=3, seed=4,
                                         extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.message.role == "assistant" for c in out.choices)
    again = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, n=3, seed=4,
                                           extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, seed=4, stream=True,
                                            extra_body={"ignore_eos": True})  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text == out.choices[0].message.content


def test_malformed_and_unknown_model_requests_get_4xx_json_errors(served):
    client, _, _ = served
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="x", temperature=-1.0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=[5, 9999])  # token outside the vocabulary
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user"}])
    with pytest.raises(openai.BadRequestError, match="malformed"):
        client.completions.create(model="tiny", prompt="x", extra_body={"n": "many"})
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    # The server still answers after errors.
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).choices[0].finish_reason


def test_stop_string_truncates_text_in_both_modes(served):
    client, _, _ = served
    kw = dict(model="tiny", prompt="abc", max_tokens=24, temperature=0.0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    assert len(text) >= 4, text
    stop = text[2:4]
    cut = text[: text.find(stop)]
    out = client.completions.create(**kw, stop=[stop]).choices[0]
    assert out.text == cut and out.finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stop=[stop], stream=True))
    assert streamed == cut


def test_loaded_adapter_is_listed_with_its_base_and_is_the_only_model_answering(served):
    from fastapi.testclient import TestClient

    from model.layers.lora import LoRAConfig, apply_lora

    _, _, tok = served
    model = apply_lora(
        MiniMaxM3ForCausalLM(ModelConfig.preset("tiny")).init_weights(seed=1).eval(), LoRAConfig(r=2)
    )
    app = build_app(NativeEngine(model, max_pages=16), tok, model_name="tiny", adapter_name="math-v1")
    try:
        with TestClient(app) as http:
            data = http.get("/v1/models").json()["data"]
            assert [(m["id"], m.get("parent")) for m in data] == [("tiny", None), ("math-v1", "tiny")]
            ok = http.post("/v1/completions", json={"model": "math-v1", "prompt": "a", "max_tokens": 2})
            assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) <= 2
            base = http.post("/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 2})
            assert base.status_code == 400 and "math-v1" in base.json()["error"]["message"]
    finally:
        app.state.worker.close()


# --------------------------------------------------------------------------------- images
def _png_part(w: int, h: int, seed: int, solid: bool = False) -> dict:
    import base64
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(seed)
    pixels = np.full((h, w, 3), 90, np.uint8) if solid else rng.randint(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def vl_http():
    from fastapi.testclient import TestClient

    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = MiniMaxM3ForCausalLM(ModelConfig.preset("tiny-vl")).init_weights(std=0.1, seed=0).eval()
    tok = ByteTokenizer()
    engine = NativeEngine(model, max_pages=64, max_batch_tokens=128, kv_dtype="fp32", index_dtype="fp32",
                          detokenize=tok.decode)  # fmt: skip
    app = build_app(engine, tok, model_name="tiny-vl")
    with TestClient(app) as http:
        yield http, model, tok
    app.state.worker.close()
    torch.set_num_threads(n_threads)


def _chat(http, content, **kw):
    body = {"model": "tiny-vl", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **kw}
    return http.post("/v1/chat/completions", json=body)


def test_chat_with_image_parts_matches_the_engine_run_on_the_same_ids_and_images(vl_http):
    from model.vision import chat_to_ids_and_images

    http, model, tok = vl_http
    content = [{"type": "text", "text": "What is shown? "}, _png_part(32, 24, 1)]
    r = _chat(http, content, max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    chat = chat_to_ids_and_images([{"role": "user", "content": content}], tok, model.vision.config)
    assert r.json()["usage"]["prompt_tokens"] == len(chat.input_ids) > chat.num_image_tokens > 0
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine = NativeEngine(model, max_pages=16, kv_dtype="fp32", index_dtype="fp32")
    ref = engine.generate([Request(tuple(chat.input_ids), greedy, images=tuple(chat.images))])[0]
    assert choice["token_ids"] == ref.token_ids and not set(ref.token_ids) & set(model.vision_token_ids)
    lps = [x["logprob"] for x in choice["logprobs"]["content"]]
    torch.testing.assert_close(torch.tensor(lps), ref.logprobs, atol=1e-5, rtol=0)
    # Text-only parts take the string path.
    parts = _chat(
        http, [{"type": "text", "text": "What is "}, {"type": "text", "text": "x"}], temperature=0.0
    )
    plain = _chat(http, "What is x", temperature=0.0)
    assert parts.status_code == plain.status_code == 200
    assert parts.json()["choices"][0]["token_ids"] == plain.json()["choices"][0]["token_ids"]


def _url(url) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize(
    ("make_part", "match"),
    [
        (lambda: _url("data:image/png;base64,@@notbase64@@"), "base64"),
        (lambda: _url("data:image/png;base64,iVBORw0KGgo="), "image 0"),  # a PNG signature only
        (lambda: _url("https://example.com/a.png"), "not fetched"),
        (lambda: _url("/no/such/file.png"), "local image files are not served"),
        (lambda: _png_part(700, 600, 3), "max_image_bytes"),
        (lambda: _png_part(1200, 1000, 3, solid=True), "max_source_pixels"),
        (lambda: {"type": "image_url", "image_url": {}}, "url"),
        (lambda: {"type": "audio", "audio": "x"}, "content"),
    ],
)
def test_malformed_or_oversized_images_are_400_with_a_message_naming_the_problem(vl_http, make_part, match):
    http, _, _ = vl_http
    r = _chat(http, [{"type": "text", "text": "hi"}, make_part()])
    assert r.status_code == 400, r.text
    assert match in r.json()["error"]["message"]
    assert _chat(http, "hi").status_code == 200  # the server keeps serving


def test_too_many_images_or_images_for_a_text_model_are_400(vl_http, served):
    http, _, _ = vl_http
    r = _chat(http, [_png_part(16, 16, i) for i in range(5)])
    assert r.status_code == 400 and "max_images_per_request" in r.json()["error"]["message"]
    client, _, _ = served
    with pytest.raises(openai.BadRequestError, match="vision tower"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": [_png_part(16, 16, 0)]}]
        )
