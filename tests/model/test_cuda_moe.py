"""v7 CUDA tensor-core MoE decode (model/kernels/cuda_moe.py + cuda_moe.cu).

CPU: a torch emulation of the staged kernel: each thread's cp.async pieces of a round (16-byte code
pieces, 4-byte scale words, from the canonical NVFP4 tensors at the kernel's offsets, into the
swizzled stage layout, chunks past the split's end skipped), then each lane's shared-memory reads
(two 8-byte code words and two scale words per tile, the prmt picking its two scale bytes), the
kernel's integer decode ops and the mma.m16n8k16 fragment layouts of the PTX ISA (see below),
reproduces `nvfp4.dequantize` exactly (every code, e4m3 subnormal scales, 0 and 448; partial rounds and
unaligned split starts) and the MMA's product (with the x-pair prmts); the copies cover every stage
byte a lane reads once, each copy instruction reads whole 128-byte row lines (codes) or 16 contiguous
bytes of 8 rows (scales), and the lanes' shared reads are bank-conflict free. GPU (-m gpu):
`moe_nvfp4_mma` against an emulation of the same roundings, `moe_experts_ref` and the v2 tile kernel at
T in {1, 4, 64, 256}, tiny and M3.1 shapes, 8- and 16-row blocks (bit-equal to each other); padding
rows and multi-block experts; special values (every E2M1 code with e4m3 subnormal scales: a flushing
bf16 multiply shows up as a wrong 0.5 code); in-place weight updates and expert-sliced banks (the
kernel reads the bank, nothing cached); CUDA-graph replay; the shared-expert add; determinism and
split counters back at 0.

The PTX ISA fragment layouts and the kernel's map of MMA column kappa of step i (0..3) of a 64-wide
chunk to input k = 16t + 8 (i >> 1) + 2 (i & 1) + (kappa >= 8) + 4 (kappa & 1) (A and B alike,
`kappa_to_k`): tests/model/mma_layouts.py, shared with test_cuda_gemv.py.
"""

import functools

import pytest
import torch

from model import nvfp4
from model.kernels.cuda_moe import _canonical, random_bank, rows_per_block, split_k, use_moe_mma
from tests.model.mma_layouts import (
    a_row_col,
    b_fragments,
    b_row_col,
    bf16_halves,
    byte_perm,
    c_row_col,
    decode_a,
    kappa_to_k,
    scale_x2119,
    special_weights,
    u32,
)

# cuda_moe.cu's constants: tiles per CTA, warps (= chunks per round), bytes per row and round, a
# stage's code bytes and bytes per matrix.
MT, WARPS, LINE, CODE_BYTES, MAT_BYTES = 4, 4, 128, 8192, 9216
THREADS = 32 * WARPS


# ------------------------------------------------------------------------------- lane emulation
def code_copies(c_begin: int, c_end: int, rnd: int) -> list[tuple[int, int, int, int]]:
    """The kernel's code copies (Copier) of one round and matrix: (thread, CTA row, byte of the row,
    stage offset) of each 16-byte piece, pieces of chunks >= c_end left out."""
    out = []
    for tid in range(THREADS):
        r0, u = tid >> 3, tid & 7
        if c_begin + WARPS * rnd + (u >> 1) >= c_end:
            continue
        for i in range(4):
            r = 16 * i + r0
            dst = r * LINE + (((u >> 1) ^ (r & 3)) * 32) + (u & 1) * 16
            out.append((tid, r, 32 * c_begin + 16 * u + LINE * rnd, dst))
    return out


def scale_copies(c_begin: int, c_end: int, rnd: int) -> list[tuple[int, int, int, int]]:
    """The kernel's scale copies of one round and matrix: (thread, CTA row, byte of the scale row,
    stage offset) of each 4-byte word."""
    out = []
    for tid in range(THREADS):
        rs, j = tid >> 2, tid & 3
        if c_begin + WARPS * rnd + j >= c_end:
            continue
        for i in range(2):
            r = 32 * i + rs
            out.append((tid, r, 4 * (c_begin + j) + 16 * rnd, CODE_BYTES + r * 16 + 4 * j))
    return out


def lane_reads(warp: int, g: int, t: int, tt: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Stage offsets a lane reads for tile tt of a matrix: (code word of row g, of row g + 8; 8 bytes
    each), (scale word of row g, of row g + 8; 4 bytes each)."""
    code = g * LINE + ((warp ^ (g & 3)) * 32) + 8 * t + tt * 16 * LINE
    scale = CODE_BYTES + g * 16 + 4 * warp + tt * 16 * 16
    return (code, code + 8 * LINE), (scale, scale + 8 * 16)


def scale_selector(t: int) -> int:
    """The kernel's `sel`: byte t of the row-g word into byte 0, byte t of the row-(g + 8) word into 1."""
    return t | (4 + t) << 4


def split_ranges(kc: int, split: int) -> list[tuple[int, int]]:
    per = -(-kc // split)
    return [(s * per, min(kc, s * per + per)) for s in range(split) if s * per < kc]


def stage_round(rows_w: torch.Tensor, rows_s: torch.Tensor, c_begin: int, c_end: int, rnd: int):
    """One matrix's stage after the round's copies: int64 [..., MAT_BYTES], -1 where nothing was
    copied. rows_w / rows_s: a CTA's 64 code / scale rows, uint8 [..., 64, I/2] / [..., 64, I/16]."""
    stage = torch.full((*rows_w.shape[:-2], MAT_BYTES), -1, dtype=torch.long)
    for copies, rows, size in ((code_copies, rows_w, 16), (scale_copies, rows_s, 4)):
        for _, r, src, dst in copies(c_begin, c_end, rnd):
            assert bool((stage[..., dst : dst + size] == -1).all()), "a stage byte written twice"
            stage[..., dst : dst + size] = rows[..., r, src : src + size].long()
    return stage


def lane_values(stage: torch.Tensor, warp: int, lane: int, tt: int) -> dict[tuple[int, int], torch.Tensor]:
    """One lane's tile tt of its warp's chunk from a stage (int64 bytes [..., MAT_BYTES]): its shared
    reads, scale prmt and decode -> {(tile row, chunk input k): e2m1 * s (fp64)} through the A layout."""
    g, t = lane // 4, lane % 4
    (cg, cg8), (sg, sg8) = lane_reads(warp, g, t, tt)
    read = [stage[..., o : o + n] for o, n in ((cg, 8), (cg8, 8), (sg, 4), (sg8, 4))]
    assert all(bool((v >= 0).all()) for v in read), "a lane read an uncopied byte"
    qg, qg8 = ([u32(stage, o), u32(stage, o + 4)] for o in (cg, cg8))
    pair = byte_perm(u32(stage, sg), u32(stage, sg8), scale_selector(t))
    s_g, s_g8 = scale_x2119(pair & 0xFF), scale_x2119((pair >> 8) & 0xFF)  # scale_splats
    out = {}
    for step in range(4):
        sh = 8 * (step & 1)
        regs = decode_a(qg[step >> 1] >> sh, qg8[step >> 1] >> sh, s_g, s_g8)
        for n in range(4):
            for h in range(2):
                row, kappa = a_row_col(2 * n + h, g, t)
                out[row, kappa_to_k(kappa, step, t)] = regs[n][h] * 2.0**7
    return out


def emulate_weights(packed: torch.Tensor, scales: torch.Tensor, split: int = 1) -> torch.Tensor:
    """Every CTA's rounds of staged copies from the canonical tensors (K split `split` ways), every
    lane's shared reads of its chunk, its scale prmt and decode, its A registers placed at (row, k)
    through the PTX A layout and `kappa_to_k`: fp32 [E, N, I] = e2m1 * s (the kernel's decoded value
    times its 2^7)."""
    E, N, H = packed.shape
    n_in, kc = 2 * H, 2 * H // 64
    rows_w = packed.view(E, N // 64, 64, H)  # [E, CTA, CTA row, byte]
    rows_s = scales.view(torch.uint8).view(E, N // 64, 64, n_in // 16)
    out = torch.full((E, N // 64, MT, 16, n_in), float("nan"))  # [E, CTA, tile, row, k]
    for c_begin, c_end in split_ranges(kc, split):
        for rnd in range(-(-(c_end - c_begin) // WARPS)):
            stage = stage_round(rows_w, rows_s, c_begin, c_end, rnd)
            for warp in range(WARPS):
                c = c_begin + WARPS * rnd + warp
                if c >= c_end:
                    continue
                for lane in range(32):
                    for tt in range(MT):
                        for (row, k), v in lane_values(stage, warp, lane, tt).items():
                            out[..., tt, row, 64 * c + k] = v
    return out.reshape(E, N, n_in)


# ------------------------------------------------------------------------------------------ CPU
def test_kappa_map_covers_each_chunk_once_and_a_lane_holds_one_scale_block():
    for t in range(4):
        ks = {kappa_to_k(kappa, i, t) for i in range(4) for kappa in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)}
        assert ks == set(range(16 * t, 16 * t + 16))  # one NVFP4 block per lane
    for i in range(4):
        ks = [kappa_to_k(kappa, i, t) for t in range(4) for kappa in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)]
        assert sorted(ks) == sorted(set(ks)) and len(ks) == 16  # a step's 16 columns are distinct inputs
    # The A and B fragments of a lane name the same MMA columns (so the same inputs).
    for lane in range(32):
        g, t = lane // 4, lane % 4
        a_cols = {a_row_col(i, g, t)[1] for i in range(8)}
        b_rows = {b_row_col(i, g, t)[0] for i in range(4)}
        assert a_cols == b_rows
    # The halves of an A register are inputs k and k + 4 (nibbles 16 bits apart in a 32-bit word).
    for t in range(4):
        for i in range(4):
            for kappa in (2 * t, 2 * t + 8):
                assert kappa_to_k(kappa + 1, i, t) == kappa_to_k(kappa, i, t) + 4


def test_each_copy_instruction_reads_whole_row_lines_and_a_round_is_copied_once():
    """A warp's code-copy instruction (fixed piece i) reads 4 rows x the round's 128 contiguous bytes
    (one whole line per row when the round starts on a 4-chunk boundary), a scale-copy instruction 8
    rows x 16 contiguous bytes; a full round writes every stage byte exactly once."""
    codes, scales = code_copies(0, 8, 1), scale_copies(0, 8, 1)
    assert len(codes) == 4 * THREADS and len(scales) == 2 * THREADS
    for copies, size, n_rows, span in ((codes, 16, 4, LINE), (scales, 4, 8, 16)):
        per_instr = {}
        for k, (tid, r, src, _) in enumerate(copies):
            per_instr.setdefault((tid >> 5, k % (len(copies) // THREADS)), []).append((r, src))
        for pieces in per_instr.values():
            assert len(pieces) == 32
            by_row = {}
            for r, src in pieces:
                by_row.setdefault(r, []).append(src)
            assert len(by_row) == n_rows
            for srcs in by_row.values():
                lo = min(srcs)
                assert sorted(srcs) == list(range(lo, lo + span, size))
                assert lo % span == 0  # aligned: whole lines (codes) at a 4-chunk-aligned round
    written = torch.zeros(MAT_BYTES, dtype=torch.long)
    for _, _, _, dst in codes:
        written[dst : dst + 16] += 1
    for _, _, _, dst in scales:
        written[dst : dst + 4] += 1
    assert bool((written == 1).all())


def test_lane_shared_reads_are_bank_conflict_free():
    """Code words (8 bytes): each half-warp's 16 lanes hit 16 distinct 8-byte bank pairs; scale words
    (4 bytes): lanes at distinct addresses hit distinct banks (lanes of one g share a word)."""
    for warp in range(WARPS):
        for tt in range(MT):
            for h in (0, 1):
                for half in (0, 1):
                    lanes = range(16 * half, 16 * half + 16)
                    pairs = {(lane_reads(warp, ln // 4, ln % 4, tt)[0][h] % 128) // 8 for ln in lanes}
                    assert len(pairs) == 16
                addrs = {lane_reads(warp, ln // 4, ln % 4, tt)[1][h] for ln in range(32)}
                assert len({(a % 128) // 4 for a in addrs}) == len(addrs) == 8


@pytest.mark.parametrize("n_in, split", [(128, 1), (512, 1), (320, 2), (576, 3)])
def test_fragment_emulation_from_staged_copies_reproduces_dequantize_exactly(n_in, split):
    """Every code with every kind of scale (subnormal, 0, 448): the lanes' decoded registers, copied
    from the canonical tensors into the stages and read back by the lanes, placed by the PTX A layout,
    are exactly e2m1 * s (nvfp4.dequantize with scale_2 = 1). n_in 128: one partial round; 320 in 2
    splits: chunks 0-2 and 3-4 (an unaligned split start); 576 in 3 splits: 3 chunks each."""
    gen = torch.Generator().manual_seed(n_in + split)
    packed, scales = special_weights((2, 64), n_in, gen)
    sbytes = scales.view(torch.uint8)
    assert {0, 1, 7, 0x7E} <= set(sbytes.unique().tolist())  # zero, subnormals, 448 are all there
    got = emulate_weights(packed, scales, split)
    want = nvfp4.dequantize(nvfp4.NVFP4Tensor(packed, scales, torch.tensor(1.0)), torch.float32)
    assert torch.equal(got, want)


def test_mma_emulation_equals_the_matrix_product():
    """D = sum over steps of A_frag x B_frag built lane by lane (A from the decode, B from the lane's
    16 contiguous x values of a chunk paired by the kernel's prmts, C layout for the result) equals
    W @ x^T."""
    gen = torch.Generator().manual_seed(2)
    E, N, n_in = 1, 64, 128
    packed, scales = special_weights((E, N), n_in, gen)
    W = emulate_weights(packed, scales)[0, :16].double()  # tile 0 [16, I], validated above
    x = (torch.randn(8, n_in, generator=gen) * 3).to(torch.bfloat16)  # 8 slot rows (MMA N)
    x_bits = x.view(torch.int16).long() & 0xFFFF
    D = torch.zeros(16, 8, dtype=torch.float64)
    for c in range(n_in // 64):
        for step in range(4):
            A = torch.full((16, 16), float("nan"), dtype=torch.float64)
            B = torch.full((16, 8), float("nan"), dtype=torch.float64)
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for i in range(8):
                    r, kappa = a_row_col(i, g, t)
                    A[r, kappa] = W[r, 64 * c + kappa_to_k(kappa, step, t)]
                # The lane's x words: bf16 pairs (2j, 2j + 1) of x[g, 64c + 16t : +16]; B regs by prmt.
                seg = x_bits[g, 64 * c + 16 * t : 64 * c + 16 * t + 16]
                regs = b_fragments(seg[0::2] | (seg[1::2] << 16))[step]
                for i in range(4):
                    kappa, col = b_row_col(i, g, t)
                    B[kappa, col] = bf16_halves(regs[i >> 1])[i & 1]
            assert not (A.isnan().any() or B.isnan().any()), "a fragment element was never written"
            D += A @ B
    C = torch.zeros(16, 8, dtype=torch.float64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(4):
            r, col = c_row_col(i, g, t)
            C[r, col] = D[r, col]
    torch.testing.assert_close(C, W @ x.double().T, rtol=1e-12, atol=1e-12)


def test_split_heuristic_fills_the_gpu_at_t1_and_stays_one_at_decode_batches():
    assert split_k(4, 3072, 6144, 132) == 5 and split_k(4, 6144, 3072, 132) == 3
    assert split_k(128, 3072, 6144, 132) == 1 and split_k(128, 6144, 3072, 132) == 1
    assert split_k(1, 64, 64, 132) == 1  # never fewer than 2 chunks per warp
    assert use_moe_mma(256, 128) and use_moe_mma(1024, 128) and not use_moe_mma(1025, 128)


def test_rows_per_block_is_16_from_six_slots_per_expert():
    assert rows_per_block(4 * 64, 128) == 8 and rows_per_block(4 * 128, 128) == 8  # T = 64, 128 at M3
    assert rows_per_block(767, 128) == 8 and rows_per_block(768, 128) == 16
    assert rows_per_block(4 * 256, 128) == 16  # T = 256
    # Wide blocks only where the split heuristic gives 1 split at M3 widths (split-K stays 8-row).
    assert split_k(min(768, 128), 3072, 6144, 132) == 1 and split_k(min(768, 128), 6144, 3072, 132) == 1


def test_moe_nvfp4_mma_rejects_cpu_and_bad_shapes_with_the_field_name():
    from model.kernels.cuda_moe import moe_nvfp4_mma

    w = (
        torch.zeros(2, 64, 32, dtype=torch.uint8),
        torch.zeros(2, 64, 4, dtype=torch.float8_e4m3fn),
        torch.ones(2),
    )
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    ids, wt = torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    with pytest.raises(ValueError, match="CUDA bf16"):
        moe_nvfp4_mma(x, ids, wt, w, w, w, swiglu_alpha=1.7, swiglu_limit=7.0)
    with pytest.raises(ValueError, match="w3 packed must be uint8"):
        _canonical("w3", (w[0][:, :32], w[1], w[2]), (2, 64, 32))
    with pytest.raises(ValueError, match="w2 scales must be float8_e4m3fn"):
        _canonical("w2", (w[0], w[1].view(torch.uint8), w[2]), (2, 64, 32))
    with pytest.raises(ValueError, match="contiguous CUDA"):  # read in place: never copied
        _canonical("w1", w, (2, 64, 32))


# ------------------------------------------------------------------------------------------ GPU
def _bank(E, D, F, seed, device, special=False):
    from model.layers.moe import ExpertBank

    gen = torch.Generator().manual_seed(seed)
    if D * F > 1 << 16:  # M3 widths: random codes and scales drawn on the GPU (CPU quantizing is minutes)
        return _big_bank(E, D, F, device)
    bank = ExpertBank(E, D, F, "nvfp4").init_normal_(0.05, gen)
    if special:  # every code with subnormal / zero / max scales, power-of-two scale_2
        for p, (n_out, n_in) in bank.proj_shapes().items():
            packed, scales = special_weights((E, n_out), n_in, gen)
            getattr(bank, f"{p}_weight").copy_(packed)
            sb = scales.view(torch.uint8) & 0x3F  # keep |w| moderate: exponents <= 7, subnormals kept
            getattr(bank, f"{p}_weight_scale").copy_(sb.view(torch.float8_e4m3fn))
            getattr(bank, f"{p}_weight_scale_2").fill_(2.0**-6)
    return bank.to(device)


@functools.cache
def _big_bank(E, D, F, device):
    return random_bank(E, D, F, device)


def _parts(bank):
    return [tuple(getattr(bank, f"{p}_{s}") for s in ("weight", "weight_scale", "weight_scale_2"))
            for p in ("w1", "w3", "w2")]  # fmt: skip


def _kw(bank):
    return dict(swiglu_alpha=bank.swiglu_alpha, swiglu_limit=bank.swiglu_limit)


def emulated(x, ids, w, bank):
    """fp32 weights (exact dequantization), gate / up / act / y rounded to bf16 as the kernels round
    them, y times the router weight, slots summed in fp32, one bf16 rounding (on x's device)."""
    from model.kernels.moe import swigluoai_ref

    bf = torch.bfloat16
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1)
    for e in torch.unique(flat).tolist():  # SYNC: test reference
        s = (flat == e).nonzero()[:, 0]
        t = s // ids.shape[1]
        w1, w3, w2 = bank.dequantized(e, torch.float32)
        xs = x[t].float()
        gate, up = (xs @ w1.T).to(bf).float(), (xs @ w3.T).to(bf).float()
        act = swigluoai_ref(gate, up, bank.swiglu_alpha, bank.swiglu_limit).to(bf).float()
        y = (act @ w2.T).to(bf).float() * w.reshape(-1)[s].float()[:, None]
        out.index_add_(0, t, y)
    return out.to(bf).float()


def _routing(T, E, K, gen, device):
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    return ids.to(device), torch.rand(T, K, generator=gen).to(device)


def _check(x, ids, w, bank, label, with_ref=True):
    from model.kernels import cuda_moe
    from model.kernels.cuda_common import split_counters
    from model.kernels.moe import moe_experts_ref, moe_experts_torch
    from model.kernels.triton_moe import moe_nvfp4_triton

    cuda_moe.POISON_INTERMEDIATES = True
    try:
        got = cuda_moe.moe_nvfp4_mma(x, ids, w, *_parts(bank), **_kw(bank),
                                     out_TD=torch.full_like(x, float("nan"))).float()  # fmt: skip
    finally:
        cuda_moe.POISON_INTERMEDIATES = False
    assert torch.isfinite(got).all(), f"{label}: {int((~torch.isfinite(got)).sum())} outputs not written"
    assert int(split_counters(x.device, 1).abs().sum()) == 0, f"{label}: split counters not back at 0"
    want = emulated(x, ids, w, bank)
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= 2**-7 * scale, f"{label}: vs emulation max err {err} > 2^-7 x {scale}"
    # v2 (the tile kernel) multiplies bf16(e2m1 * s * scale_2) as the reference does: v7 is off both
    # by that weight rounding (the emulation above is the tight check); 0.03 allows the two offsets.
    v2 = moe_nvfp4_triton(x, ids, w, *_parts(bank), **_kw(bank), variant="v2").float()
    err = (got - v2).abs().max().item()
    assert err <= 0.03 * scale, f"{label}: vs v2 max err {err} > 0.03 x {scale}"
    if with_ref:
        big = x.shape[1] * bank.intermediate_size > 1 << 16
        ref = (moe_experts_torch if big else moe_experts_ref)(x, ids, w, bank).float()
        err = (got - ref).abs().max().item()
        assert err <= 0.02 * scale, f"{label}: vs reference max err {err} > 0.02 x {scale}"
    return got


def _call(bank, x, ids, w, **kw):
    from model.kernels.cuda_moe import moe_nvfp4_mma

    return moe_nvfp4_mma(x, ids, w, *_parts(bank), **_kw(bank), **kw)


@pytest.mark.parametrize("T", [1, 4, 64, 256])
@pytest.mark.parametrize("shape", ["tiny", "m3.1"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mma_matches_emulation_v2_and_reference(shape, T):
    E, D, F, K = (8, 128, 64, 2) if shape == "tiny" else (128, 6144, 3072, 4)
    bank = _bank(E, D, F, T, "cuda")
    gen = torch.Generator().manual_seed(T)
    x = (torch.randn(T, D, generator=gen) * 2).to(torch.bfloat16).cuda()
    ids, w = _routing(T, E, K, gen, "cuda")
    _check(x, ids, w, bank, f"{shape} T={T}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_code_with_subnormal_scales_is_exact_enough():
    """A bf16 multiply that flushed the subnormal e2m1 * 2^-126 (code 0.5) would zero 1/8 of the
    weights: far outside 2^-7 of the max."""
    bank = _bank(8, 128, 128, 3, "cuda", special=True)
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(16, 128, generator=gen) * 2).to(torch.bfloat16).cuda()
    ids, w = _routing(16, 8, 2, gen, "cuda")
    _check(x, ids, w, bank, "special")


@pytest.mark.parametrize("T", [1, 4, 64, 256])
@pytest.mark.parametrize("shape", ["tiny", "m3.1"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_16_and_8_row_blocks_give_the_same_bits(shape, T, monkeypatch):
    """Forcing one block height (`rows_per_block`) against the other: every slot's sums are the same
    MMAs on the same registers, so the outputs are equal bit for bit (T = 1 at M3 widths: the split-K
    path with 16-row partials); counters back at 0."""
    from model.kernels import cuda_moe
    from model.kernels.cuda_common import split_counters

    E, D, F, K = (8, 128, 64, 2) if shape == "tiny" else (128, 6144, 3072, 4)
    bank = _bank(E, D, F, T, "cuda")
    gen = torch.Generator().manual_seed(T)
    x = (torch.randn(T, D, generator=gen) * 2).to(torch.bfloat16).cuda()
    ids, w = _routing(T, E, K, gen, "cuda")
    outs = {}
    for rb in (8, 16):
        monkeypatch.setattr(cuda_moe, "WIDE_BLOCK_SLOTS", 0 if rb == 16 else 1 << 30)
        assert cuda_moe.rows_per_block(T * K, E) == rb
        outs[rb] = _call(bank, x, ids, w)
        assert int(split_counters(x.device, 1).abs().sum()) == 0, f"rb={rb}: split counters not back at 0"
    assert torch.isfinite(outs[16].float()).all()
    assert torch.equal(outs[8], outs[16]), f"{shape} T={T}: 8- and 16-row blocks differ"


@pytest.mark.parametrize("rb", [8, 16])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_partial_rounds_and_unaligned_split_starts_match(rb, monkeypatch):
    """D = F = 1088: 17 chunks, so a split's last round holds 1 chunk; at T = 1 both launches take 2
    K splits (chunks 0-8 and 9-16: the second starts mid-line, its copies span two lines per row)."""
    from model.kernels import cuda_moe

    monkeypatch.setattr(cuda_moe, "WIDE_BLOCK_SLOTS", 0 if rb == 16 else 1 << 30)
    E, D, F, K = 4, 1088, 1088, 2
    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert split_k(min(K, E), F, D, n_sms) == 2 and split_k(min(K, E), D, F, n_sms) == 2
    bank = _bank(E, D, F, 14, "cuda")
    for T in (1, 3):
        gen = torch.Generator().manual_seed(15 + T)
        x = (torch.randn(T, D, generator=gen) * 2).to(torch.bfloat16).cuda()
        ids, w = _routing(T, E, K, gen, "cuda")
        _check(x, ids, w, bank, f"D = F = 1088, T={T}, {rb}-row blocks")


@pytest.mark.parametrize("rb", [8, 16])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_padding_rows_and_multi_block_experts_match(rb, monkeypatch):
    """Top-1 counts 1, 7, 8, 9, 0, 17, 3, 24: blocks of 1..rb valid rows (the rest -1), experts of 2
    and 3 blocks, an expert without tokens; large activations reach the swigluoai clamps."""
    from model.kernels import cuda_moe

    monkeypatch.setattr(cuda_moe, "WIDE_BLOCK_SLOTS", 0 if rb == 16 else 1 << 30)
    counts = [1, 7, 8, 9, 0, 17, 3, 24]
    gen = torch.Generator().manual_seed(5)
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    ids = ids[torch.randperm(ids.numel(), generator=gen)].view(-1, 1).cuda()
    T = ids.shape[0]
    bank = _bank(len(counts), 128, 64, 6, "cuda")
    x = (torch.randn(T, 128, generator=gen) * 8).to(torch.bfloat16).cuda()
    w = torch.rand(T, 1, generator=gen).cuda()
    _check(x, ids, w, bank, f"top-1 counts, {rb}-row blocks")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_in_place_weight_updates_and_expert_sliced_banks_are_read_directly():
    """Nothing is cached: a checkpoint reload into the bank's tensors shows at the next call, and a bank
    whose tensors are views of experts 2.. of a larger one (offset pointers) gives the result of a
    copy of those experts."""
    from model.layers.moe import ExpertBank

    E, D, F, K, T = 8, 256, 128, 2, 4
    bank, other = _bank(E, D, F, 11, "cuda"), _bank(E, D, F, 12, "cuda")
    gen = torch.Generator().manual_seed(13)
    x = (torch.randn(T, D, generator=gen) * 2).to(torch.bfloat16).cuda()
    ids, w = _routing(T, E, K, gen, "cuda")
    before = _call(bank, x, ids, w)
    for name, t in other.state_dict().items():
        bank.state_dict()[name].copy_(t)
    assert torch.equal(_call(bank, x, ids, w), _call(other, x, ids, w)), "a stale copy of the old weights"
    assert not torch.equal(before, _call(bank, x, ids, w))
    views, copies = ExpertBank(E - 2, D, F, "nvfp4").cuda(), ExpertBank(E - 2, D, F, "nvfp4").cuda()
    for p in ("w1", "w3", "w2"):
        for s in ("weight", "weight_scale", "weight_scale_2"):
            t = getattr(bank, f"{p}_{s}")[2:]
            setattr(views, f"{p}_{s}", t)  # buffers re-pointed at views into `bank`
            getattr(copies, f"{p}_{s}").copy_(t)
    assert views.w1_weight.data_ptr() != bank.w1_weight.data_ptr()
    ids2 = ids % (E - 2)
    assert torch.equal(_call(views, x, ids2, w), _call(copies, x, ids2, w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_shared_add_and_determinism():
    from model.kernels.cuda_moe import moe_nvfp4_mma

    E, D, F, K, T = 128, 6144, 3072, 4, 1  # T = 1: the split-K path
    bank = _bank(E, D, F, 7, "cuda")
    parts, kw = _parts(bank), _kw(bank)
    gen = torch.Generator().manual_seed(8)
    x = (torch.randn(T, D, generator=gen) * 2).to(torch.bfloat16).cuda()
    ids, w = _routing(T, E, K, gen, "cuda")
    shared = torch.randn(T, D, generator=gen).to(torch.bfloat16).cuda()
    first = moe_nvfp4_mma(x, ids, w, *parts, **kw)  # warm-up: compile, counters
    assert torch.equal(moe_nvfp4_mma(x, ids, w, *parts, **kw), first), "two runs differ (determinism)"
    with_shared = moe_nvfp4_mma(x, ids, w, *parts, **kw, shared_TD=shared)
    assert torch.equal(with_shared, (first.float() + shared.float()).to(torch.bfloat16))
    out = torch.empty_like(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_nvfp4_mma(x, ids, w, *parts, **kw, out_TD=out)
    x2 = (torch.randn(T, D, generator=gen) * 2).to(torch.bfloat16).cuda()
    ids2, w2 = _routing(T, E, K, gen, "cuda")
    x.copy_(x2), ids.copy_(ids2), w.copy_(w2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, moe_nvfp4_mma(x, ids, w, *parts, **kw)), "graph replay differs from eager"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_v7_dispatch_takes_the_mma_kernel_for_decode_and_v2_above():
    from model.kernels.cuda_moe import moe_nvfp4_mma
    from model.kernels.triton_moe import moe_nvfp4_triton

    bank = _bank(4, 128, 64, 9, "cuda")
    gen = torch.Generator().manual_seed(10)
    for T, takes_mma in ((16, True), (17, False)):  # T * K = 32 = 8 E: v7; 34: v2's tile kernel
        x = torch.randn(T, 128, generator=gen).to(torch.bfloat16).cuda()
        ids, w = _routing(T, 4, 2, gen, "cuda")
        got = moe_nvfp4_triton(x, ids, w, *_parts(bank), **_kw(bank), variant="v7")
        if takes_mma:
            want = moe_nvfp4_mma(x, ids, w, *_parts(bank), **_kw(bank))
        else:
            want = moe_nvfp4_triton(x, ids, w, *_parts(bank), **_kw(bank), variant="v2")
        assert torch.equal(got, want)
