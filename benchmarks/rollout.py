"""Rollout throughput of the native engine and one GRPO step's time split (issue 10 item 3), no Ray.

Target: the `small` preset trained briefly on synthetic arithmetic, routed experts quantized to NVFP4
as served, plus a DSpark drafter distilled from it (as benchmarks/dspark.py does). 1. Engine tokens/s
at concurrency 1 / 16 / 64, bf16 vs NVFP4 KV, with and without DSpark, on a `task` and a `long`
workload, each variant's greedy output compared with the plain bf16-KV run. 2. One GRPO step called
piece by piece in rl/trainer.py's order (rollout, reward, learner, sync), wall time per piece.

    python benchmarks/rollout.py --device cuda --json OUT.jsonl
    python benchmarks/rollout.py --device cpu --quick        # smoke test (tiny preset)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

# Workloads: `task` = greedy arithmetic answers, stop at EOS, <= 12 tokens (what the drafter was
# trained on); `long` = greedy, EOS ignored, `--long-tokens` (steady-state decode). NVFP4 KV changes
# the numerics, so its match fraction may be below 1; DSpark must not change a plain run's output.
# GRPO step: rollout = engine.generate, G samples per prompt at temperature 1; reward = the
# arithmetic answer check; learner = advantages, token log-probs with the KV simulation, DAPO policy
# loss, backward into rank-32 LoRA, AdamW; sync = adapter tensors to CPU as `rl.sync.make_update`
# ships them, then `engine.set_adapter`. Engine and learner share one model object (one GPU).
# No ray / wandb / vllm / datasets imports.

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark import TOK, eval_prompts, log, train_target

from common.data import arithmetic_dataset
from model.layers.lora import LoRAConfig, apply_lora, lora_state_dict
from rl.grpo import group_advantages, policy_loss
from rl.sync import make_update
from rollout.dspark.train import TrainConfig, arithmetic_prompts, generate_sequences, train_drafter
from rollout.engine import Request, SamplingParams
from rollout.native import NativeEngine


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_engine(target, kv: str, concurrency: int, drafter, max_pages: int) -> NativeEngine:
    return NativeEngine(
        target,
        max_pages=max_pages,
        max_batch_tokens=4096,
        max_num_seqs=concurrency,
        kv_dtype=kv,
        drafter=drafter,
    )


def run(target, reqs, kv, concurrency, drafter, max_pages, device) -> tuple[float, list[list[int]], float]:
    eng = make_engine(target, kv, concurrency, drafter, max_pages)
    sync(device)
    t0 = time.perf_counter()
    out = eng.generate(reqs)
    sync(device)
    st = eng.stats()
    return st.tokens_generated / (time.perf_counter() - t0), [c.token_ids for c in out], st.spec_accept_len


def bench_engine(target, drafter, args, device, emit) -> None:
    prompts = eval_prompts(args.num_prompts)
    page = target.config.index_block_size
    workloads = {
        "task": SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=TOK.stop_token_ids),
        "long": SamplingParams(temperature=0.0, max_tokens=args.long_tokens, ignore_eos=True),
    }
    for wname in args.workloads:
        sp = workloads[wname]
        max_pages = max(args.concurrency) * (-(-(max(map(len, prompts)) + sp.max_tokens + 16) // page)) + 8
        for conc in args.concurrency:
            reqs = [Request(p, sp) for p in prompts[: max(2 * conc, 4)]]
            base_ids = base_tps = None
            for kv in ("bf16", "nvfp4"):
                for spec_name, d in (("plain", None), ("dspark", drafter)):
                    run(target, reqs[:2], kv, conc, d, max_pages, device)  # warm-up / lazy init
                    rates, ids, accept = [], None, 0.0
                    for _ in range(args.repeats):
                        r, ids, accept = run(target, reqs, kv, conc, d, max_pages, device)
                        rates.append(r)
                    tps = statistics.median(rates)
                    if base_ids is None:
                        base_ids, base_tps = ids, tps
                    match = sum(a == b for a, b in zip(ids, base_ids)) / len(ids)
                    emit(
                        {
                            "bench": "engine",
                            "workload": wname,
                            "concurrency": conc,
                            "kv": kv,
                            "spec": spec_name,
                            "requests": len(reqs),
                            "tokens_per_s": tps,
                            "vs_plain_bf16": tps / base_tps,
                            "accept_len": accept,
                            "greedy_match_vs_plain_bf16": match,
                        }
                    )


# ------------------------------------------------------------------------------------- GRPO step
def arithmetic_reward(text: str, truth: str) -> float:
    """+1 when the completion states the right answer ("Answer: <int>"), else -1 (the task's check)."""
    m = re.search(r"Answer:\s*(-?\d+)", text)
    return 1.0 if m is not None and int(m.group(1)) == int(truth) else -1.0


def grpo_step(target, args, device, emit) -> None:
    """One step, piece by piece; the model gets a fresh rank-32 LoRA (B = 0: outputs unchanged)."""
    apply_lora(target, LoRAConfig(r=32, alpha=64.0), seed=0)
    params = [p for p in target.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    problems = arithmetic_dataset(args.grpo_prompts, seed=1, split="train")
    prompts = [tuple(TOK.chat_prompt(p.messages)) for p in problems]
    G, page = args.grpo_samples, target.config.index_block_size
    sp = SamplingParams(temperature=1.0, max_tokens=args.grpo_max_tokens, stop_token_ids=TOK.stop_token_ids)
    max_pages = len(prompts) * G * (-(-(max(map(len, prompts)) + sp.max_tokens + 16) // page)) + 8
    eng = NativeEngine(target, max_pages=max_pages, max_batch_tokens=4096, max_num_seqs=len(prompts) * G)
    eng.generate([Request(prompts[0], sp)])  # warm-up
    times = {}
    for step in range(2):  # step 0 warms every piece up; step 1 is reported
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            outs = eng.generate([Request(p, sp, n=G, seed=i) for i, p in enumerate(prompts)])
        sync(device)
        t1 = time.perf_counter()
        texts = [TOK.decode(c.token_ids) for c in outs]
        truths = [problems[i // G].ground_truth for i in range(len(outs))]
        rewards = torch.tensor([arithmetic_reward(t, g) for t, g in zip(texts, truths)])
        t2 = time.perf_counter()
        seqs = [list(prompts[i // G]) + list(c.token_ids) for i, c in enumerate(outs)]
        L = max(map(len, seqs))
        ids = torch.full((len(seqs), L + 1), TOK.pad_token_id, dtype=torch.long)
        seq_ids = torch.full((len(seqs), L), -1, dtype=torch.long)
        mask = torch.zeros(len(seqs), L)
        for b, (s, c) in enumerate(zip(seqs, outs)):
            ids[b, : len(s)] = torch.tensor(s)
            seq_ids[b, : len(s) - 1] = 0
            mask[b, len(s) - 1 - len(c.token_ids) : len(s) - 1] = 1.0  # completion tokens only
        adv = group_advantages(rewards.view(-1, G)).reshape(-1)
        inp, tgt, seq_ids, mask, adv = (t.to(device) for t in (ids[:, :-1], ids[:, 1:], seq_ids, mask, adv))
        logp, _ = target.token_logprobs(inp, tgt, seq_ids_BS=seq_ids, kv_sim=True)
        loss, _ = policy_loss(logp, logp.detach(), adv, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync(device)
        t3 = time.perf_counter()
        update = make_update(lora_state_dict(target), version=step + 1)
        eng.set_adapter(update.tensors, update.version)
        sync(device)
        t4 = time.perf_counter()
        times = {"rollout_s": t1 - t0, "reward_s": t2 - t1, "learner_s": t3 - t2, "sync_s": t4 - t3}
    total = sum(times.values())
    gen_tokens = sum(len(c.token_ids) for c in outs)
    emit(
        {
            "bench": "grpo_step",
            "prompts": len(prompts),
            "samples_per_prompt": G,
            "generated_tokens": gen_tokens,
            "learner_tokens": int(seq_ids.ge(0).sum()),
            "sync_bytes": update.nbytes,
            "mean_reward": rewards.mean().item(),
            **times,
            "total_s": total,
            **{k.replace("_s", "_share"): v / total for k, v in times.items()},
        }
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="native engine tokens/s (KV dtype x DSpark) and a GRPO step's split"
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="small", choices=["small", "tiny"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--long-tokens", type=int, default=256)
    p.add_argument("--workloads", nargs="*", default=["task", "long"], choices=["task", "long"])
    p.add_argument("--no-grpo", action="store_true", help="skip the GRPO step split")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--target-seconds", type=float, default=150.0)
    p.add_argument("--drafter-seconds", type=float, default=90.0)
    p.add_argument("--grpo-prompts", type=int, default=32)
    p.add_argument("--grpo-samples", type=int, default=8)
    p.add_argument("--grpo-max-tokens", type=int, default=32)
    p.add_argument("--quick", action="store_true", help="tiny preset, tiny budgets (CPU smoke test)")
    p.add_argument("--json", default=None, help="append one JSON line per result here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.quick:
        args.preset, args.concurrency, args.num_prompts, args.long_tokens, args.repeats = (
            "tiny",
            [1, 4],
            8,
            16,
            1,
        )
        args.target_seconds, args.drafter_seconds, args.grpo_prompts, args.grpo_samples = 10.0, 5.0, 4, 2
        args.grpo_max_tokens = 8
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    t_start = time.perf_counter()
    target = train_target(
        args.preset, args.device, args.target_seconds, 20 if args.quick else 100_000, log=log
    )
    n_prompts = 32 if args.quick else 2048
    cfg = TrainConfig(
        steps=100_000,
        batch_size=64,
        anchors_per_seq=8,
        lr=1e-3,
        num_prompts=n_prompts,
        samples_per_prompt=1,
        max_tokens=12,
        log_every=50,
        time_budget_s=args.drafter_seconds,
        drafter={"block_size": 6},
    )
    seqs = generate_sequences(target, arithmetic_prompts(cfg.num_prompts), cfg, TOK.stop_token_ids)
    drafter, summary = train_drafter(target, seqs, cfg, log)
    header = {
        "device": args.device,
        "preset": args.preset,
        "torch": torch.__version__,
        "quick": args.quick,
        "drafter_train": summary.get("final"),
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
    }
    rows: list[dict] = []

    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)

    def emit(row: dict) -> None:
        rows.append({**header, **row})
        log(json.dumps(row))
        if args.json:  # row by row: a run cut short by a time limit keeps what it measured
            with open(args.json, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")

    bench_engine(target, drafter, args, device, emit)
    if not args.no_grpo:
        grpo_step(target, args, device, emit)
    log(f"done in {time.perf_counter() - t_start:.0f}s")
    log("\n| workload | concurrency | KV | spec | tok/s | vs plain bf16 KV | accept len | greedy match |")
    log("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in (r for r in rows if r["bench"] == "engine"):
        log(
            f"| {r['workload']} | {r['concurrency']} | {r['kv']} | {r['spec']} | {r['tokens_per_s']:.1f} | "
            f"{r['vs_plain_bf16']:.2f}x | {r['accept_len']:.2f} | {r['greedy_match_vs_plain_bf16']:.3f} |"
        )
    g = next((r for r in rows if r["bench"] == "grpo_step"), None)
    if g is None:
        return 0
    log(
        f"\nGRPO step ({g['prompts']} prompts x {g['samples_per_prompt']}): "
        f"total {g['total_s']:.2f}s = rollout "
        f"{g['rollout_share']:.0%}, reward {g['reward_share']:.0%}, learner {g['learner_share']:.0%}, sync "
        f"{g['sync_share']:.0%} ({g['sync_bytes'] / 2**20:.2f} MiB)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
