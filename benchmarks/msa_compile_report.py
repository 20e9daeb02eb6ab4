"""Offline sm_90 compile report of the block-sparse MSA training kernels (registers, spills, SASS).

Per case: registers, spills, shared memory, SASS per loop iteration, and whether the K/V (or Q/dO)
tile loads are software-pipelined.

Why: the H200 is scarce, and spills, unpipelined loads and per-element mask gathers can be read on a
CPU machine (ptxas ships with Triton). Each case compiles one kernel of one `MSATrainConfig` at a
benchmark shape for `GPUTarget("cuda", 90, 32)`, with integer arguments specialised as the JIT would
(without that, strides look unaligned and the pipeliner skips the loads). The H200 runs Triton 3.6,
this machine may have a newer one: compare variants, not exact SASS.

Usage: python benchmarks/msa_compile_report.py [--configs v1 v2 ...] [--shapes m3 small] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

# Specialisation: values divisible by 16 get the divisibility attribute, 1 becomes a constant.
# Columns: regs, spill stores/loads (bytes), smem (bytes), async = cp.async copies in the TTGIR loop
# body (> 0: the tile loads are pipelined), sync = plain `tt.load`s of 2-D tiles left in the loop,
# moves = layout conversions and register -> shared copies in the loop (1 per P / dS feeding a dot
# from registers is the floor; more means tiles round-trip through shared memory), loop = SASS of the
# largest loop (the tile loop with its partial-tile mask branch) with its op histogram.
# Written when the kernels' efficiency per visited tile was ~6x below SDPA's (benchmarks/RESULTS.md,
# "training kernels on the H200").

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import triton
from kernel_compile_report import TARGET, _ptxas_counts, sass_counts
from triton.compiler import ASTSource

from model.kernels import triton_msa_train as m

SHAPES = {"m3": (16384, 64, 4, 128, 128), "small": (16384, 8, 4, 128, 128)}  # S, H, N, C, block
PTRS = dict(q_ptr="bf16", k_ptr="bf16", v_ptr="bf16", o_ptr="bf16", do_ptr="bf16", dq_ptr="bf16",
            dk_ptr="bf16", dv_ptr="bf16", lse_ptr="fp32", delta_ptr="fp32", seq_ptr="i32", kblk_ptr="i32",
            keep_ptr="u8", list_ptr="i32", count_ptr="i32", tlist_ptr="i32", tcount_ptr="i32")  # fmt: skip
FLOATS = {"qk_scale", "sm_scale"}


def launch_ints(S, H, N, C, block, bq, tk) -> dict:
    """The integer arguments the host passes at this shape (contiguous [1, S, H|N, C] tensors)."""
    nqt, nt = triton.cdiv(S, bq), triton.cdiv(S, tk)
    return dict(sq_b=S * H * C, sq_s=H * C, sk_b=S * N * C, sk_s=N * C, S=S, NBP=triton.cdiv(S, block) + 1,
                NQT=nqt, NT=nt, W=nt, WT=nqt)  # fmt: skip


def compile_kernel(fn, ints: dict, consts: dict, warps: int, stages: int):
    sig, attrs, constexprs = {}, {}, dict(consts)
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in PTRS:
            sig[name] = "*" + PTRS[name]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        elif name in FLOATS:
            sig[name] = "fp32"
        elif ints[name] == 1:  # the JIT turns an int argument equal to 1 into a constant
            sig[name], constexprs[name] = "constexpr", 1
        else:
            sig[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs, attrs)
    return triton.compile(src, target=TARGET, options=dict(num_warps=warps, num_stages=stages))


def _loop_body(ttgir: str) -> str:
    """Text of the outermost scf.for of the kernel (the tile loop)."""
    start = ttgir.find("scf.for")
    return ttgir[start:] if start >= 0 else ""


def report(kernel: str, cfg_name: str, shape: str) -> dict:
    cfg = m.CONFIGS[cfg_name]
    S, H, N, C, block = SHAPES[shape]
    sizes = m.tile_sizes(cfg, H // N, block)
    bq, tk = sizes["bq"], sizes["tkd" if kernel == "dkv" else "tk"]
    fn = {"fwd": m._fwd_kernel, "dq": m._bwd_dq_kernel, "dkv": m._bwd_dkv_kernel}[kernel]
    q = torch.empty((1, S, H, C), dtype=torch.bfloat16, device="meta")
    k = torch.empty((1, S, N, C), dtype=torch.bfloat16, device="meta")
    consts = m._meta(q, k, sizes, cfg, kernel)  # the launch's own constexprs
    warps, stages = consts.pop("num_warps"), consts.pop("num_stages")
    k = compile_kernel(fn, launch_ints(S, H, N, C, block, bq, tk), consts, warps, stages)
    body = _loop_body(k.asm["ttgir"])
    sc = sass_counts(k.asm["cubin"])
    rows = consts.get("QSUB", bq) * (H // N)
    return dict(
        kernel=kernel, config=cfg_name, shape=shape, M=rows, TK=tk, warps=warps,
        stages=stages, **_ptxas_counts(k.asm["ptx"]), shared=k.metadata.shared,
        async_copies=body.count("async_copy_global_to_local"),
        layout_moves=body.count("ttg.convert_layout") + len(re.findall(r"ttg\.local_alloc %", body)),
        sync_tile_loads=len(re.findall(r"tt\.load [^\n]*tensor<\d+x\d+x!tt\.ptr<bf16>", body)),
        wgmma=k.asm["ttgir"].count("warp_group_dot "), loop=sc["loop"],
        loop_ops=dict(sc["ops"].most_common(6)),
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="*", default=list(m.CONFIGS))
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--kernels", nargs="*", default=["fwd", "dq", "dkv"])
    ap.add_argument("--json", default=None, help="append one JSON line per case here")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, target sm_90")
    print(f"{'kernel':6s} {'config':9s} {'shape':6s} {'M':>4s} {'TK':>4s} {'w':>2s} {'st':>2s} {'regs':>4s} "
          f"{'spill':>9s} {'smem':>6s} {'async':>5s} {'sync':>4s} {'moves':>5s} {'loop':>5s}  "
          "loop ops")  # fmt: skip
    for shape in args.shapes:
        for cfg_name in args.configs:
            for kernel in args.kernels:
                try:
                    r = report(kernel, cfg_name, shape)
                except Exception as exc:  # one failing configuration must not hide the others
                    print(
                        f"{kernel:6s} {cfg_name:9s} {shape:6s} compile failed: {type(exc).__name__}: {exc}"[
                            :300
                        ]
                    )
                    continue
                spill = f"{r['spill_st']}/{r['spill_ld']}"
                print(f"{kernel:6s} {cfg_name:9s} {shape:6s} {r['M']:4d} {r['TK']:4d} {r['warps']:2d} "
                      f"{r['stages']:2d} {r['regs']:4d} {spill:>9s} {r['shared']:6d} {r['async_copies']:5d} "
                      f"{r['sync_tile_loads']:4d} {r['layout_moves']:5d} {r['loop']:5d}  "
                      f"{' '.join(f'{k}:{v}' for k, v in r['loop_ops'].items())}", flush=True)  # fmt: skip
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
