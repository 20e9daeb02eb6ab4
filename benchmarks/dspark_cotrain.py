"""Drafter acceptance during GRPO with and without online co-training (rollout.dspark.cotrain.enabled).

Runs the quickstart twice from one seed with the cached quickstart drafter, frozen and co-trained,
both with fixed-length verification (the accepted length then measures the drafter alone), and prints
per third of the run `spec/accept_len`, the co-trainer's held-out estimate and step timings. Then,
offline on the same held-out prompts, the teacher-forced accepted length of: the step-0 policy with
the shipped drafter; each final policy with the shipped drafter, with the run's co-trained drafter,
and with the shipped drafter fine-tuned on that policy for `--oracle-steps` (the ceiling).

    python benchmarks/dspark_cotrain.py --steps 60 --threads 1 \\
        --json benchmarks/results/dspark_cotrain_cpu.jsonl optim.lr=3e-3 \\
        [--cotrain rollout.dspark.cotrain.every=2 ...]   (overrides for the co-trained run only, last)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# Reading the offline table: the gap between the shipped drafter and the ceiling is all co-training
# can win back; decay that remains at the ceiling comes from the policy becoming harder to predict.
# optim.lr=3e-3, three times the quickstart's, makes the policy drift enough in 60 steps for a
# frozen drafter's decay to stand out of the step-to-step noise.

REPO = Path(__file__).resolve().parents[1]
DRAFTER = "runs/_cache/quickstart-dspark"


def run(out: Path, steps: int, threads: int, cotrain: bool, extra: list[str]) -> list[dict]:
    cmd = [
        sys.executable, "-m", "rl.train", "recipe=quickstart", f"output_dir={out}",
        f"trainer.total_steps={steps}", "trainer.eval_every=0", "trainer.save_every=0",
        "tracking.mode=offline", f"rollout.dspark.drafter={DRAFTER}", "rollout.dspark.mode=fixed",
        f"rollout.torch_threads={threads}", f"trainer.torch_threads={threads}",
        f"rollout.dspark.cotrain.enabled={str(cotrain).lower()}", *extra,
    ]  # fmt: skip
    t0 = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{out.name}.log"
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        sys.exit(f"rl.train failed ({proc.returncode}); its output: {log}\n{log.read_text()[-3000:]}")
    print(f"{'co-trained' if cotrain else 'frozen'} run: {time.perf_counter() - t0:.0f}s", flush=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] >= 1]


def thirds(rows: list[dict], key: str) -> list[float | None]:
    n, t = len(rows), max(1, len(rows) // 3)
    out = []
    for part in (rows[:t], rows[t : n - t], rows[n - t :]):
        vals = [r[key] for r in part if r.get(key) is not None]
        out.append(sum(vals) / len(vals) if vals else None)
    return out


# --------------------------------------------------------------------------- offline evaluation
def _policy(run_dir: Path | None):
    """The quickstart base (+ the run's final adapter), with the run's cache numerics."""
    import yaml

    from model.adapter import load_adapter
    from model.checkpoint import load_model

    target = load_model(REPO / "runs/_cache/quickstart-base", dtype=torch.float32).eval()
    target.config.kv_cache_dtype = "nvfp4"  # recipes/quickstart.yaml: what the engines ran
    if run_dir is not None:
        kv = yaml.safe_load((run_dir / "config.yaml").read_text())["rollout"]["kv_cache_dtype"]
        target.config.kv_cache_dtype = kv or target.config.kv_cache_dtype
        load_adapter(target, run_dir / "adapter")
    return target.requires_grad_(False)


def _rollouts(target, prompt_seed: int, num_prompts: int) -> list[tuple[list[int], int]]:
    from common.tokenizer import ByteTokenizer
    from rollout.dspark.train import TrainConfig, arithmetic_prompts, generate_sequences

    cfg = TrainConfig(samples_per_prompt=8, temperature=1.0, max_tokens=12, seed=prompt_seed)
    prompts = arithmetic_prompts(num_prompts, seed=prompt_seed)
    return generate_sequences(target, prompts, cfg, (ByteTokenizer.eos_token_id,))


def offline_eval(run_dirs: dict[str, Path], oracle_steps: int, num_prompts: int) -> dict[str, dict]:
    from rollout.dspark import load_drafter
    from rollout.dspark.cotrain import CoTrainConfig, CoTrainer
    from rollout.dspark.train import build_features, estimate_accept_len

    def accept_len(target, drafter, seqs) -> dict[str, float]:
        f = build_features(target, seqs, drafter.config.target_layer_ids, drafter.dtype)
        est = estimate_accept_len(drafter, f, torch.Generator().manual_seed(0), anchors_per_seq=8)
        return {k: round(est[k], 3) for k in ("accept_len_sampled", "accept_len_greedy")}

    out = {}
    target = _policy(None)
    out["start"] = {
        "shipped": accept_len(target, load_drafter(DRAFTER, target), _rollouts(target, 777, num_prompts))
    }
    for name, run_dir in run_dirs.items():
        target = _policy(run_dir)
        held = _rollouts(target, 777, num_prompts)  # the same prompts as "start"
        row = {"shipped": accept_len(target, load_drafter(DRAFTER, target), held)}
        if (run_dir / "drafter").exists():
            row["run_cotrained"] = accept_len(target, load_drafter(run_dir / "drafter", target), held)
        oracle = load_drafter(DRAFTER, target)
        ct = CoTrainer(target, oracle, CoTrainConfig(steps=oracle_steps, lr=5e-4, replay_steps=1,
                                                     max_seqs_per_step=4096))  # fmt: skip
        ct.update(_rollouts(target, 31337, 4 * num_prompts))
        row["ceiling"] = accept_len(target, oracle, held)
        out[name] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each rollout worker and learner")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--keep", type=Path, default=None, help="keep the two run directories here")
    ap.add_argument("--oracle-steps", type=int, default=300)
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--cotrain", nargs="*", default=[], help="overrides for the co-trained run only")
    ap.add_argument("extra", nargs="*", help="rl.train overrides for both runs, e.g. optim.lr=3e-3")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    torch.set_num_threads(args.threads)
    from rollout.bases.warmup import ensure_base
    from rollout.dspark.train import ensure_quickstart_drafter

    ensure_base(REPO / "runs/_cache/quickstart-base")
    ensure_quickstart_drafter()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        dirs = {"frozen": root / "frozen", "cotrained": root / "cotrain"}
        frozen = run(dirs["frozen"], args.steps, args.threads, False, args.extra)
        cotrained = run(dirs["cotrained"], args.steps, args.threads, True, [*args.extra, *args.cotrain])
        offline = offline_eval(dirs, args.oracle_steps, args.eval_prompts)

    def fmt(v):
        return "-" if v is None else f"{v:.3f}"

    table = {
        "accept_len frozen": thirds(frozen, "spec/accept_len"),
        "accept_len co-trained": thirds(cotrained, "spec/accept_len"),
        "co-trained, held-out estimate": thirds(cotrained, "spec/cotrain_accept_len_before"),
        "reward frozen": thirds(frozen, "reward/mean"),
        "reward co-trained": thirds(cotrained, "reward/mean"),
        "step s frozen": thirds(frozen, "timing_s/step"),
        "step s co-trained": thirds(cotrained, "timing_s/step"),
        "learner update s co-trained": thirds(cotrained, "timing_s/update"),
        "co-training s (worker 0, overlaps the update)": thirds(cotrained, "spec/cotrain_seconds"),
    }  # fmt: skip
    print("\n| per third of the run | first | middle | last |\n| --- | --- | --- | --- |")
    for k, v in table.items():
        print(f"| {k} | {' | '.join(fmt(x) for x in v)} |")
    print("\n| teacher-forced accept_len (sampled / greedy) | shipped drafter | run's co-trained | ceiling |")
    print("| --- | --- | --- | --- |")
    for name, row in offline.items():
        cells = [
            f"{row[k]['accept_len_sampled']:.3f} / {row[k]['accept_len_greedy']:.3f}" if k in row else "-"
            for k in ("shipped", "run_cotrained", "ceiling")
        ]
        print(f"| {name} policy | {' | '.join(cells)} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        with args.json.open("a") as f:
            for a, b in zip(frozen, cotrained, strict=True):
                keys = ("spec/accept_len", "reward/mean", "timing_s/step", "timing_s/update")
                ct_keys = (
                    *keys,
                    "spec/cotrain_accept_len_before",
                    "spec/cotrain_loss",
                    "spec/cotrain_seconds",
                )
                row = {"step": a["step"], **{f"frozen/{k}": a.get(k) for k in keys},
                       **{f"cotrained/{k}": b.get(k) for k in ct_keys}}  # fmt: skip
                f.write(json.dumps(row) + "\n")
            f.write(json.dumps({"summary": table, "offline": offline, "steps": args.steps,
                                "extra": args.extra, "cotrain": args.cotrain}) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
