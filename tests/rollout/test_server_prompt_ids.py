"""Training and serving see the same prompt (issue 26): for the same chat, the server's prompt ids
(vLLM's `return_token_ids`, over real HTTP) equal the ids the trainer's RolloutWorker feeds its
engine, with the byte tokenizer and a Hugging Face one with a chat template, with and without a
system message. The server finds the tokenizer the checkpoint records, as `python -m rollout.serve
--model CKPT` does."""

from __future__ import annotations

import httpx
import pytest

from common.data import Prompt
from common.tokenizer import tokenizer_for, write_tokenizer_record
from model.checkpoint import load_model, save_model
from model.config import ModelConfig
from model.modeling import MiniMaxM3ForCausalLM
from rollout.native import NativeEngine
from rollout.server import build_app
from tests.rollout.live_server import live_server

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CHATS = {
    "user only": [{"role": "user", "content": "12+35="}],
    "with system": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "7-3= ?"}],
}


def _hf_tokenizer(directory) -> str:
    """A byte-level BPE of ~300 ids with special tokens and a role-tagged chat template."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    raw = tokenizers.Tokenizer(tokenizers.models.BPE())
    raw.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = tokenizers.decoders.ByteLevel()
    special = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(["12+35= Answer: 47", "7-3= ? Answer briefly.", "hello world"] * 20, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module", params=["byte", "hf"])
def checkpoint(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    spec = "byte" if request.param == "byte" else _hf_tokenizer(d / "tok")
    model = MiniMaxM3ForCausalLM(ModelConfig.preset("tiny")).init_weights(std=0.05, seed=0)
    save_model(model, d / "ckpt")
    write_tokenizer_record(d / "ckpt", spec)
    return d / "ckpt", spec


def _trainer_prompt_ids(ckpt, spec: str, messages) -> list[int]:
    """The ids the trainer's rollout worker (rl/workers.py, built directly: no Ray) samples from."""
    from rl.config import load_config
    from rl.workers import RolloutWorker

    overrides = [f"model.checkpoint={ckpt}", f"model.tokenizer={spec}", "model.warmup=false",
                 "rollout.kv_cache_dtype=fp32", "rollout.max_tokens=2", "rollout.max_pages=64"]  # fmt: skip
    worker = RolloutWorker(load_config("quickstart", overrides), str(ckpt))
    (sample,) = worker.generate(
        [Prompt("p0", messages, "0", "test")], n=1, temperature=0.0, top_p=1.0, seed=0
    )
    return sample.prompt_ids


@pytest.mark.parametrize("chat", sorted(CHATS))
def test_the_servers_chat_prompt_ids_equal_the_trainers(checkpoint, chat):
    ckpt, spec = checkpoint
    messages = CHATS[chat]
    tokenizer = tokenizer_for(ckpt)  # what the server's --model finds, no --tokenizer flag
    assert tokenizer.name == ("byte" if spec == "byte" else str(ckpt))  # HF files are copied beside it
    engine = NativeEngine(load_model(ckpt).eval(), max_pages=32, kv_dtype="fp32", index_dtype="fp32")
    app = build_app(engine, tokenizer, model_name="ckpt")
    body = {
        "model": "ckpt",
        "messages": messages,
        "max_tokens": 2,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    with live_server(app) as url:
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        plain = {"model": "ckpt", "prompt": tokenizer.apply_chat_template(messages), "max_tokens": 1,
                 "return_token_ids": True}  # fmt: skip
        completion = httpx.post(f"{url}/v1/completions", json=plain, timeout=60).json()
    trainer_ids = _trainer_prompt_ids(ckpt, spec, messages)
    assert reply["prompt_token_ids"] == trainer_ids
    assert reply["usage"]["prompt_tokens"] == len(trainer_ids)
    # The rendered template sent as a completion prompt is the same ids (one bos, no doubling).
    assert completion["choices"][0]["prompt_token_ids"] == trainer_ids
    if spec != "byte":  # the template's role tags are single special tokens
        assert (
            len(set(trainer_ids) & set(tokenizer.tok.convert_tokens_to_ids(["<|user|>", "<|assistant|>"])))
            == 2
        )
