"""Sampling noise per decode step: one torch.Generator call per row (the engine before 2026-12-02)
vs the counter-based draws of rollout/native/sampler.py (one batched computation), same run.

Why: at batch 64 the per-row generator loop was a visible share of the engine step's host time
(issue 24), and generator state cannot live in a captured graph. Prints ms per step's noise
([B, V] Exp(1)) and the ratio, per batch and vocabulary (264: the byte tokenizer; 200,064: M3).

Usage: python benchmarks/sampler_noise.py [--device cpu|cuda] [--batches 1 8 64 256] [--vocab 264 200064]
"""

# ruff: noqa: B023 -- the timed lambdas run inside the loop iteration that defines them.
import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from rollout.native.sampler import CounterRNG, exponential_noise


def per_row_generators(gens: list[torch.Generator], V: int, device) -> torch.Tensor:
    """The baseline: what the engine did per step, one exponential_ per row from its generator."""
    q_BV = torch.ones((len(gens), V), dtype=torch.float32, device=device)
    for b, g in enumerate(gens):
        q_BV[b].exponential_(generator=g)
    return q_BV


def timed(fn, device, reps: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 8, 64, 256])
    ap.add_argument("--vocab", nargs="*", type=int, default=[264, 200064])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"{'B':>4s} {'V':>7s} {'per-row generators ms':>22s} {'counter-based ms':>17s} {'ratio':>6s}")
    for V in args.vocab:
        for B in args.batches:
            reps = max(3, min(200, int(2e7 // (B * V))))
            gens = [torch.Generator(device=device).manual_seed(i) for i in range(B)]
            rngs = [CounterRNG(i) for i in range(B)]
            base = timed(lambda: per_row_generators(gens, V, device), device, reps)
            new = timed(lambda: exponential_noise(rngs, V, device), device, reps)
            row = dict(device=args.device, B=B, V=V, per_row_ms=round(base, 4), counter_ms=round(new, 4),
                       ratio=round(base / new, 2), threads=args.threads)  # fmt: skip
            print(f"{B:4d} {V:7d} {base:22.4f} {new:17.4f} {base / new:6.2f}", flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
