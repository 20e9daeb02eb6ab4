"""v7 CUDA NVFP4 W4A16 GEMV (model/kernels/cuda_gemv.py + cuda_gemv.cu).

CPU: an emulation of each lane written from the kernel's index arithmetic: its cp.async copies
(global byte offset -> stage offset) and its shared reads (stage offset -> registers), then the
kernel's integer decode, byte permutes, the PTX ISA fragment layouts of mma.m16n8k16 and the chunk's
k map (tests/model/mma_layouts.py; the map is cuda_moe.cu's, checked in test_cuda_moe.py), the chunk
schedule over splits and warps, and the epilogue's row / feature map. It checks that the copies move
every code and scale byte exactly once (16-byte aligned sources, whole 32-byte sectors per lane pair),
that no two copies or reads of a stage collide, that the shared accesses are bank-conflict free, that
the decoded A fragments are `nvfp4.dequantize` exactly (every code; zero, subnormal and 448 scales)
and that the emulated kernel gives x @ W.T.
GPU (-m gpu): `nvfp4_gemv_cuda` against the exact fp64 product and `nvfp4_linear_ref` with a bound
derived per element, m = 1..16 and beyond, real (6144 x 6144, 2048 x 6144, 6144 x 2048) and small
shapes, poisoned outputs, split counters back at 0, CUDA-graph capture and replay, determinism,
rows independent of m, bf16 / fp16 / fp32 outputs, subnormal scales, the nvfp4_linear dispatch.
"""

import struct
from collections import Counter

import pytest
import torch

from model import nvfp4
from model.kernels.cuda_gemv import (
    WARPS,
    gemv_supported,
    last_reduction,
    n_tiles,
    nvfp4_gemv_cuda,
    random_nvfp4,
    split_k,
)
from tests.model.mma_layouts import (
    a_row_col,
    b_fragments,
    b_row_col,
    byte_perm,
    c_row_col,
    decode_a,
    kappa_to_k,
    scale_x2119,
    special_weights,
)

# Mirrors of cuda_gemv.cu: a stage is codes [MT][16 rows][32 B], scales [64 rows][4 B], x [NT][8][128 B].
MT = 4
W_BYTES, S_BYTES = 2048, 256
X_OFF = W_BYTES + S_BYTES


def stage_bytes(nt: int) -> int:
    return X_OFF + nt * 1024


# ------------------------------------------------------------------------------- the kernel's maps
def chunk_schedule(kc: int, split: int) -> dict[tuple[int, int], list[int]]:
    """(split y, warp w) -> its chunks in order, as the kernel computes them (per_split, c_first, n_mine)."""
    per_split = -(-kc // split)
    out = {}
    for y in range(split):
        for w in range(WARPS):
            c_first, c_end = y * per_split + w, min(kc, (y + 1) * per_split)
            n_mine = -(-(c_end - c_first) // WARPS) if c_first < c_end else 0
            out[y, w] = [c_first + WARPS * i for i in range(n_mine)]
    return out


def copy_instructions(K: int, m: int, nt: int, row0: int, c: int) -> list[list[tuple]]:
    """One warp's cp.async instructions for chunk c of the CTA at rows row0.. (issue_chunk): per
    instruction, per lane (source tensor, source byte offset or None for a zero fill, stage offset,
    bytes). x offsets are into x as contiguous bf16 [m, K]."""
    ins = []
    lanes = range(32)
    for tt in range(MT):
        src = [(row0 + 16 * tt + ln // 2) * (K // 2) + 32 * c + 16 * (ln & 1) for ln in lanes]
        ins.append([("w", src[ln], tt * 512 + 16 * ln, 16) for ln in lanes])
    for half in range(2):
        ins.append([("s", (row0 + ln + 32 * half) * (K // 16) + 4 * c, W_BYTES + 4 * (ln + 32 * half), 4)
                    for ln in lanes])  # fmt: skip
    for j in range(nt):
        for h in range(2):
            lane_copies = []
            for ln in lanes:
                g, t = ln // 4, ln % 4
                r = 8 * j + g
                src = 2 * (r * K + 64 * c + 16 * t + 8 * h) if r < m else None
                lane_copies.append(("x", src, X_OFF + 1024 * j + 128 * g + 16 * ((2 * t + h) ^ (g & 1)), 16))
            ins.append(lane_copies)
    return ins


def read_instructions(nt: int) -> dict[tuple, tuple[list[int], int]]:
    """The shared loads of compute_chunk: name -> (stage offset per lane, bytes per lane)."""
    gs, ts = [ln // 4 for ln in range(32)], [ln % 4 for ln in range(32)]
    reads = {}
    for j in range(nt):
        for h in range(2):
            slots = [(2 * t + h) ^ (g & 1) for g, t in zip(gs, ts, strict=True)]
            reads["x", j, h] = (
                [X_OFF + 1024 * j + 128 * g + 16 * s for g, s in zip(gs, slots, strict=True)],
                16,
            )
    for tt in range(MT):
        rows = [tt * 512 + 32 * g + 8 * t for g, t in zip(gs, ts, strict=True)]
        reads["w", tt, 0] = (rows, 8)
        reads["w", tt, 1] = ([r + 256 for r in rows], 8)
        reads["s", tt, 0] = ([W_BYTES + 4 * (16 * tt + g) for g in gs], 4)
        reads["s", tt, 1] = ([W_BYTES + 4 * (16 * tt + g + 8) for g in gs], 4)
    return reads


def wavefronts(offsets: list[int], width: int) -> int:
    """Shared-memory wavefronts of one warp access of `width` bytes per lane: lanes in groups of
    128 / width; a group costs the largest number of distinct 4-byte words in one bank (a word read
    by several lanes is one broadcast)."""
    per, total = 128 // width, 0
    for g0 in range(0, 32, per):
        words = {(o + b) // 4 for o in offsets[g0 : g0 + per] for b in range(0, width, 4)}
        total += max(Counter(w % 32 for w in words).values())
    return total


# ------------------------------------------------------------------------------- lane emulation
def bf16(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def fill_stage(
    packed: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, nt: int, row0: int, c: int
) -> bytes:
    """A warp's stage after its copies of chunk c (zero fills for rows past m)."""
    m, K = x.shape
    src = {
        "w": packed.reshape(-1).numpy().tobytes(),
        "s": scales.view(torch.uint8).reshape(-1).numpy().tobytes(),
        "x": x.contiguous().view(torch.int16).numpy().tobytes(),
    }
    stage = bytearray(stage_bytes(nt))
    for ins in copy_instructions(K, m, nt, row0, c):
        for kind, off, dst, n in ins:
            stage[dst : dst + n] = bytes(n) if off is None else src[kind][off : off + n]
    return bytes(stage)


def lane_registers(stage: bytes, nt: int, lane: int):
    """compute_chunk's registers of one lane: B (xb[j][0..7], 32-bit ints) and per tile the A
    registers of the 4 steps (`decode_a`: fp64 values)."""
    t = lane % 4
    reads = read_instructions(nt)

    def word(off: int) -> int:
        return int.from_bytes(stage[off : off + 4], "little")

    xb = []
    for j in range(nt):
        xw = [word(reads["x", j, h][0][lane] + 4 * i) for h in range(2) for i in range(4)]
        xb.append([reg for regs in b_fragments(xw) for reg in regs])
    a = []
    sel = t | ((t + 4) << 4)
    for tt in range(MT):
        wg = [word(reads["w", tt, 0][0][lane] + 4 * i) for i in range(2)]
        wg8 = [word(reads["w", tt, 1][0][lane] + 4 * i) for i in range(2)]
        pair = byte_perm(word(reads["s", tt, 0][0][lane]), word(reads["s", tt, 1][0][lane]), sel)
        s_g, s_g8 = (scale_x2119(torch.tensor(b)) for b in (pair & 0xFF, (pair >> 8) & 0xFF))  # scale_splats
        qg, qg8 = torch.tensor(wg), torch.tensor(wg8)
        a.append(
            [decode_a(qg[i >> 1] >> (8 * (i & 1)), qg8[i >> 1] >> (8 * (i & 1)), s_g, s_g8) for i in range(4)]
        )
    return xb, a


def emulate_weights(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Every lane's decoded A registers placed through the PTX A layout and kappa_to_k: fp64 [N, K] =
    e2m1 * s (the kernel's value times its 2^7)."""
    N, K = packed.shape[0], 2 * packed.shape[1]
    W = torch.full((N, K), float("nan"), dtype=torch.float64)
    x = torch.zeros(1, K, dtype=torch.bfloat16)
    for row0 in range(0, N, 64):
        for c in range(K // 64):
            stage = fill_stage(packed, scales, x, 1, row0, c)
            for lane in range(32):
                g, t = lane // 4, lane % 4
                _, a = lane_registers(stage, 1, lane)
                for tt in range(MT):
                    for step in range(4):
                        for n in range(4):
                            for h in range(2):
                                r, kappa = a_row_col(2 * n + h, g, t)
                                k = 64 * c + kappa_to_k(kappa, step, t)
                                W[row0 + 16 * tt + r, k] = a[tt][step][n][h] * 2.0**7
    return W


def emulate_gemv(packed: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, split: int) -> torch.Tensor:
    """The kernel in fp64: every (CTA, split, warp) runs its chunk schedule through the lanes' B and A
    registers and the MMA layouts; C fragments summed over warps and splits, the epilogue's row /
    feature map writes y [m, N] (NaN where nothing was written). scale_2 = 1."""
    m, K = x.shape
    N = packed.shape[0]
    nt = n_tiles(m)
    y = torch.full((m, N), float("nan"), dtype=torch.float64)
    for row0 in range(0, N, 64):
        acc = torch.zeros(MT, nt, 32, 4, dtype=torch.float64)  # [tile, n-tile, lane, c_r]
        for chunks in chunk_schedule(K // 64, split).values():
            for c in chunks:
                stage = fill_stage(packed, scales, x, nt, row0, c)
                regs = [lane_registers(stage, nt, lane) for lane in range(32)]
                for tt in range(MT):
                    for j in range(nt):
                        for step in range(4):
                            A = torch.full((16, 16), float("nan"), dtype=torch.float64)
                            B = torch.full((16, 8), float("nan"), dtype=torch.float64)
                            for lane, (xb, a) in enumerate(regs):
                                g, t = lane // 4, lane % 4
                                for i in range(8):
                                    A[a_row_col(i, g, t)] = a[tt][step][i >> 1][i & 1]
                                for i in range(4):
                                    B[b_row_col(i, g, t)] = bf16(xb[j][2 * step + (i >> 1)] >> (16 * (i & 1)))
                            assert not (A.isnan().any() or B.isnan().any()), (
                                "a fragment element never written"
                            )
                            D = A @ B
                            for lane in range(32):
                                for r in range(4):
                                    acc[tt, j, lane, r] += D[c_row_col(r, lane // 4, lane % 4)]
        for tt in range(MT):  # after the warp reduction thread (warp tt, lane) owns tile tt
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for i in range(4 * nt):
                    row = 8 * (i >> 2) + 2 * t + (i & 1)
                    if row < m:
                        y[row, row0 + 16 * tt + g + 8 * ((i >> 1) & 1)] = (
                            acc[tt, i >> 2, lane, i & 3] * 2.0**7
                        )
    return y


# ------------------------------------------------------------------------------------------ CPU
@pytest.mark.parametrize("kc, split", [(96, 4), (96, 12), (32, 4), (9, 4), (2, 1), (10, 3)])
def test_chunk_schedule_gives_every_chunk_to_one_warp_of_its_split(kc, split):
    per_split = -(-kc // split)
    seen = Counter()
    for (y, _), chunks in chunk_schedule(kc, split).items():
        assert all(y * per_split <= c < min(kc, (y + 1) * per_split) for c in chunks)
        seen.update(chunks)
    assert seen == Counter(range(kc))


@pytest.mark.parametrize("m", [1, 3, 8, 13, 16, 32])
def test_copies_move_every_weight_byte_once_in_whole_sectors_and_never_collide(m):
    N, K = 128, 384
    nt = n_tiles(m)
    hits = {"w": Counter(), "s": Counter(), "x": Counter()}
    for row0 in range(0, N, 64):
        for c in range(K // 64):
            written = Counter()
            for ins in copy_instructions(K, m, nt, row0, c):
                for kind, off, dst, n in ins:
                    assert dst % n == 0 and (off is None or off % n == 0), "cp.async needs aligned addresses"
                    written.update(range(dst, dst + n))
                    if off is not None:
                        hits[kind].update(range(off, off + n))
                # whole 32-byte sectors: lanes 2p, 2p + 1 of a code copy read one aligned sector
                if ins[0][0] == "w":
                    assert all(
                        ins[2 * p][1] % 32 == 0 and ins[2 * p + 1][1] == ins[2 * p][1] + 16 for p in range(16)
                    )
            assert written == Counter(range(stage_bytes(nt))), "every stage byte written exactly once"
    assert hits["w"] == Counter(range(N * K // 2)) and hits["s"] == Counter(range(N * K // 16))
    # x: each valid row's bytes once per CTA (it is re-read by every column group)
    assert hits["x"] == Counter({b: N // 64 for b in range(2 * m * K)})


@pytest.mark.parametrize("nt", [1, 2, 4])
def test_shared_reads_and_copies_are_bank_conflict_free(nt):
    for offsets, width in read_instructions(nt).values():
        assert wavefronts(offsets, width) == max(1, 32 * width // 128)
    for ins in copy_instructions(256, 8 * nt, nt, 0, 0):
        offsets, width = [dst for _, _, dst, _ in ins], ins[0][3]
        assert wavefronts(offsets, width) == max(1, 32 * width // 128)


def test_lane_decode_from_the_stages_reproduces_dequantize_exactly():
    """Every code with zero, subnormal and 448 scales: the A fragments decoded from the emulated stages
    are e2m1 * s exactly (nvfp4.dequantize with scale_2 = 1)."""
    packed, scales = special_weights((128,), 128, torch.Generator().manual_seed(1))
    assert {0, 1, 7, 0x7E} <= set(scales.view(torch.uint8).unique().tolist())
    want = nvfp4.dequantize(nvfp4.NVFP4Tensor(packed, scales, torch.tensor(1.0)), torch.float32).double()
    assert torch.equal(emulate_weights(packed, scales), want)


@pytest.mark.parametrize("m, split", [(1, 1), (5, 2), (13, 3)])
def test_emulated_kernel_equals_the_matrix_product(m, split):
    """Copies, reads, decode, MMA layouts, schedule and epilogue together give x @ W.T (fp64; every
    output of the m rows written)."""
    N, K = 64, 384
    packed, scales = special_weights((N,), K, torch.Generator().manual_seed(2 + m))
    gen = torch.Generator().manual_seed(m)
    x = (torch.randn(m, K, generator=gen) * 3).to(torch.bfloat16)
    W = nvfp4.dequantize(nvfp4.NVFP4Tensor(packed, scales, torch.tensor(1.0)), torch.float32).double()
    got = emulate_gemv(packed, scales, x, split)
    assert not got.isnan().any(), "an output was never written"
    torch.testing.assert_close(got, x.double() @ W.T, rtol=1e-12, atol=1e-9)


def test_split_heuristic_fills_one_wave_and_keeps_two_chunks_per_warp():
    assert split_k(6144, 6144, 1, 132) == 4  # 96 groups x 4 = 384 CTAs <= 3 x 132
    assert split_k(6144, 6144, 16, 132) == 4  # same split for m <= 16: rows independent of m
    assert split_k(2048, 6144, 1, 132) == 12 and split_k(6144, 2048, 1, 132) == 4
    assert split_k(6144, 6144, 32, 132) == 2  # NT = 4: 2 CTAs per SM
    assert split_k(64, 128, 1, 132) == 1  # fewer than 2 chunks per warp: no split
    for N, K, m in [(6144, 6144, 1), (2048, 6144, 16), (6144, 2048, 8), (4096, 14336, 3)]:
        s = split_k(N, K, m, 132)
        assert (N // 64) * s <= 3 * 132 and (K // 64) // s >= 2 * WARPS


def test_cpu_tensors_are_rejected_and_not_supported():
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    packed = torch.zeros(64, 64, dtype=torch.uint8)
    scales = torch.zeros(64, 8, dtype=torch.float8_e4m3fn)
    assert not gemv_supported(x, packed, scales)
    with pytest.raises(ValueError, match="CUDA bf16"):
        nvfp4_gemv_cuda(x, packed, scales, torch.tensor(1.0))
    with pytest.raises(ValueError, match="reduce must be one of"):
        nvfp4_gemv_cuda(x, packed, scales, torch.tensor(1.0), reduce="atomic")


# ------------------------------------------------------------------------------------------ GPU
def accumulation_bound(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |fp32 kernel sum - exact product| (fp64 [m, N]), for x [m, K] and the exact
    weights W [N, K]: every product x * w is exact (decoded weights are exact bf16), each of the K / 16
    MMA steps adds its 16 products to the accumulator with an error of at most 2 ulps (2^-22 relative,
    a truncating add) of a partial sum whose size is at most a = |x| @ |W|.T, and the 3 warp and <= 16
    split additions and the epilogue multiply add one more each: (K / 8 + 32) * 2^-23 * a."""
    a = x.double().abs() @ W.double().abs().T
    return (x.shape[1] / 8 + 32) * 2.0**-23 * a + 1e-30


def _check_gemv(x, w, label, out_dtype=torch.bfloat16, reduce="ticket"):
    """Poisoned outputs all written; split counters back at 0; fp32 output within
    `accumulation_bound` of the exact product; the out_dtype output is exactly that fp32 sum rounded
    once (same shape, same split: the same sums); vs `nvfp4_linear_ref` (bf16 weights, bf16 matmul) at
    most 1% of max |y|: two bf16 output roundings (2^-9 |y| each) and the reference's bf16 weight
    rounding (2^-9 per weight, random signs: ~2^-9 of |y|'s rms per output) stay below ~0.6%."""
    from model.kernels.cuda_common import split_counters
    from model.kernels.nvfp4_linear import nvfp4_linear_ref

    outs = {}
    for dtype in {torch.float32, out_dtype}:
        out = torch.full((x.shape[0], w[0].shape[0]), float("nan"), dtype=dtype, device=x.device)
        outs[dtype] = nvfp4_gemv_cuda(x, *w, dtype, out_MN=out, reduce=reduce)
        assert torch.isfinite(out).all(), f"{label}: {int((~torch.isfinite(out)).sum())} outputs not written"
        assert int(split_counters(x.device, 1).abs().sum()) == 0, f"{label}: split counters not back at 0"
    got32, got = outs[torch.float32], outs[out_dtype]
    assert torch.equal(got, got32.to(out_dtype)), f"{label}: {out_dtype} output is not the fp32 sum rounded"
    W = nvfp4.dequantize(nvfp4.NVFP4Tensor(*w), torch.float32).double()
    exact = x.double() @ W.T
    excess = ((got32.double() - exact).abs() / accumulation_bound(x, W)).max().item()
    assert excess <= 1, f"{label}: fp32 result vs exact product at {excess:.2f}x the accumulation bound"
    err = (got.double() - nvfp4_linear_ref(x, *w).double()).abs().max().item()
    assert err <= 0.01 * exact.abs().max().item(), (
        f"{label}: vs nvfp4_linear_ref {err} (max |y| {exact.abs().max()})"
    )
    return got


def _x(m, K, seed, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, K, generator=gen) * scale).to(torch.bfloat16).cuda()


@pytest.mark.parametrize("m", [*range(1, 17), 24, 40, 64])
@pytest.mark.parametrize("N, K", [(64, 128), (192, 640), (128, 2048)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_small_shapes_match_exact_product_and_reference(N, K, m):
    _check_gemv(_x(m, K, m), random_nvfp4(N, K, "cuda", seed=N + m), f"{N}x{K} m={m}")


@pytest.mark.parametrize("m", [1, 3, 8, 13, 16])
@pytest.mark.parametrize("N, K", [(6144, 6144), (2048, 6144), (6144, 2048)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_shapes_match_exact_product_and_reference(N, K, m):
    _check_gemv(_x(m, K, m), random_nvfp4(N, K, "cuda", seed=m), f"{N}x{K} m={m}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_subnormal_and_zero_scales_survive_and_outputs_in_every_dtype():
    """A flushed bf16 subnormal (the e2m1 0.5 code, e4m3 subnormal scales) would be far off the bound."""
    w = random_nvfp4(256, 1024, "cuda", seed=3, special=True)
    x = _x(5, 1024, 4)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        _check_gemv(x, w, f"special {dtype}", out_dtype=dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_strided_and_unaligned_x_equal_the_contiguous_result():
    w = random_nvfp4(128, 512, "cuda", seed=5)
    base = _x(4, 520, 6)
    want = nvfp4_gemv_cuda(base[:, :512].contiguous(), *w)
    assert torch.equal(nvfp4_gemv_cuda(base[:, :512], *w), want)  # row stride 520: 16-byte aligned rows
    assert torch.equal(nvfp4_gemv_cuda(base[:, 1:513], *w), nvfp4_gemv_cuda(base[:, 1:513].contiguous(), *w))


@pytest.mark.parametrize("reduce", ["ticket", "cluster"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rows_do_not_depend_on_m_and_calls_are_deterministic(reduce):
    """m <= 16 uses one split for the shape and each MMA column is its own dot product: row r of an
    m-row call equals the one-row call of that row, bit for bit (where both ran the same split: the
    cluster path may fit fewer splits at 16 rows, whose CTAs take more shared memory); repeated calls
    are equal."""
    w = random_nvfp4(6144, 6144, "cuda", seed=7)
    x = _x(16, 6144, 8)
    full = nvfp4_gemv_cuda(x, *w, reduce=reduce)
    ran_full = last_reduction()
    assert torch.equal(nvfp4_gemv_cuda(x, *w, reduce=reduce), full), "two calls differ"
    for m in (1, 3, 9, 13):
        got = nvfp4_gemv_cuda(x[:m], *w, reduce=reduce)
        if last_reduction() == ran_full:
            assert torch.equal(got, full[:m]), f"m={m} rows differ from m=16 ({ran_full})"
        else:
            assert reduce == "cluster", f"m={m}: {last_reduction()} vs {ran_full} at m=16"


@pytest.mark.parametrize("N, K", [(6144, 6144), (6144, 2048), (2048, 6144), (128, 2048)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cluster_reduction_matches_and_equals_tickets_at_the_same_split(N, K):
    """The cluster path sums the same partials in the same order as the ticket path: at the same split
    the bits are equal (where the clusters fit; else the launch took the ticket path itself)."""
    w = random_nvfp4(N, K, "cuda", seed=17)
    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m in (1, 13):
        x = _x(m, K, 18 + m)
        got = _check_gemv(x, w, f"cluster {N}x{K} m={m}", reduce="cluster")
        ran = last_reduction()
        assert ran == "none" or ran.split()[0] in ("cluster", "ticket"), ran
        if ran == f"cluster {split_k(N, K, m, n_sms)}":
            assert torch.equal(got, nvfp4_gemv_cuda(x, *w).double()), f"m={m}: cluster and ticket sums differ"


@pytest.mark.parametrize("reduce", ["ticket", "cluster"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_equals_eager_and_leaves_counters_at_zero(reduce):
    from model.kernels.cuda_common import split_counters

    w = random_nvfp4(6144, 6144, "cuda", seed=9)
    for m in (1, 13, 40):
        x = _x(m, 6144, 10 + m)
        nvfp4_gemv_cuda(x, *w, reduce=reduce)  # warm-up: compile, counters, cluster occupancy
        out = torch.empty(m, 6144, dtype=torch.bfloat16, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            nvfp4_gemv_cuda(x, *w, out_MN=out, reduce=reduce)
        x.copy_(_x(m, 6144, 20 + m))
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, nvfp4_gemv_cuda(x, *w, reduce=reduce)), (
            f"m={m}: graph replay differs from eager"
        )
        assert int(split_counters(x.device, 1).abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nvfp4_linear_v7_dispatches_here_and_falls_back_elsewhere():
    from model.kernels.nvfp4_linear import nvfp4_linear

    w = random_nvfp4(256, 512, "cuda", seed=11)
    for m in (1, 16, 64):
        x = _x(m, 512, 12)
        with torch.inference_mode():
            assert torch.equal(nvfp4_linear(x, *w, variant="v7"), nvfp4_gemv_cuda(x, *w))
    x = _x(3, 528, 13)  # K = 528: not a multiple of 64, v3's path
    w = random_nvfp4(256, 528, "cuda", seed=14)
    with torch.inference_mode():
        assert torch.equal(nvfp4_linear(x, *w, variant="v7"), nvfp4_linear(x, *w, variant="v3"))


def test_accumulation_bound_catches_one_lost_block_at_k_6144():
    """The GPU check must fail a kernel that lost one NVFP4 block of one row (a wrong offset or a
    skipped chunk): at K = 6144 the bound stays far below one block's share of a dot product."""
    packed, scales = special_weights((64,), 6144, torch.Generator().manual_seed(15))
    scales = (scales.view(torch.uint8) & 0x3F | 0x20).view(torch.float8_e4m3fn)  # normal scales 2^-2..1.875
    x = (torch.randn(2, 6144, generator=torch.Generator().manual_seed(16)) * 2).to(torch.bfloat16)
    W = nvfp4.dequantize(nvfp4.NVFP4Tensor(packed, scales, torch.tensor(1.0)), torch.float32).double()
    exact = x.double() @ W.T
    W_lost = W.clone()
    W_lost[5, 16 * 7 : 16 * 8] = 0
    excess = ((x.double() @ W_lost.T - exact).abs() / accumulation_bound(x, W)).max().item()
    assert excess > 10
