"""Training kernels (issue 10 items 1-2) against their baselines, side by side in one process.

MoE (forward + input-grad backward, with and without rank-32 expert LoRA): the Triton NVFP4 grouped
GEMMs (`model.kernels.triton_moe_train`) vs dequantize-then-bf16 (the target's baseline, >= 1.5x) and
vs bf16 weights resident. Sparse attention (bf16, forward and forward + backward): the Triton
block-sparse kernels (every `CONFIGS` entry) vs FlexAttention with the same block mask vs dense SDPA,
16K+ tokens, top-16 of 128-token blocks; the summary ends with the faster backend per regime (the
entries of `AUTO_TRAIN_BACKEND`). Correctness is checked before timing. No ray / wandb / vllm imports.

    python benchmarks/training_kernels.py --device cuda --json OUT.jsonl
    python benchmarks/training_kernels.py --device cuda --moe --attn m3-16k --selections noisy --variants v2
    python benchmarks/training_kernels.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

# Baselines: `dequant+bf16` dequantizes the bank every call (model.nvfp4.dequantize) and runs grouped
# bf16 matmuls (slots sorted by expert, one matmul per expert, autograd); `bf16 resident` runs them on
# weights dequantized once (3.56x the memory). Attention: `CONFIGS` v1 = the 2026-11-30 tiles and
# mask, v2* the candidates; flex full blocks skip mask_mod (`--flex-variants nofull`: the 2026-11-30
# mask). Selections: "coherent" (every token of a query block picks the same blocks: the best case)
# and "noisy" (per token, top-k of a block score plus `--noise` x per-token noise, so the union over a
# query tile grows as with a real indexer). Per Triton config: visited / full tile fractions, plan /
# forward / dQ / dK-dV kernels timed alone, forward TFLOP/s over the visited tiles (dense: over the
# causal half). Timing: CUDA events, median of `--repeats` after warm-up. CPU (`--quick`): tiny shapes
# under TRITON_INTERPRET=1, a smoke test only (ratios meaningless).

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel module is imported

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.kernels import triton_msa_train as tmsa
from model.kernels.indexer import select_blocks
from model.kernels.moe import swigluoai
from model.kernels.msa_train_flex import msa_train_flex
from model.kernels.sparse_attention import sparse_attention_train_ref
from model.kernels.triton_moe_train import moe_nvfp4_train
from model.kernels.triton_msa_train import msa_train_triton, plan_tiles
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
def make_selection(kind, B, N, S, bs, topk, device, noise=0.1, seed=0):
    """[B, N, S, topk] selections (-1 padded) and NB. "coherent": every token of a query block picks
    the same blocks (its own + topk - 1 random earlier ones: the best case for shared tiles).
    "noisy": per token, as the indexer does, the top-k of block scores = a per-(query block, key
    block) score + `noise` x per-token N(0, 1) (own block forced): neighbours share most blocks."""
    NB = -(-S // bs)
    gen = torch.Generator(device=device).manual_seed(seed)
    qb_S = torch.arange(S, device=device) // bs
    if kind == "coherent":
        base_BNQB = torch.rand(B, N, NB, NB, generator=gen, device=device)
        noise = 0.0
    elif kind == "noisy":
        base_BNQB = torch.randn(B, N, NB, NB, generator=gen, device=device)
    else:
        raise ValueError(f"unknown selection {kind!r}")
    scores_BNSB = base_BNQB[:, :, qb_S]
    if noise:
        scores_BNSB = scores_BNSB + noise * torch.randn(B, N, S, NB, generator=gen, device=device)
    sel = select_blocks(scores_BNSB, qb_S[None, None, :], topk=topk, local_blocks=1, init_blocks=0)
    return sel.contiguous(), NB


def selection_stats(sel, plan, NB) -> dict:
    """Visited / full tile fractions of a plan (visited over the causal tiles) and how many selected
    blocks a token shares with its predecessor (1.0 = identical selections)."""
    B, N = sel.shape[:2]
    bq, tk, nqt, nt = plan["bq"], plan["tk"], plan["nqt"], plan["nt"]
    causal = sum(min(nt, (qt * bq + bq - 1) // tk + 1) for qt in range(nqt))
    visited = plan["counts"].sum().item()
    keep = plan["keep"][..., :NB].bool()
    shared = (keep[:, :, 1:] & keep[:, :, :-1]).sum(-1).float() / keep[:, :, 1:].sum(-1).clamp(min=1)
    return {
        "tile_density": visited / (B * N * causal),
        "full_fraction": plan["n_full"].item() / max(visited, 1),
        "neighbour_overlap": shared.mean().item(),
    }


def bench_attention(name, device, repeats, emit, selection, variants, flex_variants, noise):
    B, S, H, N, C, bs, topk = ATTN_SHAPES[name]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(B, S, H, C, device=device).to(dtype)
    k = torch.randn(B, S, N, C, device=device).to(dtype)
    v = torch.randn(B, S, N, C, device=device).to(dtype)
    go = torch.randn(B, S, H, C, device=device).to(dtype)
    sel, NB = make_selection(selection, B, N, S, bs, topk, device, noise)
    seq = torch.zeros(B, S, dtype=torch.long, device=device)
    pos = torch.arange(S, device=device).expand(B, S).contiguous()
    scale = C**-0.5
    kw = dict(block_size=bs, num_blocks=NB, softmax_scale=scale)
    if device.type != "cuda":  # the interpreter: one small-tile config (GPU tiles would take minutes)
        variants = ["interp"]
    cfgs = {n: tmsa.INTERPRETER_CONFIG if n == "interp" else tmsa.CONFIGS[n] for n in variants}

    def fns(kind):
        if kind in cfgs:
            return lambda a, b, c: msa_train_triton(a, b, c, sel, seq, pos, **kw, config=cfgs[kind])
        if kind.startswith("flex"):
            full = kind == "flex"
            return lambda a, b, c: msa_train_flex(a, b, c, sel, seq, pos, **kw, use_full_blocks=full)
        return lambda a, b, c: F.scaled_dot_product_attention(
            a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2), is_causal=True, scale=scale,
            enable_gqa=True,
        ).transpose(1, 2)  # fmt: skip

    def fwd(kind):
        with torch.no_grad():
            return fns(kind)(q, k, v)

    def fwd_bwd(kind):
        qi, ki, vi = (t.detach().requires_grad_() for t in (q, k, v))
        out = fns(kind)(qi, ki, vi)
        out.backward(go)
        return out, qi.grad, ki.grad, vi.grad

    flexes = [f"flex{'' if f == 'full' else '-' + f}" for f in flex_variants] if device.type == "cuda" else []
    if S <= 4096:  # the dense reference fits: check every kernel against it
        qi, ki, vi = (t.detach().float().requires_grad_() for t in (q, k, v))
        ref = sparse_attention_train_ref(qi, ki, vi, sel, seq, pos, **kw)
        ref.backward(go.float())
        want, against = (ref, qi.grad, ki.grad, vi.grad), "reference"
    else:  # the dense reference is O(S^2) memory: compare with flex (else the first variant)
        against = flexes[0] if flexes else variants[0]
        want = fwd_bwd(against)
    errs = {}
    for kind in [*cfgs, *flexes]:
        if kind != against:
            errs[kind] = [rel_err(a, b) for a, b in zip(fwd_bwd(kind), want)]
            log(f"attn {name} {selection}: {kind} rel err vs {against} out/dq/dk/dv = "
                f"{', '.join(f'{e:.4f}' for e in errs[kind])}")  # fmt: skip
    row = {"bench": "msa_train", "shape": name, "selection": selection,
           "noise": noise if selection == "noisy" else 0.0, "B": B, "S": S, "H": H, "N": N, "C": C,
           "block": bs, "topk": topk, "rel_err": errs, "rel_err_vs": against}  # fmt: skip
    dense_flops = 4 * C * H * B * S * (S + 1) / 2  # causal QK^T and PV, forward
    for kind in ["dense", *flexes, *cfgs]:
        row[f"{kind}_fwd_ms"] = timeit(lambda kind=kind: fwd(kind), device, repeats) * 1e3
        row[f"{kind}_fwdbwd_ms"] = timeit(lambda kind=kind: fwd_bwd(kind), device, repeats) * 1e3
    row["dense_fwd_tflops"] = dense_flops / row["dense_fwd_ms"] / 1e9
    for kind, cfg in cfgs.items():
        row.update({f"{kind}_{part}": x for part, x in kernel_split(q, k, v, go, sel, seq, pos, kw, cfg,
                                                                      device, repeats).items()})  # fmt: skip
    best = min(cfgs, key=lambda c: row[f"{c}_fwdbwd_ms"])
    row["best_triton"] = best
    for mode in ("fwd", "fwdbwd"):
        row[f"{mode}_speedup_vs_dense"] = row[f"dense_{mode}_ms"] / row[f"{best}_{mode}_ms"]
        if flexes:
            row[f"triton_vs_flex_{mode}"] = row[f"{flexes[0]}_{mode}_ms"] / row[f"{best}_{mode}_ms"]
    emit(row)
    return row


def kernel_split(q, k, v, go, sel, seq, pos, kw, cfg, device, repeats) -> dict:
    """One Triton config's plan / forward / dQ / dK-dV kernels timed alone (inputs as in the
    backward), the plan's tile statistics and the forward's throughput on the tiles it visits."""
    G, C, bs, NB = q.shape[2] // k.shape[2], q.shape[3], kw["block_size"], kw["num_blocks"]
    scale = kw["softmax_scale"]
    sizes = tmsa.tile_sizes(cfg, G, bs)
    bq, tk = sizes["bq"], sizes["tk"]
    plan = plan_tiles(sel, seq, pos, block_size=bs, num_blocks=NB, **sizes)
    out, lse = tmsa.msa_fwd(q, k, v, plan, scale, cfg)
    _, delta = tmsa.msa_bwd_dq(q, k, v, out, go, lse, plan, scale, cfg)
    parts = {
        "plan": lambda: plan_tiles(sel, seq, pos, block_size=bs, num_blocks=NB, **sizes),
        "fwd": lambda: tmsa.msa_fwd(q, k, v, plan, scale, cfg),
        "dq": lambda: tmsa.msa_bwd_dq(q, k, v, out, go, lse, plan, scale, cfg),
        "dkv": lambda: tmsa.msa_bwd_dkv(q, k, v, go, lse, delta, plan, scale, cfg),
    }
    res = {f"kernel_{part}_ms": timeit(fn, device, repeats) * 1e3 for part, fn in parts.items()}
    tile_flops = 4 * C * plan["counts"].sum().item() * bq * G * tk  # QK^T and PV over visited tiles
    return {
        **res,
        "fwd_tile_tflops": tile_flops / res["kernel_fwd_ms"] / 1e9,
        **selection_stats(sel, plan, NB),
    }


def attention_tables(rows) -> None:
    """Per (shape, selection): one line per backend; then the measured-faster backend per regime."""
    rows = [r for r in rows if r["bench"] == "msa_train"]
    if not rows:
        return
    log("\n| attention | selection | backend | tiles visited / full | fwd ms | fwd+bwd ms "
        "| plan / fwd / dq / dkv ms | fwd TFLOP/s (tiles) | vs dense fwd / fwd+bwd |")  # fmt: skip
    log("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        kinds = [
            "dense",
            *sorted({k[: -len("_fwdbwd_ms")] for k in r if k.endswith("_fwdbwd_ms")} - {"dense"}),
        ]
        for kind in kinds:
            dens = (f"{r[kind + '_tile_density']:.1%} / {r[kind + '_full_fraction']:.0%}"
                    if kind + "_tile_density" in r else "")  # fmt: skip
            split = (" / ".join(f"{r[f'{kind}_kernel_{p}_ms']:.2f}" for p in ("plan", "fwd", "dq", "dkv"))
                     if f"{kind}_kernel_plan_ms" in r else "")  # fmt: skip
            tfl = r.get(f"{kind}_fwd_tile_tflops", r["dense_fwd_tflops"] if kind == "dense" else None)
            fwd, fwdbwd = r[kind + "_fwd_ms"], r[kind + "_fwdbwd_ms"]
            ratio = f"{r['dense_fwd_ms'] / fwd:.2f}x / {r['dense_fwdbwd_ms'] / fwdbwd:.2f}x"
            log(f"| {r['shape']} | {r['selection']} | {kind} | {dens} | {fwd:.2f} | {fwdbwd:.2f} | {split} "
                f"| {'' if tfl is None else f'{tfl:.0f}'} | {ratio} |")  # fmt: skip
    # The dispatch's AUTO_TRAIN_BACKEND: per (needs grad, G >= 16), summed over the measured shapes.
    log("\nmeasured-faster backend per regime (AUTO_TRAIN_BACKEND; Triton = its best config per shape):")
    for big_group in (False, True):
        sub = [r for r in rows if (r["H"] // r["N"] >= 16) == big_group]
        for mode, grad in (("fwd", False), ("fwdbwd", True)):
            if not sub:
                continue
            tri = sum(min(r[f"{c}_{mode}_ms"] for c in _triton_kinds(r)) for r in sub)
            flex = sum(r.get(f"flex_{mode}_ms", float("inf")) for r in sub)
            log(f"  ({grad}, {big_group}): {'flex' if flex < tri else 'triton'}  (triton {tri:.2f} ms, "
                f"flex {flex:.2f} ms over {len(sub)} runs)")  # fmt: skip


def _triton_kinds(row) -> list[str]:
    return [k[: -len("_kernel_plan_ms")] for k in row if k.endswith("_kernel_plan_ms")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="NVFP4 MoE and MSA training kernels vs baselines")
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--moe", nargs="*", default=None, help=f"MoE shapes {list(MOE_SHAPES)}")
    p.add_argument("--attn", nargs="*", default=None, help=f"attention shapes {list(ATTN_SHAPES)}")
    p.add_argument("--ranks", type=int, nargs="+", default=[0, 32], help="expert LoRA ranks (0 = none)")
    p.add_argument("--no-flex", action="store_true")
    p.add_argument(
        "--selections", nargs="+", default=["coherent", "noisy"], help="attention block selections"
    )
    p.add_argument("--noise", type=float, default=0.1, help="per-token score noise of the noisy selection")
    p.add_argument("--variants", nargs="+", default=list(tmsa.CONFIGS), help="Triton MSA configs to time")
    p.add_argument("--flex-variants", nargs="+", default=["full"],
                   help="flex BlockMasks: full blocks skip mask_mod, or nofull (2026-11-30)")  # fmt: skip
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
        for selection in args.selections:
            flex = [] if args.no_flex else args.flex_variants
            bench_attention(name, device, args.repeats, emit, selection, args.variants, flex, args.noise)
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
    attention_tables(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
