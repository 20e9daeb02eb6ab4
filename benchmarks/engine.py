"""Native engine throughput against naive generation, and KV capacity per cache dtype.

Proof of value for rollout/native: the same model generates the same greedy tokens (checked before
numbers are reported) with the engine (paged KV cache, one flattened `forward_cached` per step) or
naively (the full `forward` re-run for every new token, O(S^2)). Also bytes per token of the whole
cache and tokens per GiB for bf16, fp8 and NVFP4 main K/V. Timing: perf_counter around whole
generations after a warm-up, median of `--repeats`; tokens/s counts generated tokens.

    python benchmarks/engine.py --preset tiny --batch 1 8 --json runs/engine.json
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

from model.config import ModelConfig
from model.kv_cache import KVCache
from model.modeling import MiniMaxM3ForCausalLM
from rollout.engine import Request, SamplingParams
from rollout.native import NativeEngine


@torch.inference_mode()
def naive_generate(model: MiniMaxM3ForCausalLM, prompts_BS: torch.Tensor, max_tokens: int) -> list[list[int]]:
    """Greedy, full forward over the whole sequence for every new token (equal-length prompts).
    A quantized KV cache is matched by the forward's KV simulation."""
    kv_sim = model.config.kv_cache_dtype != "bf16" or model.config.index_cache_dtype != "bf16"
    ids_BS = prompts_BS
    for _ in range(max_tokens):
        next_B = model(ids_BS, kv_sim=kv_sim)[:, -1].argmax(-1)
        ids_BS = torch.cat([ids_BS, next_B[:, None]], dim=1)
    return ids_BS[:, prompts_BS.shape[1] :].tolist()


def engine_generate(model, prompts_BS, max_tokens, max_pages) -> list[list[int]]:
    # bf16 config dtypes run as fp32 caches: the naive forward keeps K/V unrounded then.
    plain = model.config.kv_cache_dtype == "bf16" and model.config.index_cache_dtype == "bf16"
    dt = "fp32" if plain else None
    eng = NativeEngine(model, max_pages=max_pages, max_batch_tokens=4096, max_num_seqs=256, kv_dtype=dt,
                       index_dtype=dt)  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = eng.generate([Request(tuple(p.tolist()), sp) for p in prompts_BS])
    return [c.token_ids for c in out]


def timed(fn, device, repeats: int) -> tuple[float, object]:
    result = fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def capacity(cfg: ModelConfig) -> list[dict]:
    rows = []
    for dtype in ("bf16", "fp8", "nvfp4"):
        cache = KVCache(cfg, 1, device="meta", dtype=dtype)
        per_tok = cache.total_bytes_per_token()
        main = sum(cache.bytes_per_token(i) for i in range(cfg.num_hidden_layers))
        rows.append({"kv_dtype": dtype, "bytes_per_token": per_tok, "main_kv_bytes_per_token": main,
                     "tokens_per_gib": (1 << 30) // per_tok})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    # bf16 runs the cache in fp32, as the plain forward keeps K/V.
    ap.add_argument(
        "--kv-dtype", default="bf16", choices=["bf16", "fp8", "nvfp4"], help="main K/V cache dtype"
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg = dataclasses.replace(
        ModelConfig.preset(args.preset), num_mtp_modules=0, kv_cache_dtype=args.kv_dtype
    )
    # Initialised on the CPU (the init generator is a CPU one), then moved.
    model = MiniMaxM3ForCausalLM(cfg).init_weights(std=0.05, seed=0)
    model = model.to(device=device, dtype=getattr(torch, args.dtype)).eval()
    gen = torch.Generator().manual_seed(0)
    page = cfg.index_block_size
    results = []
    for B in args.batch:
        prompts_BS = torch.randint(3, cfg.vocab_size, (B, args.prompt_len), generator=gen).to(device)
        max_pages = B * -(-(args.prompt_len + args.max_tokens) // page) + 1

        def run_naive(prompts_BS=prompts_BS):
            return naive_generate(model, prompts_BS, args.max_tokens)

        def run_engine(prompts_BS=prompts_BS, max_pages=max_pages):
            return engine_generate(model, prompts_BS, args.max_tokens, max_pages)

        t_naive, naive = timed(run_naive, device, args.repeats)
        t_eng, eng = timed(run_engine, device, args.repeats)
        agree = sum(a == b for x, y in zip(naive, eng) for a, b in zip(x, y)) / (B * args.max_tokens)
        n_tok = B * args.max_tokens
        results.append({
            "preset": args.preset, "device": str(device), "dtype": args.dtype, "kv_dtype": args.kv_dtype,
            "batch": B, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
            "naive_tok_s": n_tok / t_naive, "engine_tok_s": n_tok / t_eng, "speedup": t_naive / t_eng,
            "greedy_token_agreement": agree, "threads": torch.get_num_threads(),
        })  # fmt: skip
    report = {"throughput": results, "capacity": capacity(cfg)}
    print("| batch | naive tok/s | engine tok/s | speedup | greedy agreement |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r['batch']} | {r['naive_tok_s']:.1f} | {r['engine_tok_s']:.1f} | {r['speedup']:.2f}x "
              f"| {r['greedy_token_agreement']:.3f} |")  # fmt: skip
    print("\n| KV dtype | bytes/token (all layers, K/V + index) | tokens/GiB |\n|---|---|---|")
    for r in report["capacity"]:
        print(f"| {r['kv_dtype']} | {r['bytes_per_token']} | {r['tokens_per_gib']} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
