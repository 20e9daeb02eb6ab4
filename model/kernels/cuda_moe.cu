// NVFP4 routed-MoE decode on tensor cores (v7): the kernels of model/kernels/cuda_moe.py.
//
// One launch of `moe_mma_kernel<GLU, F16_DECODE>` is one of the two MoE projections for every row
// block (8 token-slots of one expert, `triton_moe._group_by_expert(block_rows=8)`):
//   GLU:  act[r, f] = bf16(swigluoai(bf16(x_r . w1[f] * sc2_1), bf16(x_r . w3[f] * sc2_3)))
//   down: y[slot, d] = bf16(act_r . w2[d] * sc2_2) * router_w[slot]
// CTA (blockIdx.x, .y, .z) = (64 output features = MT 16-row tiles, K split, row block); its 4
// warps take interleaved 64-wide K chunks of the split, each warp all MT tiles (the x fragment of a
// chunk is loaded once per warp and used by every tile); the warps' fp32 tiles are summed in shared
// memory in warp order, the K splits through global partials by the CTA that draws the unit's last
// ticket, in split order (deterministic; every counter is back at 0 when the launch ends).
//
// mma.sync.m16n8k16 bf16 x bf16 -> fp32. A (16 x 16, weights: M = output features, K = inputs) and
// B (16 x 8, activations: N = the block's 8 slot rows) fragments, lane = 4 g + t (PTX ISA layout):
//   A reg j (j = 0..3): rows g + 8 (j & 1), MMA columns kappa = 2t + 8 (j >> 1) + {0, 1}
//   B reg j (j = 0..1): MMA rows kappa = 2t + 8 j + {0, 1}, column g
//   C c0..c3: row g + 8 (r >> 1), column 2t + (r & 1)
// Within a 64-wide chunk, MMA step i (0..3) column kappa maps to input k = 16t + 4i + 2 (kappa >= 8)
// + (kappa & 1) for kappa in {2t, 2t+1, 2t+8, 2t+9}: a lane's 16 inputs of the chunk are the 16 of
// NVFP4 scale block t (one scale per row and lane per chunk) and its x fragment is 16 contiguous
// values (two 16-byte loads). The repack (cuda_moe.py) stores, per (expert, tile, chunk), 32 lanes x
// 16 bytes: word i = step i, bits 16h + 4n..+3 = A reg n, half h (code bit 3 = sign), and per lane one
// u16 of scale bytes (row g, row g + 8 of block t).
//
// Decode (bf16, default): A reg n of a word q is ((q' & 0x000F000F or 0x00F000F0) * (2^a + 2^b)) &
// 0x81C081C0, q' = q or q >> 8: the multiply copies each nibble twice without carries, its sign to
// bit 15 and its magnitude to bits 6..8 (bf16 exponent lsbs + mantissa msb), so the bf16 value is
// e2m1 * 2^-126 exactly (code 1 = 0.5 is the subnormal 2^-127). One bf16x2 multiply by the block
// scale s * 2^119 (exact: s has <= 4 significant bits and s * 2^119 <= 1.75 * 2^127) gives
// e2m1 * s * 2^-7, exact (<= 6 significant bits, in [2^-17, 21]); the epilogue multiplies the fp32
// sums by scale_2 * 2^7. F16_DECODE (fallback): the same bits as fp16 (e2m1 * 2^-14, PTX f16
// arithmetic keeps subnormals), times fp16 s * 2^7, then fp16 -> fp32 -> bf16 (exact), for a GPU
// whose bf16 multiply flushed the subnormal 0.5.

#include <stdint.h>

namespace cuda_moe {

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
  const uint4* wa;           // repacked [E, n_out / 16, n_in / 64, 32] x 16 bytes (w1 or w2)
  const uint16_t* sa;        // repacked scale pairs [E, n_out / 16, n_in / 64, 32]
  const float* sc2a;         // [E]
  const uint4* wb;           // w3 (GLU only)
  const uint16_t* sb;
  const float* sc2b;
  void* out;                 // GLU: bf16 act [MB * RB, n_out]; down: fp32 y [S, n_out]
  long long stride_o;
  float* part;               // [split, units, NMAT * 4, THREADS] fp32 partials (split > 1)
  int* counters;             // [units] zeros
  int n_out, n_in, topk, split;
  float alpha, limit;
};

__device__ __forceinline__ uint4 ld_stream_v4(const uint4* p) {
  uint4 v;  // weights: read once per launch, kept out of L1
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t ld_stream_u16(const uint16_t* p) {
  uint16_t v;
  asm("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ uint4 ld_v4(const uint16_t* p) {
  uint4 v;  // activations: shared by the CTAs of a row block, L1-cached
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t bmul2(uint32_t a, uint32_t b) {
  uint32_t d;  // bf16x2 a * b (+ -0: exact products keep their sign)
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

__device__ __forceinline__ void f16x2_to_f32(uint32_t h2, float& lo, float& hi) {
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }"
      : "=f"(lo), "=f"(hi) : "r"(h2));
}

__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t pair) {
  uint32_t d;  // exact: every e4m3 value (subnormals included) is an fp16 normal
  asm("{ .reg .b16 t; cvt.u16.u32 t, %1; cvt.rn.f16x2.e4m3x2 %0, t; }" : "=r"(d) : "r"(pair));
  return d;
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

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Block scales of a lane's rows g (low byte) and g + 8 (high byte) -> the per-register multipliers:
// bf16x2 {s * 2^119, s * 2^119} (F16_DECODE: fp16x2 {s * 2^7, s * 2^7}) for row g and row g + 8.
template <bool F16_DECODE>
__device__ __forceinline__ void scale_regs(uint32_t pair, uint32_t& s_g, uint32_t& s_g8) {
  const uint32_t h2 = e4m3x2_to_f16x2(pair);
  if (F16_DECODE) {
    const uint32_t m = hmul2(h2, 0x58005800u);  // x {128, 128}: <= 57344, exact
    s_g = __byte_perm(m, 0, 0x1010);
    s_g8 = __byte_perm(m, 0, 0x3232);
  } else {
    float lo, hi;
    f16x2_to_f32(h2, lo, hi);
    s_g = pack_bf16x2(lo * 0x1p119f, lo * 0x1p119f);
    s_g8 = pack_bf16x2(hi * 0x1p119f, hi * 0x1p119f);
  }
}

// One step's word q -> the 4 A registers, e2m1 * s * 2^-7 as bf16 (exact).
template <bool F16_DECODE>
__device__ __forceinline__ void decode(uint32_t q, uint32_t s_g, uint32_t s_g8, uint32_t (&a)[4]) {
  if (F16_DECODE) {
    const uint32_t S = 0x80008000u, E = 0x0E000E00u;  // fp16 sign, exponent lsbs + mantissa msb
    uint32_t r[4] = {((q << 12) & S) | ((q << 9) & E), ((q << 8) & S) | ((q << 5) & E),
                     ((q << 4) & S) | ((q << 1) & E), (q & S) | ((q >> 3) & E)};
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      float lo, hi;
      f16x2_to_f32(hmul2(r[n], (n & 1) ? s_g8 : s_g), lo, hi);
      a[n] = pack_bf16x2(lo, hi);
    }
  } else {
    const uint32_t M = 0x81C081C0u;  // bf16 sign, exponent bits 7-8, mantissa msb (both halves)
    const uint32_t u = q >> 8;
    a[0] = bmul2(((q & 0x000F000Fu) * 0x1040u) & M, s_g);   // nibble 0: x 2^12 (sign), 2^6 (magnitude)
    a[1] = bmul2(((q & 0x00F000F0u) * 0x0104u) & M, s_g8);  // nibble 1: x 2^8, 2^2
    a[2] = bmul2(((u & 0x000F000Fu) * 0x1040u) & M, s_g);   // nibble 2
    a[3] = bmul2(((u & 0x00F000F0u) * 0x0104u) & M, s_g8);  // nibble 3
  }
}

template <int NMAT>
struct Chunk {
  uint4 w[NMAT][MT];      // a lane's 16 bytes of each tile
  uint32_t s[NMAT][MT];   // its scale pair of each tile
  uint4 x0, x1;           // its 16 activation values of the chunk
};

template <int NMAT>
__device__ __forceinline__ void load_chunk(Chunk<NMAT>& ch, const Params& p, size_t tile0, int kc, int c,
                                           int lane, const uint16_t* xrow) {
#pragma unroll
  for (int m = 0; m < NMAT; ++m) {
    const uint4* w = m == 0 ? p.wa : p.wb;
    const uint16_t* s = m == 0 ? p.sa : p.sb;
#pragma unroll
    for (int tt = 0; tt < MT; ++tt) {
      const size_t idx = ((tile0 + tt) * kc + c) * 32 + lane;
      ch.w[m][tt] = ld_stream_v4(w + idx);
      ch.s[m][tt] = ld_stream_u16(s + idx);
    }
  }
  const uint16_t* xp = xrow + (size_t)c * 64 + (lane & 3) * 16;
  ch.x0 = ld_v4(xp);
  ch.x1 = ld_v4(xp + 8);
}

template <int NMAT, bool F16_DECODE>
__device__ __forceinline__ void compute_chunk(const Chunk<NMAT>& ch, float (&acc)[NMAT][MT][4]) {
  const uint32_t xb[8] = {ch.x0.x, ch.x0.y, ch.x0.z, ch.x0.w, ch.x1.x, ch.x1.y, ch.x1.z, ch.x1.w};
#pragma unroll
  for (int m = 0; m < NMAT; ++m) {
#pragma unroll
    for (int tt = 0; tt < MT; ++tt) {
      uint32_t s_g, s_g8;
      scale_regs<F16_DECODE>(ch.s[m][tt], s_g, s_g8);
      const uint32_t q[4] = {ch.w[m][tt].x, ch.w[m][tt].y, ch.w[m][tt].z, ch.w[m][tt].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint32_t a[4];
        decode<F16_DECODE>(q[i], s_g, s_g8, a);
        mma_bf16(acc[m][tt], a, xb[2 * i], xb[2 * i + 1]);
      }
    }
  }
}

template <bool GLU, bool F16_DECODE>
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
  const size_t tile0 = (size_t)e * (p.n_out / 16) + (size_t)blockIdx.x * MT;

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
    load_chunk<NMAT>(cur, p, tile0, kc, c, lane, xrow);
    for (; c < c_end; c += WARPS) {
      Chunk<NMAT> nxt;
      load_chunk<NMAT>(nxt, p, tile0, kc, min(c + WARPS, c_end - 1), lane, xrow);
      compute_chunk<NMAT, F16_DECODE>(cur, acc);
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
      // swigluoai on the bf16-rounded projections, as the tile kernel and v6 compute it.
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

// Host launcher (load_inline binds it): one projection launch, see Params. Shapes and dtypes are
// checked by the Python wrapper (model/kernels/cuda_moe.py).
void moe_mma_launch(torch::Tensor x, torch::Tensor rows, torch::Tensor block_expert, torch::Tensor router_w,
                    torch::Tensor wa, torch::Tensor sa, torch::Tensor sc2a, torch::Tensor wb, torch::Tensor sb,
                    torch::Tensor sc2b, torch::Tensor out, torch::Tensor part, torch::Tensor counters,
                    int64_t n_out, int64_t n_in, int64_t topk, int64_t split, double alpha, double limit,
                    bool glu, bool f16_decode) {
  const c10::cuda::CUDAGuard device_guard(x.device());
  cuda_moe::Params p;
  p.x = reinterpret_cast<const uint16_t*>(x.data_ptr());
  p.stride_x = x.stride(0);
  p.rows = rows.data_ptr<int>();
  p.block_expert = block_expert.data_ptr<int>();
  p.router_w = router_w.data_ptr<float>();
  p.wa = reinterpret_cast<const uint4*>(wa.data_ptr());
  p.sa = reinterpret_cast<const uint16_t*>(sa.data_ptr());
  p.sc2a = sc2a.data_ptr<float>();
  p.wb = reinterpret_cast<const uint4*>(wb.data_ptr());
  p.sb = reinterpret_cast<const uint16_t*>(sb.data_ptr());
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
  if (glu && f16_decode) {
    cuda_moe::moe_mma_kernel<true, true><<<grid, cuda_moe::THREADS, 0, stream>>>(p);
  } else if (glu) {
    cuda_moe::moe_mma_kernel<true, false><<<grid, cuda_moe::THREADS, 0, stream>>>(p);
  } else if (f16_decode) {
    cuda_moe::moe_mma_kernel<false, true><<<grid, cuda_moe::THREADS, 0, stream>>>(p);
  } else {
    cuda_moe::moe_mma_kernel<false, false><<<grid, cuda_moe::THREADS, 0, stream>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
#endif
