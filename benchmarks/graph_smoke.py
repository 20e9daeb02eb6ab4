"""CUDA-graph smoke test of the native engine's static decode pass, one bucket at a time (GPU only).

Why: one H200 call should say whether every bucket captures and, if not, which op broke it. Per bucket:
1. the padded pass (forward and in-pass sampling, `ModelRunner.static_step`) runs eagerly once (Triton
   autotuning, per-stream scratch), then once more under `torch.cuda.set_sync_debug_mode("error")`: any
   host sync raises at its op (named below);
2. the pass is captured on its own pool (a failure prints the innermost project frame of the error);
3. the replay is compared with the eager padded pass (max |logits difference| and whether the sampled
   tokens and log-probs are equal; expected 0 and True). Every row is a padded row (token 0 at position 0
   of the scratch page: every row writes the same value to the same slot), sampled at temperature 1 with
   its own draw key, so the sampling noise runs too.
Variants: `--preset small --dtype bf16 --kv-dtype nvfp4` (the served path, Triton kernels), `--preset tiny
--dtype fp32 --kv-dtype fp32` (the exact torch paths), `--lora` (adapters on the attention projections,
`--lora-experts` also on the routed experts).

    python benchmarks/graph_smoke.py                       # small, bf16, NVFP4 KV, buckets up to 256
    python benchmarks/graph_smoke.py --preset tiny --dtype fp32 --kv-dtype fp32
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.config import ModelConfig
from model.modeling import MiniMaxM3ForCausalLM
from rollout.engine import Request, SamplingParams
from rollout.native import NativeEngine

ROOT = Path(__file__).resolve().parents[1]


def _original(exc: BaseException) -> BaseException:
    """The first exception of a chain: a failed capture's own error is raised again by the graph's
    capture_end in `torch.cuda.graph.__exit__`, which would hide the op that broke the capture."""
    while exc.__context__ is not None or exc.__cause__ is not None:
        exc = exc.__cause__ or exc.__context__
    return exc


def project_frame(exc: BaseException) -> str:
    """The innermost frame inside this repository of the chain's first exception: the failing op's call."""
    exc = _original(exc)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if str(ROOT) in f.filename]
    if not frames:
        return "(no project frame)"
    f = frames[-1]
    return f"{Path(f.filename).relative_to(ROOT)}:{f.lineno} in {f.name}: {f.line}"


def first_line(exc: BaseException) -> str:
    exc = _original(exc)
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--kv-dtype", default="nvfp4", choices=["bf16", "fp8", "nvfp4", "fp32"])
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--lora", action="store_true", help="LoRA on the attention projections")
    ap.add_argument("--lora-experts", action="store_true", help="LoRA on the routed experts too")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_smoke.py needs a CUDA device")
    device = torch.device("cuda")
    cfg_kv = args.kv_dtype if args.kv_dtype != "fp32" else "bf16"
    cfg = dataclasses.replace(ModelConfig.preset(args.preset), num_mtp_modules=0, kv_cache_dtype=cfg_kv)
    model = MiniMaxM3ForCausalLM(cfg).init_weights(std=0.02, seed=0)
    if args.lora or args.lora_experts:
        from model.layers.lora import LoRAConfig, apply_lora

        apply_lora(model, LoRAConfig(r=8, routed_experts=args.lora_experts))
    model = model.to(device=device, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32).eval()
    kv = args.kv_dtype
    eng = NativeEngine(model, max_pages=8 * args.max_num_seqs, max_batch_tokens=4096,
                       max_num_seqs=args.max_num_seqs, kv_dtype=kv, index_dtype=kv, cuda_graphs=False,
                       static_decode=True)  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    eng.generate([Request(tuple(range(3, 40)), sp)])  # one ordinary run: the static buffers get built
    runner = eng.runner
    print(f"preset {args.preset} {args.dtype}, KV {kv}, buckets {runner.buckets}, table width "
          f"{runner._width}, lora {args.lora or args.lora_experts} (experts {args.lora_experts})",
          flush=True)  # fmt: skip
    results = []
    with torch.inference_mode():  # the static buffers are inference tensors (built inside engine.step)
        runner._fill_static()  # every row padded: only scratch is written
        v = runner._static_views
        v["temperature"].fill_(1.0)  # sampled rows, not greedy: the noise kernel runs in the graph
        v["keys"].copy_(torch.arange(v["keys"].numel(), device=device) * 7919 + 1)
        for bs in reversed(runner.buckets):
            row = {"bs": bs, "sync": "ok", "capture": "ok", "replay_max_diff": None, "same_samples": None}
            eager = None
            try:
                runner.static_step(bs)  # warm-up: autotuning and first-use allocations may sync
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    eager = [t.clone() for t in runner.static_step(bs)]
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            except Exception as exc:
                row["sync"] = f"{first_line(exc)} at {project_frame(exc)}"
            try:
                runner.capture_bucket(bs)
                graph, outs = runner._graphs[bs]
                graph.replay()
                torch.cuda.synchronize()
                if eager is None:
                    eager = runner.static_step(bs)
                row["replay_max_diff"] = float((outs[0] - eager[0]).abs().max())
                row["same_samples"] = bool(torch.equal(outs[1], eager[1]) and torch.equal(outs[2], eager[2]))
            except Exception as exc:
                row["capture"] = f"{first_line(exc)} at {project_frame(exc)}"
                runner._graphs.pop(bs, None)
            results.append(row)
            print(row, flush=True)
    print("\n| bucket | host-sync check | capture | replay max diff | same samples |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r['bs']} | {r['sync']} | {r['capture']} | {r['replay_max_diff']} | {r['same_samples']} |")
    bad = [r for r in results if r["sync"] != "ok" or r["capture"] != "ok" or r["replay_max_diff"] != 0.0
           or not r["same_samples"]]  # fmt: skip
    print(f"\n{len(results) - len(bad)} of {len(results)} buckets capture-safe and replay-exact")


if __name__ == "__main__":
    main()
