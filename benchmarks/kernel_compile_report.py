"""Offline sm_90 compile report of the decode kernels: registers, spills, shared memory, SASS counts.

Why: the H200 is scarce, and whether a Triton kernel spills, how much shared memory it stages and how
many instructions its hot loop issues per weight / key value can be read on a CPU machine. Each case
compiles one kernel configuration at a benchmark shape for `GPUTarget("cuda", 90, 32)` (ptxas ships
with Triton) and reads `ptxas -v`, the compiled metadata and `cuobjdump -sass`. Caveat: the H200 runs
an older Triton (3.6); compare variants compiled here, do not read the numbers as the device's SASS.

Usage: python benchmarks/kernel_compile_report.py [--only SUBSTR ...] [--json OUT.jsonl] [--ops N] [--mem]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

# Columns: regs / spill stores / spill loads (bytes) from `ptxas -v` on the generated PTX; shared =
# static + Triton-managed shared memory; sass = all SASS instructions; loop = instructions inside the
# largest backward branch (the per-tile K / page loop) with its op histogram; per_elem = loop /
# elements a thread handles per iteration (the case's `elems`); stg = decoded floating-point tiles the
# loop stages in shared memory for the dot (`staged_tiles`). pipe / blk / KB/SM (bytes in flight
# of a latency-bound loop): how the loop's loads are pipelined (TTGIR "sync" or "async xD"), programs
# resident per SM, and HBM bytes in flight per SM = programs x D x tile bytes. Cases: each indexer /
# attention cache format, NVFP4 in both decode versions, over the configurations those launches
# autotune, and the one-launch KV append; 72-byte NVFP4 row strides get no divisibility hint, as at
# run time. --mem adds the loop's memory instructions by opcode (LDG.64 / LDG.128 / LDGSTS, STS.U16 /
# STS.128, LDSM) and the register layouts of the big global loads (TTGIR): the evidence for how the
# page loads are coalesced.

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
TARGET = GPUTarget("cuda", 90, 32)
# Triton's PTX targets the newest ISA version it knows; the bundled ptxas-blackwell reads it (and
# still assembles sm_90a), the older plain ptxas may not.
_PTXAS = BIN / "ptxas-blackwell" if (BIN / "ptxas-blackwell").exists() else BIN / "ptxas"


@dataclass
class Case:
    """One kernel configuration: `ptrs` maps each pointer argument to its element type ("bf16", "u8",
    "i32", "fp32", ...); `floats` are fp32 scalars; every other non-constexpr argument is an i32."""

    name: str
    fn: object
    consts: dict
    ptrs: dict
    floats: set = field(default_factory=set)
    num_warps: int = 4
    num_stages: int = 3
    elems: int | None = None  # weight / key values one thread handles per hot-loop iteration
    divisibility: dict = field(default_factory=dict)  # stride -> 1 where not a multiple of 16 (no hint)
    tile_bytes: int | None = None  # HBM bytes one hot-loop iteration loads (for the bytes-in-flight column)


# sm_90 (H100 / H200) per-SM limits for the occupancy estimate: registers, shared memory (a block may
# use up to 227 KB; 1 KB per resident block is reserved by the driver), warps, resident blocks.
SM_REGS, SM_SMEM, SM_SMEM_RESERVED, SM_WARPS, SM_BLOCKS = 65536, 233472, 1024, 64, 32


def blocks_per_sm(regs: int, shared: int, warps: int) -> int:
    """Resident programs per SM: registers are allocated per warp in units of 8 per thread."""
    by_regs = SM_REGS // (-(-max(regs, 1) // 8) * 8 * 32 * warps)
    by_smem = SM_SMEM // (shared + SM_SMEM_RESERVED)
    return max(0, min(by_regs, by_smem, SM_WARPS // warps, SM_BLOCKS))


def compile_case(case: Case):
    fn = case.fn
    while not isinstance(fn, triton.runtime.JITFunction):  # an autotuner wraps the JITFunction
        fn = fn.fn
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in case.consts:
            sig[name] = "constexpr"
        elif name in case.ptrs:
            sig[name] = "*" + case.ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        elif name in case.floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride") and case.divisibility.get(name, 16) == 16:
                attrs[(i,)] = [["tt.divisibility", 16]]  # row strides of the benchmark shapes
    src = ASTSource(fn, sig, case.consts, attrs)
    return triton.compile(
        src, target=TARGET, options=dict(num_warps=case.num_warps, num_stages=case.num_stages)
    )


def _ptxas_counts(ptx: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        Path(path).write_text(ptx)
        proc = subprocess.run(
            [str(_PTXAS), "-v", "--gpu-name", "sm_90a", path, "-o", os.path.join(d, "k.o")],
            capture_output=True,
            text=True,
        )
    text = proc.stderr + proc.stdout
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return dict(
        regs=int(regs.group(1)) if regs else -1,
        spill_st=int(spill.group(1)) if spill else -1,
        spill_ld=int(spill.group(2)) if spill else -1,
    )


def sass_counts(cubin: bytes) -> dict:
    """Total SASS, and the largest loop's instruction count and op histogram."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        Path(path).write_bytes(cubin)
        sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", path], capture_output=True, text=True).stdout
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for addr, text in ins:
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            loops.append((int(target.group(1), 16), addr))
    ops: collections.Counter = collections.Counter()
    mem: collections.Counter = collections.Counter()  # full opcodes of the loop's memory instructions
    n_loop = 0
    if loops:
        lo, hi = max(loops, key=lambda span: span[1] - span[0])
        for addr, text in ins:
            if lo <= addr <= hi:
                n_loop += 1
                op = text.split()[1] if text.startswith("@") else text.split()[0]
                ops[op.split(".")[0]] += 1
                if op.split(".")[0] in _MEM_OPS:
                    mem[op.replace(".E.", ".").replace(".E", "").replace(".BYPASS", "")] += 1
    return dict(sass=len(ins), loop=n_loop, ops=ops, mem=mem)


# Memory instructions counted per loop iteration by full width (LDG.64 vs LDG.128, STS.U16 vs STS.128):
# global loads synchronous (LDG) or cp.async (LDGSTS), tile stores into shared, dot-operand loads.
_MEM_OPS = ("LDG", "LDGSTS", "STS", "LDS", "LDSM")


def load_layouts(ttgir: str, min_elems: int = 256) -> list[str]:
    """Register layouts of the big global loads (tt.load or cp.async, >= min_elems elements) as
    "shape x type: sizePerThread/threadsPerWarp/order": whether consecutive threads of a warp read
    consecutive bytes (the NVFP4 word loads: threads along the flat block index, not one per row)."""
    layouts = dict(re.findall(r"^#(blocked\d*) = #ttg\.blocked<\{(.*?)\}>", ttgir, re.M))
    out = []
    op = r"(?:tt\.load|async_copy_global_to_local) %[^:{]*(?:\{[^}]*\})? ?"  # cp.async may carry {contiguity}
    for shape, ty, enc in re.findall(op + r": tensor<([0-9x]+)x!tt\.ptr<(\w+)>, #(blocked\d*)>", ttgir):
        n = 1
        for d in shape.split("x"):
            n *= int(d)
        fields = dict(re.findall(r"(\w+) = \[([0-9, ]*)\]", layouts.get(enc, "")))
        text = f"{shape}x{ty}: " + "/".join(
            "[" + fields.get(k, "?").replace(" ", "") + "]"
            for k in ("sizePerThread", "threadsPerWarp", "order")
        )
        if n >= min_elems and text not in out:
            out.append(text)
    return out


def pipeline_info(ttgir: str) -> str:
    """How the hot loop's global loads reach the dot, from the TTGIR: "sync" (plain loads to
    registers, no cp.async), else "async xD" where D is the buffer depth of the largest multi-buffered
    shared allocation the software pipeliner made (1: the next tile is fetched while nothing else is
    in flight: one tile per program; 2+: that many tiles in flight)."""
    if "async_copy_global_to_local" not in ttgir:
        return "sync"
    best = (0, 1)
    for dims in re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<([0-9x]+)x[a-z]", ttgir):
        shape = [int(d) for d in dims.split("x") if d]
        size = 1
        for d in shape[1:]:
            size *= d
        best = max(best, (size, shape[0]))
    return f"async x{best[1]}"


def staged_tiles(ttgir: str) -> int:
    """Decoded floating-point tiles the hot loop writes to shared memory (TTGIR `local_alloc` of a
    register tensor after the first `scf.for`): the round trip a register-resident MMA operand avoids.
    Raw code bytes staged by cp.async are not counted (integer memdescs)."""
    loop = ttgir[ttgir.find("scf.for") :] if "scf.for" in ttgir else ""
    return len(re.findall(r"local_alloc %\S+ : \(tensor<[0-9x]+x(?:f16|bf16|f32|f8E4M3FN)", loop))


def report(case: Case, n_ops: int = 10) -> dict:
    k = compile_case(case)
    row = dict(
        name=case.name,
        warps=case.num_warps,
        stages=case.num_stages,
        **_ptxas_counts(k.asm["ptx"]),
        shared=k.metadata.shared,
        pipe=pipeline_info(k.asm["ttgir"]),
        staged=staged_tiles(k.asm["ttgir"]),
    )
    sc = sass_counts(k.asm["cubin"])
    row.update(sass=sc["sass"], loop=sc["loop"], loop_mem=dict(sorted(sc["mem"].items())))
    row["load_layouts"] = load_layouts(k.asm["ttgir"])
    row["blocks_sm"] = blocks_per_sm(row["regs"], row["shared"], case.num_warps)
    if case.tile_bytes:
        # Tiles in flight per program: the pipeliner's buffer depth (a sync loop: the one being loaded).
        depth = int(row["pipe"].split("x")[-1]) if row["pipe"].startswith("async") else 1
        row["inflight_kb"] = round(row["blocks_sm"] * depth * case.tile_bytes / 1024, 1)
    if case.elems:
        row["per_elem"] = round(sc["loop"] / case.elems, 2)
    row["loop_ops"] = dict(sc["ops"].most_common(n_ops))
    return row


# ------------------------------------------------------------------------------------------ cases
def gemv_cases() -> list[Case]:
    """6144 x 6144 W4A16 GEMV: v3 split-K FMA configs (rows 1 / 4) and the v2 tile kernel (LINEAR)."""
    from model.kernels import triton_gemv as m

    out = []
    ptrs = dict(
        x_ptr="bf16", w_ptr="i32", s_ptr="u8", sc2_ptr="fp32", out_ptr="bf16", part_ptr="fp32", cnt_ptr="i32"
    )
    for cfg in m._GEMV_CONFIGS:
        for mr in (1, 4):
            kw = cfg.kwargs
            out.append(
                Case(
                    f"gemv v3 fma MR={mr} BN={kw['BN']} BK={kw['BK']} SPLIT_K={kw['SPLIT_K']}",
                    m._w4a16_gemv_kernel,
                    {"MR": mr, "HW": True, **kw},
                    ptrs,
                    num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages,
                    elems=kw["BN"] * kw["BK"] // (32 * cfg.num_warps),
                    tile_bytes=kw["BN"] * kw["BK"] * 9 // 16,
                )
            )
    out += tile_cases(linear=True)
    return out


def tile_cases(linear: bool) -> list[Case]:
    from model.kernels import triton_moe as m

    ptrs = dict(
        x_ptr="bf16",
        rows_ptr="i32",
        block_expert_ptr="i32",
        router_w_ptr="fp32",
        wa_ptr="i32",
        sa_ptr="u8",
        sc2a_ptr="fp32",
        wb_ptr="i32",
        sb_ptr="u8",
        sc2b_ptr="fp32",
        out_ptr="bf16" if linear else "fp32",
    )
    out = []
    modes = (
        [("linear", False, False, True)]
        if linear
        else [("glu", True, True, False), ("down", False, False, False)]
    )
    for cfg in m._TUNED_CONFIGS:
        kw = cfg.kwargs
        for label, glu, gather, lin in modes:
            consts = dict(
                TOPK=1 if lin else 4, BM=m.BM, FUSE_GLU=glu, GATHER_X=gather, LINEAR=lin, HW=True, **kw
            )
            if not lin and not glu:
                ptrs = {**ptrs, "x_ptr": "bf16", "out_ptr": "fp32"}
            out.append(
                Case(
                    f"{'gemv v2 tile' if lin else 'moe ' + label} BN={kw['BN']} BK={kw['BK']} "
                    f"planes={kw['PLANES']}",
                    m._nvfp4_moe_kernel,
                    consts,
                    ptrs,
                    floats={"swiglu_alpha", "swiglu_limit"},
                    num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages,
                    elems=kw["BN"] * kw["BK"] * (2 if glu else 1) // (32 * cfg.num_warps),
                )
            )
    return out


def indexer_cases() -> list[Case]:
    """Indexer scores kernel, M3.1 shapes (4 index heads padded to 16 rows, C = 128, 128-token pages)."""
    from model.kernels import triton_indexer as ix

    out = []
    for fmt, label, tuned in (
        (2, "nvfp4 v2", False),
        (1, "fp8", True),
        (0, "bf16", True),
    ):
        ptrs = dict(q_ptr="bf16", pages_ptr="bf16" if fmt == 0 else "u8", bt_ptr="i32", seq_ptr="i32",
                    pos_ptr="i64", scale_ptr="fp32", out_ptr="fp32")  # fmt: skip
        consts = dict(N=4, N_P2=16, C=128, PAGE=128, FMT=fmt, DOT_F32=False, HW=True)
        # elems: key values per thread per page (128 keys x 128 dims over the threads). NVFP4 rows are
        # 72 bytes: Triton gets no divisibility hint for their stride (not a multiple of 16).
        div = {"stride_ps": 1} if fmt == 2 else {}
        configs = ix._index_scores_tuned.configs if tuned else [triton.Config({}, num_warps=4, num_stages=3)]
        for cfg in configs:  # FP8 / bf16 launches are tuned over these; v2 runs the default
            w, st = cfg.num_warps, cfg.num_stages
            out.append(Case(f"indexer {label}", ix._index_scores_kernel, consts, ptrs, num_warps=w,
                            num_stages=st, elems=128 * 128 // (32 * w), divisibility=div,
                            tile_bytes=128 * (72, 128, 256)[2 - fmt]))  # fmt: skip
    # NVFP4 keys of head dim 128 take the CUDA kernel of model/kernels/cuda_indexer.py on a GPU.
    return out


def attention_cases() -> list[Case]:
    """Sparse attention decode kernel, M3.1 shapes (G = 16 heads per KV head, C = 128, 128-token
    pages), every autotune configuration of each cache format and version."""
    from model.kernels import triton_sparse_attention as sa

    out = []
    for fmt, label in ((2, "nvfp4 v2"), (1, "fp8"), (0, "bf16")):
        ptrs = dict(q_ptr="bf16", kv_ptr="bf16" if fmt == 0 else "u8", bt_ptr="i32", seq_ptr="i32",
                    pos_ptr="i64", sel_ptr="i64", kscale_ptr="fp32", vscale_ptr="fp32", out_ptr="bf16",
                    part_ptr="fp32", ml_ptr="fp32")  # fmt: skip
        for cfg in sa._sparse_attn_tuned.configs:
            consts = dict(G=16, G_P2=16, C=128, PAGE=128, FMT=fmt, FP8_DOT=fmt != 0, DENSE=False,
                          IS_SPLIT=True, HW=True, **cfg.kwargs)  # fmt: skip
            sub = cfg.kwargs["SUB"]
            # elems: K plus V values per thread per SUB-token step; NVFP4 rows are 72 bytes (no hint).
            div = {"stride_ks": 1} if fmt == 2 else {}
            out.append(Case(f"attention {label} SUB={sub}", sa._sparse_attn_kernel, consts, ptrs,
                            floats={"sm_scale_log2"}, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                            elems=2 * sub * 128 // (32 * cfg.num_warps), divisibility=div,
                            tile_bytes=2 * sub * (72, 128, 256)[2 - fmt]))  # fmt: skip
    # v6: K and V as dot operands decoded in registers (V6_CONFIGS: sub-tile keys, warps, stages); the
    # packed 72-byte row stride is a constexpr of the kernel.
    ptrs = dict(q_ptr="bf16", kv_ptr="u8", bt_ptr="i32", seq_ptr="i32", pos_ptr="i64", sel_ptr="i64",
                kscale_ptr="fp32", vscale_ptr="fp32", out_ptr="bf16", part_ptr="fp32",
                ml_ptr="fp32")  # fmt: skip
    consts = dict(G=16, G_P2=16, C=128, PAGE=128, DENSE=False, IS_SPLIT=True, HW=True)
    for sub, w, st, _ in sa.V6_CONFIGS:  # register caps are not modelled here
        out.append(Case(f"attention nvfp4 v6 SUB={sub}", sa._sparse_attn_v6_kernel, {**consts, "SUB": sub},
                        ptrs, floats={"sm_scale_log2"}, num_warps=w, num_stages=st,
                        elems=2 * sub * 128 // (32 * w), tile_bytes=2 * sub * 72))  # fmt: skip
    return out


def append_cases() -> list[Case]:
    """The one-launch KV append (K, V and the index key of a layer), M3.1 rows (C = Ci = 128, 4 KV
    heads, 128-token pages), per K/V x index format the engine uses: no loop, so the columns that
    matter are registers and spills. NVFP4 rows are 72 bytes: their stride gets no divisibility hint."""
    from model.kernels import triton_kv_append as ka

    fmts = {"fp32": (0, "fp32"), "bf16": (1, "bf16"), "fp8": (2, "u8"), "nvfp4": (3, "u8")}
    out = []
    for kv, index in (("nvfp4", "bf16"), ("nvfp4", "nvfp4"), ("nvfp4", "fp8"), ("nvfp4", None),
                      ("bf16", "bf16"), ("fp8", "fp8")):  # fmt: skip
        i_fmt, i_elem = fmts[index or kv]  # an absent part's constexprs copy the other's (as the wrapper)
        ptrs = dict(slot_ptr="i64", k_ptr="bf16", v_ptr="bf16", k_scale_ptr="fp32", v_scale_ptr="fp32",
                    kv_ptr=fmts[kv][1], i_ptr="bf16", i_scale_ptr="fp32", idx_ptr=i_elem)  # fmt: skip
        consts = dict(KV_ROWS=8, HAS_INDEX=index is not None, C=128, C_P2=128, KV_FMT=fmts[kv][0], CI=128,
                      CI_P2=128, I_FMT=i_fmt, HW=True)  # fmt: skip
        div = {"stride_kvo": 1 if kv == "nvfp4" else 16, "stride_io": 1 if index == "nvfp4" else 16}
        out.append(Case(f"kv append K/V {kv} + index {index}", ka._kv_append_kernel, consts, ptrs,
                        divisibility=div))  # fmt: skip
    return out


def moe_glue_cases() -> list[Case]:
    """The MoE block's fused glue at M3 / small / tiny shapes: router epilogue (E experts, top-K, the
    wrapper's rows per program), swigluoai (bf16 and fp32) and the slot-sum combine (K = 4 with the
    shared-expert add, K = 8 without)."""
    from model.kernels import triton_moe_combine as mc
    from model.kernels import triton_router as rt
    from model.kernels import triton_swiglu as sw

    out = []
    for E, K in ((8, 2), (32, 4), (128, 4), (128, 8), (256, 8)):
        e_p2, k_p2 = triton.next_power_of_2(E), triton.next_power_of_2(K)
        consts = dict(E=E, E_P2=e_p2, K=K, K_P2=k_p2, ROWS=max(1, rt.ROW_ELEMENTS // e_p2), HW=True)
        ptrs = dict(logits_ptr="fp32", bias_ptr="fp32", ids_ptr="i64", w_ptr="fp32")
        out.append(Case(f"router topk E={E} K={K}", rt._router_topk_kernel, consts, ptrs, floats={"scale"}))
    for dt, is_bf16 in (("bf16", True), ("fp32", False)):
        ptrs = dict(gate_ptr=dt, up_ptr=dt, out_ptr=dt)
        consts = dict(IS_BF16=is_bf16, HW=True, BLOCK=sw.BLOCK)
        out.append(Case(f"swigluoai {dt}", sw._swigluoai_kernel, consts, ptrs, floats={"alpha", "limit"}))
    for K, shared in ((4, True), (8, False)):
        ptrs = dict(y_ptr="fp32", shared_ptr="bf16", out_ptr="bf16")
        out.append(Case(f"moe combine K={K} shared={shared}", mc._moe_combine_kernel,
                        dict(K=K, HAS_SHARED=shared, HW=True, BLOCK=mc.BLOCK), ptrs))  # fmt: skip
    return out


GROUPS = {
    "gemv": gemv_cases,
    "moe": lambda: tile_cases(linear=False),
    "indexer": indexer_cases,
    "attention": attention_cases,
    "append": append_cases,
    "moe_glue": moe_glue_cases,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", nargs="*", default=list(GROUPS), help=f"subset of {list(GROUPS)}")
    ap.add_argument("--only", nargs="*", default=None, help="keep cases whose name contains any of these")
    ap.add_argument("--json", default=None, help="append one JSON line per case here")
    ap.add_argument("--ops", type=int, default=8, help="loop ops to show per case")
    ap.add_argument("--mem", action="store_true", help="also print loop memory ops by width + load layouts")
    args = ap.parse_args()
    print(
        f"triton {triton.__version__}, target sm_90; per_elem = loop SASS / values per thread per iteration"
    )
    print(
        f"{'case':58s} {'w':>2s} {'st':>2s} {'regs':>4s} {'spill':>9s} {'smem':>6s} {'sass':>5s} "
        f"{'loop':>5s} {'/elem':>6s} {'pipe':>8s} {'stg':>3s} {'blk':>3s} {'KB/SM':>5s}  loop ops"
    )
    for group in args.groups:
        for case in GROUPS[group]():
            if args.only and not any(s in case.name for s in args.only):
                continue
            try:
                row = report(case, args.ops)
            except Exception as exc:  # one failing configuration must not hide the others
                print(f"{case.name:58s} compile failed: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            spill = f"{row['spill_st']}/{row['spill_ld']}"
            print(
                f"{row['name']:58s} {row['warps']:2d} {row['stages']:2d} {row['regs']:4d} {spill:>9s} "
                f"{row['shared']:6d} {row['sass']:5d} {row['loop']:5d} {row.get('per_elem', ''):>6} "
                f"{row['pipe']:>8s} {row['staged']:3d} "
                f"{row['blocks_sm']:3d} {row.get('inflight_kb', ''):>5}  "
                f"{' '.join(f'{k}:{v}' for k, v in row['loop_ops'].items())}",
                flush=True,
            )
            if args.mem:
                mem = " ".join(f"{k}:{v}" for k, v in row["loop_mem"].items())
                print(f"{'':4s}loop memory ops: {mem}; loads (sizePerThread/threadsPerWarp/order): "
                      f"{'; '.join(row['load_layouts'])}")  # fmt: skip
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
