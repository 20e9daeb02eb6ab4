"""DSpark speculative decoding against plain decoding in the native engine: tokens/s, accepted
length, fixed vs confidence-scheduled verification.

The same target generates the same prompts greedily with and without a drafter in one process, and
outputs are compared token for token before any number is reported (exact on CPU fp32; on a bf16 GPU
target a rare near-tie may flip, so the match fraction is reported). tokens/s counts generated tokens;
accepted length = tokens emitted per verification pass. CPU: the quickstart's tiny target and cached
drafter. GPU: the `small` preset trained briefly (`--target-seconds`) and a drafter distilled from it
(`--drafter-seconds`), at each `--concurrency`. No ray / wandb / vllm / datasets imports.

    python benchmarks/dspark.py --json benchmarks/results/dspark_cpu.jsonl
    python benchmarks/dspark.py --device cuda --preset small --json out.jsonl [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.data import arithmetic_dataset
from common.tokenizer import ByteTokenizer
from model.config import ModelConfig, QuantConfig
from model.modeling import MiniMaxM3ForCausalLM
from rollout.dspark import Drafter, SpecConfig, load_drafter
from rollout.dspark.train import TrainConfig, arithmetic_prompts, generate_sequences, train_drafter
from rollout.engine import Request, SamplingParams
from rollout.native import NativeEngine

TOK = ByteTokenizer()


def log(msg: str) -> None:
    print(msg, flush=True)


def eval_prompts(n: int) -> list[tuple[int, ...]]:
    return [tuple(TOK.chat_prompt(p.messages)) for p in arithmetic_dataset(n, split="eval")]


# --------------------------------------------------------------------------- GPU target
def train_target(preset: str, device: str, seconds: float, max_steps: int, log=log) -> MiniMaxM3ForCausalLM:
    """`preset` trained on "a+b=" -> "Answer: c<eos>" for `seconds` (float experts), then its routed
    experts quantized to NVFP4 as the product serves them; bf16 for serving on a GPU."""
    from rollout.bases.warmup import answer_example, quantized_copy, sft_batch

    torch.manual_seed(0)
    cfg = ModelConfig.preset(preset)
    float_cfg = dataclasses.replace(cfg, quantization=QuantConfig(routed_experts="bf16"))
    model = MiniMaxM3ForCausalLM(float_cfg).init_weights(std=0.02, seed=0).to(device)
    model.requires_grad_(True)
    examples = [answer_example(TOK, p) for p in arithmetic_dataset(4096, seed=0, split="train")]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    t0, step, loss = time.perf_counter(), 0, torch.zeros(())
    while step < max_steps and time.perf_counter() - t0 < seconds:
        step += 1
        idx = torch.randint(len(examples), (64,), generator=gen).tolist()
        inp, tgt, mask = (x.to(device) for x in sft_batch([examples[i] for i in idx]))
        with torch.autocast(
            device_type="cuda", dtype=torch.bfloat16, enabled=torch.device(device).type == "cuda"
        ):
            logp, _ = model.token_logprobs(inp, tgt)
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0:
            log(f"target step {step}: loss {loss.item():.3f} ({time.perf_counter() - t0:.0f}s)")
    log(f"target trained {step} steps in {time.perf_counter() - t0:.0f}s, final loss {loss.item():.3f}")
    model.requires_grad_(False)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    served = quantized_copy(model.cpu().float(), cfg).to(device=device, dtype=dtype)
    # The router stays fp32 (docs/FACTS.md, "M3 architecture"), as load_model keeps it.
    for module in served.modules():
        if hasattr(module, "e_score_correction_bias"):
            module.gate.float()
            module.e_score_correction_bias.data = module.e_score_correction_bias.data.float()
    return served.eval()


def load_cpu_target_and_drafter() -> tuple[MiniMaxM3ForCausalLM, Drafter]:
    from model.checkpoint import load_model
    from rollout.dspark.train import QUICKSTART_BASE, ensure_quickstart_drafter

    path = ensure_quickstart_drafter(log=log)
    target = load_model(QUICKSTART_BASE, dtype=torch.float32).eval()
    return target, load_drafter(path, target)


# --------------------------------------------------------------------------- timing
def run_engine(target, reqs, concurrency, drafter, spec, max_pages) -> tuple[float, list[list[int]], dict]:
    eng = NativeEngine(target, max_pages=max_pages, max_batch_tokens=4096, max_num_seqs=concurrency,
                       drafter=drafter, spec=spec)  # fmt: skip
    sync = torch.cuda.synchronize if target.lm_head.weight.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = eng.generate(reqs)
    sync()
    dt = time.perf_counter() - t0
    st = eng.stats()
    extra = {"accept_len": st.spec_accept_len, "drafted": st.spec_drafted, "accepted": st.spec_accepted,
             "draft_time_s": st.draft_time_s, "steps": st.steps}  # fmt: skip
    if eng.proposer is not None and eng.proposer.cost is not None:
        extra["verify_cost"] = dataclasses.asdict(eng.proposer.cost)
        extra["draft_cost"] = dataclasses.asdict(eng.proposer.draft_cost)
    return st.tokens_generated / dt, [c.token_ids for c in out], extra


def bench(target, drafter, prompts, concurrencies, repeats, max_tokens, block_sizes, rows_out) -> list[dict]:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=TOK.stop_token_ids)
    page = target.config.index_block_size
    max_pages = max(concurrencies) * (-(-(max(map(len, prompts)) + max_tokens + 16) // page)) + 8
    results = []
    for conc in concurrencies:
        reqs = [Request(p, sp) for p in prompts[: max(conc * 2, 8)]]  # two waves at concurrency > 4
        variants = [("plain", None, None)]
        for n in block_sizes:
            variants += [
                (f"fixed-{n}", drafter, SpecConfig("fixed", n)),
                (f"scheduled-{n}", drafter, SpecConfig("scheduled", n)),
            ]
        base_ids, base_tps = None, None
        for name, d, spec in variants:
            run_engine(target, reqs[:2], conc, d, spec, max_pages)  # warm-up (and lazy init)
            tps, extras = [], None
            for _ in range(repeats):
                r, ids, extras = run_engine(target, reqs, conc, d, spec, max_pages)
                tps.append(r)
            med = statistics.median(tps)
            if base_ids is None:
                base_ids, base_tps = ids, med
            match = sum(a == b for a, b in zip(ids, base_ids)) / len(ids)
            row = {"concurrency": conc, "variant": name, "requests": len(reqs), "tokens_per_s": round(med, 2),
                   "speedup": round(med / base_tps, 3), "greedy_match": match, **extras}  # fmt: skip
            results.append(row)
            rows_out(row)
            log(f"  conc {conc:>3} {name:<12} {med:9.1f} tok/s  x{med / base_tps:.2f}  accept_len "
                f"{extras['accept_len']:.2f}  greedy match {match:.3f}")  # fmt: skip
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="DSpark vs plain decoding in the native engine")
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument(
        "--block", type=int, nargs="+", default=None, help="verify lengths (default: the drafter's)"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--target-seconds", type=float, default=150.0, help="GPU: target training time")
    p.add_argument("--drafter-seconds", type=float, default=90.0, help="GPU: drafter training time")
    p.add_argument("--quick", action="store_true", help="smoke test: tiny budgets everywhere")
    p.add_argument("--from-scratch", action="store_true",
                   help="train the target and drafter here (implied by --preset small); tiny otherwise "
                        "uses the cached quickstart base and drafter")  # fmt: skip
    p.add_argument("--json", default=None, help="append one JSON line per result here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        args.repeats, args.num_prompts, args.target_seconds, args.drafter_seconds = 1, 16, 20.0, 15.0
    out_rows: list[dict] = []
    t_start = time.perf_counter()
    if args.preset == "tiny" and not args.from_scratch:
        target, drafter = load_cpu_target_and_drafter()
        target, drafter = target.to(args.device), drafter.to(args.device)
        meta = drafter.config.metadata.get("final", {})
        log(f"quickstart drafter: block {drafter.config.block_size}, training estimate {meta}")
    else:
        if args.device == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
        target = train_target(args.preset, args.device, args.target_seconds, 20 if args.quick else 100_000)
        n_prompts = 256 if args.quick else 2048
        cfg = TrainConfig(steps=100_000, batch_size=64, anchors_per_seq=8, lr=1e-3, num_prompts=n_prompts,
                          samples_per_prompt=1, max_tokens=args.max_tokens, log_every=50,
                          time_budget_s=args.drafter_seconds, drafter={"block_size": 6})  # fmt: skip
        t0 = time.perf_counter()
        seqs = generate_sequences(target, arithmetic_prompts(cfg.num_prompts), cfg, TOK.stop_token_ids)
        log(f"drafter data: {len(seqs)} target completions in {time.perf_counter() - t0:.0f}s")
        drafter, summary = train_drafter(target, seqs, cfg, log)
        meta = summary["final"]
    blocks = args.block or [drafter.config.block_size]
    header = {"device": args.device, "preset": args.preset, "torch": torch.__version__, "quick": args.quick,
              "drafter_block": drafter.config.block_size, "drafter_train": meta,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None}  # fmt: skip
    log(f"benchmark: {header}")

    def emit(row: dict) -> None:
        out_rows.append({**header, **row})

    bench(
        target,
        drafter,
        eval_prompts(args.num_prompts),
        args.concurrency,
        args.repeats,
        args.max_tokens,
        blocks,
        emit,
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "a") as f:
            for row in out_rows:
                f.write(json.dumps(row) + "\n")
    log(f"done in {time.perf_counter() - t_start:.0f}s")
    log("\n| concurrency | variant | tok/s | speedup | accept len | greedy match |")
    log("| --- | --- | --- | --- | --- | --- |")
    for r in out_rows:
        log(f"| {r['concurrency']} | {r['variant']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
            f"{r['accept_len']:.2f} | {r['greedy_match']:.3f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
