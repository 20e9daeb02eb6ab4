"""Native engine decode step on the GPU: eager vs CUDA graphs side by side, against the bytes floor and
Hugging Face transformers' MiniMax-M3 port, in one run.

Per config (preset, batch): decode ms per step = (long run - short run) / (extra tokens) of the same
batch (prefill cancels, docs/PERFORMANCE.md), tokens/s = batch / step, GPU busy = profiler kernel time
per decode-only step / the unprofiled decode step (`gpu_busy_profiled`: over the profiled window's own
wall time, which the profiler's host cost stretches), bytes floor = every weight byte once + the KV
bytes the batch reads, / 4.17 TB/s; the touched floor counts only the routed experts a batch is expected
to reach (uniform routing).
Modes: `eager` (unpadded, no capture), `graphs` (all-decode steps replayed from captured buckets; on
CPU `static`, the same padded passes without capture), `compiled` (graphs of torch.compile'd passes).
The peer (`MiniMaxM3VLForCausalLM.generate`, greedy, bf16 experts, dynamic and static cache) runs on the
same weights when importable.

    python benchmarks/engine_gpu.py --json $OUT/engine_gpu.jsonl            # H200
    python benchmarks/engine_gpu.py --quick                                  # CPU smoke (tiny preset)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.config import ModelConfig
from model.layers.moe import ExpertBank
from model.modeling import MiniMaxM3ForCausalLM
from rollout.engine import Request, SamplingParams
from rollout.native import NativeEngine

HBM_BYTES_PER_S = 4.17e12  # measured H200 device copy (docs/PERFORMANCE.md)


def build(preset: str, layers: int, device: torch.device, dtype: torch.dtype, kv_dtype: str):
    cfg = dataclasses.replace(ModelConfig.preset(preset), num_mtp_modules=0, kv_cache_dtype=kv_dtype)
    if preset == "m3.1-flash":  # the last `layers` layers: MSA + MoE only (as benchmarks/learner.py)
        cfg = dataclasses.replace(
            cfg, num_hidden_layers=layers, layer_types=["minimax_m3_sparse"] * layers,
            mlp_layer_types=["sparse"] * layers,
            quantization=dataclasses.replace(cfg.quantization, dense_mlp="bf16"),  # no dense layer left
        )  # fmt: skip
        from random_init import random_model_

        with torch.device(device):
            model = MiniMaxM3ForCausalLM(cfg)
        random_model_(model, torch.Generator(device).manual_seed(0))
        return model.to(dtype=dtype).eval()
    model = MiniMaxM3ForCausalLM(cfg).init_weights(std=0.02, seed=0)
    return model.to(device=device, dtype=dtype).eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # SYNC: timing only


def make_engine(model, batch: int, ctx: int, mode: str, kv_dtype: str) -> NativeEngine:
    page = model.config.index_block_size
    max_pages = batch * -(-ctx // page) + 1
    # "graphs_sync" / "static_sync": the step reads its tokens back before the next one is launched
    # (async_decode off), the engine's behaviour before the lookahead.
    base, sync_mode = mode.removesuffix("_sync"), mode.endswith("_sync")
    is_graphs = base in ("graphs", "compiled") and model.lm_head.weight.is_cuda
    return NativeEngine(model, max_pages=max_pages, max_batch_tokens=max(4096, batch), max_num_seqs=batch,
                        kv_dtype=kv_dtype, index_dtype=kv_dtype, cuda_graphs=is_graphs,
                        static_decode=base != "eager", compile_decode=base == "compiled",
                        async_decode=False if sync_mode or base == "eager" else None)  # fmt: skip


def requests(prompts_BS: torch.Tensor, max_tokens: int) -> list[Request]:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [Request(tuple(p), sp) for p in prompts_BS.tolist()]


def timed(fn, device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gpu_busy(eng: NativeEngine, prompts_BS: torch.Tensor, steps: int, device: torch.device) -> tuple:
    """(kernel us per step, kernel time / the profiled wall, kernels launched per step, top kernels) over
    `steps` decode-only steps (prefill stepped through first); Nones off CUDA. Only device activity is
    recorded: the host's own profiling would slow the host loop that async decode hides."""
    if device.type != "cuda":
        return None, None, None, None
    from torch.profiler import ProfilerActivity, profile

    for r in requests(prompts_BS, steps + 2):
        eng.add_request(r)
    while any(not s.output for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync(device)
        wall_us = (time.perf_counter() - t0) * 1e6
    while eng.has_unfinished():
        eng.step()
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events)
    cuda = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = sum(e.count for e in cuda)
    top = sorted(cuda, key=lambda e: -e.count)[:25]
    top = [(e.key[:70], round(e.count / steps, 1), round(e.self_device_time_total / steps, 1)) for e in top]
    return kernel_us / steps, kernel_us / wall_us, kernels / steps, top


def replay_only_ms(eng: NativeEngine, batch: int, device: torch.device, n: int = 50) -> float | None:
    """ms per replay of the bucket graph of `batch` alone (no scheduling, staging or sampling): the
    step's GPU part; decode_ms minus it is the host's share. None without a captured graph."""
    r = eng.runner
    bs = next((b for b in r.buckets if b >= batch), None)
    if device.type != "cuda" or bs not in r._graphs:
        return None
    graph = r._graphs[bs][0]
    graph.replay()  # the static buffers hold the last real step (or padding): replays write no real row
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        graph.replay()
    sync(device)
    return 1e3 * (time.perf_counter() - t0) / n


def bytes_floor_s(model, eng: NativeEngine, batch: int, ctx: int) -> tuple[float, int, int, float]:
    """(seconds, weight bytes, KV bytes, seconds of the touched-expert floor): every parameter / buffer
    byte once + what attention reads; the last counts of each routed expert bank only the experts a
    batch is expected to touch under uniform top-k routing, E * (1 - (1 - K / E)^batch) of E (at batch
    8 of 128 experts top-4, 29: the all-weights floor then overstates the bytes a step must read)."""
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    cfg, cache = model.config, eng.cache
    kv = 0
    for i in range(cfg.num_hidden_layers):
        keys = ctx if not cfg.is_sparse_layer(i) else min(ctx, cfg.index_topk_blocks * cfg.index_block_size)
        kv += keys * cache.bytes_per_token(i) + ctx * cache.index_bytes_per_token(i)
    kv *= batch
    untouched = 0.0
    for mod in model.modules():
        if isinstance(mod, ExpertBank):
            E, K = mod.num_experts, cfg.num_experts_per_tok
            bank = sum(t.numel() * t.element_size() for t in [*mod.parameters(), *mod.buffers()])
            untouched += bank * (1 - K / E) ** batch
    return (weights + kv) / HBM_BYTES_PER_S, weights, kv, (weights - untouched + kv) / HBM_BYTES_PER_S


def _dynamo_counts(mode: str) -> dict:
    """Compiled mode: Dynamo's graph breaks (reason -> count, cumulative in the process)."""
    if mode != "compiled":
        return {}
    from torch._dynamo.utils import counters

    return {"graph_breaks": {k[:120]: v for k, v in counters["graph_break"].items()}}


# ------------------------------------------------------------------ the transformers peer
def to_hf(model: MiniMaxM3ForCausalLM, dtype: torch.dtype):
    """transformers' MiniMaxM3VLForCausalLM (text) with this model's weights in `dtype`, routed experts
    dequantized (the port has no NVFP4 MoE), through model/adapter.py's one name mapping (the twin
    PEFT adapters are checked against). None if the port is not importable."""
    try:
        from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM
    except ImportError:
        return None
    from model.adapter import hf_twin_config, hf_twin_state_dict

    hf = MiniMaxM3VLForCausalLM._from_config(hf_twin_config(model.config), dtype=dtype)
    sd = hf_twin_state_dict(model)  # fp32 (the peer at M3.1 widths holds it beside the bf16 port)
    hf.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}, strict=False)
    missing = [k for k in set(hf.state_dict()) - set(sd) if not k.endswith("inv_freq")]
    if missing:
        raise RuntimeError(f"to_hf: port tensors left unset: {sorted(missing)[:5]}")
    return hf.to(model.lm_head.weight.device).eval()


def hf_decode(hf, prompts_BS, short: int, long: int, repeats: int, device, cache: str, expect) -> dict:
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompts_BS))
    if cache == "static":
        kw["cache_implementation"] = "static"

    def run(n):
        with torch.inference_mode():
            return hf.generate(prompts_BS, max_new_tokens=n, min_new_tokens=n, **kw)

    run(short)  # warm-up of both lengths: a static cache is compiled per cache length
    ids_BS = run(long)[:, prompts_BS.shape[1] :].tolist()
    # Same weights, greedy: the peer is checked against the engine before it is timed (tokens agree
    # until bf16 / cache rounding lets a near-tie flip; fp32 on the CPU they agree exactly).
    agree = sum(a == b for x, y in zip(ids_BS, expect) for a, b in zip(x, y)) / max(1, sum(map(len, expect)))
    t_short, t_long = timed(lambda: run(short), device, repeats), timed(lambda: run(long), device, repeats)
    step_s = (t_long - t_short) / (long - short)
    return {"decode_ms": 1e3 * step_s, "tok_s": prompts_BS.shape[0] / step_s, "greedy_agreement": agree}


def measure(model, preset: str, B: int, mode: str, prompts_BS, args, device, dtype, kv: str):
    """One (config, mode) row and the greedy tokens of its warm-up run (the peer's correctness check)."""
    ctx = args.prompt_len + args.long + 1
    eng = make_engine(model, B, ctx, mode, kv)
    t0 = time.perf_counter()
    warm = eng.generate(requests(prompts_BS, args.long))  # warm-up: autotuning, compilation, capture
    warmup_s = time.perf_counter() - t0
    reqs_short, reqs_long = requests(prompts_BS, args.short), requests(prompts_BS, args.long)
    w0 = eng.readback_wait_s
    t_short = timed(lambda: eng.generate(reqs_short), device, args.repeats)
    w1 = eng.readback_wait_s
    t_long = timed(lambda: eng.generate(reqs_long), device, args.repeats)
    w2 = eng.readback_wait_s
    step_s = (t_long - t_short) / (args.long - args.short)
    # Async decode: the host waits for a launched step's tokens only if it is ahead of the device, so a
    # wait near 0 means a host-bound step and decode - wait is the host loop's own time per step.
    wait_s = ((w2 - w1) - (w1 - w0)) / args.repeats / (args.long - args.short)
    floor_s, w_bytes, kv_bytes, touched_s = bytes_floor_s(model, eng, B, args.prompt_len + args.long // 2)
    kernel_us, busy_profiled, kernels, top = gpu_busy(eng, prompts_BS, args.profile_steps, device)
    busy = None if kernel_us is None else kernel_us / 1e6 / step_s
    replay_ms = replay_only_ms(eng, B, device)
    row = {
        "preset": preset, "layers": model.config.num_hidden_layers, "batch": B, "mode": mode,
        "lora_rank": args.lora,
        "device": str(device), "dtype": str(dtype), "kv_dtype": kv, "prompt_len": args.prompt_len,
        "decode_ms": 1e3 * step_s, "tok_s": B / step_s,
        "gpu_busy": busy, "gpu_busy_profiled": busy_profiled, "kernel_ms": kernel_us and kernel_us / 1e3,
        "kernels_per_step": kernels,
        "floor_ms": 1e3 * floor_s, "over_floor": step_s / floor_s, "weight_bytes": w_bytes,
        "kv_bytes": kv_bytes, "touched_floor_ms": 1e3 * touched_s, "over_touched_floor": step_s / touched_s,
        "graph_error": eng.runner.graph_error,
        "static_steps": eng.runner.static_steps, "captures": eng.runner.num_captures,
        "lookahead_steps": eng.lookahead_steps, "lookahead_discarded": eng.lookahead_discarded,
        "replay_ms": replay_ms, "host_ms": None if replay_ms is None else 1e3 * step_s - replay_ms,
        "readback_wait_ms": 1e3 * wait_s, "host_loop_ms": 1e3 * (step_s - wait_s),
        "warmup_s": warmup_s, "compile_error": eng.runner.compile_error, **_dynamo_counts(mode),
        **({"top_kernels": top} if args.breakdown else {}),
    }  # fmt: skip
    return row, [c.token_ids for c in warm]


# ------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU smoke: tiny preset, batch 1 and 4, short runs")
    ap.add_argument("--configs", nargs="*", default=None,
                    help="preset:batch items (default small:1 small:8 small:64 small:256 m3.1-flash:8 "
                         "m3.1-flash:64)")  # fmt: skip
    ap.add_argument("--layers", type=int, default=4, help="layers of the m3.1-flash preset")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--short", type=int, default=16, help="new tokens of the short run")
    ap.add_argument("--long", type=int, default=80, help="new tokens of the long run")
    ap.add_argument("--kv-dtype", default="nvfp4", choices=["bf16", "fp8", "nvfp4"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=16)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument(
        "--lora",
        type=int,
        default=0,
        help="rank of fp32 adapters on the default targets, as in rl.train (implies --no-peer)",
    )
    ap.add_argument(
        "--modes",
        nargs="*",
        default=None,
        help="engine modes (default eager graphs compiled on CUDA, eager static on CPU; a _sync suffix "
        "turns async decode off)",
    )
    ap.add_argument("--breakdown", action="store_true", help="rows list the 25 most launched kernels")
    ap.add_argument(
        "--peer-m3", action="store_true", help="also run the peer at M3.1-Flash widths (bf16 experts)"
    )
    ap.add_argument("--json", type=Path, default=None, help="JSON lines, one per (config, mode)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.quick:
        configs = args.configs or ["tiny:1", "tiny:4"]
        args.prompt_len, args.short, args.long, args.repeats, args.profile_steps = 24, 4, 12, 1, 4
        torch.set_num_threads(1)
    else:
        configs = args.configs or ["small:1", "small:8", "small:64", "small:256", "m3.1-flash:8",
                                   "m3.1-flash:64"]  # fmt: skip
    kv = args.kv_dtype if device.type == "cuda" else "fp32"
    rows, models = [], {}
    out = args.json.open("a") if args.json else None
    for item in configs:
        preset, batch = item.split(":")
        B = int(batch)
        if preset not in models:
            models.clear()
            models[preset] = build(preset, args.layers, device, dtype, args.kv_dtype)
            if args.lora:  # the rollout model of a GRPO run: fp32 adapters on the default targets
                from model.layers.lora import LoRAConfig, apply_lora

                apply_lora(models[preset], LoRAConfig(r=args.lora, alpha=2.0 * args.lora))
        model = models[preset]
        gen = torch.Generator().manual_seed(0)
        prompts_BS = torch.randint(3, model.config.vocab_size, (B, args.prompt_len), generator=gen)
        eager_tokens: list[list[int]] = []
        modes = args.modes or (
            ["eager", "graphs", "compiled"] if device.type == "cuda" else ["eager", "static"]
        )
        for mode in modes:
            try:
                row, tokens = measure(model, preset, B, mode, prompts_BS, args, device, dtype, kv)
            except Exception as exc:  # one config's failure (e.g. out of memory) must not end the run
                row, tokens = {"preset": preset, "batch": B, "mode": mode, "error": f"{type(exc).__name__}: "
                               f"{str(exc)[:300]}"}, []  # fmt: skip
            if mode == "eager":
                eager_tokens = tokens
            rows.append(row)
            print(json.dumps(row), flush=True)
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()
        if args.no_peer or args.lora or (preset == "m3.1-flash" and not args.peer_m3):
            continue
        try:
            hf = to_hf(model, dtype)
        except Exception as exc:  # another transformers version may name the port's tensors otherwise
            print(f"peer skipped: converting to transformers failed: {type(exc).__name__}: {exc}", flush=True)
            continue
        if hf is None:
            print("peer skipped: transformers.models.minimax_m3_vl is not importable", flush=True)
            args.no_peer = True
            continue
        for cache in ("dynamic", "static"):
            try:
                r = hf_decode(hf, prompts_BS.to(device), args.short, args.long, args.repeats, device, cache,
                              eager_tokens)  # fmt: skip
            except Exception as exc:  # the peer's failure must not lose the engine's rows
                print(f"peer {cache} failed: {type(exc).__name__}: {exc}", flush=True)
                continue
            peer_kv = "bf16" if dtype == torch.bfloat16 else "fp32"  # the port caches in the model dtype
            row = {"preset": preset, "batch": B, "mode": f"transformers_{cache}", "device": str(device),
                   "dtype": str(dtype), "kv_dtype": peer_kv, **r}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()
        del hf
    print(
        "\n| preset | batch | mode | decode ms | replay ms | tok/s | GPU busy | floor ms | x floor "
        "| touched floor ms | x touched |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['preset']} | {r['batch']} | {r['mode']} | failed: {r['error'][:80]} | | | | | | | |")
            continue
        busy = "" if r.get("gpu_busy") is None else f"{100 * r['gpu_busy']:.0f}%"
        floor = f"{r['floor_ms']:.3f}" if "floor_ms" in r else ""
        over = f"{r['over_floor']:.1f}x" if "over_floor" in r else ""
        touched = (
            f"{r['touched_floor_ms']:.3f} | {r['over_touched_floor']:.1f}x"
            if "touched_floor_ms" in r
            else " |"
        )
        replay = f"{r['replay_ms']:.3f}" if r.get("replay_ms") is not None else ""
        print(f"| {r['preset']} | {r['batch']} | {r['mode']} | {r['decode_ms']:.3f} | {replay} | "
              f"{r['tok_s']:.0f} | "
              f"{busy} | {floor} | {over} | {touched} |")  # fmt: skip


if __name__ == "__main__":
    main()
