// NVFP4 sparse-attention decode on tensor cores (v7): the kernel of model/kernels/cuda_attention.py.
//
// out[t, n G + h] = sum_j p_j v_j / sum_j p_j, p_j = exp(softmax_scale q_h . k_j) over the keys j of
// KV group n that token t sees: positions j <= pos_t inside the blocks the indexer selected for (t, n)
// (every block 0 .. pos_t / page when dense); zeros when it sees none. K / V are the cache's NVFP4 rows
// of C = 128 values, 72 bytes each (64 code bytes, 8 e4m3 block scales), side 2n (K) and 2n + 1 (V) of
// a page uint8 [pages, 2N, page, 72]; k_scale / v_scale the fp32 per-layer globals. G <= 16 heads.
//
// Work: a pair (t, n) walks "units" u = slot * (page / 32) + chunk: 32 keys (rows) of one selected
// block. Grid (T, N, splits): CTA (t, n, s) takes units [s UPS, (s + 1) UPS); its 4 warps are
// independent (no __syncthreads until the merge), warp w takes units s UPS + w, + 4, ... A unit is
// skipped without a load when its slot is -1 or its first key lies past pos. A warp resolves its units
// 32 at a time, one per lane (selection, validity, page offset: one parallel round trip), a ballot
// marks those with keys, and taking the next is a find-first-set and three shuffles. Each warp streams
// its units through its own ring of STAGES shared-memory stages: one stage = the unit's 32 K rows and
// its 32 V rows, two cp.async.bulk (TMA) copies of 2304 contiguous bytes each, completed on the stage's
// mbarrier (evict-first in L2); lane 0 refills a stage once the warp has consumed it (the stage's first
// key travels through shared memory, released by the mbarrier arrive).
//
// Per unit, in registers (no decoded tile ever in shared memory):
// 1. S^T = K Q^T with keys on the MMA's M side: two 16-key tiles x NT = ceil(G / 8) 8-head n-tiles x
//    8 k-steps of mma.m16n8k16 bf16 -> fp32. A = K decoded from its code words as cuda_indexer.cu does
//    (E2M1 -> bf16 e2m1 * 2^-126 with integer ops, one bf16x2 FMA by the block scale s * 2^119: exact,
//    e2m1 * s * 2^-7); B = the query's bf16 values, in fragment order in shared memory (written once
//    by warp 0, one 16-byte load per k-step: 32 registers fewer). k permutation (free: the 128 dims
//    are summed inside the warp, A and B use one map): lane t holds whole scale blocks b0(t) =
//    (t & 1) + 4 (t >> 1) (steps 0-3) and b0(t) + 2 (steps 4-7).
// 2. Online softmax in the exp2 domain on the S^T fragments (lane: 2 keys x 2 NT heads per tile), with
//    a lazy reference: m_ref[h] moves only when some score exceeds it by more than 8 (then p <= 2^8;
//    exact math for any reference, as FlashAttention-3's rescale skipping), so the warp-wide max and the
//    rescale of O (a shuffle of alpha and 64 FMULs) run on a warp vote, rarely after the first unit.
// 3. P^T (C layout: lane = key rows g, g + 8, heads 2t, 2t + 1) becomes the A operand P of P V (rows
//    = heads, columns = keys) by one movmatrix.trans per 8 x 8 block, rounded to bf16 on the way.
// 4. O += P V with heads on M (16 rows, NT = 1 leaves rows 8-15 zero), keys on K, head dims on N (16
//    n-tiles): B = V decoded from its code words. A register of B holds two keys of one dim, so each
//    pair of key rows' code words is first merged by one prmt (low halves: key a, high: key b), then
//    decoded as above and multiplied by the bf16x2 pair {s_a, s_b} * 2^119 of the two rows' scales.
// Row permutation (free: softmax and P V do not care which M row holds which key, as long as the
// three stages agree): M row m of a 16-key tile = key 4 sig((m & 7) >> 1) + 2 (m & 1) + (m >> 3),
// sig(x) = 2 (x & 1) + (x >> 1). Then the movmatrix hands lane t keys 4 sig(t) + {0..3} for P V (B
// register j: keys 4 sig(t) + j and + 2 + j), and every shared load is free of bank conflicts: the
// K code loads (8 bytes at 72-byte rows: bank pair (9 row + unit) mod 16, units {b0(t), b0(t) + 2}),
// the V code loads (lane g: bytes 8g .. 8g + 7 = scale block g) and the V scale bytes.
// P V's n-tile j, column c: head dim 16 c + j (lane group g decodes dims 16 g .. 16 g + 15).
//
// Merge (deterministic, no atomics on data): the 4 warps' (m_ref, l, O) are combined through shared
// memory in warp order; a pair with one active split writes out = O / l * v_scale * 2^7 (0 if l == 0),
// otherwise every split writes its (m, l, O) to a global workspace, the CTA drawing the pair's last
// ticket merges them in split order, writes the output, resets the pair's counter to 0 and drops the
// partials from L2 (discard: never written back). Splits past a pair's last visible block exit at once.
//
// Standalone compile check (no torch, no GPU): nvcc -DCUDA_ATTENTION_STANDALONE -std=c++17 -O3
// -arch=sm_90a -cubin -Xptxas -v -I model/kernels -x cu model/kernels/cuda_attention.cu -o /tmp/attn.cubin:
// 159 registers (G > 8) / 151 (G <= 8), 0 spills (nvcc 13.0; __launch_bounds__ caps 168 for 3 CTAs per
// SM); per 32-key unit ~1,000 SASS on the common path, 512 of them the E2M1 decode (4 per register).

#include <stdint.h>

#include "cuda_memory.cuh"
#include "cuda_nvfp4.cuh"

namespace cuda_attention {

using namespace cuda_mem;
using namespace nvfp4_mma;

constexpr int C = 128;                        // head dim (the only one served)
constexpr int ROW_BYTES = C / 2 + C / 16;     // 72: 64 code bytes, 8 scale bytes
constexpr int WARPS = 4;                      // independent warps per CTA
constexpr int THREADS = 32 * WARPS;
constexpr int CH = 32;                        // keys per unit (a page holds a multiple of CH)
constexpr int SIDE_BYTES = CH * ROW_BYTES;    // 2304: one TMA copy (a multiple of 16)
constexpr int STAGE_BYTES = 2 * SIDE_BYTES;   // a unit's K rows, then its V rows
constexpr int STAGES = 3;                     // ring depth per warp
constexpr int RING_BYTES = STAGES * STAGE_BYTES;
constexpr int Q_BYTES = 8 * 32 * 16;          // Q . K B fragments [step][lane][4 regs], shared by the warps
constexpr int SMEM_BYTES = WARPS * RING_BYTES + Q_BYTES;  // 59392: 3 CTAs (12 warps) per SM
constexpr int CTAS_PER_SM = 3;
constexpr int PART_FLOATS = 64 * 32 + 2 * 16;  // a split's partial: O [64 regs][32 lanes], m[16], l[16]
constexpr float NEG_BIG = -1.0e30f;            // finite "minus infinity": exp2(NEG_BIG - m) == 0, no NaN
constexpr float REF_SLACK = 8.f;               // log2 units a score may exceed the reference by
static_assert(CTAS_PER_SM * (SMEM_BYTES + 1024) <= 228 * 1024, "3 CTAs must fit in the 228 KB of an SM");
static_assert(RING_BYTES >= (64 * 32 + 2 * 16) * 4, "a warp's merge buffer lives in its ring");

struct Params {
  const uint16_t* q;          // bf16 bits [T, H, C], unit last stride, 16-byte aligned rows
  long long stride_qt, stride_qh;
  const uint8_t* pages;       // [P, 2N, page, 72], 16-byte aligned
  long long stride_pp, stride_ph;  // bytes
  const void* bt;             // [B, width] int32 / int64 page ids
  long long stride_bb;
  const void* seq;            // [T] row of bt
  const void* pos;            // [T] position of the query
  const void* sel;            // [T, N, K] selected blocks (-1 padded), or nullptr: dense
  long long stride_st, stride_sn, stride_sk;
  const float* k_scale;
  const float* v_scale;
  float sm_scale_log2;        // softmax_scale * log2(e)
  uint16_t* out;              // bf16 [T, H, C], unit last stride, 8-byte aligned rows
  long long stride_ot, stride_oh;
  float* part;                // [T * N * splits][PART_FLOATS] (splits > 1)
  int* counters;              // [T * N] zeros, left at zero
  int n_groups, g_heads, page, n_slots, ups, splits;
  int bt64, seq64, pos64, sel64;
};

// Lane 0: one unit (K rows at k_src, V rows at k_src + v_off) into a stage, completing on its mbarrier.
__device__ __forceinline__ void tma_unit(uint32_t dst, const uint8_t* k_src, long long v_off, uint32_t bar,
                                         uint64_t policy) {
  mbar_expect_tx(bar, STAGE_BYTES);
  tma_load(dst, k_src, SIDE_BYTES, bar, policy);
  tma_load(dst + SIDE_BYTES, k_src + v_off, SIDE_BYTES, bar, policy);
}

__device__ __forceinline__ float ex2(float x) {
  float y;  // 2^x, -inf -> +0
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t a) {
  uint32_t d;  // 8 x 8 b16 matrix in the mma C / A fragment layout -> its transpose, same layout
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(a));
  return d;
}

__device__ __forceinline__ int sig(int x) { return 2 * (x & 1) + (x >> 1); }

// --------------------------------------------------------------------------------------- Q . K
// S^T of one unit: tiles tt = 0, 1 (rows 16 tt .. of the stage). krow: shared address of this lane's
// row g of tile 0 (row g + 8 is the next row); off0: byte offset of its block b0(t) (+ 16: b0 + 2);
// swd: its scale word offset (64 or 68); sel0 / sel1: prmt selectors of its two blocks' scale bytes;
// qf: shared address of its B fragments of step 0 (step i at + 512 i: n-tile 0's two registers, then
// n-tile 1's).
template <int NT>
__device__ __forceinline__ void unit_scores(uint32_t krow, uint32_t off0, uint32_t swd, uint32_t sel0,
                                            uint32_t sel1, uint32_t qf, float (&acc)[2][NT][4]) {
#pragma unroll
  for (int tt = 0; tt < 2; ++tt) {
    const uint32_t row = krow + tt * 16 * ROW_BYTES, row8 = row + ROW_BYTES;
    const uint2 cg[2] = {lds64(row + off0), lds64(row + off0 + 16)};
    const uint2 ch[2] = {lds64(row8 + off0), lds64(row8 + off0 + 16)};
    const uint32_t sg = lds32(row + swd), sh = lds32(row8 + swd);
    const uint32_t pairs[2] = {__byte_perm(sg, sh, sel0), __byte_perm(sg, sh, sel1)};
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[tt][nt][r] = 0.f;
#pragma unroll
    for (int bb = 0; bb < 2; ++bb) {  // block b0(t), then b0(t) + 2
      uint32_t s_g, s_g8;
      scale_splats(pairs[bb], s_g, s_g8);
      const uint32_t xg[2] = {cg[bb].x, cg[bb].y}, xh[2] = {ch[bb].x, ch[bb].y};
#pragma unroll
      for (int w = 0; w < 2; ++w) {    // code word: values 0-7, 8-15 of the block
#pragma unroll
        for (int p = 0; p < 2; ++p) {  // nibbles 0-1 / 2-3 of each half
          uint32_t a[4];
          decode_a(p ? xg[w] >> 8 : xg[w], p ? xh[w] >> 8 : xh[w], s_g, s_g8, a);
          const uint4 bq = lds128(qf + (4 * bb + 2 * w + p) * 512);
          mma_bf16(acc[tt][0], a, bq.x, bq.y);
          if (NT == 2) mma_bf16(acc[tt][NT - 1], a, bq.z, bq.w);
        }
      }
    }
  }
}

// --------------------------------------------------------------------------------------- P . V
// O += P V for one 16-key tile. vrow: shared address of row 4 sig(t) of the tile's V rows, byte 8g;
// vsc: of its scale byte g; lim: rows 4 sig(t) + x with x > lim are not keys (their scales read as 0,
// so a garbage row past pos, even a NaN scale, gives zeros that P's zeros keep out of O).
__device__ __forceinline__ void tile_pv(uint32_t vrow, uint32_t vsc, int lim, const uint32_t (&pa)[4],
                                        float (&o)[16][4]) {
  uint2 w[4];
  uint32_t sb[4];
#pragma unroll
  for (int x = 0; x < 4; ++x) {
    w[x] = lds64(vrow + x * ROW_BYTES);
    sb[x] = x <= lim ? lds8(vsc + x * ROW_BYTES) : 0u;
  }
  // B register j: keys 4 sig(t) + j (low halves) and 4 sig(t) + 2 + j (high halves).
  const uint32_t sp[2] = {scale_pair(sb[0] | sb[2] << 8), scale_pair(sb[1] | sb[3] << 8)};
#pragma unroll
  for (int wd = 0; wd < 2; ++wd) {  // code word 2g + wd: dims 16 g + 8 wd + 0..7
    uint32_t ql[2], qh[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const uint32_t a = wd ? w[j].y : w[j].x, b = wd ? w[j + 2].y : w[j + 2].x;
      ql[j] = __byte_perm(a, b, 0x5410);  // nibbles 0-3 of key a, then of key b
      qh[j] = __byte_perm(a, b, 0x7632);  // nibbles 4-7
    }
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) {  // n-tile 8 wd + nb: dim 16 c + 8 wd + nb in column c
      uint32_t b[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint32_t src = (nb < 4 ? ql[j] : qh[j]) >> (8 * ((nb >> 1) & 1));
        b[j] = bmul2((nb & 1) ? nibble_pair<1>(src) : nibble_pair<0>(src), sp[j]);
      }
      mma_bf16(o[8 * wd + nb], pa, b[0], b[1]);
    }
  }
}

// --------------------------------------------------------------------------------------- units
// The warp's units k = 0, 1, ... (unit u = u_first + WARPS k) are resolved 32 at a time, one per lane:
// whether it has keys (its slot is not -1 and its first key <= pos), its first key and the byte
// offset of its K rows from the group's K side of page 0; `mask` is the batch's ballot of units with
// keys. So the lookups of a batch (selection, block table) are one parallel round trip, and taking
// the next unit is a find-first-set and three shuffles, for the whole warp at once.
struct UnitBatch {
  uint32_t mask;
  int key0;
  long long off;
};

__device__ __forceinline__ UnitBatch load_batch(const Params& p, int batch, int lane, int u_first, int n_k,
                                                int cpb, long long pos, const void* sel_row, const void* bt_row) {
  UnitBatch b;
  b.key0 = 0;
  b.off = 0;
  bool has_keys = false;
  const int k = 32 * batch + lane;
  if (k < n_k) {
    const int u = u_first + WARPS * k;
    const int slot = u / cpb, chunk = u - slot * cpb;
    const long long blk = p.sel ? load_index(sel_row, slot * p.stride_sk, p.sel64) : slot;
    const long long k0 = blk * p.page + chunk * CH;
    if (blk >= 0 && k0 <= pos) {
      has_keys = true;
      b.key0 = static_cast<int>(k0);
      b.off = load_index(bt_row, blk, p.bt64) * p.stride_pp + chunk * SIDE_BYTES;
    }
  }
  b.mask = __ballot_sync(0xFFFFFFFFu, has_keys);
  return b;
}

// --------------------------------------------------------------------------------------- merge
// Combine n partials (m[16] at ml, l[16] at ml + 16, O [64][32] at o; partial i at + i * stride
// floats) in index order, for this thread's 16 O registers r = 16 w .. 16 w + 15 of lane `lane`
// (heads g, g + 8): v[r] = sum_i 2^(m_i - M) O_i, {M, L} of heads g and g + 8. L2: the partials were
// written by other CTAs (read them through L2, never a stale L1 line); else shared memory.
template <bool L2>
__device__ __forceinline__ float ld_part(const float* a) {
  return L2 ? __ldcg(a) : *a;
}

template <bool L2>
__device__ __forceinline__ void merge_parts(const float* ml, const float* o, int stride, int n, int w, int lane,
                                            float (&v)[16], float (&mm)[2], float (&ll)[2]) {
  const int g = lane >> 2;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float m = NEG_BIG;
    for (int i = 0; i < n; ++i) m = fmaxf(m, ld_part<L2>(ml + i * stride + g + 8 * h));
    mm[h] = m;
    ll[h] = 0.f;
  }
#pragma unroll
  for (int r = 0; r < 16; ++r) v[r] = 0.f;
  for (int i = 0; i < n; ++i) {
    const float* mi = ml + i * stride;
    const float wg = ex2(ld_part<L2>(mi + g) - mm[0]), wg8 = ex2(ld_part<L2>(mi + g + 8) - mm[1]);
    ll[0] += wg * ld_part<L2>(mi + 16 + g);
    ll[1] += wg8 * ld_part<L2>(mi + 16 + g + 8);
    const float* oi = o + i * stride + (16 * w) * 32 + lane;
#pragma unroll
    for (int r = 0; r < 16; ++r) v[r] += ((r & 2) ? wg8 : wg) * ld_part<L2>(oi + r * 32);
  }
}

// out rows of heads g, g + 8 (< heads): register r = 4 j + c of lane (g, t) is head g + 8 (c >> 1),
// dim 16 (2t + (c & 1)) + j; this thread's j = 4 w .. 4 w + 3 are 4 consecutive dims (one 8-byte store).
__device__ __forceinline__ void store_out(const Params& p, long long tok, int n, int w, int lane,
                                          const float (&v)[16], const float (&ll)[2]) {
  const int g = lane >> 2, t = lane & 3;
  const float vs = *p.v_scale * 128.f;  // the decode's 2^-7 (exact)
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int h = g + 8 * (c >> 1);
    if (h >= p.g_heads) continue;
    const float l = ll[c >> 1];
    const float f = l > 0.f ? vs / l : 0.f;
    uint2 st;
    st.x = pack_bf16x2(v[c] * f, v[4 + c] * f);
    st.y = pack_bf16x2(v[8 + c] * f, v[12 + c] * f);
    uint16_t* dst = p.out + tok * p.stride_ot + (static_cast<long long>(n) * p.g_heads + h) * p.stride_oh +
                    16 * (2 * t + (c & 1)) + 4 * w;
    *reinterpret_cast<uint2*>(dst) = st;
  }
}

// --------------------------------------------------------------------------------------- kernel
template <int NT>
__global__ void __launch_bounds__(THREADS, CTAS_PER_SM) sparse_attn_kernel(const Params p) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t bars[WARPS][STAGES];
  __shared__ int stage_key0[WARPS][STAGES];  // first key of the unit in each stage
  __shared__ int ticket;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const long long tok = blockIdx.x;
  const int n = blockIdx.y, split = blockIdx.z;
  const long long pos = load_index(p.pos, tok, p.pos64);
  const long long seq = load_index(p.seq, tok, p.seq64);
  const int cpb = p.page / CH;
  // Units with keys lie in the first min(n_slots, pos / page + 1) slots (selections are left-packed
  // and causal); the splits past them have nothing to add and are not waited for.
  const long long n_blocks = pos < 0 ? 0 : pos / p.page + 1;
  const int units = static_cast<int>(min(static_cast<long long>(p.n_slots), n_blocks)) * cpb;
  const int active = max(1, (units + p.ups - 1) / p.ups);
  if (split >= active) return;
  const int u_first = split * p.ups + warp, u_end = min(units, split * p.ups + p.ups);

  uint8_t* ring_ptr = smem + warp * RING_BYTES;
  const uint32_t ring = smem_u32(ring_ptr);
  const uint32_t bar0 = smem_u32(&bars[warp][0]);
  const void* sel_row = p.sel ? static_cast<const uint8_t*>(p.sel) +
                                    (tok * p.stride_st + n * p.stride_sn) * (p.sel64 ? 8 : 4)
                              : nullptr;
  const void* bt_row = static_cast<const uint8_t*>(p.bt) + seq * p.stride_bb * (p.bt64 ? 8 : 4);
  const uint8_t* k_base = p.pages + static_cast<long long>(2 * n) * p.stride_ph;
  // This warp's units with keys: n_valid of them, the producer's batch `prod` (it resolves batch 1, 2,
  // ... when one is used up; one batch whenever the warp has <= 32 units).
  const int n_k = u_first < u_end ? (u_end - u_first + WARPS - 1) / WARPS : 0;
  const int n_batches = (n_k + 31) / 32;
  UnitBatch prod = load_batch(p, 0, lane, u_first, n_k, cpb, pos, sel_row, bt_row);
  int pbatch = 0;
  int n_valid = __popc(prod.mask);
  for (int bt = 1; bt < n_batches; ++bt)
    n_valid += __popc(load_batch(p, bt, lane, u_first, n_k, cpb, pos, sel_row, bt_row).mask);
  // The producer's next unit (warp-uniform): its first key and K-row offset, written / issued by lane 0.
  auto next_unit = [&](int& key0, long long& off) {
    while (prod.mask == 0 && pbatch + 1 < n_batches)  // never past the last batch (callers take n_valid)
      prod = load_batch(p, ++pbatch, lane, u_first, n_k, cpb, pos, sel_row, bt_row);
    const int k = __ffs(prod.mask) - 1;
    prod.mask &= prod.mask - 1;
    key0 = __shfl_sync(0xFFFFFFFFu, prod.key0, k);
    off = static_cast<long long>(__shfl_sync(0xFFFFFFFFu, static_cast<unsigned long long>(prod.off), k));
  };

  uint64_t policy = 0;
  if (lane == 0) {
    mbar_init_ring<STAGES>(bar0);
    policy = evict_first_policy();
  }
  __syncwarp();
  for (int s = 0; s < min(STAGES, n_valid); ++s) {
    int k0;
    long long off;
    next_unit(k0, off);
    if (lane == 0) {
      stage_key0[warp][s] = k0;  // released to the consumers by the mbarrier arrive
      tma_unit(ring + s * STAGE_BYTES, k_base + off, p.stride_ph, bar0 + 8 * s, policy);
    }
  }

  // B fragments of Q . K (the query), once, by warp 0 into shared memory: n-tile nt, step i, reg j =
  // q[h, base + j], q[h, base + j + 4] for head h = 8 nt + g and the lane's block b = b0(t) + 2 (i >> 2),
  // base = 16 b + 8 ((i >> 1) & 1) + 2 (i & 1). Heads >= G are zero.
  const int b0 = (t & 1) + 4 * (t >> 1);
  const uint32_t qf = smem_u32(smem + WARPS * RING_BYTES) + 16 * lane;
  if (warp == 0) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int h = 8 * nt + g;
      uint32_t bq[8][2];
      if (nt < NT && h < p.g_heads) {
        const uint16_t* qrow = p.q + tok * p.stride_qt + (static_cast<long long>(n) * p.g_heads + h) * p.stride_qh;
#pragma unroll
        for (int bb = 0; bb < 2; ++bb) {
          const uint4* src = reinterpret_cast<const uint4*>(qrow + 16 * (b0 + 2 * bb));
          const uint4 v0 = __ldg(src), v1 = __ldg(src + 1);
          // cuda_nvfp4.cuh's b_fragments, written out: through the helper the PTX registers of the
          // softmax state are numbered in another order and ptxas assigns other registers.
          const uint32_t wv[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};  // value pairs
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const uint32_t lo = wv[4 * (i >> 1) + (i & 1)], hi = wv[4 * (i >> 1) + (i & 1) + 2];
            bq[4 * bb + i][0] = __byte_perm(lo, hi, 0x5410);
            bq[4 * bb + i][1] = __byte_perm(lo, hi, 0x7632);
          }
        }
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) bq[i][0] = bq[i][1] = 0u;
      }
#pragma unroll
      for (int i = 0; i < 8; ++i)
        asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(qf + i * 512 + 8 * nt), "r"(bq[i][0]), "r"(bq[i][1])
                     : "memory");
    }
  }
  __syncthreads();  // the fragments, and every warp's mbarrier initialisation
  // Scores in the exp2 domain: k_scale, the decode's 2^7 (exact), softmax_scale * log2(e).
  const float factor = *p.k_scale * 128.f * p.sm_scale_log2;

  // Lane constants. Q . K: row g is key kg of the tile, row g + 8 key kg + 1 (the next row).
  const int kg = 4 * sig(g >> 1) + 2 * (g & 1);
  const uint32_t k_lane = kg * ROW_BYTES;
  const uint32_t off0 = 8 * b0;                 // code bytes of block b0 (block b0 + 2: + 16)
  const uint32_t swd = 64 + 4 * (t >> 1);       // the scale word holding bytes b0 and b0 + 2
  const uint32_t sel0 = (b0 & 3) | ((b0 & 3) + 4) << 4, sel1 = ((b0 + 2) & 3) | (((b0 + 2) & 3) + 4) << 4;
  // P . V: rows 4 sig(t) + 0..3 of the tile, code bytes 8g .. 8g + 7 (block g), scale byte g.
  const int vk = 4 * sig(t);
  const uint32_t v_lane = SIDE_BYTES + vk * ROW_BYTES;

  float o[16][4];
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) o[j][r] = 0.f;
  float mref[NT][2], lsum[NT][2];  // heads 8 nt + 2t + e: the reference (exp2 domain), this lane's sum
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) mref[nt][0] = mref[nt][1] = NEG_BIG, lsum[nt][0] = lsum[nt][1] = 0.f;

  int s = 0;
  uint32_t parity = 0;  // of stage s's mbarrier phase
  for (int c = 0; c < n_valid; ++c) {
    mbar_wait(bar0 + 8 * s, parity);
    const int key0 = stage_key0[warp][s];
    const uint32_t stage = ring + s * STAGE_BYTES;
    float acc[2][NT][4];
    unit_scores<NT>(stage + k_lane, off0, swd, sel0, sel1, qf, acc);
#pragma unroll
    for (int tt = 0; tt < 2; ++tt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[tt][nt][r] *= factor;
    const bool partial = key0 + CH - 1 > pos;  // warp-uniform: the query's own block
    if (partial) {  // keys past pos (garbage rows, NaN even) -> -inf
      const int lim = static_cast<int>(pos - key0) - kg;
#pragma unroll
      for (int tt = 0; tt < 2; ++tt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int r = 0; r < 4; ++r)
            if (16 * tt + (r >> 1) > lim) acc[tt][nt][r] = __int_as_float(0xFF800000);
    }
    float mx[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e)
        mx[nt][e] = fmaxf(fmaxf(acc[0][nt][e], acc[0][nt][2 + e]), fmaxf(acc[1][nt][e], acc[1][nt][2 + e]));
    }
    bool up = false;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      up |= (mx[nt][0] > mref[nt][0] + REF_SLACK) | (mx[nt][1] > mref[nt][1] + REF_SLACK);
    if (__any_sync(0xFFFFFFFFu, up)) {  // move the reference to the max over the warp's keys
      float alpha[NT][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float m = mx[nt][e];
#pragma unroll
          for (int off = 4; off < 32; off <<= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
          const float m_new = fmaxf(mref[nt][e], m);
          alpha[nt][e] = ex2(mref[nt][e] - m_new);
          mref[nt][e] = m_new;
          lsum[nt][e] *= alpha[nt][e];
        }
      // O rows are heads g (nt 0) and g + 8 (nt 1): their alphas live in lane g >> 1 (t = g >> 1).
      float a_row[2] = {1.f, 1.f};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const float a0 = __shfl_sync(0xFFFFFFFFu, alpha[nt][0], g >> 1);
        const float a1 = __shfl_sync(0xFFFFFFFFu, alpha[nt][1], g >> 1);
        a_row[nt] = (g & 1) ? a1 : a0;
      }
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        o[j][0] *= a_row[0];
        o[j][1] *= a_row[0];
        o[j][2] *= a_row[1];
        o[j][3] *= a_row[1];
      }
    }
    // P = 2^(s - m_ref) (<= 2^REF_SLACK), its row sums in fp32, then bf16 A fragments of P V.
    uint32_t pa[2][4];
#pragma unroll
    for (int tt = 0; tt < 2; ++tt) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        float pr[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          pr[r] = ex2(acc[tt][nt][r] - mref[nt][r & 1]);
          lsum[nt][r & 1] += pr[r];
        }
        // C-layout block (key rows 0-7 or 8-15 of the tile) x (heads 8 nt ..): transposed, it is A
        // register nt (heads g / g + 8) + 2 h (kappa 2t.. / 2t + 8..).
        pa[tt][nt] = movmatrix_trans(pack_bf16x2(pr[0], pr[1]));
        pa[tt][nt + 2] = movmatrix_trans(pack_bf16x2(pr[2], pr[3]));
      }
      if (NT == 1) pa[tt][1] = pa[tt][3] = 0u;
    }
#pragma unroll
    for (int tt = 0; tt < 2; ++tt) {
      const int lim = partial ? static_cast<int>(min(pos - (key0 + 16 * tt + vk), 3LL)) : 3;
      const uint32_t vrow = stage + v_lane + tt * 16 * ROW_BYTES;
      tile_pv(vrow + 8 * g, vrow + 64 + g, lim, pa[tt], o);
    }
    // Every lane has consumed stage s: lane 0 refills it with the producer's next unit (consumer unit
    // c sits in stage c % STAGES, so the producer's unit c + STAGES goes there too).
    __syncwarp();
    if (c + STAGES < n_valid) {
      int k0;
      long long off;
      next_unit(k0, off);
      if (lane == 0) {
        fence_proxy_async();
        stage_key0[warp][s] = k0;
        tma_unit(stage, k_base + off, p.stride_ph, bar0 + 8 * s, policy);
      }
    }
    if (++s == STAGES) s = 0, parity ^= 1u;
  }

  // Row sums over the warp's keys (lanes g), then the warp's partial into its ring: O [64][32], and
  // lanes g = 0 write m_ref / l of heads 8 nt + 2t + e.
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) lsum[nt][e] += __shfl_xor_sync(0xFFFFFFFFu, lsum[nt][e], off);
  float* wbuf = reinterpret_cast<float*>(ring_ptr);  // this warp's ring: every TMA into it has landed
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) wbuf[(4 * j + r) * 32 + lane] = o[j][r];
  float* wml = wbuf + 64 * 32;
  if (g == 0) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int h = 8 * nt + 2 * t + e;
        wml[h] = nt < NT ? mref[nt][e] : NEG_BIG;
        wml[16 + h] = nt < NT ? lsum[nt][e] : 0.f;
      }
  }
  __syncthreads();
  // The CTA's partial: thread (warp, lane) owns O registers 16 warp .. 16 warp + 15 of lane `lane`.
  constexpr int WSTRIDE = RING_BYTES / 4;
  float v[16], mm[2], ll[2];
  merge_parts<false>(reinterpret_cast<const float*>(smem) + 64 * 32, reinterpret_cast<const float*>(smem), WSTRIDE,
              WARPS, warp, lane, v, mm, ll);
  const long long pair = tok * p.n_groups + n;
  if (active == 1) {
    store_out(p, tok, n, warp, lane, v, ll);
    return;
  }
  float* mine = p.part + (pair * p.splits + split) * PART_FLOATS;
#pragma unroll
  for (int r = 0; r < 16; ++r) mine[(16 * warp + r) * 32 + lane] = v[r];
  if (warp == 0 && t == 0) {
    mine[64 * 32 + g] = mm[0];
    mine[64 * 32 + g + 8] = mm[1];
    mine[64 * 32 + 16 + g] = ll[0];
    mine[64 * 32 + 16 + g + 8] = ll[1];
  }
  if (!last_ticket(p.counters, pair, active, ticket)) return;
  // Last CTA of the pair: the splits' partials, in split order.
  const float* base = p.part + pair * p.splits * PART_FLOATS;
  merge_parts<true>(base + 64 * 32, base, PART_FLOATS, active, warp, lane, v, mm, ll);
  store_out(p, tok, n, warp, lane, v, ll);
  __syncthreads();  // every thread has read the partials
  if (threadIdx.x == 0) p.counters[pair] = 0;
  // The partials are dead: drop their lines from L2 without a write-back (128-byte lines; each split's
  // PART_FLOATS * 4 = 8320 bytes start 128-byte aligned, 65 lines).
  for (int i = threadIdx.x; i < active * (PART_FLOATS * 4 / 128); i += THREADS) {
    const float* line = base + (i / (PART_FLOATS * 4 / 128)) * PART_FLOATS + (i % (PART_FLOATS * 4 / 128)) * 32;
    asm volatile("discard.global.L2 [%0], 128;" ::"l"(line) : "memory");
  }
}

}  // namespace cuda_attention

#ifdef CUDA_ATTENTION_STANDALONE
template __global__ void cuda_attention::sparse_attn_kernel<1>(const cuda_attention::Params);
template __global__ void cuda_attention::sparse_attn_kernel<2>(const cuda_attention::Params);
#else
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

// Host launcher (load_inline binds it). Shapes, dtypes and alignment are checked by the Python
// wrapper (model/kernels/cuda_attention.py); `sel` is an empty tensor for dense walks.
void sparse_attn_launch(torch::Tensor q, torch::Tensor pages, torch::Tensor bt, torch::Tensor seq, torch::Tensor pos,
                        torch::Tensor sel, torch::Tensor k_scale, torch::Tensor v_scale, double sm_scale_log2,
                        torch::Tensor out, torch::Tensor part, torch::Tensor counters, int64_t heads, int64_t ups,
                        int64_t splits) {
  const c10::cuda::CUDAGuard device_guard(q.device());
  cuda_attention::Params p;
  p.q = reinterpret_cast<const uint16_t*>(q.data_ptr());
  p.stride_qt = q.stride(0);
  p.stride_qh = q.stride(1);
  p.pages = pages.data_ptr<uint8_t>();
  p.stride_pp = pages.stride(0);
  p.stride_ph = pages.stride(1);
  p.bt = bt.data_ptr();
  p.stride_bb = bt.stride(0);
  p.seq = seq.data_ptr();
  p.pos = pos.data_ptr();
  const bool dense = sel.numel() == 0;
  p.sel = dense ? nullptr : sel.data_ptr();
  p.stride_st = dense ? 0 : sel.stride(0);
  p.stride_sn = dense ? 0 : sel.stride(1);
  p.stride_sk = dense ? 0 : sel.stride(2);
  p.k_scale = k_scale.data_ptr<float>();
  p.v_scale = v_scale.data_ptr<float>();
  p.sm_scale_log2 = static_cast<float>(sm_scale_log2);
  p.out = reinterpret_cast<uint16_t*>(out.data_ptr());
  p.stride_ot = out.stride(0);
  p.stride_oh = out.stride(1);
  p.part = part.data_ptr<float>();
  p.counters = counters.data_ptr<int>();
  p.n_groups = static_cast<int>(pages.size(1) / 2);
  p.g_heads = static_cast<int>(heads);
  p.page = static_cast<int>(pages.size(2));
  p.n_slots = static_cast<int>(dense ? bt.size(1) : sel.size(2));
  p.ups = static_cast<int>(ups);
  p.splits = static_cast<int>(splits);
  p.bt64 = bt.scalar_type() == at::kLong;
  p.seq64 = seq.scalar_type() == at::kLong;
  p.pos64 = pos.scalar_type() == at::kLong;
  p.sel64 = !dense && sel.scalar_type() == at::kLong;
  const bool wide = heads > 8;
  static bool attr_set[2][64] = {};  // per kernel and device: opt in to > 48 KB of dynamic shared memory
  const int dev = q.get_device();
  if (dev >= 64 || !attr_set[wide][dev]) {
    const auto kernel = wide ? cuda_attention::sparse_attn_kernel<2> : cuda_attention::sparse_attn_kernel<1>;
    C10_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, cuda_attention::SMEM_BYTES));
    if (dev < 64) attr_set[wide][dev] = true;
  }
  const dim3 grid(static_cast<unsigned>(q.size(0)), static_cast<unsigned>(p.n_groups), static_cast<unsigned>(splits));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (wide) {
    cuda_attention::sparse_attn_kernel<2><<<grid, cuda_attention::THREADS, cuda_attention::SMEM_BYTES, stream>>>(p);
  } else {
    cuda_attention::sparse_attn_kernel<1><<<grid, cuda_attention::THREADS, cuda_attention::SMEM_BYTES, stream>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
#endif
