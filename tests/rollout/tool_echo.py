"""A `tiny` model that has learnt a few chats by heart, so a server test knows the model's reply:
each user message in ROWS, rendered with TOOLS the way the server renders it, is followed greedily
by its reply (tool calls in the M3 format, or a malformed one) and eos.

Why: a random tiny model never writes a tool call, and a test must not mock the engine; a
supervised fit of three sequences takes ~45 s on one core, so the weights are cached in
runs/_cache/ (keyed by the rows and the preset) and checked on load: greedy decoding by the native
engine reproduces every reply token for token, or the build fails.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from common.tokenizer import ByteTokenizer
from common.tool_calls import NS, ToolCall, render_tool_calls
from model.config import ModelConfig, QuantConfig
from model.modeling import MiniMaxM3ForCausalLM
from rollout.engine import Request, SamplingParams
from rollout.native import NativeEngine

CACHE = Path(__file__).resolve().parents[2] / "runs" / "_cache" / "tool-echo"
ADD = {
    "name": "add",
    "description": "a + b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
}
TOOLS = [{"type": "function", "function": ADD}]
CALLS = {
    "add 2 and 3": [ToolCall("add", {"a": 2, "b": 3}), ToolCall("add", {"a": 1, "b": 1})],
    "what is 7+8": [ToolCall("add", {"a": 7, "b": 8})],
}
MALFORMED = (  # the argument element <a> closed by </b>
    f'{NS}<tool_call>\n{NS}<invoke name="add">\n{NS}<a>1{NS}</b>\n{NS}</invoke>\n{NS}</tool_call>'
)
ROWS = {  # user message -> the reply the model writes after it
    "add 2 and 3": "Let me add.\n" + render_tool_calls(CALLS["add 2 and 3"]),
    "what is 7+8": render_tool_calls(CALLS["what is 7+8"]),
    "break it": MALFORMED,
}
MAX_STEPS = 800


def _config() -> ModelConfig:
    # Float experts: the fit trains them, and the engine serves the very same weights.
    return dataclasses.replace(ModelConfig.preset("tiny"), quantization=QuantConfig(routed_experts="bf16"))


def _examples(tok: ByteTokenizer) -> list[tuple[list[int], int]]:
    out = []
    for user, reply in ROWS.items():
        prompt = tok.chat_prompt([{"role": "user", "content": user}], TOOLS)
        out.append((prompt + tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id], len(prompt)))
    return out


def _engine(model: MiniMaxM3ForCausalLM) -> NativeEngine:
    return NativeEngine(model, max_pages=64, max_batch_tokens=512, kv_dtype="fp32", index_dtype="fp32")


@torch.no_grad()
def _reproduces(model: MiniMaxM3ForCausalLM, examples) -> bool:
    greedy = SamplingParams(temperature=0.0, max_tokens=400, stop_token_ids=(ByteTokenizer.eos_token_id,))
    outs = _engine(model.eval()).generate([Request(tuple(ids[:n]), greedy) for ids, n in examples])
    return all(list(o.token_ids) == ids[n:] for o, (ids, n) in zip(outs, examples))


def _fit(examples) -> MiniMaxM3ForCausalLM:
    from rollout.bases.warmup import sft_batch, sft_update

    model = MiniMaxM3ForCausalLM(_config()).init_weights(std=0.02, seed=0)
    model.requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    inp, tgt, mask = sft_batch(examples)
    for step in range(1, MAX_STEPS + 1):
        model.train()
        logp, _ = model.token_logprobs(inp, tgt)
        loss = sft_update(model, opt, logp, mask)
        if step % 25 == 0 and loss.item() < 0.01 and _reproduces(model, examples):
            return model.requires_grad_(False).eval()
    raise AssertionError(f"the tiny model did not learn the tool-call replies in {MAX_STEPS} steps")


def tool_echo_model() -> MiniMaxM3ForCausalLM:
    """The model (eval mode, fp32), from the cache or fitted and cached."""
    tok = ByteTokenizer()
    examples = _examples(tok)
    key = hashlib.sha256(json.dumps([ROWS, TOOLS, dataclasses.asdict(_config())], default=str).encode())
    path = CACHE / f"{key.hexdigest()[:16]}.pt"
    if path.is_file():
        model = MiniMaxM3ForCausalLM(_config())
        model.load_state_dict(torch.load(path, weights_only=True))
        model.eval()
        assert _reproduces(model, examples), f"{path} does not reproduce the replies: delete it"
        return model
    model = _fit(examples)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(model.state_dict(), tmp)
    tmp.rename(path)  # whole or not at all
    return model
