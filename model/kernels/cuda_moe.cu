// NVFP4 routed-MoE decode on tensor cores (v7): the kernels of model/kernels/cuda_moe.py.
//
// One launch of `moe_mma_kernel<GLU>` is one of the two MoE projections for every row block (8
// token-slots of one expert, `triton_moe._group_by_expert(block_rows=8)`):
//   GLU:  act[r, f] = bf16(swigluoai(bf16(x_r . w1[f] * sc2_1), bf16(x_r . w3[f] * sc2_3)))
//   down: y[slot, d] = bf16(act_r . w2[d] * sc2_2) * router_w[slot]
// CTA (blockIdx.x, .y, .z) = (64 output features = MT 16-row tiles, K split, row block); its 4
// warps take interleaved 64-wide K chunks of the split, each warp all MT tiles (the x fragment of a
// chunk is loaded once per warp and used by every tile); the warps' fp32 tiles are summed in shared
// memory in warp order, the K splits through global partials by the CTA that draws the unit's last
// ticket, in split order (deterministic; every counter is back at 0 when the launch ends).
//
// Weights are read in their canonical storage, no repack: packed uint8 [E, N, I/2] (byte j of a
// row = inputs 2j (low nibble), 2j + 1), e4m3 scales [E, N, I/16], both contiguous.
//
// mma.sync.m16n8k16 bf16 x bf16 -> fp32. A (16 x 16, weights: M = output features, K = inputs) and
// B (16 x 8, activations: N = the block's 8 slot rows) fragments, lane = 4 g + t (PTX ISA layout):
//   A reg n (n = 0..3): row g + 8 (n & 1), MMA columns kappa = 2t + 8 (n >> 1) + {0, 1}
//   B reg j (j = 0..1): MMA rows kappa = 2t + 8 j + {0, 1}, column g
//   C c0..c3: row g + 8 (r >> 1), column 2t + (r & 1)
// Within a 64-wide chunk, MMA step i (0..3) column kappa maps to input
//   k = 16t + 8 (i >> 1) + 2 (i & 1) + (kappa >= 8) + 4 (kappa & 1),
// so a lane's 16 inputs of the chunk are NVFP4 scale block t (one scale per row and lane per chunk),
// and the two halves of an A register are inputs k and k + 4: nibbles n and n + 4 of a 32-bit word
// of the canonical row, 16 bits apart, which is what the multiply decode below needs. The B side
// pairs x the same way (one prmt per B register, shared by all NMAT * MT tiles of the chunk).
//
// Loads per (tile, chunk) and lane: 8 bytes of row g and 8 of row g + 8 (scale block t = bytes
// 32c + 8t .. +7 of the row), two 64-bit loads; the 4 lanes of a group read 32 contiguous bytes of a
// row, so every 32-byte sector a warp touches is used whole. Why 64-bit and not 128-bit loads (a lane
// taking blocks 2t, 2t + 1 of a 128-input span): the register double buffer of a 128-input span needs
// twice the weight registers (~190 in all, over the 168 of 3 CTAs per SM, which the GLU kernel already
// fills with 64-input chunks), and single-buffering it would leave nothing in flight while a warp
// multiplies. 64-bit loads keep the registers and the bytes in flight per warp of the repacked layout
// at the cost of one more load per 32 weights per lane. Scales: lane t loads the 4 scale bytes of
// the chunk (one u32) of row g (t < 2) or row g + 8 (t >= 2), gets the other row's word from lane
// t ^ 2 (one shfl) and picks byte t of both (one prmt): one register per tile, as the repack's u16
// pair. Scale loads go through L1 (a 32-byte sector of scales serves 8 chunks, the CTA's 4 warps read
// it within two rounds); weights stream past L1.
//
// Decode: A reg of a word q is ((q & 0x000F000F) * 0x1040) & 0x81C081C0 (nibbles 0, 4) or
// ((q & 0x00F000F0) * 0x0104) & 0x81C081C0 (nibbles 1, 5); q >> 8 gives nibbles 2, 6 and 3, 7. The
// multiply copies each nibble twice without carries, its sign to bit 15 and its magnitude to bits
// 6..8 (bf16 exponent lsbs + mantissa msb), so the bf16 value is e2m1 * 2^-126 exactly (code 1 = 0.5
// is the subnormal 2^-127). One bf16x2 multiply by the block scale s * 2^119 (exact: s has <= 4
// significant bits and s * 2^119 <= 1.75 * 2^127) gives e2m1 * s * 2^-7, exact (<= 6 significant
// bits, in [2^-17, 21]); the epilogue multiplies the fp32 sums by scale_2 * 2^7. PTX's bf16 fma has
// no .ftz (subnormal inputs and results are kept by definition; checked on the H200).

#include <stdint.h>

#include "cuda_nvfp4.cuh"

namespace cuda_moe {

using namespace nvfp4_mma;

constexpr int MT = 4;     // 16-row tiles per CTA (64 output features)
constexpr int WARPS = 4;  // K-interleaved warps per CTA; == MT: warp w finishes tile w
constexpr int RB = 8;     // slot rows per block (the MMA N)
constexpr int THREADS = 32 * WARPS;
static_assert(MT == WARPS, "after the warp reduction, warp w owns tile w");

struct Params {
  const uint16_t* x;         // bf16 bits: GLU tokens [T, n_in]; down act [MB * RB, n_in]
  long long stride_x;        // elements
  const int* rows;           // [MB * RB] slot or -1
  const int* block_expert;   // [MB] expert or -1
  const float* router_w;     // [S] fp32
  const uint8_t* wa;         // packed codes [E, n_out, n_in / 2] (w1 or w2), contiguous
  const uint8_t* sa;         // e4m3 scale bytes [E, n_out, n_in / 16], contiguous
  const float* sc2a;         // [E]
  const uint8_t* wb;         // w3 (GLU only)
  const uint8_t* sb;
  const float* sc2b;
  void* out;                 // GLU: bf16 act [MB * RB, n_out]; down: fp32 y [S, n_out]
  long long stride_o;
  float* part;               // [split, units, NMAT * 4, THREADS] fp32 partials (split > 1)
  int* counters;             // [units] zeros
  int n_out, n_in, topk, split;
  float alpha, limit;
};

__device__ __forceinline__ uint2 ld_stream_v2(const uint8_t* p) {
  uint2 v;  // weights: read once per launch, kept out of L1
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t ld_u32(const uint8_t* p) {
  uint32_t v;  // scales: a sector serves 8 chunks of the CTA, L1-cached
  asm("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
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

__device__ __forceinline__ uint16_t bf16_bits(float v) {
  uint16_t h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
}

// A tile's scale word (this lane's row, see the header) -> the per-register multipliers bf16x2
// {s * 2^119, s * 2^119} of row g and of row g + 8. sel: this lane's prmt selector, picking byte t of
// the row-g word into byte 0 and byte t of the row-(g + 8) word into byte 1.
__device__ __forceinline__ void scale_regs(uint32_t word, uint32_t sel, uint32_t& s_g, uint32_t& s_g8) {
  const uint32_t other = __shfl_xor_sync(0xffffffffu, word, 2);  // lane t ^ 2: the other row's word
  scale_splats(__byte_perm(word, other, sel), s_g, s_g8);
}

template <int NMAT>
struct Chunk {
  uint2 wg[NMAT][MT], wg8[NMAT][MT];  // a lane's 8 bytes of rows g and g + 8 of each tile
  uint32_t s[NMAT][MT];               // its scale word of each tile
  uint4 x0, x1;                       // its 16 activation values of the chunk
};

// w_lane / s_lane: byte offsets (within a matrix) of this lane's row g, block t and of its scale row,
// chunk 0, tile 0. Rows of the tile are n_in / 2 (codes) and n_in / 16 (scales) bytes apart.
template <int NMAT>
__device__ __forceinline__ void load_chunk(Chunk<NMAT>& ch, const Params& p, size_t w_lane, size_t s_lane, int c,
                                           int lane, const uint16_t* xrow) {
  const size_t w_row = p.n_in / 2, s_row = p.n_in / 16;
#pragma unroll
  for (int m = 0; m < NMAT; ++m) {
    const uint8_t* w = (m == 0 ? p.wa : p.wb) + w_lane + (size_t)c * 32;
    const uint8_t* s = (m == 0 ? p.sa : p.sb) + s_lane + (size_t)c * 4;
#pragma unroll
    for (int tt = 0; tt < MT; ++tt) {
      ch.wg[m][tt] = ld_stream_v2(w + (16 * tt) * w_row);
      ch.wg8[m][tt] = ld_stream_v2(w + (16 * tt + 8) * w_row);
      ch.s[m][tt] = ld_u32(s + (16 * tt) * s_row);
    }
  }
  const uint16_t* xp = xrow + (size_t)c * 64 + (lane & 3) * 16;
  ch.x0 = ld_v4(xp);
  ch.x1 = ld_v4(xp + 8);
}

template <int NMAT>
__device__ __forceinline__ void compute_chunk(const Chunk<NMAT>& ch, uint32_t sel, float (&acc)[NMAT][MT][4]) {
  // x word j = inputs (2j, 2j + 1) of the lane's block; step i takes inputs b, b + 4 (B reg 0) and
  // b + 1, b + 5 (B reg 1), b = 8 (i >> 1) + 2 (i & 1): words w = b / 2 and w + 2, low or high halves.
  const uint32_t xw[8] = {ch.x0.x, ch.x0.y, ch.x0.z, ch.x0.w, ch.x1.x, ch.x1.y, ch.x1.z, ch.x1.w};
  uint32_t xb[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int w = 4 * (i >> 1) + (i & 1);
    xb[2 * i] = __byte_perm(xw[w], xw[w + 2], 0x5410);
    xb[2 * i + 1] = __byte_perm(xw[w], xw[w + 2], 0x7632);
  }
#pragma unroll
  for (int m = 0; m < NMAT; ++m) {
#pragma unroll
    for (int tt = 0; tt < MT; ++tt) {
      uint32_t s_g, s_g8;
      scale_regs(ch.s[m][tt], sel, s_g, s_g8);
      const uint32_t qg[2] = {ch.wg[m][tt].x, ch.wg[m][tt].y}, qg8[2] = {ch.wg8[m][tt].x, ch.wg8[m][tt].y};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int sh = 8 * (i & 1);  // odd steps: nibbles 2, 3, 6, 7 of the word
        uint32_t a[4];
        decode_a(qg[i >> 1] >> sh, qg8[i >> 1] >> sh, s_g, s_g8, a);
        mma_bf16(acc[m][tt], a, xb[2 * i], xb[2 * i + 1]);
      }
    }
  }
}

template <bool GLU>
__global__ void __launch_bounds__(THREADS, 3) moe_mma_kernel(const Params p) {
  constexpr int NMAT = GLU ? 2 : 1;
  constexpr int NV = NMAT * 4;  // fp32 values per thread after the warp reduction
  __shared__ float red[WARPS][NMAT * MT * 4][32];
  __shared__ int ticket;

  const int b = blockIdx.z;
  const int e = p.block_expert[b];
  if (e < 0) return;  // unused block: nothing to read or write
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int n_groups = p.n_out / (16 * MT), kc = p.n_in / 64;
  const int unit = b * n_groups + blockIdx.x;

  // This lane's B column: slot row g of the block (GLU: its token's x row; down: the act row).
  // Padding rows (-1) read row 0 / their own act row: finite or not, they only feed their own MMA
  // column, which is never stored.
  const int slot_g = p.rows[b * RB + g];
  const long long xr = GLU ? (long long)(slot_g < 0 ? 0 : slot_g / p.topk) : (long long)(b * RB + g);
  const uint16_t* xrow = p.x + xr * p.stride_x;

  const int per_split = (kc + p.split - 1) / p.split;
  const int c_begin = blockIdx.y * per_split;
  const int c_end = min(kc, c_begin + per_split);
  // Row g of tile 0 of this CTA, block t of chunk 0; the scale row is g (t < 2) or g + 8 (t >= 2).
  const size_t row_g = (size_t)e * p.n_out + (size_t)blockIdx.x * (16 * MT) + g;
  const size_t w_lane = row_g * (size_t)(p.n_in / 2) + 8 * t;
  const size_t s_lane = (row_g + 8 * (t >> 1)) * (size_t)(p.n_in / 16);
  const uint32_t sel = t < 2 ? (t | (4 + t) << 4) : ((4 + t) | t << 4);

  float acc[NMAT][MT][4];
#pragma unroll
  for (int m = 0; m < NMAT; ++m)
#pragma unroll
    for (int tt = 0; tt < MT; ++tt)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[m][tt][r] = 0.f;

  // Register double buffer: chunk c + WARPS is in flight while chunk c is decoded and multiplied
  // (the last prefetch re-reads the final chunk: an L2 hit, never used).
  int c = c_begin + warp;
  if (c < c_end) {
    Chunk<NMAT> cur;
    load_chunk<NMAT>(cur, p, w_lane, s_lane, c, lane, xrow);
    for (; c < c_end; c += WARPS) {
      Chunk<NMAT> nxt;
      load_chunk<NMAT>(nxt, p, w_lane, s_lane, min(c + WARPS, c_end - 1), lane, xrow);
      compute_chunk<NMAT>(cur, sel, acc);
      cur = nxt;
    }
  }

  // Warp partials -> shared memory; thread (warp w, lane) then owns tile w's C fragment at `lane`.
#pragma unroll
  for (int m = 0; m < NMAT; ++m)
#pragma unroll
    for (int tt = 0; tt < MT; ++tt)
#pragma unroll
      for (int r = 0; r < 4; ++r) red[warp][(m * MT + tt) * 4 + r][lane] = acc[m][tt][r];
  __syncthreads();
  float v[NV];
#pragma unroll
  for (int m = 0; m < NMAT; ++m)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = (m * MT + warp) * 4 + r;
      v[m * 4 + r] = ((red[0][i][lane] + red[1][i][lane]) + red[2][i][lane]) + red[3][i][lane];
    }

  if (p.split > 1) {
    // Serial split-K: partials at [split, unit, NV, THREADS]; the CTA drawing the unit's last ticket
    // sums all of them in split order (threadfence-reduction pattern) and resets the counter.
    const size_t n_units = (size_t)gridDim.z * n_groups;
    float* mine = p.part + ((blockIdx.y * n_units + unit) * NV) * THREADS + threadIdx.x;
#pragma unroll
    for (int j = 0; j < NV; ++j) mine[j * THREADS] = v[j];
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) ticket = atomicAdd(p.counters + unit, 1);
    __syncthreads();
    if (ticket != p.split - 1) return;
    __threadfence();
#pragma unroll
    for (int j = 0; j < NV; ++j) v[j] = 0.f;
    for (int s = 0; s < p.split; ++s) {
      const float* part = p.part + ((s * n_units + unit) * NV) * THREADS + threadIdx.x;
#pragma unroll
      for (int j = 0; j < NV; ++j) v[j] += __ldcg(part + j * THREADS);
    }
    if (threadIdx.x == 0) p.counters[unit] = 0;
  }

  // Epilogue: C fragment element r of tile `warp` = feature f_r, slot row 2t + (r & 1).
  const float sca = p.sc2a[e] * 128.f;  // 2^7 of the decode (exact)
  const float scb = GLU ? p.sc2b[e] * 128.f : 0.f;
  const int f0 = (blockIdx.x * MT + warp) * 16 + g;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int row = b * RB + 2 * t + (r & 1);
    const int slot = p.rows[row];
    if (slot < 0) continue;
    const int f = f0 + 8 * (r >> 1);
    if (GLU) {
      // swigluoai on the bf16-rounded projections, as the tile kernel (v2) computes it.
      const float gate = fminf(bf16_round(v[r] * sca), p.limit);
      const float up = fminf(fmaxf(bf16_round(v[4 + r] * scb), -p.limit), p.limit);
      const float act = gate * (1.f / (1.f + expf(-(p.alpha * gate)))) * (up + 1.f);
      static_cast<uint16_t*>(p.out)[(long long)row * p.stride_o + f] = bf16_bits(act);
    } else {
      static_cast<float*>(p.out)[(long long)slot * p.stride_o + f] = bf16_round(v[r] * sca) * p.router_w[slot];
    }
  }
}

}  // namespace cuda_moe

#ifndef CUDA_MOE_STANDALONE
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

// Host launcher (load_inline binds it): one projection launch, see Params. Shapes, dtypes,
// contiguity and alignment are checked by the Python wrapper (model/kernels/cuda_moe.py).
void moe_mma_launch(torch::Tensor x, torch::Tensor rows, torch::Tensor block_expert, torch::Tensor router_w,
                    torch::Tensor wa, torch::Tensor sa, torch::Tensor sc2a, torch::Tensor wb, torch::Tensor sb,
                    torch::Tensor sc2b, torch::Tensor out, torch::Tensor part, torch::Tensor counters,
                    int64_t n_out, int64_t n_in, int64_t topk, int64_t split, double alpha, double limit,
                    bool glu) {
  const c10::cuda::CUDAGuard device_guard(x.device());
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
  const dim3 grid(static_cast<unsigned>(n_out / (16 * cuda_moe::MT)), static_cast<unsigned>(split),
                  static_cast<unsigned>(block_expert.numel()));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (glu) {
    cuda_moe::moe_mma_kernel<true><<<grid, cuda_moe::THREADS, 0, stream>>>(p);
  } else {
    cuda_moe::moe_mma_kernel<false><<<grid, cuda_moe::THREADS, 0, stream>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
#endif
