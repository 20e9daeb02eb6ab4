"""v7 CUDA NVFP4 sparse-attention decode (model/kernels/cuda_attention.py + cuda_attention.cu).

CPU: a torch emulation of each lane's registers, written against the kernel's byte offsets, integer
decode, prmt selectors and the PTX fragment layouts (tests/model/mma_layouts.py):
- Q.K: the A operand decoded from raw 72-byte K rows reproduces `nvfp4.kv_dequantize` exactly (every
  E2M1 code; zero, subnormal, 448 and negative scales) at the rows `key_of_row` and dims `k_of` name;
  the B operand (the query fragments warp 0 writes to shared memory) reproduces the query; the
  emulated MMAs give the keys' dot products.
- P.V: the movmatrix transposes turn the S^T fragments into P's A operand with column kappa = S^T row
  kappa; the B operand decoded from raw V rows (two keys per register, scale pairs, rows past pos
  zeroed) reproduces `kv_dequantize` at keys key_of_row(kappa) and dims `pv_dim`; the emulated MMAs
  give P V, and the epilogue's store map covers every (head, dim) once.
- every shared load of a warp is free of bank conflicts;
- the kernel's algorithm (split plan, warps' units, skipped -1 / future units, partial last block,
  lazy softmax reference with its vote, bf16 P, warp then split merges in order) equals
  `sparse_attention_ref` and visits every visible key exactly once.
GPU (-m gpu): v7 against `sparse_attention_ref` and v6 (B in {1, 3, 8, 64}, short and long contexts,
ragged lengths with partial last pages, groups with no visible key, G in {2, 5, 8, 16}, dense and
sparse walks, int32 / int64 indices, two calibrations); CUDA-graph capture and replay; determinism.
"""

import math

import pytest
import torch

from model import nvfp4
from model.kernels.cuda_attention import (
    HEAD_DIM,
    PART_FLOATS,
    ROW_BYTES,
    UNIT,
    WARPS,
    k_of,
    key_of_row,
    plan_splits,
    pv_dim,
    pv_key,
    qk_block,
    ragged_problem,
    sig,
    sparse_attention_cuda,
    v7_applies,
    visible_selections,
)
from model.kernels.sparse_attention import sparse_attention, sparse_attention_ref
from model.kv_cache import PagedKV
from tests.model.mma_layouts import (
    a_row_col,
    b_fragments,
    b_row_col,
    bf16_halves,
    bmul,
    byte_perm,
    c_row_col,
    decode_a,
    nibble_pair,
    scale_x2119,
    special_rows,
    u32,
)

NEG_BIG = -1.0e30
REF_SLACK = 8.0


# ------------------------------------------------------------------------------------------ bit helpers
def to_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.float().to(torch.bfloat16).double()


# ------------------------------------------------------------------------------------------ Q . K lanes
def lane_k_registers(tile_u8: torch.Tensor, g: int, t: int) -> list[list[tuple]]:
    """Lane (g, t)'s Q.K A registers for the 8 k-steps of a 16-key tile (uint8 [..., 16, 72] as
    staged): `unit_scores`' loads (blocks b0, b0 + 2 at byte 8 b0 and + 16, the scale word at 64 +
    4 (t >> 1), prmt selectors), `scale_splats` and `decode_a`. [step][reg] = (low, high) fp64."""
    kg = 4 * sig(g >> 1) + 2 * (g & 1)
    rows = [tile_u8[..., kg, :], tile_u8[..., kg + 1, :]]  # rows g and g + 8 of the MMA
    b0 = qk_block(t, 0)
    swd = 64 + 4 * (t >> 1)
    sels = [(b0 & 3) | (((b0 & 3) + 4) << 4), ((b0 + 2) & 3) | ((((b0 + 2) & 3) + 4) << 4)]
    sg, sh = u32(rows[0], swd), u32(rows[1], swd)
    steps = []
    for bb in range(2):
        pair = byte_perm(sg, sh, sels[bb])
        s_g, s_g8 = scale_x2119(pair & 0xFF), scale_x2119((pair >> 8) & 0xFF)
        for w in range(2):
            xg, xh = u32(rows[0], 8 * b0 + 16 * bb + 4 * w), u32(rows[1], 8 * b0 + 16 * bb + 4 * w)
            for p in range(2):
                qg, qh = (xg >> 8, xh >> 8) if p else (xg, xh)
                steps.append(decode_a(qg, qh, s_g, s_g8))
    return steps


def emulate_k_tile(tile_u8: torch.Tensor) -> torch.Tensor:
    """Every lane's A registers placed by the PTX A layout, `key_of_row` and `k_of`: fp64 [..., 16
    keys, 128] = e2m1 * s (the decoded value times its 2^7)."""
    out = torch.full((*tile_u8.shape[:-2], 16, HEAD_DIM), float("nan"), dtype=torch.float64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for step, regs in enumerate(lane_k_registers(tile_u8, g, t)):
            for n in range(4):
                for h in range(2):
                    row, kappa = a_row_col(2 * n + h, g, t)
                    out[..., key_of_row(row), k_of(step, kappa, t)] = regs[n][h] * 2.0**7
    return out


def query_fragments(q_GC: torch.Tensor) -> list[list[list[int]]]:
    """The kernel's shared-memory Q fragments (warp 0's stores): [step][lane][4 words] (n-tile 0's two
    B registers, then n-tile 1's; heads >= G zero)."""
    G = q_GC.shape[0]
    bits = q_GC.view(torch.int16).long() & 0xFFFF
    out = [[[0, 0, 0, 0] for _ in range(32)] for _ in range(8)]
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for nt in range(2):
            h = 8 * nt + g
            if h >= G:
                continue
            for bb in range(2):
                seg = bits[h, 16 * qk_block(t, bb) : 16 * qk_block(t, bb) + 16]
                wv = [int(seg[2 * m]) | (int(seg[2 * m + 1]) << 16) for m in range(8)]
                for i, regs in enumerate(b_fragments(wv)):
                    out[4 * bb + i][lane][2 * nt : 2 * nt + 2] = regs
    return out


def emulate_qk(tiles_u8: torch.Tensor, q_GC: torch.Tensor) -> torch.Tensor:
    """Sum over the 8 k-steps of A_step @ B_step for both n-tiles, fragments built lane by lane, read
    back through the C layout: tiles uint8 [..., 16, 72] -> fp64 [..., 16 keys, 16 heads] (x 2^-7)."""
    lead = tiles_u8.shape[:-2]
    A_lanes = [lane_k_registers(tiles_u8, lane // 4, lane % 4) for lane in range(32)]
    qf = query_fragments(q_GC)
    D = torch.zeros(*lead, 2, 16, 8, dtype=torch.float64)
    for step in range(8):
        A = torch.full((*lead, 16, 16), float("nan"), dtype=torch.float64)
        B = torch.full((2, 16, 8), float("nan"), dtype=torch.float64)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for n in range(4):
                for h in range(2):
                    r, kappa = a_row_col(2 * n + h, g, t)
                    A[..., r, kappa] = A_lanes[lane][step][n][h]
            for nt in range(2):
                for j in range(2):
                    for h, v in enumerate(bf16_halves(torch.tensor(qf[step][lane][2 * nt + j]))):
                        kappa, col = b_row_col(2 * j + h, g, t)
                        B[nt, kappa, col] = v
        assert not (A.isnan().any() or B.isnan().any()), "a fragment element was never written"
        D += A[..., None, :, :] @ B
    out = torch.full((*lead, 16, 16), float("nan"), dtype=torch.float64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for nt in range(2):
            for i in range(4):
                r, col = c_row_col(i, g, t)
                out[..., key_of_row(r), 8 * nt + col] = D[..., nt, r, col]
    return out


# ------------------------------------------------------------------------------------------ P . V lanes
def movmatrix_trans(regs: list[torch.Tensor]) -> list[torch.Tensor]:
    """PTX movmatrix.m8n8.trans.b16 over a warp: lane i's register holds row i // 4, columns
    2 (i % 4) + {0, 1} (low half first); the result holds the same of the transposed matrix."""
    M = [[None] * 8 for _ in range(8)]
    for i in range(32):
        M[i // 4][2 * (i % 4)] = regs[i] & 0xFFFF
        M[i // 4][2 * (i % 4) + 1] = (regs[i] >> 16) & 0xFFFF
    return [M[2 * (i % 4)][i // 4] | (M[2 * (i % 4) + 1][i // 4] << 16) for i in range(32)]


def bf16_bits(x: torch.Tensor) -> torch.Tensor:
    return x.float().to(torch.bfloat16).view(torch.int16).long() & 0xFFFF


def p_fragments(p_kh: torch.Tensor) -> list[list[torch.Tensor]]:
    """The kernel's P A operand of one 16-key tile from P^T in S^T's C layout: p_kh fp32 [16 keys,
    16 heads] indexed by key; lane (g, t) packs (c0, c1) and (c2, c3) of each n-tile to bf16x2 and the
    movmatrix transposes give A register nt + 2 h. [lane][reg] int64."""
    packs = {}
    for nt in range(2):
        for hrow in range(2):  # C rows g (c0, c1) and g + 8 (c2, c3)
            regs = []
            for lane in range(32):
                g, t = lane // 4, lane % 4
                key = key_of_row(g + 8 * hrow)
                lo, hi = bf16_bits(p_kh[key, 8 * nt + 2 * t]), bf16_bits(p_kh[key, 8 * nt + 2 * t + 1])
                regs.append(lo | (hi << 16))
            packs[nt, hrow] = movmatrix_trans(regs)
    return [[packs[nt, h][lane] for h in range(2) for nt in range(2)] for lane in range(32)]


def lane_v_registers(tile_u8: torch.Tensor, g: int, t: int, lim: int = 3) -> list[list[tuple]]:
    """Lane (g, t)'s P.V B registers for the 16 n-tiles of a 16-key tile of V rows (uint8 [16, 72]):
    `tile_pv`'s loads (rows 4 sig(t) + x, bytes 8g .., scale byte 64 + g, zero past lim), scale pairs,
    prmt merges and decode. [n_tile][reg] = (low, high) fp64."""
    vk = 4 * sig(t)
    rows = [tile_u8[vk + x] for x in range(4)]
    sb = [rows[x][64 + g].long() if x <= lim else torch.tensor(0) for x in range(4)]
    sp = [(scale_x2119(sb[j]), scale_x2119(sb[j + 2])) for j in range(2)]  # scale_pair: {vk + j, vk + j + 2}
    out = [[None, None] for _ in range(16)]
    for wd in range(2):
        ql, qh = [], []
        for j in range(2):
            a, b = u32(rows[j], 8 * g + 4 * wd), u32(rows[j + 2], 8 * g + 4 * wd)
            ql.append(byte_perm(a, b, 0x5410))
            qh.append(byte_perm(a, b, 0x7632))
        for nb in range(8):
            for j in range(2):
                src = (ql[j] if nb < 4 else qh[j]) >> (8 * ((nb >> 1) & 1))
                lo, hi = nibble_pair(src, nb & 1)
                out[8 * wd + nb][j] = (bmul(lo, sp[j][0]), bmul(hi, sp[j][1]))
    return out


def emulate_v_tile(tile_u8: torch.Tensor, lim_t=lambda t: 3) -> torch.Tensor:
    """Every lane's B registers placed by the PTX B layout: fp64 [16 keys, 128] at key key_of_row(kappa)
    (P's column kappa) and dim `pv_dim`, = e2m1 * s (times 2^7)."""
    out = torch.full((16, HEAD_DIM), float("nan"), dtype=torch.float64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        regs = lane_v_registers(tile_u8, g, t, lim_t(t))
        for jn in range(16):
            for j in range(2):
                for h in range(2):
                    kappa, col = b_row_col(2 * j + h, g, t)
                    assert key_of_row(kappa) == pv_key(t, j, h)
                    out[key_of_row(kappa), pv_dim(jn, col)] = regs[jn][j][h] * 2.0**7
    return out


def emulate_pv(tile_u8: torch.Tensor, p_kh: torch.Tensor) -> torch.Tensor:
    """O [16 heads, 128 dims] (x 2^-7) of one tile: A = P from `p_fragments`, B from
    `lane_v_registers`, each n-tile's MMA read back through the C layout and `pv_dim`."""
    pa = p_fragments(p_kh)
    A = torch.full((16, 16), float("nan"), dtype=torch.float64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for n in range(4):
            for h, v in enumerate(bf16_halves(pa[lane][n])):
                r, kappa = a_row_col(2 * n + h, g, t)
                A[r, kappa] = v
    lanes = [lane_v_registers(tile_u8, lane // 4, lane % 4) for lane in range(32)]
    out = torch.full((16, HEAD_DIM), float("nan"), dtype=torch.float64)
    for jn in range(16):
        B = torch.full((16, 8), float("nan"), dtype=torch.float64)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for j in range(2):
                for h in range(2):
                    kappa, col = b_row_col(2 * j + h, g, t)
                    B[kappa, col] = lanes[lane][jn][j][h]
        D = A @ B
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for i in range(4):
                r, col = c_row_col(i, g, t)
                out[r, pv_dim(jn, col)] = D[r, col]
    return out


# ------------------------------------------------------------------------------------------ CPU: maps
def test_row_map_is_a_permutation_and_pv_keys_are_the_movmatrix_columns():
    assert sorted(key_of_row(m) for m in range(16)) == list(range(16))
    for t in range(4):
        # P.V lane t holds keys 4 sig(t) .. + 3: its V rows are consecutive.
        keys = sorted(pv_key(t, j, h) for j in range(2) for h in range(2))
        assert keys == list(range(4 * sig(t), 4 * sig(t) + 4))
        for j in range(2):
            for h in range(2):  # movmatrix: P's column 2t + h + 8j is S^T's row 2t + h + 8j
                assert pv_key(t, j, h) == key_of_row(2 * t + h + 8 * j)
    for g in range(8):  # Q.K: rows g and g + 8 are adjacent keys (the kernel loads row8 = row + 72)
        assert key_of_row(g + 8) == key_of_row(g) + 1 == 4 * sig(g >> 1) + 2 * (g & 1) + 1


def test_k_map_gives_each_lane_two_whole_scale_blocks():
    for t in range(4):
        ks = [k_of(i, kappa, t) for i in range(8) for kappa in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)]
        blocks = [qk_block(t, 0), qk_block(t, 1)]
        assert sorted(ks) == sorted(d for b in blocks for d in range(16 * b, 16 * b + 16))
        for i in range(8):  # a step's values lie in one scale block: one splat per row and step
            assert len({k_of(i, kappa, t) // 16 for kappa in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)}) == 1
    for i in range(8):
        ks = {k_of(i, kappa, t) for t in range(4) for kappa in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)}
        assert len(ks) == 16
    assert sorted(pv_dim(j, c) for j in range(16) for c in range(8)) == list(range(HEAD_DIM))


def test_epilogue_store_map_covers_every_head_and_dim_once():
    """Thread (warp w, lane) stores O registers 16 w .. 16 w + 15 of its lane: register 4 j + c is
    head g + 8 (c >> 1), dim 16 (2t + (c & 1)) + j (the C layout through `pv_dim`), and `store_out`'s
    8-byte store of c covers dims 16 (2t + (c & 1)) + 4 w + 0..3 in register order c, 4 + c, 8 + c, 12 + c."""
    seen = set()
    for w in range(WARPS):
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for c in range(4):
                base = 16 * (2 * t + (c & 1)) + 4 * w
                for k in range(4):
                    reg = 16 * w + 4 * k + c
                    row, col = c_row_col(reg % 4, g, t)
                    assert (row, pv_dim(reg // 4, col)) == (g + 8 * (c >> 1), base + k)
                    seen.add((row, base + k))
    assert len(seen) == 16 * HEAD_DIM


def _conflict_free(addrs: list[int], width: int) -> bool:
    """One wavefront: distinct words (width bytes) map to distinct banks (4-byte banks, 32 of them)."""
    words = {a // width for a in addrs}
    return len({(w * width // 4) % 32 for w in words}) == len(words)


def _qk_row(g: int, hrow: int) -> int:
    """Stage row lane group g reads for MMA row g (hrow 0) or g + 8 (hrow 1) in Q.K."""
    return 4 * sig(g >> 1) + 2 * (g & 1) + hrow


def test_every_shared_load_of_a_warp_is_conflict_free():
    """64-bit loads are served per half-warp (16 lanes), 32-bit / 8-bit per warp; rows are 72 bytes
    (K rows at the stage start, V rows 2304 bytes later: both 128-byte aligned)."""
    lanes = [(lane // 4, lane % 4) for lane in range(32)]
    halves = [lanes[:16], lanes[16:]]
    for tt in range(2):
        for hrow in range(2):  # Q.K: rows g, g + 8; blocks b0, b0 + 2
            for bb in range(2):
                for half in halves:
                    a = [(16 * tt + _qk_row(g, hrow)) * ROW_BYTES + 8 * qk_block(t, bb) for g, t in half]
                    assert _conflict_free(a, 8), (tt, hrow, bb)
            a = [(16 * tt + _qk_row(g, hrow)) * ROW_BYTES + 64 + 4 * (t >> 1) for g, t in lanes]
            assert _conflict_free(a, 4)
        for x in range(4):  # P.V: rows 4 sig(t) + x, code bytes 8g, scale byte 64 + g
            for half in halves:
                a = [2304 + (16 * tt + 4 * sig(t) + x) * ROW_BYTES + 8 * g for g, t in half]
                assert _conflict_free(a, 8), (tt, x)
            a = [2304 + (16 * tt + 4 * sig(t) + x) * ROW_BYTES + 64 + g for g, t in lanes]
            assert _conflict_free(a, 4)


# ------------------------------------------------------------------------------------------ CPU: decode
def test_qk_lane_decode_reproduces_kv_dequantize_exactly_for_every_code_and_scale():
    gen = torch.Generator().manual_seed(0)
    rows = special_rows(16 * 6, gen)
    got = emulate_k_tile(rows.view(6, 16, ROW_BYTES))
    want = nvfp4.kv_dequantize(rows, torch.tensor(1.0), torch.float32).double().view(6, 16, HEAD_DIM)
    assert torch.equal(got, want)


def test_pv_lane_decode_reproduces_kv_dequantize_and_zeroes_rows_past_pos():
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        rows = special_rows(16, gen)
        want = nvfp4.kv_dequantize(rows, torch.tensor(1.0), torch.float32).double()
        assert torch.equal(emulate_v_tile(rows), want)
        # pos inside the tile at key 9: lane t's rows 4 sig(t) + x are keys for x <= 9 - 4 sig(t).
        got = emulate_v_tile(rows, lim_t=lambda t: min(9 - 4 * sig(t), 3))
        assert torch.equal(got[:10], want[:10]) and torch.equal(got[10:], torch.zeros(6, HEAD_DIM).double())
    garbage = torch.full((16, ROW_BYTES), 0xFF, dtype=torch.uint8)  # NaN scale bytes everywhere
    assert torch.equal(emulate_v_tile(garbage, lim_t=lambda t: -1), torch.zeros(16, HEAD_DIM).double())


@pytest.mark.parametrize("G", [2, 5, 16])
def test_emulated_qk_mma_gives_the_keys_dot_products(G):
    gen = torch.Generator().manual_seed(G)
    rows = special_rows(32, gen).view(2, 16, ROW_BYTES)
    q = (torch.randn(G, HEAD_DIM, generator=gen) * 2).to(torch.bfloat16)
    got = emulate_qk(rows, q) * 2.0**7
    keys = nvfp4.kv_dequantize(rows, torch.tensor(1.0), torch.float32).double()
    torch.testing.assert_close(got[..., :G], keys @ q.double().T, rtol=1e-12, atol=1e-12)
    assert torch.equal(got[..., G:], torch.zeros(2, 16, 16 - G).double())


def test_emulated_pv_mma_through_movmatrix_gives_p_times_v():
    gen = torch.Generator().manual_seed(3)
    rows = special_rows(16, gen)
    p_kh = torch.rand(16, 16, generator=gen) * 300  # lazy reference: P up to 2^8
    got = emulate_pv(rows, p_kh) * 2.0**7
    v = nvfp4.kv_dequantize(rows, torch.tensor(1.0), torch.float32).double()
    torch.testing.assert_close(got, to_bf16(p_kh).T @ v, rtol=1e-12, atol=1e-9)


# ------------------------------------------------------------------------------------------ CPU: algorithm
def emulate_kernel(q, kv: PagedKV, table, seq, pos, sel, softmax_scale, n_sms=4, visits=None):
    """The kernel's algorithm in fp64 on the CPU, at warp granularity (the lanes' fragments are the
    tests above): grid (T, N, splits) from `plan_splits`, active splits, warp w's units u = split * ups +
    w + 4 k, units skipped without keys, the lazy reference and its vote, P rounded to bf16, row sums
    of unrounded P, then the warp and split merges in index order and the epilogue. `visits` collects
    (t, n, key) of every key that enters a softmax."""
    T, H, C = q.shape
    N, page = kv.pages.shape[1] // 2, kv.pages.shape[2]
    G, cpb = H // N, page // UNIT
    n_slots = table.shape[1] if sel is None else sel.shape[2]
    _, ups = plan_splits(T * N, n_slots, page, n_sms)
    factor = float(kv.k_scale) * 128 * softmax_scale * math.log2(math.e)
    one = torch.tensor(1.0)
    out = torch.zeros(T, H, C, dtype=torch.float64)
    for tok in range(T):
        p_t, b = int(pos[tok]), int(seq[tok])
        units = min(n_slots, p_t // page + 1) * cpb if p_t >= 0 else 0
        active = max(1, -(-units // ups))
        for n in range(N):
            qn = q[tok, n * G : (n + 1) * G].double()
            parts = []
            for split in range(active):
                warps = []
                for w in range(WARPS):
                    m = torch.full((G,), NEG_BIG, dtype=torch.float64)
                    l_sum = torch.zeros(G, dtype=torch.float64)
                    o = torch.zeros(G, C, dtype=torch.float64)
                    u_end = min(units, split * ups + ups)
                    for u in range(split * ups + w, u_end, WARPS):
                        slot, chunk = divmod(u, cpb)
                        blk = slot if sel is None else int(sel[tok, n, slot])
                        key0 = blk * page + chunk * UNIT
                        if blk < 0 or key0 > p_t:
                            continue
                        pg = int(table[b, blk])
                        rows = slice(chunk * UNIT, chunk * UNIT + UNIT)
                        k, v = (nvfp4.kv_dequantize(kv.pages[pg, 2 * n + side, rows], one, torch.float32)
                                for side in (0, 1))  # fmt: skip
                        is_key = key0 + torch.arange(UNIT) <= p_t
                        v = torch.where(is_key[:, None], v.double() / 128, 0.0)
                        s = (qn @ (k.double() / 128).T) * factor  # [G, 32]
                        s = s.masked_fill(~is_key[None, :], float("-inf"))
                        if visits is not None:
                            visits.extend((tok, n, key0 + i) for i in range(UNIT) if is_key[i])
                        mx = s.max(1).values
                        if bool((mx > m + REF_SLACK).any()):
                            m_new = torch.maximum(m, mx)
                            alpha = torch.exp2(m - m_new)
                            m, l_sum, o = m_new, l_sum * alpha, o * alpha[:, None]
                        p = torch.exp2(s - m[:, None])
                        assert float(p.max()) <= 2**REF_SLACK, "P must stay <= 2^8 (bf16 / fp32 range)"
                        l_sum = l_sum + p.sum(1)
                        o = o + to_bf16(p) @ v
                    warps.append((m, l_sum, o))
                parts.append(_merge(warps))
            m, l_sum, o = _merge(parts)
            f = torch.where(l_sum > 0, float(kv.v_scale) * 128 / l_sum.clamp_min(1e-300), 0.0)
            out[tok, n * G : (n + 1) * G] = o * f[:, None]
    return out


def _merge(parts):
    m = torch.stack([p[0] for p in parts]).max(0).values
    w = [torch.exp2(p[0] - m) for p in parts]
    return m, sum(wi * p[1] for wi, p in zip(w, parts)), sum(wi[:, None] * p[2] for wi, p in zip(w, parts))


@pytest.mark.parametrize(
    "lens,G,K,dense,n_sms,q_mul",
    [([300, 129, 1000], 16, 4, False, 4, 1.0), ([700, 1, 260, 2049], 2, 8, False, 4, 1.0),
     ([900, 333], 16, 16, True, 2, 1.0), ([40, 640], 5, 16, False, 200, 1.0),
     ([2000, 1300], 16, 16, False, 4, 30.0)],
)  # fmt: skip
def test_emulated_kernel_equals_the_reference_and_visits_each_visible_key_once(lens, G, K, dense, n_sms,
                                                                              q_mul):  # fmt: skip
    """Ragged lengths (partial last pages: 300 = 2 x 128 + 44, lengths 1 and 129), group 0 of row 0
    with no selected block (zeros), -1 slots, a dense walk, many splits (n_sms = 200) and one, and a
    peaked softmax (q x 30: scores spread over hundreds of log2 units, so the lazy reference must move)."""
    gen = torch.Generator().manual_seed(len(lens) * 7 + G)
    q, kv, table, seq, pos, sel = ragged_problem(lens, 2, G, K, 128, gen, calib=448.0)
    q = (q.float() * q_mul).to(torch.bfloat16)
    sel = None if dense else sel
    visits = []
    got = emulate_kernel(q, kv, table, seq, pos, sel, HEAD_DIM**-0.5, n_sms=n_sms, visits=visits)
    want = sparse_attention_ref(q, kv, table, seq, pos, torch.tensor(lens), sel, softmax_scale=HEAD_DIM**-0.5)
    want = want.double()
    assert (got - want).abs().max() <= 2**-7 * want.abs().max()  # bf16 P (2^-9) and the output rounding
    if not dense:
        assert torch.equal(got[0, :G], torch.zeros(G, HEAD_DIM).double())
    expect = set()
    for t in range(len(lens)):
        for n in range(2):
            blocks = range(int(pos[t]) // 128 + 1) if dense else [int(b) for b in sel[t, n] if b >= 0]
            last = int(pos[t])
            expect |= {(t, n, j) for blk in blocks for j in range(blk * 128, min(blk * 128 + 128, last + 1))}
    assert len(visits) == len(set(visits)) and set(visits) == expect


# ------------------------------------------------------------------------------------------ CPU: plan / entry
def test_split_plan_fills_the_gpu_and_covers_every_unit():
    assert plan_splits(256, 16, 128, 132) == (4, 16)
    assert plan_splits(4, 16, 128, 132) == (16, 4)
    for pairs in (1, 4, 32, 256, 1024):
        for n_slots in (1, 3, 16, 1024):
            splits, ups = plan_splits(pairs, n_slots, 128, 132)
            units = n_slots * 4
            assert ups % WARPS == 0 and splits * ups >= units > (splits - 1) * ups
    assert PART_FLOATS * 4 % 128 == 0  # the partials' L2 discards take whole 128-byte lines


def test_selftest_reference_over_selected_pages_equals_the_spec():
    from model.kernels.cuda_attention import decode_problem, selected_pages_ref

    for B, ctx, K in ((3, 1000, 16), (2, 4096, 4)):  # fewer blocks than slots (-1 padded), and more
        q, kv, table, seq, pos, sel = decode_problem(B, ctx, 2, 4, K, torch.device("cpu"), seed=ctx)
        want = sparse_attention_ref(q, kv, table, seq, pos, pos + 1, sel, softmax_scale=HEAD_DIM**-0.5)
        got = selected_pages_ref(q, kv, table, pos, sel, HEAD_DIM**-0.5)
        torch.testing.assert_close(got, want.float(), rtol=0, atol=2**-8 * want.abs().max().item())


def test_v7_does_not_apply_on_cpu_and_the_entry_rejects_it():
    gen = torch.Generator().manual_seed(5)
    q, kv, table, seq, pos, sel = ragged_problem([200], 2, 4, 2, 128, gen, calib=448.0)
    assert not v7_applies(q, kv)
    with pytest.raises(ValueError, match="sm_90"):
        sparse_attention_cuda(q, kv, table, seq, pos, sel, softmax_scale=0.1)


def test_dispatch_v7_falls_back_off_cuda_and_rejects_unknown_variants():
    gen = torch.Generator().manual_seed(6)
    q, kv, table, seq, pos, sel = ragged_problem([300, 70], 2, 4, 2, 128, gen, calib=448.0)
    lens = pos + 1
    want = sparse_attention(q, kv, table, seq, pos, lens, sel, softmax_scale=0.1)
    got = sparse_attention(q, kv, table, seq, pos, lens, sel, softmax_scale=0.1, variant="v7")
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="variant"):
        sparse_attention(q, kv, table, seq, pos, lens, sel, softmax_scale=0.1, variant="v5")


# ------------------------------------------------------------------------------------------ GPU
# Bound: K, V decode exactly, every product is exact in fp32; left are P rounded to bf16 for P.V
# (relative 2^-9 per weight, errors of both signs), ex2.approx (~2^-22), fp32 summation order and the
# bf16 output (2^-9 relative): about 2^-9 of the output scale. 2^-7 leaves 4x room; a fragment or
# mapping error is O(1) of it.
TOL = 2**-7

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _gpu_problem(lens, N, G, K, seed, calib=448.0, idx64=False):
    gen = torch.Generator().manual_seed(seed)
    q, kv, table, seq, pos, sel = ragged_problem(lens, N, G, K, 128, gen, calib=calib)
    cpu = (q, kv, table, seq, pos, torch.tensor(lens), sel)
    dev = torch.device("cuda")
    cast = (lambda x: x.long()) if idx64 else (lambda x: x.int())
    kv_d = PagedKV(kv.pages.to(dev), kv.dtype, kv.k_scale.to(dev), kv.v_scale.to(dev), HEAD_DIM)
    gpu_args = (q.to(dev), kv_d, cast(table).to(dev), cast(seq).to(dev), cast(pos).to(dev), cast(sel).to(dev))
    return cpu, gpu_args


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float().cpu() - want.float()).abs().max().item() / max(want.abs().max().item(), 1e-30)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("lens,G,K", [
    ([300, 129, 1000], 16, 4), ([5000, 128, 77, 4096, 3000], 16, 16), ([700, 1, 260, 2049], 2, 8),
    ([1500, 40, 640], 5, 16), ([3000] * 8, 8, 16), ([20000, 9000, 131], 16, 16),
])  # fmt: skip
@pytest.mark.parametrize("calib", [448.0, 2688.0])
def test_v7_matches_the_reference_and_v6(lens, G, K, calib):
    """Partial last pages, a group with no selected block (zeros), -1 slots, G = 2 / 5 / 8 / 16,
    caches at amax / 448 and amax / 2688 (block scales up to 448); output poisoned."""
    from model.kernels.triton_sparse_attention import sparse_attention_triton

    cpu, (q, kv, table, seq, pos, sel) = _gpu_problem(lens, 2, G, K, seed=len(lens) + G + int(calib))
    assert v7_applies(q, kv)
    want = sparse_attention_ref(*cpu, softmax_scale=HEAD_DIM**-0.5)
    got = sparse_attention_cuda(q, kv, table, seq, pos, sel, softmax_scale=HEAD_DIM**-0.5,
                                out_THC=torch.full_like(q, float("nan")))  # fmt: skip
    assert torch.isfinite(got).all()
    assert _err(got, want) <= TOL, f"vs reference: {_err(got, want)}"
    assert torch.equal(got[0, :G].cpu(), torch.zeros(G, HEAD_DIM, dtype=got.dtype)), "no visible key -> 0"
    v6 = sparse_attention_triton(q, kv, table, seq, pos, sel, softmax_scale=HEAD_DIM**-0.5)
    assert _err(got, v6.cpu()) <= 2**-4  # v6 rounds P to e4m3 (2^-4 relative per weight)


@pytest.mark.gpu
@gpu
def test_v7_dense_walk_int64_indices_empty_selection_and_the_dispatch():
    cpu, (q, kv, table, seq, pos, sel) = _gpu_problem([900, 333, 4000], 2, 16, 16, seed=21, idx64=True)
    want = sparse_attention_ref(*cpu[:6], None, softmax_scale=HEAD_DIM**-0.5)
    got = sparse_attention_cuda(q, kv, table, seq, pos, None, softmax_scale=HEAD_DIM**-0.5)
    assert _err(got, want) <= TOL
    want = sparse_attention_ref(*cpu, softmax_scale=HEAD_DIM**-0.5)
    lens = pos + 1
    got = sparse_attention(q, kv, table, seq, pos, lens, sel, softmax_scale=HEAD_DIM**-0.5, variant="v7")
    assert _err(got, want) <= TOL
    none = sparse_attention_cuda(q, kv, table, seq, pos, sel[:, :, :0], softmax_scale=HEAD_DIM**-0.5,
                                 out_THC=torch.full_like(q, float("nan")))  # fmt: skip
    assert torch.equal(none, torch.zeros_like(q)), "no selected slot -> zeros"


@pytest.mark.gpu
@gpu
def test_v7_verify_rows_of_one_sequence():
    """Several query rows of one sequence at increasing positions (a verify / prefill chunk): each sees
    the keys up to its own position only; a row at position -1 sees none (zeros)."""
    cpu, (_, kv, table, *_) = _gpu_problem([5000], 2, 16, 16, seed=22)
    T = 10
    pos_t = torch.tensor([0, 1, 127, 128, 129, 2000, 4097, 4998, 4999, -1])
    gen = torch.Generator().manual_seed(3)
    sel_t = visible_selections(pos_t, 2, 16, 128, gen)
    q_t = (torch.randn(T, 32, HEAD_DIM, generator=gen) * 2).to(torch.bfloat16)
    seq_t = torch.zeros(T, dtype=torch.int32)
    want = sparse_attention_ref(q_t, cpu[1], cpu[2], seq_t, pos_t, torch.tensor([5000]), sel_t,
                                softmax_scale=HEAD_DIM**-0.5)  # fmt: skip
    got = sparse_attention_cuda(q_t.cuda(), kv, table, seq_t.cuda(), pos_t.cuda(), sel_t.cuda(),
                                softmax_scale=HEAD_DIM**-0.5)  # fmt: skip
    assert _err(got, want) <= TOL
    assert torch.equal(got[-1].cpu(), torch.zeros_like(q_t[-1])), "position -1: no visible key -> 0"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B,ctx", [(1, 131072), (8, 8192), (64, 32768)])
def test_v7_decode_shapes_match_the_selected_pages_reference_and_are_deterministic(B, ctx):
    """M3.1-Flash decode shapes (N = 4, G = 16, top-16 of 128-token blocks), the splits of real
    launches (B = 1: 16 splits), against the fp32 reference over the selected pages."""
    from model.kernels.cuda_attention import decode_problem, selected_pages_ref

    q, kv, table, seq, pos, sel = decode_problem(B, ctx, 4, 16, 16, torch.device("cuda"), seed=B)
    want = selected_pages_ref(q, kv, table, pos, sel, HEAD_DIM**-0.5)
    got = sparse_attention_cuda(q, kv, table, seq, pos, sel, softmax_scale=HEAD_DIM**-0.5)
    assert _err(got, want.cpu()) <= TOL
    again = sparse_attention_cuda(q, kv, table, seq, pos, sel, softmax_scale=HEAD_DIM**-0.5)
    assert torch.equal(got, again), "two runs differ (determinism)"


@pytest.mark.gpu
@gpu
def test_v7_graph_replay_equals_eager_with_new_inputs():
    from model.kernels.cuda_attention import decode_problem

    q, kv, table, seq, pos, sel = decode_problem(64, 16384, 4, 16, 16, torch.device("cuda"), seed=7)
    out = torch.empty_like(q)
    sparse_attention_cuda(q, kv, table, seq, pos, sel, softmax_scale=HEAD_DIM**-0.5, out_THC=out)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sparse_attention_cuda(q, kv, table, seq, pos, sel, softmax_scale=HEAD_DIM**-0.5, out_THC=out)
    gen = torch.Generator(device="cuda").manual_seed(8)
    for step in range(3):  # new queries, positions (partial last blocks) and selections each replay
        q.copy_(torch.randn(q.shape, generator=gen, device="cuda").to(torch.bfloat16))
        pos.copy_(torch.randint(4000, 16384, pos.shape, generator=gen, device="cuda"))
        for b, n_b in enumerate((pos // 128 + 1).tolist()):  # the own block, then 15 earlier distinct ones
            sel[b, :, 0] = n_b - 1
            sel[b, :, 1:] = torch.rand(4, n_b - 1, generator=gen, device="cuda").argsort(-1)[:, :15]
        graph.replay()
        torch.cuda.synchronize()
        want = sparse_attention_cuda(q, kv, table, seq, pos, sel, softmax_scale=HEAD_DIM**-0.5)
        assert torch.equal(out, want), f"replay {step} differs from eager"
