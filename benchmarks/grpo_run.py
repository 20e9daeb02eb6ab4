"""Runs `python -m rl.train` for real and summarises its metrics.jsonl: the GRPO step split.

Why: the step's time split (generation, learner update, adapter sync, the rest) and the held-out
accuracy curve are read from the run's own metrics, not from a harness, so a figure in the README
is the trainer's. Steps after the first `--skip` (compile / warm-up) give the medians.

    python benchmarks/grpo_run.py --json out.jsonl -- recipe=gpu_small trainer.total_steps=40
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

SPLIT = ("timing_s/gen", "timing_s/update", "sync/seconds", "timing_s/step")


def summarise(metrics_file: Path, skip: int) -> dict:
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "timing_s/step" in r and r["step"] > skip]
    out = {k: statistics.median(r[k] for r in steps) for k in SPLIT if steps and all(k in r for r in steps)}
    if "timing_s/step" in out:
        known = sum(out.get(k, 0.0) for k in SPLIT[:3])
        out["other_s"] = out["timing_s/step"] - known
    out["eval_acc"] = [(r["step"], r["eval/acc"]) for r in rows if "eval/acc" in r]
    out["tokens_per_s"] = statistics.median(r["perf/tokens_per_s"] for r in steps) if steps else None
    out["steps"] = len(steps)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True, help="append the summary as one JSON line here")
    p.add_argument("--label", default="run")
    p.add_argument("--skip", type=int, default=2, help="leading steps left out of the medians")
    p.add_argument("--output-dir", default=None, help="the run directory (default: a new one in runs/)")
    p.add_argument("overrides", nargs="+", help="rl.train arguments: recipe=NAME key=value ...")
    args = p.parse_args(argv)
    out_dir = Path(args.output_dir or f"runs/grpo-run-{time.strftime('%Y%m%d-%H%M%S')}")
    cmd = [sys.executable, "-m", "rl.train", *args.overrides, f"output_dir={out_dir}"]
    t0 = time.perf_counter()
    rc = subprocess.call(cmd)
    summary = {"label": args.label, "rc": rc, "wall_s": round(time.perf_counter() - t0, 1),
               "overrides": args.overrides}  # fmt: skip
    if (out_dir / "metrics.jsonl").exists():
        summary |= summarise(out_dir / "metrics.jsonl", args.skip)
    with open(args.json, "a") as f:
        f.write(json.dumps(summary) + "\n")
    step = summary.get("timing_s/step")
    if step:
        print(f"{'part':<16}{'median s':>10}{'share':>8}")
        for k in (*SPLIT[:3], "other_s"):
            print(f"{k:<16}{summary.get(k, 0.0):>10.3f}{summary.get(k, 0.0) / step:>8.1%}")
        print(f"{'step':<16}{step:>10.3f}")
    print("eval/acc:", ", ".join(f"{s}: {a:.3f}" for s, a in summary.get("eval_acc", [])))
    return rc


if __name__ == "__main__":
    sys.exit(main())
