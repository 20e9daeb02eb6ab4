"""Training kernels (issue 10 items 1-2) against their baselines, side by side in one process.

MoE (forward + input-grad backward, router weights and x need grad, no adapter, then with rank-32
expert LoRA): the Triton NVFP4 grouped GEMMs (`model.kernels.triton_moe_train`) vs
- `dequant+bf16`: every call dequantizes the bank to bf16 (model.nvfp4.dequantize, the torch
  reference decode) then runs the grouped bf16 matmuls (slots sorted by expert, one matmul per expert,
  autograd) - the baseline of the target (>= 1.5x);
- `bf16 resident`: the same grouped matmuls on weights dequantized once beforehand (3.56x the memory:
  what the NVFP4 kernel would have to beat if memory were free).
Sparse attention (forward, forward + backward; bf16): the Triton block-sparse kernels
(`model.kernels.triton_msa_train`) vs FlexAttention with the same block mask (compiled) vs dense causal
attention (SDPA, flash backend), at 16K+ tokens, top-16 of 128-token blocks. Selections are block-
coherent (all tokens of a query block pick the same blocks: local + random earlier ones), as a trained
indexer's tend to be; the fraction of key tiles visited is printed.

Correctness is checked before timing (outputs and input grads vs the baseline). Timing: CUDA events,
median of `--repeats` after warm-up. CPU (`--device cpu --quick`): tiny shapes, the Triton kernels
under TRITON_INTERPRET=1 - a smoke test of the script, ratios meaningless.

    python benchmarks/training_kernels.py --device cuda --json OUT.jsonl
    python benchmarks/training_kernels.py --device cpu --quick

No ray / wandb / vllm / datasets imports.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel module is imported

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.kernels.moe import swigluoai
from model.kernels.sparse_attention import sparse_attention_train_ref
from model.kernels.triton_moe_train import moe_nvfp4_train
from model.kernels.triton_msa_train import msa_train_flex, msa_train_triton, plan_tiles
from model.layers.lora import ExpertLoRA
from model.layers.moe import ExpertBank
from model.nvfp4 import NVFP4Tensor, dequantize

MOE_SHAPES = {  # name: (E, D, F, K, T)
    "small": (32, 1024, 256, 4, 8192),
    "m3": (128, 6144, 3072, 4, 4096),
    "tiny": (4, 64, 64, 2, 48),
}
ATTN_SHAPES = {  # name: (B, S, H, N, C, block, topk)
    "small-16k": (1, 16384, 8, 4, 128, 128, 16),
    "m3-16k": (1, 16384, 64, 4, 128, 128, 16),
    "m3-32k": (1, 32768, 64, 4, 128, 128, 16),
    "tiny": (1, 64, 4, 2, 32, 16, 2),
}


def log(msg: str) -> None:
    print(msg, flush=True)


def timeit(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of fn() after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12)).item()


# ----------------------------------------------------------------------------------------- MoE
def _parts(bank, p):
    return (
        getattr(bank, f"{p}_weight"),
        getattr(bank, f"{p}_weight_scale"),
        getattr(bank, f"{p}_weight_scale_2"),
    )


def dequant_bank(bank: ExpertBank, dtype) -> list[torch.Tensor]:
    """[w1, w3, w2] stacked over experts, dequantized with the torch reference decode."""
    out = []
    for p in ("w1", "w3", "w2"):
        packed, scales, scale_2 = _parts(bank, p)
        t = NVFP4Tensor(packed, scales, scale_2[:, None, None])  # per-expert global scale, broadcast
        out.append(dequantize(t, torch.float32).to(dtype))
    return out


def grouped_bf16(x_TD, ids_TK, w_TK, ws, lora, alpha, limit):
    """Baseline grouped MoE on float weights ws = [w1_EFD, w3_EFD, w2_EDF] (+ LoRA as ExpertLoRA)."""
    K = ids_TK.shape[1]
    ids_S = ids_TK.reshape(-1)
    order = torch.argsort(ids_S, stable=True)
    counts = torch.bincount(ids_S, minlength=ws[0].shape[0]).tolist()  # SYNC: baseline's group bounds
    x_SD = x_TD[order // K]
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            xe = x_SD[start : start + n]
            g, u = xe @ ws[0][e].T, xe @ ws[1][e].T
            if lora is not None:
                g, u = g + lora(e, "w1", xe), u + lora(e, "w3", xe)
            a = swigluoai(g, u, alpha, limit)
            y = a @ ws[2][e].T
            outs.append(y + lora(e, "w2", a) if lora is not None else y)
        start += n
    y_SD = torch.cat(outs).float() * w_TK.reshape(-1)[order, None].float()
    return (
        torch.zeros(x_TD.shape, dtype=torch.float32, device=x_TD.device)
        .index_add(0, order // K, y_SD)
        .to(x_TD.dtype)
    )


def bench_moe(name, device, repeats, rank, emit):
    E, D, Fd, K, T = MOE_SHAPES[name]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    bank = ExpertBank(E, D, Fd, "nvfp4", device=device)
    for e in range(
        E
    ):  # drawn per expert on the device: a full M3 bank in fp32 would not fit on the host fast
        ws = [torch.randn(s, device=device) * 0.02 for s in ((Fd, D), (Fd, D), (D, Fd))]
        bank.quantize_expert_(e, *ws)
    lora = None
    if rank:
        lora = ExpertLoRA(bank, rank, 2.0 * rank, generator=gen).to(device)
        with torch.no_grad():
            for p in ("w1", "w2", "w3"):
                getattr(lora, p).lora_B.normal_(0, 0.01)
    x = torch.randn(T, D, device=device).to(dtype)
    logits = torch.randn(T, E, device=device)
    w_TK, ids_TK = torch.topk(torch.sigmoid(logits), K, dim=-1)
    go = torch.randn(T, D, device=device).to(dtype)
    lt = None
    if lora is not None:
        lt = (
            lora.w1.lora_A,
            lora.w1.lora_B,
            lora.w3.lora_A,
            lora.w3.lora_B,
            lora.w2.lora_A,
            lora.w2.lora_B,
            lora.scaling,
        )
    resident = dequant_bank(bank, dtype)

    def run(kind):
        xi, wi = x.detach().requires_grad_(), w_TK.detach().requires_grad_()
        if kind == "triton":
            y = moe_nvfp4_train(
                xi,
                ids_TK,
                wi,
                _parts(bank, "w1"),
                _parts(bank, "w3"),
                _parts(bank, "w2"),
                lt,
                swiglu_alpha=1.702,
                swiglu_limit=7.0,
            )
        else:
            ws = dequant_bank(bank, dtype) if kind == "dequant+bf16" else resident
            y = grouped_bf16(xi, ids_TK, wi, ws, lora, 1.702, 7.0)
        y.backward(go)
        return y, xi.grad, wi.grad

    base = run("bf16 resident")
    got = run("triton")
    errs = [rel_err(a, b) for a, b in zip(got, base)]
    log(f"moe {name} r={rank}: rel err vs bf16 baseline y/dx/dw = {', '.join(f'{e:.4f}' for e in errs)}")
    times = {
        k: timeit(lambda k=k: run(k), device, repeats) for k in ("triton", "dequant+bf16", "bf16 resident")
    }
    flops = 2 * T * K * 3 * D * Fd * 2  # forward + input-grad backward, three projections
    row = {
        "bench": "moe_train",
        "shape": name,
        "E": E,
        "D": D,
        "F": Fd,
        "K": K,
        "T": T,
        "lora_rank": rank,
        "rel_err": errs,
        **{f"{k}_ms": v * 1e3 for k, v in times.items()},
        "speedup_vs_dequant_bf16": times["dequant+bf16"] / times["triton"],
        "speedup_vs_bf16_resident": times["bf16 resident"] / times["triton"],
        "triton_tflops": flops / times["triton"] / 1e12,
    }
    emit(row)
    return row


# ----------------------------------------------------------------------------------- attention
def block_coherent_selection(B, N, S, bs, topk, gen, device):
    """[B, N, S, topk]: each query block selects itself + (topk - 1) random earlier blocks."""
    NB = -(-S // bs)
    sel_BNQK = torch.full((B, N, NB, topk), -1, dtype=torch.long)
    for qb in range(NB):
        cand = torch.randperm(qb, generator=gen)[: topk - 1] if qb else torch.zeros(0, dtype=torch.long)
        sel_BNQK[:, :, qb, 0] = qb
        sel_BNQK[:, :, qb, 1 : 1 + cand.numel()] = cand
    return sel_BNQK.repeat_interleave(bs, dim=2)[:, :, :S].contiguous().to(device), NB


def bench_attention(name, device, repeats, emit, with_flex):
    B, S, H, N, C, bs, topk = ATTN_SHAPES[name]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, H, C, device=device).to(dtype)
    k = torch.randn(B, S, N, C, device=device).to(dtype)
    v = torch.randn(B, S, N, C, device=device).to(dtype)
    go = torch.randn(B, S, H, C, device=device).to(dtype)
    sel, NB = block_coherent_selection(B, N, S, bs, topk, gen, device)
    seq = torch.zeros(B, S, dtype=torch.long, device=device)
    pos = torch.arange(S, device=device).expand(B, S).contiguous()
    kw = dict(block_size=bs, num_blocks=NB, softmax_scale=C**-0.5)
    plan = plan_tiles(sel, seq, pos, block_size=bs, num_blocks=NB, bq=max(1, 64 // (H // N)), tk=min(bs, 64))
    visited = plan["counts"].float().sum().item()
    causal_tiles = sum(
        min(plan["nt"], (qt * plan["bq"] + plan["bq"] - 1) // plan["tk"] + 1) for qt in range(plan["nqt"])
    )
    density = visited / (B * N * causal_tiles)

    def fns(kind):
        if kind == "triton":
            return lambda a, b, c: msa_train_triton(a, b, c, sel, seq, pos, **kw)
        if kind == "flex":
            return lambda a, b, c: msa_train_flex(a, b, c, sel, seq, pos, **kw)
        return lambda a, b, c: F.scaled_dot_product_attention(
            a.transpose(1, 2),
            b.transpose(1, 2),
            c.transpose(1, 2),
            is_causal=True,
            scale=C**-0.5,
            enable_gqa=True,
        ).transpose(1, 2)

    def fwd(kind):
        with torch.no_grad():
            return fns(kind)(q, k, v)

    def fwd_bwd(kind):
        qi, ki, vi = (t.detach().requires_grad_() for t in (q, k, v))
        out = fns(kind)(qi, ki, vi)
        out.backward(go)
        return out, qi.grad, ki.grad, vi.grad

    kinds = ["triton", "dense"] + (["flex"] if with_flex else [])
    if S <= 4096:  # the dense reference fits: check the kernels against it
        qi, ki, vi = (t.detach().float().requires_grad_() for t in (q, k, v))
        ref = sparse_attention_train_ref(qi, ki, vi, sel, seq, pos, **kw)
        ref.backward(go.float())
        want = (ref, qi.grad, ki.grad, vi.grad)
    else:  # the dense reference is O(S^2) memory: long shapes compare Triton with flex instead
        want = None
    got = fwd_bwd("triton")
    if want is not None:
        log(
            f"attn {name}: triton rel err vs reference out/dq/dk/dv = "
            f"{', '.join(f'{rel_err(a, b):.4f}' for a, b in zip(got, want))}"
        )
    if with_flex and device.type == "cuda":
        flex = fwd_bwd("flex")
        log(
            f"attn {name}: triton vs flex rel err out/dq/dk/dv = "
            f"{', '.join(f'{rel_err(a, b):.4f}' for a, b in zip(got, flex))}"
        )
    times = {}
    for kind in kinds:
        times[f"{kind}_fwd_ms"] = timeit(lambda kind=kind: fwd(kind), device, repeats) * 1e3
        if kind != "flex" or device.type == "cuda":  # FlexAttention has no CPU backward
            times[f"{kind}_fwdbwd_ms"] = timeit(lambda kind=kind: fwd_bwd(kind), device, repeats) * 1e3
    row = {
        "bench": "msa_train",
        "shape": name,
        "B": B,
        "S": S,
        "H": H,
        "N": N,
        "C": C,
        "block": bs,
        "topk": topk,
        "tile_density": density,
        **times,
        "fwd_speedup_vs_dense": times["dense_fwd_ms"] / times["triton_fwd_ms"],
        "fwdbwd_speedup_vs_dense": times["dense_fwdbwd_ms"] / times["triton_fwdbwd_ms"],
    }
    if "flex_fwdbwd_ms" in times:
        row["triton_vs_flex_fwdbwd"] = times["flex_fwdbwd_ms"] / times["triton_fwdbwd_ms"]
    if "flex_fwd_ms" in times:
        row["triton_vs_flex_fwd"] = times["flex_fwd_ms"] / times["triton_fwd_ms"]
    emit(row)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="NVFP4 MoE and MSA training kernels vs baselines")
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--moe", nargs="*", default=None, help=f"MoE shapes {list(MOE_SHAPES)}")
    p.add_argument("--attn", nargs="*", default=None, help=f"attention shapes {list(ATTN_SHAPES)}")
    p.add_argument("--ranks", type=int, nargs="+", default=[0, 32], help="expert LoRA ranks (0 = none)")
    p.add_argument("--no-flex", action="store_true")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", default=None, help="append one JSON line per result here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    moe = args.moe if args.moe is not None else (["tiny"] if args.quick else ["small", "m3"])
    attn = (
        args.attn
        if args.attn is not None
        else (["tiny"] if args.quick else ["small-16k", "m3-16k", "m3-32k"])
    )
    if args.quick:
        args.repeats, args.ranks = 1, [0, 4]
    header = {
        "device": args.device,
        "torch": torch.__version__,
        "quick": args.quick,
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
    }
    rows: list[dict] = []

    def emit(row):
        rows.append({**header, **row})
        log(json.dumps(rows[-1]))

    for name in moe:
        for r in args.ranks:
            bench_moe(name, device, args.repeats, r, emit)
    for name in attn:
        bench_attention(name, device, args.repeats, emit, not args.no_flex)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    log(
        "\n| MoE shape | LoRA r | Triton ms | dequant+bf16 ms | bf16 resident ms | vs dequant+bf16 (>= 1.5x) "
        "| vs resident |"
    )
    log("| --- | --- | --- | --- | --- | --- | --- |")
    for r in (r for r in rows if r["bench"] == "moe_train"):
        log(
            f"| {r['shape']} | {r['lora_rank']} | {r['triton_ms']:.2f} | {r['dequant+bf16_ms']:.2f} | "
            f"{r['bf16 resident_ms']:.2f} | {r['speedup_vs_dequant_bf16']:.2f}x | "
            f"{r['speedup_vs_bf16_resident']:.2f}x |"
        )
    log(
        "\n| attention | S | tiles visited | Triton fwd / fwd+bwd ms | dense fwd / fwd+bwd ms "
        "| flex fwd / fwd+bwd ms | "
        "sparse vs dense fwd+bwd | Triton vs flex fwd+bwd |"
    )
    log("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in (r for r in rows if r["bench"] == "msa_train"):
        fl = f"{r.get('flex_fwd_ms', float('nan')):.2f} / {r.get('flex_fwdbwd_ms', float('nan')):.2f}"
        log(
            f"| {r['shape']} | {r['S']} | {r['tile_density']:.1%} | "
            f"{r['triton_fwd_ms']:.2f} / {r['triton_fwdbwd_ms']:.2f} | "
            f"{r['dense_fwd_ms']:.2f} / {r['dense_fwdbwd_ms']:.2f} | {fl} | "
            f"{r['fwdbwd_speedup_vs_dense']:.2f}x | "
            f"{r.get('triton_vs_flex_fwdbwd', float('nan')):.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
