"""Learner throughput and memory (issue 10 item 3): NVFP4 base + rank-32 LoRA vs a bf16 dequantized twin.

One learner step as rl/learner.py runs it, called directly (no Ray): token log-probs of a packed
batch (with the KV simulation), the DAPO clipped loss, backward into the adapter, one AdamW step. Two
models with identical weights, measured one at a time: `nvfp4` (the `small` preset as served, Triton
MoE and block-sparse attention kernels on CUDA) and `bf16` (every routed expert dequantized). Both get
the same LoRA (routed experts too unless --no-routed-lora). Reported: tokens/s, peak memory, weight
bytes, and the capacity planner's `m3.1-flash` memory table beside what `small` measured.

    python benchmarks/learner.py --device cuda --json OUT.jsonl
    python benchmarks/learner.py --device cpu --quick        # smoke test (tiny preset, torch paths)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import capacity
from model.config import ModelConfig
from model.layers.lora import LoRAConfig, apply_lora, lora_num_bytes
from model.layers.moe import ExpertBank
from model.modeling import MiniMaxM3ForCausalLM
from rl.grpo import policy_loss

sys.path.insert(1, str(Path(__file__).resolve().parent))
from random_init import random_model_

M3_WIDTH = 4096  # hidden sizes from here up are built on the device with random weights


def log(msg: str) -> None:
    print(msg, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def build_model(
    cfg: ModelConfig, device: torch.device, dtype: torch.dtype, variant: str
) -> MiniMaxM3ForCausalLM:
    """The preset with seeded weights; variant 'bf16' replaces each NVFP4 bank by its dequantized twin.
    At M3 width (`--preset m3.1-flash`) both variants draw random weights on the device instead
    (benchmarks/random_init.py; a host draw and dequantization would take minutes per layer): same
    shapes and value ranges, the bf16 variant's routed experts built as bf16 banks."""
    if cfg.hidden_size >= M3_WIDTH:
        if variant == "bf16":
            cfg = dataclasses.replace(
                cfg, quantization=dataclasses.replace(cfg.quantization, routed_experts="bf16")
            )
        with torch.device(device):
            model = MiniMaxM3ForCausalLM(cfg)
        random_model_(model, torch.Generator(device).manual_seed(0))
        return model.to(dtype=dtype)
    model = MiniMaxM3ForCausalLM(cfg).init_weights(std=0.02, seed=0)
    if variant == "bf16":
        for module in list(model.modules()):
            bank = getattr(module, "experts", None)
            if isinstance(bank, ExpertBank) and bank.fmt == "nvfp4":
                module.experts = ExpertBank.from_float(
                    *bank.dequantized_all(torch.float32),
                    "float",
                    swiglu_alpha=bank.swiglu_alpha,
                    swiglu_limit=bank.swiglu_limit,
                )
    return model.to(device=device, dtype=dtype)


def make_batch(cfg: ModelConfig, batch: int, seq_len: int, device: torch.device, seed: int = 0) -> dict:
    """Random token rows with ragged lengths (75-100% of seq_len), padding -1 after each sequence."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, cfg.vocab_size, (batch, seq_len + 1), generator=gen)
    lens = torch.randint(int(0.75 * seq_len), seq_len + 1, (batch,), generator=gen)
    seq_ids = torch.where(torch.arange(seq_len)[None, :] < lens[:, None], 0, -1)
    mask = (seq_ids >= 0).float()
    adv = torch.randn(batch, generator=gen)
    to = lambda t: t.to(device)
    return {
        "input_ids": to(ids[:, :-1]),
        "targets": to(ids[:, 1:]),
        "seq_ids": to(seq_ids),
        "mask": to(mask),
        "adv": to(adv),
        "tokens": int(lens.sum()),
    }


def learner_step(model, opt, b, kv_sim: bool) -> float:
    logp, _ = model.token_logprobs(b["input_ids"], b["targets"], seq_ids_BS=b["seq_ids"], kv_sim=kv_sim)
    loss, _ = policy_loss(logp, logp.detach(), b["adv"], b["mask"])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.detach()


def measure(variant, cfg, device, dtype, args) -> dict:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    model = build_model(cfg, device, dtype, variant)
    lcfg = LoRAConfig(r=args.rank, alpha=2.0 * args.rank, routed_experts=not args.no_routed_lora)
    apply_lora(model, lcfg, seed=0)
    model.gradient_checkpointing = args.gradient_checkpointing
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    sync(device)
    weight_bytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    b = make_batch(cfg, args.batch, args.seq_len, device)
    learner_step(model, opt, b, args.kv_sim)  # warm-up: compiles kernels, allocates optimizer state
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base_alloc = torch.cuda.memory_allocated()
    times = []
    for _ in range(args.repeats):
        sync(device)
        t0 = time.perf_counter()
        learner_step(model, opt, b, args.kv_sim)
        sync(device)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else float("nan")
    row = {
        "variant": variant,
        "step_s": step_s,
        "tokens_per_step": b["tokens"],
        "tokens_per_s": b["tokens"] / step_s,
        "weight_bytes": weight_bytes,
        "adapter_bytes": lora_num_bytes(model),
        "peak_bytes": peak,
        "activation_peak_bytes": peak - base_alloc if device.type == "cuda" else float("nan"),
    }
    log(
        f"  {variant:>5}: {row['tokens_per_s']:.0f} tok/s (step {step_s * 1e3:.1f} ms, {b['tokens']} tok), "
        f"weights {weight_bytes / 2**30:.2f} GiB, peak {peak / 2**30:.2f} GiB"
    )
    del model, opt, params
    return row


def adapter_bytes(cfg: ModelConfig, rank: int) -> int:
    """Bytes of the recipes' default adapter (rank `rank` on attention, fp32) of `cfg`, from the model
    built on the meta device (no memory): the adapter-sync bytes a step moves for that model."""
    with torch.device("meta"):
        model = MiniMaxM3ForCausalLM(cfg)
    apply_lora(model, LoRAConfig(r=rank, alpha=2.0 * rank), seed=0)
    return lora_num_bytes(model)


def memory_table(small: ModelConfig, preset: str, rows: dict, rank: int = 32) -> list[dict]:
    """Capacity-planner figures (m3.1-flash and the measured preset) beside the measured learner."""
    out = []
    for name in ("m3.1-flash", preset):
        cfg = ModelConfig.preset(name) if name != preset else small
        n = capacity.num_parameters(cfg)
        out.append(
            {
                "preset": name,
                "params": n,
                "checkpoint_bytes": capacity.checkpoint_bytes(cfg),
                "bytes_per_param": capacity.checkpoint_bytes(cfg) / n,
                "kv_bytes_per_token": capacity.kv_bytes_per_token(cfg),
                "adapter_bytes": adapter_bytes(cfg, rank),
                "source": "capacity planner",
            }
        )
    for variant, r in rows.items():
        n = capacity.num_parameters(small)
        out.append(
            {
                "preset": f"{preset} ({variant}, measured)",
                "params": n,
                "weight_bytes": r["weight_bytes"],
                "bytes_per_param": r["weight_bytes"] / n,
                "activation_bytes_per_token": r["activation_peak_bytes"] / r["tokens_per_step"],
                "source": "measured",
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="learner tokens/s and memory: NVFP4 + LoRA vs bf16 dequantized")
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--preset",
        default="small",
        choices=["small", "tiny", "m3.1-flash"],
        help="m3.1-flash: the real model's layer shapes (hidden 6144, 128 experts of 3072, 200K vocab) with "
        "--layers MSA + MoE layers",
    )
    p.add_argument("--layers", type=int, default=2, help="layers of the m3.1-flash preset (default 2)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--no-routed-lora", action="store_true", help="no adapter on the routed experts")
    p.add_argument("--no-kv-sim", dest="kv_sim", action="store_false")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument(
        "--experts",
        type=int,
        default=None,
        help="override the preset's routed experts per layer (e.g. 128, as M3.1-Flash has: the weight mix "
        "then resembles the real model's, where routed experts are most of the bytes)",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="tiny preset, short batch (CPU smoke test)")
    p.add_argument("--json", default=None, help="append one JSON line per result here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.quick:
        args.preset, args.batch, args.seq_len, args.repeats, args.rank = "tiny", 2, 64, 1, 4
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = ModelConfig.preset(args.preset)
    if args.preset == "m3.1-flash":  # MSA + MoE layers only: no dense MLP left to quantize
        L = args.layers
        cfg = dataclasses.replace(
            cfg, num_hidden_layers=L, layer_types=["minimax_m3_sparse"] * L, mlp_layer_types=["sparse"] * L,
            num_mtp_modules=0, quantization=dataclasses.replace(cfg.quantization, dense_mlp="bf16"),
        )  # fmt: skip
    if args.experts is not None:
        cfg = dataclasses.replace(cfg, num_local_experts=args.experts)
    header = {
        "bench": "learner",
        "device": args.device,
        "preset": args.preset,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "rank": args.rank,
        "routed_lora": not args.no_routed_lora,
        "kv_sim": args.kv_sim,
        "experts": cfg.num_local_experts,
        "layers": cfg.num_hidden_layers,
        "gradient_checkpointing": args.gradient_checkpointing,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
    }
    log(f"learner benchmark: {header}")
    rows = {v: measure(v, cfg, device, dtype, args) for v in ("nvfp4", "bf16")}
    ratio = {
        "speedup": rows["nvfp4"]["tokens_per_s"] / rows["bf16"]["tokens_per_s"],
        "peak_memory_ratio": rows["bf16"]["peak_bytes"] / rows["nvfp4"]["peak_bytes"],
        "weight_memory_ratio": rows["bf16"]["weight_bytes"] / rows["nvfp4"]["weight_bytes"],
    }
    mem = memory_table(cfg, args.preset, rows, args.rank)
    out = (
        [{**header, **r} for r in rows.values()]
        + [{**header, "summary": ratio}]
        + [{**header, "memory": m} for m in mem]
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in out)
    log("\n| variant | tokens/s | step ms | weights GiB | peak GiB |")
    log("| --- | --- | --- | --- | --- |")
    for r in rows.values():
        log(
            f"| {r['variant']} | {r['tokens_per_s']:.0f} | {r['step_s'] * 1e3:.1f} | "
            f"{r['weight_bytes'] / 2**30:.3f} | "
            f"{r['peak_bytes'] / 2**30:.3f} |"
        )
    log(
        f"\nNVFP4 vs bf16: {ratio['speedup']:.2f}x tokens/s, "
        f"peak memory {ratio['peak_memory_ratio']:.2f}x lower "
        f"(target >= 2x), weights {ratio['weight_memory_ratio']:.2f}x lower"
    )
    log("\n| preset | source | params | bytes/param | KV B/token | learner activation B/token | adapter GB |")
    log("| --- | --- | --- | --- | --- | --- | --- |")
    for m in mem:
        log(
            f"| {m['preset']} | {m['source']} | {m['params'] / 1e9:.3f}e9 | {m['bytes_per_param']:.3f} | "
            f"{m.get('kv_bytes_per_token', '')} | {m.get('activation_bytes_per_token', '')} | "
            f"{m['adapter_bytes'] / 1e9 if 'adapter_bytes' in m else ''} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
