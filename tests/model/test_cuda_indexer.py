"""v7 CUDA NVFP4 indexer decode (model/kernels/cuda_indexer.py + cuda_indexer.cu).

CPU: a torch emulation of each lane's registers (its shared-memory loads of raw 72-byte key rows, the
kernel's integer decode and byte permutes, the mma.m16n8k16 fragment layouts of the PTX ISA
(tests/model/mma_layouts.py), `k_of` and `key_of_row`) reproduces `nvfp4.kv_dequantize` exactly
(every E2M1 code; e4m3 zero, subnormal and 448 scales) and the query exactly; the emulated MMAs give
the keys' dot products; the emulated warp loop (splits, chunks, causal mask, block max) gives
`block_scores_ref` and, through `select_blocks`, `index_select_blocks_ref`'s selections. GPU (-m gpu):
v7 scores and selections against the reference and the byte-wise tile kernel (v2) at B in {1, 4, 64},
short and long contexts, ragged lengths, -1 padded block tables, 3 / 4 / 8 heads, pages of 64 and 128;
CUDA-graph capture and replay; determinism.
"""

import pytest
import torch

from model import nvfp4
from model.kernels.cuda_common import ragged_tables, random_nvfp4_rows
from model.kernels.cuda_indexer import (
    CHUNK,
    HEAD_DIM,
    ROW_BYTES,
    WARPS,
    block_scores_ref,
    index_block_scores_cuda,
    k_of,
    key_of_row,
    plan_splits,
    v7_applies,
)
from model.kernels.indexer import index_select_blocks_ref, select_blocks
from model.kv_cache import PagedIndex
from tests.model.mma_layouts import (
    a_row_col,
    b_fragments,
    b_row_col,
    bf16_halves,
    byte_perm,
    c_row_col,
    decode_a,
    scale_x2119,
    special_rows,
    u32,
)


# ------------------------------------------------------------------------------- lane emulation
def lane_a_registers(tile_u8: torch.Tensor, g: int, t: int) -> list[list[tuple]]:
    """Lane (g, t)'s A registers for the 8 k-steps of a 16-key tile (uint8 [..., 16, 72] raw rows, as
    the lane reads them from shared memory): [step][reg] = (low, high) fp64 values."""
    rows = [tile_u8[..., key_of_row(g), :], tile_u8[..., key_of_row(g) + 2, :]]  # the kernel's row g + 8
    assert key_of_row(g + 8) == key_of_row(g) + 2
    sel = t | ((t + 4) << 4)
    pairs = [byte_perm(u32(rows[0], 64 + 4 * bb), u32(rows[1], 64 + 4 * bb), sel) & 0xFFFF for bb in (0, 1)]
    steps = []
    for bb in range(2):  # block t, then t + 4; scale_splats of row g's (low) and row g + 8's scale bytes
        s_g, s_g8 = scale_x2119(pairs[bb] & 0xFF), scale_x2119(pairs[bb] >> 8)
        for w in range(2):
            xg = u32(rows[0], 8 * (t + 4 * bb) + 4 * w)
            xh = u32(rows[1], 8 * (t + 4 * bb) + 4 * w)
            for p in range(2):
                qg, qh = (xg >> 8, xh >> 8) if p else (xg, xh)
                steps.append(decode_a(qg, qh, s_g, s_g8))
    return steps


def emulate_tile_keys(tile_u8: torch.Tensor) -> torch.Tensor:
    """Every lane's A registers placed by the PTX A layout, `key_of_row` and `k_of`: fp64
    [..., 16 keys, 128] = e2m1 * s (the kernel's decoded value times its 2^7)."""
    out = torch.full((*tile_u8.shape[:-2], 16, HEAD_DIM), float("nan"), dtype=torch.float64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for step, regs in enumerate(lane_a_registers(tile_u8, g, t)):
            for n in range(4):
                for h in range(2):
                    row, kappa = a_row_col(2 * n + h, g, t)
                    out[..., key_of_row(row), k_of(step, kappa, t)] = regs[n][h] * 2.0**7
    return out


def lane_b_registers(q_NC: torch.Tensor, g: int, t: int) -> list[list[int]]:
    """Lane (g, t)'s B registers (the kernel's query fragment load): [step][j] = 32-bit word."""
    N = q_NC.shape[0]
    if g >= N:
        return [[0, 0] for _ in range(8)]
    bits = q_NC[g].view(torch.int16).long() & 0xFFFF  # [128] bf16 bits
    out = [None] * 8
    for bb in range(2):
        seg = bits[16 * (t + 4 * bb) : 16 * (t + 4 * bb) + 16]
        wv = [int(seg[2 * m]) | (int(seg[2 * m + 1]) << 16) for m in range(8)]  # the two 16-byte loads
        out[4 * bb : 4 * bb + 4] = b_fragments(wv)
    return out


def emulate_query(q_NC: torch.Tensor) -> torch.Tensor:
    """Every lane's B registers placed by the PTX B layout and `k_of`: fp64 [128, 8] (k, head)."""
    out = torch.full((HEAD_DIM, 8), float("nan"), dtype=torch.float64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for step, regs in enumerate(lane_b_registers(q_NC, g, t)):
            for j in range(2):
                lo, hi = bf16_halves(torch.tensor(regs[j]))
                for h, v in enumerate((lo, hi)):
                    kappa, col = b_row_col(2 * j + h, g, t)
                    out[k_of(step, kappa, t), col] = v
    return out


def emulate_tile_mma(tile_u8: torch.Tensor, q_NC: torch.Tensor) -> torch.Tensor:
    """Sum over the 8 k-steps of A_step @ B_step, each fragment built lane by lane, read back through
    the C layout: tiles uint8 [..., 16, 72] -> fp64 [..., 16 keys, 8 heads] dot products (times 2^-7,
    the decode's factor)."""
    lead = tile_u8.shape[:-2]
    A_lanes = [lane_a_registers(tile_u8, lane // 4, lane % 4) for lane in range(32)]
    B_lanes = [lane_b_registers(q_NC, lane // 4, lane % 4) for lane in range(32)]
    D = torch.zeros(*lead, 16, 8, dtype=torch.float64)
    for step in range(8):
        A = torch.full((*lead, 16, 16), float("nan"), dtype=torch.float64)
        B = torch.full((16, 8), float("nan"), dtype=torch.float64)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for n in range(4):
                for h in range(2):
                    r, kappa = a_row_col(2 * n + h, g, t)
                    A[..., r, kappa] = A_lanes[lane][step][n][h]
            for j in range(2):
                for h, v in enumerate(bf16_halves(torch.tensor(B_lanes[lane][step][j]))):
                    kappa, col = b_row_col(2 * j + h, g, t)
                    B[kappa, col] = v
        assert not (A.isnan().any() or B.isnan().any()), "a fragment element was never written"
        D += A @ B
    out = torch.full((*lead, 16, 8), float("nan"), dtype=torch.float64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(4):
            r, col = c_row_col(i, g, t)
            out[..., key_of_row(r), col] = D[..., r, col]
    return out


def emulate_block_scores(q_TNC, pages, scale, table_BP, seq_T, pos_T, n_sms: int = 4) -> torch.Tensor:
    """The kernel's loop (splits, warps' blocks, chunks up to pos, per-key dots from `emulate_tile_mma`,
    mask, block max, scale_2 * 2^7) on the CPU; blocks not written stay NaN."""
    T, N, _ = q_TNC.shape
    page, P = pages.shape[1], table_BP.shape[1]
    out = torch.full((T, N, P), float("nan"))
    splits, bps = plan_splits(T, P, n_sms)
    g_scale = float(scale) * 128.0
    for r in range(T):
        pos = int(pos_T[r])
        n_blocks = pos // page + 1
        for split in range(splits):
            for warp in range(WARPS):
                for blk in range(split * bps + warp, min(split * bps + bps, n_blocks), WARPS):
                    chunks = page // CHUNK if blk < n_blocks - 1 else (pos % page) // CHUNK + 1
                    rows = pages[int(table_BP[int(seq_T[r]), blk]), : chunks * CHUNK]  # the chunks read
                    dots = emulate_tile_mma(rows.view(-1, 16, ROW_BYTES), q_TNC[r]).view(-1, 8)
                    is_vis = blk * page + torch.arange(chunks * CHUNK) <= pos
                    best = dots.masked_fill(~is_vis[:, None], float("-inf")).amax(0)
                    out[r, :, blk] = (best[:N].float() * g_scale).float()
    return out


# ------------------------------------------------------------------------------------------ CPU
def test_k_map_gives_each_lane_two_whole_scale_blocks_and_matches_a_and_b_columns():
    for t in range(4):
        ks = [k_of(i, kappa, t) for i in range(8) for kappa in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)]
        assert sorted(ks) == list(range(16 * t, 16 * t + 16)) + list(range(16 * t + 64, 16 * t + 80))
        for i in range(8):  # a step's values lie in one scale block: one scale per row and step
            assert len({k_of(i, kappa, t) // 16 for kappa in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)}) == 1
    for i in range(8):  # a step's 16 MMA columns are 16 distinct dims
        ks = {k_of(i, kappa, t) for t in range(4) for kappa in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)}
        assert len(ks) == 16
    assert sorted(key_of_row(m) for m in range(16)) == list(range(16))


def test_shared_loads_of_a_half_warp_hit_distinct_bank_pairs():
    """8-byte loads: bank pair = (byte address / 8) mod 16; a half-warp (g = 0..3 or 4..7) is one
    wavefront, so its 16 lanes must touch 16 distinct pairs (code loads) or share words (scales)."""
    for half in (0, 1):
        for row_off in (0, 2):  # rows g and g + 8
            for bb in (0, 1):
                pairs = {((key_of_row(g) + row_off) * ROW_BYTES + 8 * (t + 4 * bb)) // 8 % 16
                         for g in range(4 * half, 4 * half + 4) for t in range(4)}  # fmt: skip
                assert len(pairs) == 16
            scale_pairs = {
                ((key_of_row(g) + row_off) * ROW_BYTES + 64) // 8 % 16 for g in range(4 * half, 4 * half + 4)
            }
            assert len(scale_pairs) == 4


def test_lane_decode_reproduces_kv_dequantize_exactly_for_every_code_and_scale():
    gen = torch.Generator().manual_seed(0)
    rows = special_rows(16 * 12, gen)
    got = emulate_tile_keys(rows.view(12, 16, ROW_BYTES))
    want = nvfp4.kv_dequantize(rows, torch.tensor(1.0), torch.float32).double().view(12, 16, HEAD_DIM)
    assert torch.equal(got, want)


def test_lane_decode_of_quantized_keys_times_the_global_is_kv_dequantize():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, HEAD_DIM, generator=gen) * 3
    scale = torch.tensor(x.abs().max().item() / 2688)
    rows = nvfp4.kv_quantize(x, scale)
    got = (emulate_tile_keys(rows.view(2, 16, ROW_BYTES)).float() * scale).view(32, HEAD_DIM)
    torch.testing.assert_close(got, nvfp4.kv_dequantize(rows, scale, torch.float32), rtol=2**-23, atol=0)


@pytest.mark.parametrize("N", [1, 3, 4, 8])
def test_lane_query_fragments_reproduce_the_query(N):
    gen = torch.Generator().manual_seed(N)
    q = torch.randn(N, HEAD_DIM, generator=gen).to(torch.bfloat16)
    got = emulate_query(q)
    assert torch.equal(got[:, :N], q.double().T) and torch.equal(
        got[:, N:], torch.zeros(HEAD_DIM, 8 - N).double()
    )


def test_emulated_mma_gives_the_keys_dot_products():
    gen = torch.Generator().manual_seed(2)
    rows = special_rows(16, gen)
    q = (torch.randn(4, HEAD_DIM, generator=gen) * 2).to(torch.bfloat16)
    got = emulate_tile_mma(rows, q)[:, :4] * 2.0**7
    keys = nvfp4.kv_dequantize(rows, torch.tensor(1.0), torch.float32).double()
    torch.testing.assert_close(got, keys @ q.double().T, rtol=1e-12, atol=1e-12)
    assert torch.equal(emulate_tile_mma(rows, q)[:, 4:], torch.zeros(16, 4).double())


def _ragged_case(gen, B, lens, page, N):
    table, n_pages = ragged_tables(lens, page, gen)
    pages = special_rows(n_pages * page, gen).view(n_pages, page, ROW_BYTES)
    q = (torch.randn(B, N, HEAD_DIM, generator=gen) * 2).to(torch.bfloat16)
    return q, pages, table


def test_emulated_kernel_loop_equals_the_reference_scores_and_selections():
    """Decode rows (every sequence's last token) and a verify-style chunk (several rows of one
    sequence); lengths not multiples of a block, -1 padded tables, pages of 64 and 128."""
    gen = torch.Generator().manual_seed(3)
    for page, lens, N in ((128, [200, 129, 64], 4), (64, [130, 1], 3)):
        B = len(lens)
        q_B, pages, table = _ragged_case(gen, B, lens, page, N)
        seq = torch.tensor([*range(B), 0, 0], dtype=torch.int32)
        pos = torch.tensor([n - 1 for n in lens] + [lens[0] - 2, 5], dtype=torch.long)
        q = torch.cat([q_B, (torch.randn(2, N, HEAD_DIM, generator=gen) * 2).to(torch.bfloat16)])
        scale = torch.tensor(0.01)
        want = block_scores_ref(q, pages, scale, table, seq, pos)
        got = emulate_block_scores(q, pages, scale, table, seq, pos)
        cand = torch.isfinite(want)
        assert torch.isnan(got[~cand]).all(), "blocks past a row's own block must stay unwritten"
        torch.testing.assert_close(
            got[cand], want[cand], rtol=1e-5, atol=1e-5 * want[cand].abs().max().item()
        )
        kw = dict(topk=2, local_blocks=1, init_blocks=0)
        sel = select_blocks(got.nan_to_num(float("-inf")), (pos // page)[:, None], **kw)
        lens_B = torch.tensor(lens)
        ref = index_select_blocks_ref(
            q, PagedIndex(pages, "nvfp4", scale, HEAD_DIM), table, seq, pos, lens_B, **kw
        )
        assert torch.equal(sel, ref)


def test_split_plan_fills_the_gpu_and_covers_every_block():
    assert plan_splits(64, 1024, 132) == (32, 32)
    assert plan_splits(1, 1024, 132) == (256, 4)
    assert plan_splits(1, 3, 132) == (1, 4)
    for T in (1, 4, 64, 256):
        for nb in (1, 7, 256, 1024, 4096):
            splits, bps = plan_splits(T, nb, 132)
            assert bps % WARPS == 0 and splits * bps >= nb > (splits - 1) * bps


def test_v7_does_not_apply_on_cpu_and_the_cuda_entry_rejects_it():
    q = torch.zeros(1, 4, HEAD_DIM, dtype=torch.bfloat16)
    pages = torch.zeros(2, 128, ROW_BYTES, dtype=torch.uint8)
    assert not v7_applies(q, pages, "nvfp4")
    table, seq, pos = (
        torch.zeros(1, 2, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        torch.zeros(1).long(),
    )
    with pytest.raises(ValueError, match="sm_90"):
        index_block_scores_cuda(q, pages, torch.tensor(1.0), table, seq, pos)


def test_v7_is_the_default_variant():
    """The engine calls the indexer without a variant: v7 must be what it gets (off CUDA, and for
    shapes v7 does not take, the tile kernel: kernel_cases' "indexer" group checks that path)."""
    pytest.importorskip("triton")
    import inspect

    from model.kernels.triton_indexer import (
        DecodeVariant,
        index_block_scores_triton,
        index_select_blocks_triton,
    )

    assert DecodeVariant.__args__[0] == "v7"
    for fn in (index_block_scores_triton, index_select_blocks_triton):
        assert inspect.signature(fn).parameters["variant"].default == "v7"


# ------------------------------------------------------------------------------------------ GPU
# Scores: exact products, fp32 sums in another order (tensor-core accumulation): a mapping or decode
# error is O(1) of the largest score, summation order ~1e-6 of it.
TOL = 1e-4


def _gpu_case(B, ctx, page, N, seed, ragged=True, special=True):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, ctx + 1, (B,), generator=gen).tolist() if ragged else [ctx] * B
    if ragged:
        lens[0] = ctx  # the longest row reaches the table's width
    table, n_pages = ragged_tables(lens, page, gen, spare_cols=2, spare_pages=3)  # -1 past every row
    dev = torch.device("cuda")
    pages = random_nvfp4_rows((n_pages, page), dev, torch.Generator(device=dev).manual_seed(seed), special)
    q = (torch.randn(B, N, HEAD_DIM, generator=gen) * 2).to(torch.bfloat16).to(dev)
    seq = torch.arange(B, dtype=torch.int32, device=dev)
    pos = torch.tensor(lens, device=dev).long() - 1
    return q, pages, table.to(dev), seq, pos, torch.tensor(lens, device=dev)


@pytest.mark.parametrize("B,ctx", [(1, 300), (1, 20000), (4, 1000), (4, 40000), (64, 700), (64, 9000)])
@pytest.mark.parametrize("N,page", [(4, 128), (3, 64), (8, 128)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_v7_scores_and_selections_match_the_reference_and_v2(B, ctx, N, page):
    from model.kernels.triton_indexer import index_block_scores_triton, index_select_blocks_triton

    q, pages, table, seq, pos, lens = _gpu_case(B, ctx, page, N, seed=B * 7 + ctx + N)
    scale = torch.tensor(0.01, device="cuda")
    assert v7_applies(q, pages, "nvfp4")
    want = block_scores_ref(q, pages, scale, table, seq, pos)
    got = index_block_scores_cuda(
        q, pages, scale, table, seq, pos, out_TNP=torch.full_like(want, float("nan"))
    )
    cand = torch.isfinite(want)
    assert torch.isnan(got[~cand]).all(), "blocks past a row's own block must stay unwritten"
    norm = want[cand].abs().max().item()
    err = (got[cand] - want[cand]).abs().max().item()
    assert err <= TOL * norm, f"vs reference: max err {err} > {TOL} x {norm}"
    v2 = index_block_scores_triton(q, pages, "nvfp4", scale, table, seq, pos, variant="v2")
    err = (got[cand] - v2[cand]).abs().max().item()
    assert err <= TOL * norm, f"vs v2: max err {err} > {TOL} x {norm}"
    kw = dict(topk=16, local_blocks=1, init_blocks=0)
    sel7 = index_select_blocks_triton(q, pages, "nvfp4", scale, table, seq, pos, **kw, variant="v7")
    ref = select_blocks(want, (pos // page)[:, None], **kw)
    agree = (sel7.sort(-1).values == ref.sort(-1).values).float().mean().item()
    assert agree >= 0.999, f"selections agree with the reference's on {agree:.4f} only"  # near-ties aside
    if B <= 4 and ctx <= 1000:  # the spec itself (a Python loop over sequences)
        index = PagedIndex(pages, "nvfp4", scale, HEAD_DIM)
        spec = index_select_blocks_ref(q, index, table, seq, pos, lens, **kw)
        assert (sel7.sort(-1).values == spec.sort(-1).values).float().mean().item() >= 0.999


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_v7_verify_rows_of_one_sequence_and_int64_tables():
    """Several query rows of one sequence (a verify / prefill chunk), int64 tables and seq ids."""
    q, pages, table, *_ = _gpu_case(1, 5000, 128, 4, seed=11, ragged=False)
    T = 37
    rows_pos = torch.linspace(0, 4999, T).long().cuda()
    q = (torch.randn(T, 4, HEAD_DIM) * 2).to(torch.bfloat16).cuda()
    seq = torch.zeros(T, dtype=torch.long, device="cuda")
    scale = torch.tensor(0.02, device="cuda")
    want = block_scores_ref(q, pages, scale, table, seq, rows_pos)
    got = index_block_scores_cuda(q, pages, scale, table.long(), seq, rows_pos)
    cand = torch.isfinite(want)
    torch.testing.assert_close(got[cand], want[cand], rtol=TOL, atol=TOL * want[cand].abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_v7_graph_replay_equals_eager_and_is_deterministic():
    from model.kernels.triton_indexer import index_select_blocks_triton

    q, pages, table, seq, pos, _ = _gpu_case(64, 32768, 128, 4, seed=12, ragged=False, special=False)
    scale = torch.tensor(0.01, device="cuda")
    kw = dict(topk=16, local_blocks=1, init_blocks=0)
    first = index_block_scores_cuda(q, pages, scale, table, seq, pos)  # warm-up: compile
    again = index_block_scores_cuda(q, pages, scale, table, seq, pos)
    cand = (torch.arange(table.shape[1], device="cuda") <= (pos // 128)[:, None])[:, None, :].expand_as(first)
    assert torch.equal(first[cand], again[cand]), "two runs differ (determinism)"
    out = torch.empty(q.shape[0], 4, 16, dtype=torch.long, device="cuda")
    index_select_blocks_triton(q, pages, "nvfp4", scale, table, seq, pos, **kw, out_TNK=out, variant="v7")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        index_select_blocks_triton(q, pages, "nvfp4", scale, table, seq, pos, **kw, out_TNK=out, variant="v7")
    q.copy_((torch.randn_like(q.float()) * 2).to(torch.bfloat16))
    pos.sub_(1000)
    graph.replay()
    torch.cuda.synchronize()
    want = index_select_blocks_triton(q, pages, "nvfp4", scale, table, seq, pos, **kw, variant="v7")
    assert torch.equal(out, want), "graph replay differs from eager"
