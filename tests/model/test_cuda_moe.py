"""v7 CUDA tensor-core MoE decode (model/kernels/cuda_moe.py + cuda_moe.cu).

CPU: the repack is a bijection, and a torch emulation of each lane's registers (the kernel's integer
decode ops, both decodes, and the mma.m16n8k16 fragment layouts of the PTX ISA written out below)
reproduces `nvfp4.dequantize` exactly and the MMA's product. GPU (-m gpu): `moe_nvfp4_mma` against
an emulation of the same roundings, `moe_experts_ref`, and v6 (`moe_nvfp4_gemv`) at T in {1, 4, 64,
256}, tiny and M3.1 shapes; padding rows and multi-block experts; special values (every E2M1 code
with e4m3 subnormal scales: a flushing bf16 multiply shows up as a wrong 0.5 code); CUDA-graph replay;
the shared-expert add; determinism and split counters back at 0.

PTX ISA, mma.m16n8k16 with .bf16 A / B and .f32 C, lane = 4 * groupID + threadID_in_group (g, t):
  A a_i (i = 0..7, two per .b32 register, a_{2n} in the low half of register n):
    row = g for i in {0, 1, 4, 5}, g + 8 otherwise; col = 2t + (i & 1) + 8 * (i >= 4)
  B b_i (i = 0..3): row = 2t + (i & 1) + 8 * (i >= 2); col = g
  C c_i (i = 0..3): row = g + 8 * (i >= 2); col = 2t + (i & 1)
Kernel map of MMA column kappa of step i (0..3) of a 64-wide chunk to input k (A and B alike):
  k = 16t + 4i + 2 * (kappa >= 8) + (kappa & 1), for the kappa a lane holds (2t, 2t+1, 2t+8, 2t+9).
"""

import functools

import pytest
import torch

from model import nvfp4
from model.kernels.cuda_moe import random_bank, repack_nvfp4_mma, split_k, unpack_nvfp4_mma, use_moe_mma

MASK32 = 0xFFFFFFFF


# ------------------------------------------------------------------------------- layouts (PTX ISA)
def a_row_col(i: int, g: int, t: int) -> tuple[int, int]:
    return g + 8 * (i not in (0, 1, 4, 5)), 2 * t + (i & 1) + 8 * (i >= 4)


def b_row_col(i: int, g: int, t: int) -> tuple[int, int]:
    return 2 * t + (i & 1) + 8 * (i >= 2), g


def c_row_col(i: int, g: int, t: int) -> tuple[int, int]:
    return g + 8 * (i >= 2), 2 * t + (i & 1)


def kappa_to_k(kappa: int, step: int, t: int) -> int:
    return 16 * t + 4 * step + 2 * (kappa >= 8) + (kappa & 1)


# ------------------------------------------------------------------------------- decode emulation
def _u32(words_u8: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 16] (a lane's bytes) -> int64 [..., 4] little-endian 32-bit words."""
    b = words_u8.long().view(*words_u8.shape[:-1], 4, 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _halves_to_f32(r: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 32-bit registers -> (low, high) 16-bit halves as fp32 values of bf16 / fp16 bits."""
    lo, hi = r & 0xFFFF, (r >> 16) & 0xFFFF
    if fmt == "bf16":
        to = lambda h: (h << 16).to(torch.int32).view(torch.float32)
    else:
        to = lambda h: h.to(torch.int16).view(torch.float16).float()
    return to(lo), to(hi)


def _exact_in(v: torch.Tensor, dtype: torch.dtype) -> bool:
    return bool(torch.equal(v.to(dtype).float(), v))


def decode_registers(q: torch.Tensor, scale_g: torch.Tensor, scale_g8: torch.Tensor, decode: str):
    """The kernel's `decode` on int64 words q [...]: -> (lo, hi) fp32 values of A registers 0..3,
    each exactly the bf16 the kernel multiplies (checked representable). scale_*: fp32 e4m3 values."""
    out = []
    if decode == "bf16":
        M = 0x81C081C0
        u = q >> 8
        raws = [((q & 0x000F000F) * 0x1040) & M, ((q & 0x00F000F0) * 0x0104) & M,
                ((u & 0x000F000F) * 0x1040) & M, ((u & 0x00F000F0) * 0x0104) & M]  # fmt: skip
        mult = [scale_g * 2.0**119, scale_g8 * 2.0**119]
        for m in mult:
            assert _exact_in(m, torch.bfloat16), "s * 2^119 must be a bf16"
        for n, r in enumerate(raws):
            for half in _halves_to_f32(r & MASK32, "bf16"):
                v = half * mult[n & 1]  # fp32: exact (<= 6 significant bits, far from the range ends)
                assert _exact_in(v, torch.bfloat16), "the bf16 multiply must be exact"
                out.append(v)
    else:
        S, E = 0x80008000, 0x0E000E00
        raws = [((q << 12) & S) | ((q << 9) & E), ((q << 8) & S) | ((q << 5) & E),
                ((q << 4) & S) | ((q << 1) & E), (q & S) | ((q >> 3) & E)]  # fmt: skip
        mult = [scale_g * 2.0**7, scale_g8 * 2.0**7]
        for m in mult:
            assert _exact_in(m, torch.float16), "s * 2^7 must be an fp16"
        for n, r in enumerate(raws):
            for half in _halves_to_f32(r & MASK32, "f16"):
                v = half * mult[n & 1]
                assert _exact_in(v, torch.float16) and _exact_in(v, torch.bfloat16), "must stay exact"
                out.append(v)
    return [(out[2 * n], out[2 * n + 1]) for n in range(4)]


def emulate_weights(words: torch.Tensor, pairs: torch.Tensor, decode: str) -> torch.Tensor:
    """Every lane's A registers placed at (row, k) through the PTX A layout and `kappa_to_k`:
    fp32 [E, N, I] = e2m1 * s (the kernel's decoded value times its 2^7)."""
    E, NT, KC = words.shape[:3]
    out = torch.full((E, 16 * NT, 64 * KC), float("nan"))
    q = _u32(words)  # [E, NT, KC, 32, 4]
    s = pairs.view(torch.float8_e4m3fn).float()  # [E, NT, KC, 32, 2]
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for step in range(4):
            regs = decode_registers(q[:, :, :, lane, step], s[:, :, :, lane, 0], s[:, :, :, lane, 1], decode)
            for n in range(4):
                for h in range(2):
                    row, kappa = a_row_col(2 * n + h, g, t)
                    k = kappa_to_k(kappa, step, t)
                    rows = torch.arange(NT)[:, None] * 16 + row
                    ks = torch.arange(KC)[None, :] * 64 + k
                    out[:, rows, ks] = regs[n][h] * 2.0**7
    return out


def _special_weights(E: int, N: int, n_in: int, gen: torch.Generator):
    """Random codes (all 16 appear) and scales covering e4m3 subnormals (0x01-0x07), 0, and 448."""
    packed = torch.randint(0, 256, (E, N, n_in // 2), generator=gen, dtype=torch.uint8)
    sbytes = torch.randint(0, 0x7F, (E, N, n_in // 16), generator=gen, dtype=torch.uint8)  # 0x7F is NaN
    sbytes.view(-1)[:8] = torch.tensor([0, 1, 2, 3, 5, 7, 0x7E, 0x08], dtype=torch.uint8)
    return packed, sbytes.view(torch.float8_e4m3fn)


# ------------------------------------------------------------------------------------------ CPU
def test_repack_is_a_bijection_and_unpack_inverts_it():
    gen = torch.Generator().manual_seed(0)
    for E, N, n_in in ((1, 16, 64), (3, 64, 256), (2, 48, 192)):
        packed, scales = _special_weights(E, N, n_in, gen)
        words, pairs = repack_nvfp4_mma(packed, scales)
        KC = n_in // 64
        assert words.shape == (E, N // 16, KC, 32, 16) and pairs.shape == (E, N // 16, KC, 32, 2)
        back_p, back_s = unpack_nvfp4_mma(words, pairs)
        assert torch.equal(back_p, packed) and torch.equal(back_s.view(torch.uint8), scales.view(torch.uint8))
        # Same sizes and a lossless round trip of random bytes: a permutation of nibble positions.
        assert words.numel() == packed.numel() and pairs.numel() == scales.numel()


def test_repack_rejects_shapes_the_kernel_cannot_tile():
    with pytest.raises(ValueError, match="I % 64"):
        repack_nvfp4_mma(
            torch.zeros(1, 16, 16, dtype=torch.uint8), torch.zeros(1, 16, 2, dtype=torch.float8_e4m3fn)
        )
    with pytest.raises(ValueError, match="scales"):
        repack_nvfp4_mma(
            torch.zeros(1, 16, 32, dtype=torch.uint8), torch.zeros(1, 16, 3, dtype=torch.float8_e4m3fn)
        )


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


@pytest.mark.parametrize("decode", ["bf16", "f16"])
def test_fragment_emulation_reproduces_dequantize_exactly(decode):
    """Every code with every kind of scale (subnormal, 0, 448): the lanes' decoded registers, placed
    by the PTX A layout, are exactly e2m1 * s (nvfp4.dequantize with scale_2 = 1)."""
    gen = torch.Generator().manual_seed(1)
    packed, scales = _special_weights(2, 32, 128, gen)
    words, pairs = repack_nvfp4_mma(packed, scales)
    got = emulate_weights(words, pairs, decode)
    want = nvfp4.dequantize(nvfp4.NVFP4Tensor(packed, scales, torch.tensor(1.0)), torch.float32)
    assert torch.equal(got, want)


def test_mma_emulation_equals_the_matrix_product():
    """D = sum over steps of A_frag x B_frag built lane by lane (A from the decode, B from the lane's
    16 contiguous x values of a chunk, C layout for the result) equals W @ x^T."""
    gen = torch.Generator().manual_seed(2)
    E, N, n_in = 1, 16, 128
    packed, scales = _special_weights(E, N, n_in, gen)
    words, pairs = repack_nvfp4_mma(packed, scales)
    W = emulate_weights(words, pairs, "bf16")[0].double()  # [16, I], validated above
    x = (torch.randn(8, n_in, generator=gen) * 3).to(torch.bfloat16).double()  # 8 slot rows (MMA N)
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
                # B registers: the lane's x words 2 * step and 2 * step + 1 of x[g, 64c + 16t : +16]
                seg = x[g, 64 * c + 16 * t : 64 * c + 16 * t + 16]
                vals = [seg[4 * step], seg[4 * step + 1], seg[4 * step + 2], seg[4 * step + 3]]
                for i in range(4):
                    kappa, col = b_row_col(i, g, t)
                    B[kappa, col] = vals[i]
            assert not (A.isnan().any() or B.isnan().any()), "a fragment element was never written"
            D += A @ B
    C = torch.zeros(16, 8, dtype=torch.float64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(4):
            r, col = c_row_col(i, g, t)
            C[r, col] = D[r, col]
    torch.testing.assert_close(C, W @ x.T, rtol=1e-12, atol=1e-12)


def test_split_heuristic_fills_the_gpu_at_t1_and_stays_one_at_decode_batches():
    assert split_k(4, 3072, 6144, 132) == 5 and split_k(4, 6144, 3072, 132) == 3
    assert split_k(128, 3072, 6144, 132) == 1 and split_k(128, 6144, 3072, 132) == 1
    assert split_k(1, 64, 64, 132) == 1  # never fewer than 2 chunks per warp
    assert use_moe_mma(256, 128) and use_moe_mma(1024, 128) and not use_moe_mma(1025, 128)


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


# ------------------------------------------------------------------------------------------ GPU
def _bank(E, D, F, seed, device, special=False):
    from model.layers.moe import ExpertBank

    gen = torch.Generator().manual_seed(seed)
    if D * F > 1 << 16:  # M3 widths: random codes and scales drawn on the GPU (CPU quantizing is minutes)
        return _big_bank(E, D, F, device)
    bank = ExpertBank(E, D, F, "nvfp4").init_normal_(0.05, gen)
    if special:  # every code with subnormal / zero / max scales, power-of-two scale_2
        for p, (n_out, n_in) in bank.proj_shapes().items():
            packed, scales = _special_weights(E, n_out, n_in, gen)
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


def _check(x, ids, w, bank, label, decode="bf16", with_ref=True):
    from model.kernels import cuda_moe
    from model.kernels.moe import moe_experts_ref, moe_experts_torch
    from model.kernels.triton_gemv import split_counters
    from model.kernels.triton_moe_gemv import moe_nvfp4_gemv

    cuda_moe.POISON_INTERMEDIATES = True
    try:
        got = cuda_moe.moe_nvfp4_mma(x, ids, w, *_parts(bank), **_kw(bank), decode=decode,
                                     out_TD=torch.full_like(x, float("nan"))).float()  # fmt: skip
    finally:
        cuda_moe.POISON_INTERMEDIATES = False
    assert torch.isfinite(got).all(), f"{label}: {int((~torch.isfinite(got)).sum())} outputs not written"
    assert int(split_counters(x.device, 1).abs().sum()) == 0, f"{label}: split counters not back at 0"
    want = emulated(x, ids, w, bank)
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= 2**-7 * scale, f"{label}: vs emulation max err {err} > 2^-7 x {scale}"
    v6 = moe_nvfp4_gemv(x, ids, w, *_parts(bank), **_kw(bank)).float()
    err = (got - v6).abs().max().item()
    assert err <= 2**-6 * scale, f"{label}: vs v6 max err {err} > 2^-6 x {scale}"
    if with_ref:
        big = x.shape[1] * bank.intermediate_size > 1 << 16
        ref = (moe_experts_torch if big else moe_experts_ref)(x, ids, w, bank).float()
        err = (got - ref).abs().max().item()
        assert err <= 0.02 * scale, f"{label}: vs reference max err {err} > 0.02 x {scale}"
    return got


@pytest.mark.parametrize("decode", ["bf16", "f16"])
@pytest.mark.parametrize("T", [1, 4, 64, 256])
@pytest.mark.parametrize("shape", ["tiny", "m3.1"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mma_matches_emulation_v6_and_reference(shape, T, decode):
    E, D, F, K = (8, 128, 64, 2) if shape == "tiny" else (128, 6144, 3072, 4)
    bank = _bank(E, D, F, T, "cuda")
    gen = torch.Generator().manual_seed(T)
    x = (torch.randn(T, D, generator=gen) * 2).to(torch.bfloat16).cuda()
    ids, w = _routing(T, E, K, gen, "cuda")
    _check(x, ids, w, bank, f"{shape} T={T} {decode}", decode)


@pytest.mark.parametrize("decode", ["bf16", "f16"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_code_with_subnormal_scales_is_exact_enough(decode):
    """A bf16 multiply that flushed the subnormal e2m1 * 2^-126 (code 0.5) would zero 1/8 of the
    weights: far outside 2^-7 of the max."""
    bank = _bank(8, 128, 128, 3, "cuda", special=True)
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(16, 128, generator=gen) * 2).to(torch.bfloat16).cuda()
    ids, w = _routing(16, 8, 2, gen, "cuda")
    _check(x, ids, w, bank, f"special {decode}", decode)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_padding_rows_and_multi_block_experts_match():
    """Top-1 counts 1, 7, 8, 9, 0, 17, 3, 24: blocks of 1..8 valid rows (the rest -1), experts of 2
    and 3 blocks, an expert without tokens; large activations reach the swigluoai clamps."""
    counts = [1, 7, 8, 9, 0, 17, 3, 24]
    gen = torch.Generator().manual_seed(5)
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    ids = ids[torch.randperm(ids.numel(), generator=gen)].view(-1, 1).cuda()
    T = ids.shape[0]
    bank = _bank(len(counts), 128, 64, 6, "cuda")
    x = (torch.randn(T, 128, generator=gen) * 8).to(torch.bfloat16).cuda()
    w = torch.rand(T, 1, generator=gen).cuda()
    _check(x, ids, w, bank, "top-1 counts")


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
    first = moe_nvfp4_mma(x, ids, w, *parts, **kw)  # warm-up: compile, repack, counters
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
def test_v7_dispatch_takes_the_mma_kernel_for_decode_and_falls_back_above():
    from model.kernels.cuda_moe import moe_nvfp4_mma
    from model.kernels.triton_moe import moe_nvfp4_triton

    bank = _bank(4, 128, 64, 9, "cuda")
    gen = torch.Generator().manual_seed(10)
    for T, takes_mma in ((16, True), (17, False)):  # T * K = 32 = 8 E: v7; 34: v2's tile kernel
        x = torch.randn(T, 128, generator=gen).to(torch.bfloat16).cuda()
        ids, w = _routing(T, 4, 2, gen, "cuda")
        got = moe_nvfp4_triton(x, ids, w, *_parts(bank), **_kw(bank), variant="v7")
        want = (moe_nvfp4_mma if takes_mma else moe_nvfp4_triton)(x, ids, w, *_parts(bank), **_kw(bank))
        assert torch.equal(got, want)
