// NVFP4 routed-MoE decode on tensor cores (v7): the kernels of model/kernels/cuda_moe.py.
//
// One launch of `moe_mma_kernel<GLU, NB>` is one of the two MoE projections for every row block
// (RB = 8 NB token-slots of one expert, `triton_moe._group_by_expert(block_rows=RB)`):
//   GLU:  act[r, f] = bf16(swigluoai(bf16(x_r . w1[f] * sc2_1), bf16(x_r . w3[f] * sc2_3)))
//   down: y[slot, d] = bf16(act_r . w2[d] * sc2_2) * router_w[slot]
// CTA (blockIdx.x, .y, .z) = (64 output features = MT 16-row tiles, K split, row block); its 4
// warps take interleaved 64-wide K chunks of the split (warp w: chunks c_begin + w + 4j, in order),
// each warp all MT tiles and all NB 8-row column groups (a decoded A fragment feeds NB MMAs; the x
// fragment of a chunk is loaded once per warp and used by every tile); the warps' fp32 tiles are
// summed in shared memory in warp order, the K splits through global partials by the CTA that draws
// the unit's last ticket, in split order (deterministic; every counter is back at 0 at the end).
//
// Weights are read in their canonical storage, no repack: packed uint8 [E, N, I/2] (byte j of a
// row = inputs 2j (low nibble), 2j + 1), e4m3 scales [E, N, I/16], both contiguous.
//
// Staging (why): the 4 chunks of a round (one per warp) are bytes 32 c0 .. 32 c0 + 127 of each of the
// CTA's 64 rows: one whole 128-byte line per row. The CTA copies a round's raw codes and scales into a
// ring of STAGES shared-memory stages with cp.async (16-byte code pieces, 8 threads per row line, so
// each copy instruction reads 4 whole lines; 4-byte scale words), one barrier per round, and each
// warp reads its A-fragment bytes from shared memory. Reading the fragments straight from global
// memory (the previous version: two 8-byte loads per lane, tile and chunk, plus a 4-byte scale word)
// touched 8 (codes) and 16 (scales) distinct lines per load instruction, ~272 L1 line lookups per
// warp and GLU chunk against ~56 for a lane-ordered repacked copy; here ~128 (copies 64, shared reads
// 48 wavefronts, x 16), with 2 rounds (36 KB at GLU) in flight per CTA and no weight registers held
// across a round. Nothing decoded is ever stored: shared memory holds codes and scales as they are
// in global memory, only permuted within a row line.
// Stage layout per matrix (MAT_BYTES = 9216): codes [64 rows][128 B], the 32-byte block of round
// chunk j of row r at block j ^ (r & 3) (the 16 lanes of a half-warp, rows g = 0..3 or 4..7 at one
// chunk, then hit 16 distinct 8-byte bank pairs); then scales [64 rows][4 chunks] u32 (one 4-byte
// word per row and chunk: scale blocks 0..3 of that chunk; rows g = 0..7 at one chunk are 8 banks).
// Code copies carry the L2::256B prefetch hint: a 256-byte DRAM read serves two rounds of a row.
//
// mma.sync.m16n8k16 bf16 x bf16 -> fp32. A (16 x 16, weights: M = output features, K = inputs) and
// B (16 x 8, activations: N = 8 slot rows of a column group) fragments, lane = 4 g + t (PTX layout):
//   A reg n (n = 0..3): row g + 8 (n & 1), MMA columns kappa = 2t + 8 (n >> 1) + {0, 1}
//   B reg j (j = 0..1): MMA rows kappa = 2t + 8 j + {0, 1}, column g
//   C c0..c3: row g + 8 (r >> 1), column 2t + (r & 1)
// Within a 64-wide chunk, MMA step i (0..3) column kappa maps to input
//   k = 16t + 8 (i >> 1) + 2 (i & 1) + (kappa >= 8) + 4 (kappa & 1),
// so a lane's 16 inputs of the chunk are NVFP4 scale block t (one scale per row and lane per chunk),
// and the two halves of an A register are inputs k and k + 4: nibbles n and n + 4 of a 32-bit word
// of the canonical row, 16 bits apart, which is what the multiply decode below needs. The B side
// pairs x the same way (one prmt per B register, shared by all NMAT * MT tiles of the chunk).
// Per (tile, chunk) a lane reads 8 code bytes of row g and 8 of row g + 8 (block t: bytes 8t .. 8t + 7
// of the chunk's 32) and the chunk's scale words of both rows, and picks byte t of each (one prmt).
//
// Decode: A reg of a word q is ((q & 0x000F000F) * 0x1040) & 0x81C081C0 (nibbles 0, 4) or
// ((q & 0x00F000F0) * 0x0104) & 0x81C081C0 (nibbles 1, 5); q >> 8 gives nibbles 2, 6 and 3, 7. The
// multiply copies each nibble twice without carries, its sign to bit 15 and its magnitude to bits
// 6..8 (bf16 exponent lsbs + mantissa msb), so the bf16 value is e2m1 * 2^-126 exactly (code 1 = 0.5
// is the subnormal 2^-127). One bf16x2 multiply by the block scale s * 2^119 (exact: s has <= 4
// significant bits and s * 2^119 <= 1.75 * 2^127) gives e2m1 * s * 2^-7, exact (<= 6 significant
// bits, in [2^-17, 21]); the epilogue multiplies the fp32 sums by scale_2 * 2^7. PTX's bf16 fma has
// no .ftz (subnormal inputs and results are kept by definition; checked on the H200).
//
// By construction the results are bit for bit those of the unstaged version (ad64169): every MMA
// gets the same A and B registers in the same order per warp; only the path of the bytes changed.
// NB = 2 only adds MMAs on other columns (each output column's sums are unchanged).
//
// Standalone compile check (no torch, no GPU): an instantiation file that defines CUDA_MOE_STANDALONE,
// includes this file and instantiates moe_mma_kernel<true / false, 1 / 2>, then nvcc -std=c++17 -O3
// -arch=sm_90a -cubin -Xptxas -v -I model/kernels (ptxas figures: cuda_moe.py's module docstring).
// SASS of the round loop (nvcc 13), per warp and chunk: GLU 792 instructions (32 HMMA, 32 LDS, 12
// LDGSTS, 2 LDG, 1 BAR), down 432; 16-row blocks 848 / 479 (64 / 32 HMMA); the unstaged version had
// GLU 775 (26 LDG, 8 SHFL), down 401.

#include <stdint.h>

#include "cuda_memory.cuh"
#include "cuda_nvfp4.cuh"

namespace cuda_moe {

using namespace cuda_mem;
using namespace nvfp4_mma;

constexpr int MT = 4;     // 16-row tiles per CTA (64 output features)
constexpr int WARPS = 4;  // K-interleaved warps per CTA; == MT: warp w finishes tile w
constexpr int THREADS = 32 * WARPS;
constexpr int ROWS = 16 * MT;                        // weight rows per CTA
constexpr int LINE = 32 * WARPS;                     // 128 code bytes per row and round
constexpr int CODE_BYTES = ROWS * LINE;              // 8192 per matrix and stage
constexpr int MAT_BYTES = CODE_BYTES + ROWS * 4 * WARPS;  // + 1024 scale bytes
constexpr int STAGES = 3;                            // ring depth: 2 rounds in flight while one is used
static_assert(MT == WARPS, "after the warp reduction, warp w owns tile w");
static_assert(ROWS * 8 == 4 * THREADS, "code copies: 4 pieces of 16 bytes per thread and matrix");
static_assert(ROWS * 4 == 2 * THREADS, "scale copies: 2 words per thread and matrix");

template <int NMAT, int NB>
constexpr int smem_bytes() {  // the ring, reused after the loop for the warp reduction
  return STAGES * NMAT * MAT_BYTES > WARPS * NMAT * MT * NB * 4 * 32 * 4 ? STAGES * NMAT * MAT_BYTES
                                                                         : WARPS * NMAT * MT * NB * 4 * 32 * 4;
}

struct Params {
  const uint16_t* x;         // bf16 bits: GLU tokens [T, n_in]; down act [MB * RB, n_in]
  long long stride_x;        // elements
  const int* rows;           // [MB * RB] slot or -1
  const int* block_expert;   // [MB] expert or -1
  const float* router_w;     // [S] fp32
  const uint8_t* wa;         // packed codes [E, n_out, n_in / 2] (w1 or w2), contiguous, 16-B aligned
  const uint8_t* sa;         // e4m3 scale bytes [E, n_out, n_in / 16], contiguous, 4-B aligned
  const float* sc2a;         // [E]
  const uint8_t* wb;         // w3 (GLU only)
  const uint8_t* sb;
  const float* sc2b;
  void* out;                 // GLU: bf16 act [MB * RB, n_out]; down: fp32 y [S, n_out]
  long long stride_o;
  float* part;               // [split, units, NMAT * NB * 4, THREADS] fp32 partials (split > 1)
  int* counters;             // [units] zeros
  int n_out, n_in, topk, split;
  float alpha, limit;
};

__device__ __forceinline__ void cp_async_code(uint32_t dst, const uint8_t* src) {
  // weights: read once per launch, past L1 (.cg); the 256-byte L2 prefetch covers the next round
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ uint4 ld_v4(const uint16_t* p) {
  uint4 v;  // activations: shared by the CTAs of a row block, L1-cached
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ float bf16_round(float v) {
  uint16_t h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return __uint_as_float(static_cast<uint32_t>(h) << 16);
}

// One thread's share of a round's copies, global -> a stage: per matrix 4 code pieces (rows
// 16 i + tid / 8, 16-byte unit u = tid % 8 of the row's 128-byte round line) and 2 scale words (rows
// 32 i + tid / 4, chunk tid % 4). Pieces of chunks at or past c_end are not copied (never read).
template <int NMAT>
struct Copier {
  const uint8_t* w[NMAT];  // code source of piece i = 0, round 0
  const uint8_t* s[NMAT];  // scale source of word i = 0, round 0
  size_t w_step, s_step;   // bytes between pieces i and i + 1 (16 and 32 rows)
  uint32_t w_dst, s_dst;   // offsets of piece / word 0 in a stage's matrix 0
  int w_chunk, s_chunk;    // the round chunk (0..3) of this thread's pieces / words

  __device__ __forceinline__ void issue(uint32_t stage, int round, int chunks_left) const {
    if (w_chunk < chunks_left) {
#pragma unroll
      for (int m = 0; m < NMAT; ++m)
#pragma unroll
        for (int i = 0; i < 4; ++i)
          cp_async_code(stage + m * MAT_BYTES + w_dst + i * 16 * LINE, w[m] + i * w_step + round * LINE);
    }
    if (s_chunk < chunks_left) {  // cp_async4 (.ca): a 32-byte sector of scales serves two rounds
#pragma unroll
      for (int m = 0; m < NMAT; ++m)
#pragma unroll
        for (int i = 0; i < 2; ++i)
          cp_async4(stage + m * MAT_BYTES + s_dst + i * 32 * 16, s[m] + i * s_step + round * 16);
    }
  }
};

// One warp's chunk of a round from a stage: the MT tiles of each matrix, NB column groups each.
// code / scale: this lane's offsets (row g, its chunk's swizzled block, byte 8t / its chunk's word).
template <int NMAT, int NB>
__device__ __forceinline__ void compute_chunk(const uint8_t* stage, uint32_t code, uint32_t scale, uint32_t sel,
                                              const uint4 (&x)[NB][2], float (&acc)[NMAT][MT][NB][4]) {
  uint32_t xb[NB][4][2];  // the lane's 16 x values of each column group's row: b_fragments
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) b_fragments(x[nb][0], x[nb][1], xb[nb]);
#pragma unroll
  for (int m = 0; m < NMAT; ++m) {
#pragma unroll
    for (int tt = 0; tt < MT; ++tt) {
      const uint8_t* c = stage + m * MAT_BYTES + code + tt * 16 * LINE;
      const uint2 wg = *reinterpret_cast<const uint2*>(c);
      const uint2 wg8 = *reinterpret_cast<const uint2*>(c + 8 * LINE);
      const uint8_t* s = stage + m * MAT_BYTES + CODE_BYTES + scale + tt * 16 * 16;
      const uint32_t sw_g = *reinterpret_cast<const uint32_t*>(s);
      const uint32_t sw_g8 = *reinterpret_cast<const uint32_t*>(s + 8 * 16);
      chunk_tile_mma<NB>(wg, wg8, __byte_perm(sw_g, sw_g8, sel), xb, acc[m][tt]);
    }
  }
}

template <int NB>
__device__ __forceinline__ void load_x(uint4 (&x)[NB][2], const uint16_t* const (&xrow)[NB], int c, int t) {
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    const uint16_t* xp = xrow[nb] + (size_t)c * 64 + t * 16;
    x[nb][0] = ld_v4(xp);
    x[nb][1] = ld_v4(xp + 8);
  }
}

template <bool GLU, int NB>
__global__ void __launch_bounds__(THREADS, 3) moe_mma_kernel(const Params p) {
  constexpr int NMAT = GLU ? 2 : 1;
  constexpr int RB = 8 * NB;          // slot rows per block
  constexpr int NV = NMAT * NB * 4;   // fp32 values per thread after the warp reduction
  constexpr int NACC = NMAT * MT * NB * 4;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int ticket;

  const int b = blockIdx.z;
  const int e = p.block_expert[b];
  if (e < 0) return;  // unused block: nothing to read or write
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int n_groups = p.n_out / ROWS, kc = p.n_in / 64;
  const int unit = b * n_groups + blockIdx.x;

  // This lane's B columns: slot row g of each column group (GLU: its token's x row; down: the act
  // row). Padding rows (-1) read row 0 / their own act row: finite or not, they only feed their own
  // MMA column, which is never stored.
  const uint16_t* xrow[NB];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    const int slot = p.rows[b * RB + 8 * nb + g];
    const long long xr = GLU ? (long long)(slot < 0 ? 0 : slot / p.topk) : (long long)(b * RB + 8 * nb + g);
    xrow[nb] = p.x + xr * p.stride_x;
  }

  const int per_split = (kc + p.split - 1) / p.split;
  const int c_begin = blockIdx.y * per_split;
  const int c_end = min(kc, c_begin + per_split);
  const int n_rounds = c_end > c_begin ? (c_end - c_begin + WARPS - 1) / WARPS : 0;

  // Copy assignment (see Copier). Row r of the CTA = weight row row0 + r.
  const size_t row0 = (size_t)e * p.n_out + (size_t)blockIdx.x * ROWS;
  const size_t w_row = p.n_in / 2, s_row = p.n_in / 16;
  Copier<NMAT> cp;
  {
    const int r = tid >> 3, u = tid & 7, rs = tid >> 2, j = tid & 3;
#pragma unroll
    for (int m = 0; m < NMAT; ++m) {
      cp.w[m] = (m == 0 ? p.wa : p.wb) + (row0 + r) * w_row + (size_t)c_begin * 32 + 16 * u;
      cp.s[m] = (m == 0 ? p.sa : p.sb) + (row0 + rs) * s_row + (size_t)(c_begin + j) * 4;
    }
    cp.w_step = 16 * w_row;
    cp.s_step = 32 * s_row;
    cp.w_dst = r * LINE + (((u >> 1) ^ (r & 3)) * 32) + (u & 1) * 16;
    cp.s_dst = CODE_BYTES + rs * 16 + 4 * j;
    cp.w_chunk = u >> 1;
    cp.s_chunk = j;
  }
  // This lane's fragment offsets in a stage's matrix: row g, its warp's chunk block, byte 8t; the
  // scale word of row g and its warp's chunk. sel: byte t of the row-g word into byte 0, byte t of
  // the row-(g + 8) word into byte 1.
  const uint32_t lane_code = g * LINE + ((warp ^ (g & 3)) * 32) + 8 * t;
  const uint32_t lane_scale = g * 16 + 4 * warp;
  const uint32_t sel = t | (4 + t) << 4;
  const uint32_t ring = smem_u32(smem);

  float acc[NMAT][MT][NB][4];
#pragma unroll
  for (int m = 0; m < NMAT; ++m)
#pragma unroll
    for (int tt = 0; tt < MT; ++tt)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[m][tt][nb][r] = 0.f;

  // Ring: rounds 0 .. STAGES - 2 in flight before the loop; round r + STAGES - 1 is issued (into the
  // stage round r - 1 used: every warp has passed this round's barrier, so it is free) before round r
  // is computed. One commit group per round and thread, empty past the end, so wait_group
  // STAGES - 2 means "round r has landed" for this thread's copies; the barrier makes all visible.
#pragma unroll
  for (int r = 0; r < STAGES - 1; ++r) {
    if (r < n_rounds) cp.issue(ring + r * NMAT * MAT_BYTES, r, c_end - c_begin - WARPS * r);
    cp_async_commit();
  }
  if (n_rounds > 0) {
    int c = c_begin + warp;  // this warp's chunk of round r
    uint4 xc[NB][2];
    load_x<NB>(xc, xrow, min(c, c_end - 1), t);
    int use = 0, fill = STAGES - 1;  // stage of round r, stage of round r + STAGES - 1
    for (int r = 0; r < n_rounds; ++r) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();
      const int ahead = r + STAGES - 1;
      if (ahead < n_rounds) cp.issue(ring + fill * NMAT * MAT_BYTES, ahead, c_end - c_begin - WARPS * ahead);
      cp_async_commit();
      uint4 xn[NB][2];  // the next round's x (clamped at the end: an L1 hit, never used)
      load_x<NB>(xn, xrow, min(c + WARPS, c_end - 1), t);
      if (c < c_end) {
        compute_chunk<NMAT, NB>(smem + use * NMAT * MAT_BYTES, lane_code, lane_scale, sel, xc, acc);
      }
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) xc[nb][0] = xn[nb][0], xc[nb][1] = xn[nb][1];
      c += WARPS;
      use = use == STAGES - 1 ? 0 : use + 1;
      fill = fill == STAGES - 1 ? 0 : fill + 1;
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the ring is free: reused for the warp reduction

  // Warp partials -> shared memory; thread (warp w, lane) then owns tile w's C fragments at `lane`.
  float* red = reinterpret_cast<float*>(smem);  // [WARPS][NACC][32]
#pragma unroll
  for (int m = 0; m < NMAT; ++m)
#pragma unroll
    for (int tt = 0; tt < MT; ++tt)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int r = 0; r < 4; ++r)
          red[(warp * NACC + ((m * MT + tt) * NB + nb) * 4 + r) * 32 + lane] = acc[m][tt][nb][r];
  __syncthreads();
  float v[NV];  // [m][nb][r]
#pragma unroll
  for (int m = 0; m < NMAT; ++m)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = ((m * MT + warp) * NB + nb) * 4 + r;
        const float* q = red + i * 32 + lane;
        v[(m * NB + nb) * 4 + r] = ((q[0] + q[NACC * 32]) + q[2 * NACC * 32]) + q[3 * NACC * 32];
      }

  if (p.split > 1) {
    // Serial split-K: partials at [split, unit, NV, THREADS]; the CTA drawing the unit's last ticket
    // sums all of them in split order (threadfence-reduction pattern) and resets the counter.
    const size_t n_units = (size_t)gridDim.z * n_groups;
    float* mine = p.part + ((blockIdx.y * n_units + unit) * NV) * THREADS + tid;
#pragma unroll
    for (int j = 0; j < NV; ++j) mine[j * THREADS] = v[j];
    if (!last_ticket(p.counters, unit, p.split, ticket)) return;
#pragma unroll
    for (int j = 0; j < NV; ++j) v[j] = 0.f;
    for (int s = 0; s < p.split; ++s) {
      const float* part = p.part + ((s * n_units + unit) * NV) * THREADS + tid;
#pragma unroll
      for (int j = 0; j < NV; ++j) v[j] += __ldcg(part + j * THREADS);
    }
    if (tid == 0) p.counters[unit] = 0;
  }

  // Epilogue: C fragment element r of tile `warp`, group nb = feature f_r, slot row 8 nb + 2t + (r & 1).
  const float sca = p.sc2a[e] * 128.f;  // 2^7 of the decode (exact)
  const float scb = GLU ? p.sc2b[e] * 128.f : 0.f;
  const int f0 = (blockIdx.x * MT + warp) * 16 + g;
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = b * RB + 8 * nb + 2 * t + (r & 1);
      const int slot = p.rows[row];
      if (slot < 0) continue;
      const int f = f0 + 8 * (r >> 1);
      if (GLU) {
        // swigluoai on the bf16-rounded projections, as the tile kernel (v2) computes it.
        const float gate = fminf(bf16_round(v[nb * 4 + r] * sca), p.limit);
        const float up = fminf(fmaxf(bf16_round(v[(NB + nb) * 4 + r] * scb), -p.limit), p.limit);
        const float act = gate * (1.f / (1.f + expf(-(p.alpha * gate)))) * (up + 1.f);
        static_cast<uint16_t*>(p.out)[(long long)row * p.stride_o + f] = bf16_bits(act);
      } else {
        const float y = bf16_round(v[nb * 4 + r] * sca) * p.router_w[slot];
        static_cast<float*>(p.out)[(long long)slot * p.stride_o + f] = y;
      }
    }
}

}  // namespace cuda_moe

#ifndef CUDA_MOE_STANDALONE
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

template <bool GLU, int NB>
static void launch_one(const cuda_moe::Params& p, dim3 grid, cudaStream_t stream, int dev) {
  constexpr int smem = cuda_moe::smem_bytes<GLU ? 2 : 1, NB>();
  static bool attr_set[64] = {};  // per device: opt in to > 48 KB of dynamic shared memory
  if (dev >= 64 || !attr_set[dev]) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(cuda_moe::moe_mma_kernel<GLU, NB>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    if (dev < 64) attr_set[dev] = true;
  }
  cuda_moe::moe_mma_kernel<GLU, NB><<<grid, cuda_moe::THREADS, smem, stream>>>(p);
}

// Host launcher (load_inline binds it): one projection launch, see Params; rows_per_block 8 or 16
// (NB = 1 or 2). Shapes, dtypes, contiguity and alignment are checked by the Python wrapper
// (model/kernels/cuda_moe.py).
void moe_mma_launch(torch::Tensor x, torch::Tensor rows, torch::Tensor block_expert, torch::Tensor router_w,
                    torch::Tensor wa, torch::Tensor sa, torch::Tensor sc2a, torch::Tensor wb, torch::Tensor sb,
                    torch::Tensor sc2b, torch::Tensor out, torch::Tensor part, torch::Tensor counters,
                    int64_t n_out, int64_t n_in, int64_t topk, int64_t split, double alpha, double limit,
                    bool glu, int64_t rows_per_block) {
  const c10::cuda::CUDAGuard device_guard(x.device());
  TORCH_CHECK(rows_per_block == 8 || rows_per_block == 16, "moe_mma_launch: rows_per_block must be 8 or 16");
  cuda_moe::Params p;
  p.x = reinterpret_cast<const uint16_t*>(x.data_ptr());
  p.stride_x = x.stride(0);
  p.rows = rows.data_ptr<int>();
  p.block_expert = block_expert.data_ptr<int>();
  p.router_w = router_w.data_ptr<float>();
  p.wa = reinterpret_cast<const uint8_t*>(wa.data_ptr());
  p.sa = reinterpret_cast<const uint8_t*>(sa.data_ptr());
  p.sc2a = sc2a.data_ptr<float>();
  p.wb = reinterpret_cast<const uint8_t*>(wb.data_ptr());
  p.sb = reinterpret_cast<const uint8_t*>(sb.data_ptr());
  p.sc2b = sc2b.data_ptr<float>();
  p.out = out.data_ptr();
  p.stride_o = out.stride(0);
  p.part = part.data_ptr<float>();
  p.counters = counters.data_ptr<int>();
  p.n_out = static_cast<int>(n_out);
  p.n_in = static_cast<int>(n_in);
  p.topk = static_cast<int>(topk);
  p.split = static_cast<int>(split);
  p.alpha = static_cast<float>(alpha);
  p.limit = static_cast<float>(limit);
  const dim3 grid(static_cast<unsigned>(n_out / cuda_moe::ROWS), static_cast<unsigned>(split),
                  static_cast<unsigned>(block_expert.numel()));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int dev = x.get_device();
  if (glu && rows_per_block == 8) {
    launch_one<true, 1>(p, grid, stream, dev);
  } else if (glu) {
    launch_one<true, 2>(p, grid, stream, dev);
  } else if (rows_per_block == 8) {
    launch_one<false, 1>(p, grid, stream, dev);
  } else {
    launch_one<false, 2>(p, grid, stream, dev);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
#endif
