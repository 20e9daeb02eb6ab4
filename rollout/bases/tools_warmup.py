"""Supervised warm-up that builds the `quickstart_tools` base: a `tiny` M3.1-architecture model that
calls the calculator correctly on 3-digit x 2-digit products when it calls, but under greedy decoding
mostly answers directly (which it cannot do reliably), stored with NVFP4 routed experts.

Why: GRPO can only raise tool use it sometimes sees, and a call is rewarded only once the model copies
the expression into it and the tool's result into its answer. Phase 1 trains on whole calculator
episodes only (prompt, M3 `<tool_call>`, the real tool reply, "Answer: <n>"), the copied tokens
weighted `copy_weight`, until held-out greedy episode accuracy (real calculator, native multi-turn
driver, NVFP4 copy) reaches `target_acc` or `max_steps`. Unweighted, 300 steps still copied wrongly
(accuracy 0); weight 8 reached 0.64 at step 200. Phase 2 (`mix_steps`) mixes in direct answers so that
only `tool_share` of examples call: greedy decoding then answers directly (accuracy ~0) while sampling
calls about a third of the time, mostly right, which is the reward variance GRPO needs. Both phases
render through the rollouts' own code (tokenizer.chat_prompt, common/tool_calls.py, rollout/multiturn.py);
only model tokens carry loss, as in RL. Experts are then quantized like rollout/bases/warmup.py.

    python -m rollout.bases.tools_warmup --out runs/_cache/quickstart-tools-base [--threads 1]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import functools
import sys
import time
from pathlib import Path

import torch

import rollout.tools.calculator  # noqa: F401  (registers the calculator)
from common.data import Prompt, arithmetic_dataset
from common.tokenizer import ByteTokenizer, recorded_tokenizer
from common.tool_calls import TOOL_CALL_END, ToolCall, render_tool_calls
from model.checkpoint import load_model
from model.config import ModelConfig, QuantConfig
from model.modeling import MiniMaxM3ForCausalLM
from rollout import multiturn
from rollout.bases.warmup import (
    builder_defaults,
    cached_base,
    publish_base,
    quantized_copy,
    sft_step,
    stage_base,
)
from rollout.engine import SamplingParams
from rollout.tools.env import ToolEnv
from rollout.tools.registry import REGISTRY

_say = functools.partial(print, flush=True)  # progress lines appear as they happen, even when piped
DIGITS = (3, 2)
MAX_TURNS, TURN_TOKENS, CONTEXT = 3, 192, 512  # a calculator call of a 6-character expression is 171 bytes


def tool_example(tok: ByteTokenizer, p: Prompt, code: str | None = None,
                 copy_weight: float = 1.0) -> tuple[list[int], list[float]]:  # fmt: skip
    """(ids, loss weights) of one episode that calls the calculator: prompt, call (trained), tool reply
    (not trained), "Answer: <result>" + EOS (trained). The tokens the model must copy (the expression
    inside the call, the result's digits in the answer) weigh `copy_weight`, the rest 1: the template
    is learned in tens of steps, the copies are what the call is for. With `code`: a `python` call of
    that program instead, its reply a placeholder (test bases that exercise the sandbox; nothing runs)."""
    prompt = tok.chat_prompt(p.messages)
    expression = p.messages[-1]["content"].rstrip("=")
    if code is None:
        text = render_tool_calls([ToolCall("calculator", {"expression": expression})])
        at = text.index(expression)  # the template holds no digits: the expression occurs once
        head, copied, tail = (tok.encode(t, add_special_tokens=False)
                              for t in (text[:at], expression, text[at + len(expression) :]))  # fmt: skip
        call = head + copied + tail
        call_w = [1.0] * len(head) + [copy_weight] * len(copied) + [1.0] * len(tail)
        result = REGISTRY.call("calculator", {"expression": expression})[0]
        name = "calculator"
    else:
        call = tok.encode(render_tool_calls([ToolCall("python", {"code": code})]), False)
        call_w = [1.0] * len(call)
        result, name = p.ground_truth, "python"
    reply = multiturn.env_turn_ids(tok, [{"role": "tool", "name": name, "content": result}])
    lead, digits = (tok.encode(t, add_special_tokens=False) for t in ("Answer: ", result))
    answer = [*lead, *digits, tok.eos_token_id]
    answer_w = [1.0] * len(lead) + [copy_weight] * len(digits) + [1.0]
    ids = prompt + call + reply + answer
    return ids, [0.0] * len(prompt) + call_w + [0.0] * len(reply) + answer_w


def direct_example(tok: ByteTokenizer, p: Prompt) -> tuple[list[int], list[float]]:
    prompt = tok.chat_prompt(p.messages)
    answer = [*tok.encode(f"Answer: {p.ground_truth}", add_special_tokens=False), tok.eos_token_id]
    return prompt + answer, [0.0] * len(prompt) + [1.0] * len(answer)


def batch(examples: list[tuple[list[int], list[float]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (inputs, targets, target loss weights)."""
    T = max(len(ids) for ids, _ in examples) - 1
    inp = torch.zeros(len(examples), T, dtype=torch.long)
    tgt = torch.zeros_like(inp)
    mask = torch.zeros(len(examples), T)
    for b, (ids, m) in enumerate(examples):
        n = len(ids) - 1
        inp[b, :n], tgt[b, :n] = torch.tensor(ids[:-1]), torch.tensor(ids[1:])
        mask[b, :n] = torch.tensor(m[1:], dtype=torch.float32)
    return inp, tgt, mask


@torch.no_grad()
def episode_accuracy(model: MiniMaxM3ForCausalLM, prompts: list[Prompt]) -> dict[str, float]:
    """Greedy multi-turn episodes with the real calculator (native engine): accuracy and tool use."""
    from rollout.native.engine import NativeEngine

    tok = ByteTokenizer()
    model.eval()
    engine = NativeEngine(model, max_pages=40 * len(prompts), max_batch_tokens=4096,
                          max_num_seqs=len(prompts), detokenize=tok.decode)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=TURN_TOKENS, stop_token_ids=tok.stop_token_ids,
                            stop=(TOOL_CALL_END,))  # fmt: skip
    groups = []
    for p in prompts:
        env = ToolEnv(["calculator"], max_turns=MAX_TURNS)
        env.reset({"prompt": p.messages[-1]["content"], "answer": p.ground_truth})
        groups.append(multiturn.EpisodeGroup(p.uid, tuple(tok.chat_prompt(p.messages)),
                                             [env], params, 0))  # fmt: skip
    limits = multiturn.TurnLimits(MAX_TURNS, TURN_TOKENS, CONTEXT)
    with cf.ThreadPoolExecutor(4) as pool:
        trajs = multiturn.run_episodes(multiturn.NativeTurns(engine), groups, tok, limits, pool)
    n = len(trajs)
    return {"acc": sum(t.env_reward > 0 for t in trajs) / n,
            "tool_use": sum(t.tool_calls + t.malformed > 0 for t in trajs) / n}  # fmt: skip


def build_tools_base(
    out: str | Path,
    *,
    tool_share: float = 0.3,
    copy_weight: float = 8.0,
    target_acc: float | None = 0.6,
    max_steps: int = 600,
    mix_steps: int = 60,
    eval_every: int = 50,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    num_train: int = 4096,
    num_eval: int = 64,
    python_codes: tuple[str, ...] = (),
    python_share: float = 0.5,
    device: str = "cpu",
    log=_say,
) -> dict:
    """Phase 1 trains on calls only, for `max_steps` or until held-out greedy episode accuracy reaches
    `target_acc` (checked every `eval_every` steps; None: no check); phase 2 runs `mix_steps` more on
    examples of which `tool_share` call and the rest answer directly. `python_codes`: `python_share` of
    the call examples call `python` with one of these programs (in turn) instead of the calculator (test
    bases whose rollouts exercise the sandbox)."""
    out = Path(out)
    torch.manual_seed(seed)
    # As rollout/bases/warmup.py: float experts while training, K/V seen through the NVFP4 cache.
    base_cfg = dataclasses.replace(ModelConfig.preset("tiny"), kv_cache_dtype="nvfp4")
    float_cfg = dataclasses.replace(base_cfg, quantization=QuantConfig(routed_experts="bf16"))
    model = MiniMaxM3ForCausalLM(float_cfg).init_weights(std=0.02, seed=seed).to(device)
    model.requires_grad_(True)
    tok = ByteTokenizer()
    train = arithmetic_dataset(num_train, seed=0, ops=["*"], digits=DIGITS, split="train")
    evals = arithmetic_dataset(num_eval, seed=0, ops=["*"], digits=DIGITS, split="eval")
    gen = torch.Generator().manual_seed(seed)
    codes: list[str | None] = [None] * len(train)
    if python_codes:
        is_python = (torch.rand(len(train), generator=gen) < python_share).tolist()
        codes = [python_codes[i % len(python_codes)] if py else None for i, py in enumerate(is_python)]
    calls = [tool_example(tok, p, c, copy_weight) for p, c in zip(train, codes, strict=True)]
    is_tool = (torch.rand(len(train), generator=gen) < tool_share).tolist()
    mixed = [c if t else direct_example(tok, p) for p, c, t in zip(train, calls, is_tool, strict=True)]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    t0, ev, step = time.perf_counter(), {"acc": 0.0, "tool_use": 0.0}, 0
    for step in range(1, max_steps + 1):
        loss = sft_step(model, opt, calls, batch, gen, batch_size, device)
        if step % eval_every == 0:
            ev = episode_accuracy(quantized_copy(model, base_cfg), evals)
            log(f"tools warm-up step {step} (calls): loss {loss.item():.3f}, held-out greedy episodes "
                f"(NVFP4): acc {ev['acc']:.3f}, tool use {ev['tool_use']:.3f} "
                f"({time.perf_counter() - t0:.0f}s)")  # fmt: skip
            if target_acc is not None and ev["acc"] >= target_acc:
                break
    for _ in range(mix_steps):
        sft_step(model, opt, mixed, batch, gen, batch_size, device)
    staging = stage_base(model, out)
    final = episode_accuracy(load_model(staging, device=device, dtype=torch.float32), evals)
    info = {"call_steps": step, "mix_steps": mix_steps, "eval": ev,
            "nvfp4": final, "seconds": time.perf_counter() - t0, "tool_share": tool_share,
            "copy_weight": copy_weight, "target_acc": target_acc, "digits": list(DIGITS)}  # fmt: skip
    publish_base(staging, out, info)
    log(f"tools warm-up done in {info['seconds']:.0f}s ({step} steps of calls, {mix_steps} mixed): "
        f"held-out greedy episodes acc {final['acc']:.3f}, tool use {final['tool_use']:.3f} "
        "(NVFP4 experts, KV)")  # fmt: skip
    return info


def ensure_tools_base(path: str | Path, device: str = "cpu", threads: int | None = None, log=_say) -> Path:
    """`path`, built first if missing, with `threads` torch CPU threads (None: torch's default)."""
    path = Path(path)
    settings = builder_defaults(build_tools_base, "tool_share", "copy_weight", "target_acc", "mix_steps")
    if cached_base(path, settings, log) and recorded_tokenizer(path) is not None:
        return path
    if threads is not None:
        torch.set_num_threads(threads)
    log(f"building the tools base at {path} (supervised warm-up, once; cached afterwards)")
    build_tools_base(path, device=device, log=log)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rollout.bases.tools_warmup",
                                description="Build the quickstart_tools base.")  # fmt: skip
    names = ("tool_share", "copy_weight", "target_acc", "max_steps", "mix_steps", "eval_every", "batch_size",
             "lr", "seed")  # fmt: skip
    d = builder_defaults(build_tools_base, *names)
    p.add_argument("--out", default="runs/_cache/quickstart-tools-base")
    p.add_argument(
        "--tool-share", type=float, default=d["tool_share"], help="share of calls in the mixed phase"
    )
    p.add_argument("--copy-weight", type=float, default=d["copy_weight"])
    p.add_argument(
        "--target-acc", type=float, default=d["target_acc"], help="ends the calls phase (<0: never)"
    )
    p.add_argument("--max-steps", type=int, default=d["max_steps"], help="cap on the calls phase")
    p.add_argument("--mix-steps", type=int, default=d["mix_steps"])
    p.add_argument("--eval-every", type=int, default=d["eval_every"])
    p.add_argument("--batch-size", type=int, default=d["batch_size"])
    p.add_argument("--lr", type=float, default=d["lr"])
    p.add_argument("--seed", type=int, default=d["seed"])
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (the result depends on it)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    build_tools_base(args.out, tool_share=args.tool_share, copy_weight=args.copy_weight,
                     target_acc=args.target_acc if args.target_acc >= 0 else None, max_steps=args.max_steps,
                     mix_steps=args.mix_steps, eval_every=args.eval_every, batch_size=args.batch_size,
                     lr=args.lr, seed=args.seed)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
