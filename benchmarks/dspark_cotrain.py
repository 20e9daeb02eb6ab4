"""Drafter acceptance during GRPO with and without online co-training (rollout.dspark.cotrain).

Runs the quickstart twice from the same seed with the cached quickstart drafter
(rollout.dspark.train.ensure_quickstart_drafter): once with the drafter frozen, once co-trained on
every step's rollouts, and prints `spec/accept_len` (tokens per verification pass in the step's
rollouts) per step side by side, plus the means over the first and last thirds. Both runs sample
the same way (speculation is lossless), so any difference in acceptance is the drafter's.

    python benchmarks/dspark_cotrain.py --steps 30 --json benchmarks/results/dspark_cotrain_cpu.jsonl
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(out: Path, steps: int, cotrain: bool, extra: list[str]) -> list[dict]:
    cmd = [
        sys.executable, "-m", "rl.train", "recipe=quickstart", f"output_dir={out}",
        f"trainer.total_steps={steps}", "trainer.eval_every=0", "trainer.save_every=0",
        "tracking.mode=offline", "rollout.dspark.drafter=runs/_cache/quickstart-dspark",
        f"rollout.dspark.cotrain={str(cotrain).lower()}", *extra,
    ]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("extra", nargs="*", help="more rl.train overrides, e.g. optim.lr=2e-3")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from rl.warmup import ensure_base
    from rollout.dspark.train import ensure_quickstart_drafter

    ensure_base(REPO / "runs/_cache/quickstart-base")
    ensure_quickstart_drafter()
    with tempfile.TemporaryDirectory() as tmp:
        frozen = run(Path(tmp) / "frozen", args.steps, False, args.extra)
        cotrained = run(Path(tmp) / "cotrain", args.steps, True, args.extra)
    rows = []
    print("| step | accept_len frozen | accept_len co-trained | co-train loss |\n|---|---|---|---|")
    for a, b in zip(frozen, cotrained, strict=True):
        row = {"step": a["step"], "frozen": a.get("spec/accept_len"), "cotrained": b.get("spec/accept_len"),
               "cotrain_loss": b.get("spec/cotrain_loss"), "reward_frozen": a.get("reward/mean"),
               "reward_cotrained": b.get("reward/mean")}  # fmt: skip
        rows.append(row)
        loss = row["cotrain_loss"] or 0.0
        print(f"| {row['step']} | {row['frozen']:.3f} | {row['cotrained']:.3f} | {loss:.4f} |")
    third = max(1, len(rows) // 3)

    def mean(key, part):
        return sum(r[key] for r in part) / len(part)

    first, last = rows[:third], rows[-third:]
    summary = {
        "first_third_frozen": mean("frozen", first), "first_third_cotrained": mean("cotrained", first),
        "last_third_frozen": mean("frozen", last), "last_third_cotrained": mean("cotrained", last),
    }  # fmt: skip
    summary["last_third_ratio"] = summary["last_third_cotrained"] / summary["last_third_frozen"]
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        with args.json.open("a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
            f.write(json.dumps({"summary": summary, "steps": args.steps}) + "\n")


if __name__ == "__main__":
    main()
