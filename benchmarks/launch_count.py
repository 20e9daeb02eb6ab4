"""Kernels per decode step of the native engine, counted on the CPU through the GPU's code path.

Why: a graph-captured decode step at `small` is launch-bound (benchmarks/RESULTS.md: 1,777 kernels
per step in session 10, 595 in session 11), and each removed launch is a few microseconds of replay.
Counting needs no GPU: under TRITON_INTERPRET=1 every Triton kernel the GPU runs runs in the
interpreter, and every torch op that would launch a CUDA kernel passes the dispatcher. Counted per
all-decode static step (the step CUDA graphs capture): Triton launches, and torch ops that compute
(views, metadata ops, empty allocations and casts that return their input are not kernels). The
baseline in the same run is the same step outside inference mode, where the ops gated by
`triton_inference_path` (norms with their residual adds, RoPE, the MoE router epilogue, swigluoai)
take their torch ops (the appends, attention, indexer, MoE kernels and combine launch in both). One
overcount: the sampler's noise takes its torch twin on CPU tensors (one launch on CUDA).

    TRITON_INTERPRET=1 python benchmarks/launch_count.py [--preset tiny] [--batch 4] [--lora 32] [--json OUT]

Invariant: counts only; nothing here is timed.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.config import ModelConfig
from model.modeling import MiniMaxM3ForCausalLM
from rollout.engine import Request, SamplingParams
from rollout.native import NativeEngine

_NOT_KERNELS = {"empty", "empty_strided", "empty_like", "lift_fresh", "_local_scalar_dense", "detach"}


class _Ops(TorchDispatchMode):
    """Counts dispatched torch ops that would launch a kernel."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        is_noop = isinstance(out, torch.Tensor) and args and out is args[0] and not name.endswith("_")
        if not (func.is_view or name in _NOT_KERNELS or is_noop):
            self.counts[name] += 1
        return out


def count_step(eng: NativeEngine, inference: bool) -> tuple[collections.Counter, collections.Counter]:
    """(Triton launches by kernel, torch ops by name) of one static decode forward of `eng`."""
    from triton.runtime.interpreter import InterpretedFunction

    inputs, _, _ = eng._plan(eng.scheduler.schedule(), [], [])
    with torch.inference_mode():
        views = eng.runner.prepare(inputs)
    bs = eng.runner._bucket(len(inputs.seq_lens))
    launches: collections.Counter = collections.Counter()
    run = InterpretedFunction.run

    def counted(self, *a, **k):
        launches[self.fn.__name__] += 1
        with torch.utils._python_dispatch._disable_current_modes():
            return run(self, *a, **k)

    InterpretedFunction.run = counted
    ops = _Ops()
    try:
        ctx = torch.inference_mode() if inference else torch.no_grad()
        with ctx, ops:
            eng.runner.static_step(bs)
    finally:
        InterpretedFunction.run = run
    del views
    return launches, ops.counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--lora", type=int, default=0, help="rank of fp32 adapters on the default targets (as rl.train)"
    )
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1: the count follows the GPU's Triton path in the interpreter")
    torch.set_num_threads(1)
    cfg = dataclasses.replace(ModelConfig.preset(args.preset), num_mtp_modules=0, kv_cache_dtype="nvfp4")
    model = MiniMaxM3ForCausalLM(cfg).init_weights(std=0.02, seed=0).to(torch.bfloat16).eval()
    if args.lora:  # the rollout model of a GRPO run: every default target adapted (fp32 A / B)
        from model.layers.lora import LoRAConfig, apply_lora

        apply_lora(model, LoRAConfig(r=args.lora, alpha=2.0 * args.lora))
    eng = NativeEngine(model, max_num_seqs=args.batch, max_pages=16 * args.batch, static_decode=True)
    sp = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    for i in range(args.batch):
        eng.add_request(Request([1, 5 + i, 7, 9, 11], sp, seed=i, request_id=f"r{i}"))
    for _ in range(2):  # prefill, then one decode step (the static buffers exist)
        eng.step()
    rows = []
    for label, inference in (("torch glue ops (baseline)", False), ("engine path", True)):
        launches, ops = count_step(eng, inference)
        total = sum(launches.values()) + sum(ops.values())
        rows.append({"preset": args.preset, "batch": args.batch, "path": label, "lora_rank": args.lora,
                     "layers": cfg.num_hidden_layers, "triton": sum(launches.values()),
                     "torch_ops": sum(ops.values()), "kernels": total, "launches": dict(launches),
                     "top_ops": ops.most_common(12)})  # fmt: skip
    base = rows[0]["kernels"]
    print(f"kernels per static decode step, preset {args.preset}, batch {args.batch}, LoRA rank {args.lora} "
          "(interpreter count):")  # fmt: skip
    print("| path | Triton launches | torch ops | kernels | per layer | vs baseline |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        r["ratio_vs_baseline"] = round(r["kernels"] / base, 3)
        print(f"| {r['path']} | {r['triton']} | {r['torch_ops']} | {r['kernels']} | "
              f"{r['kernels'] / r['layers']:.1f} | {r['ratio_vs_baseline']:.2f}x |")  # fmt: skip
    print("top torch ops (engine path):", rows[-1]["top_ops"])
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
