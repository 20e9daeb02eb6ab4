// NVFP4 W4A16 decode GEMV on tensor cores (v7): the kernel of model/kernels/cuda_gemv.py.
//
// y[r, f] = scale_2 * sum_k x[r, k] * e2m1(W[f, k]) * s[f, k / 16], for r < m <= 8 NT rows of bf16 x
// [m, n_in] and one NVFP4 matrix W [n_out, n_in] read in its canonical storage (packed uint8
// [n_out, n_in / 2], byte j of a row = inputs 2j (low nibble), 2j + 1; e4m3 scales [n_out, n_in / 16]).
//
// Grid (n_out / 64, split): CTA (x, y) = output features 64x .. 64x + 63 (MT = 4 tiles of 16) over
// the y-th K range. Its 4 warps take interleaved 64-input chunks of the range (warp w: chunks w,
// w + 4, ...; the CTA reads 128 contiguous bytes of each row per round) and each keeps all MT tiles
// and NT n-tiles of 8 x rows in registers; the warps' fp32 tiles are summed in shared memory in warp
// order, then the K splits in split order (deterministic either way), by one of two reductions:
//   ticket  (CLUSTER = false): global partials, summed by the CTA that draws its column group's last
//           ticket (every counter is back at 0 when the launch ends);
//   cluster (CLUSTER = true): the splits of a column group are one thread-block cluster (1, split, 1);
//           rank 0 reads the others' sums from their shared memory (DSMEM) after a cluster barrier.
//           No global round trips at the end (a fence, an atomic and a reload in the ticket path).
//
// Loads: each warp streams its chunks through its own ring of STAGES shared-memory stages with
// cp.async (16-byte copies of codes and x, 4-byte copies of scale words), STAGES - 1 chunks in flight
// while one is multiplied; no CTA barrier until the reduction. A stage holds, for one chunk:
//   codes  [MT tiles][16 rows][32 B]  (2048 B)  lane l copies row l / 2, bytes 16 (l & 1) of each tile
//   scales [64 rows][4 B]             (256 B)   lane l copies rows l and l + 32 (the chunk's 4 blocks)
//   x      [NT][8 rows][8 x 16 B]     (NT KB)   lane (g, t) copies units 2t, 2t + 1 of row 8j + g
//                                               into slots (2t + h) ^ (g & 1); rows >= m zero-filled
// Every code and scale byte of W is copied exactly once, in whole 32-byte sectors per pair / group of
// lanes; weights stream past L1 with an L2 evict-first hint (a decode step reads every weight once).
// Shared reads are bank-conflict free: a warp's 8-byte code reads of one tile half are 256
// contiguous bytes; the 16-byte x reads of a quarter warp (rows g, g + 1) hit 8 distinct bank quads
// thanks to the slot swizzle; the scale words are broadcasts.
//
// mma.sync.m16n8k16 bf16 x bf16 -> fp32, A = 16 output features (M) x 16 inputs, B = 16 inputs x 8 x
// rows (N), lane = 4 g + t (PTX ISA layout), exactly as model/kernels/cuda_moe.cu:
//   A reg n: row g + 8 (n & 1), MMA columns kappa = 2t + 8 (n >> 1) + {0, 1}
//   B reg j: MMA rows kappa = 2t + 8 j + {0, 1}, column (x row) g
//   C c0..c3: row g + 8 (r >> 1), column (x row) 2t + (r & 1)
// and MMA step i (0..3) of a chunk maps column kappa to input k = 16t + 8 (i >> 1) + 2 (i & 1) +
// (kappa >= 8) + 4 (kappa & 1): lane t holds NVFP4 block t of the chunk (8 code bytes of rows g and
// g + 8, one scale byte each), the halves of an A register are nibbles n, n + 4 of a code word. The
// decode is cuda_nvfp4.cuh's (e2m1 * s * 2^-7 exactly in bf16); the epilogue scales by scale_2 * 2^7.
//
// Standalone compile check (no torch, no GPU): nvcc -DCUDA_GEMV_STANDALONE -std=c++17 -O3 -arch=sm_90a
// -cubin -Xptxas -v -I model/kernels -x cu model/kernels/cuda_gemv.cu -o /tmp/gemv.cubin. nvcc 13.0:
// NT = 1 / 2 / 4: 77 / 106 / 156 registers (cluster reduction 80 / 106 / 156), 0 spills; per warp and
// chunk (4096 weights) 409 / 444 / 507 PTX instructions in the loop, 256 of them the decode (the
// integer pipe, at 16 lanes per clock, is then ~2/3 busy when the weights stream at 4.17 TB/s).

#include <cooperative_groups.h>
#include <stdint.h>

#include "cuda_memory.cuh"
#include "cuda_nvfp4.cuh"

namespace cuda_gemv {

using namespace cuda_mem;
using namespace nvfp4_mma;

constexpr int MT = 4;     // 16-row weight tiles per CTA (64 output features)
constexpr int WARPS = 4;  // K-interleaved warps per CTA; == MT: after the warp reduction warp w owns tile w
constexpr int THREADS = 32 * WARPS;
constexpr int CHUNK = 64;                          // inputs per warp step: 4 NVFP4 blocks
constexpr int W_BYTES = MT * 16 * (CHUNK / 2);     // 2048: the CTA's codes of one chunk
constexpr int S_BYTES = MT * 16 * (CHUNK / 16);    // 256: their scale bytes
static_assert(MT == WARPS, "after the warp reduction, warp w owns tile w");

// NT n-tiles of 8 x rows (m <= 8 NT). Stages: 4 (3 chunks in flight per warp) where 3 CTAs of 128
// threads fit an SM's 228 KB; 3 for NT = 4 (2 CTAs per SM).
template <int NT>
struct Shape {
  static constexpr int X_BYTES = NT * 8 * CHUNK * 2;
  static constexpr int STAGE = W_BYTES + S_BYTES + X_BYTES;
  static constexpr int STAGES = NT <= 2 ? 4 : 3;
  static constexpr int SMEM = WARPS * STAGES * STAGE;
  static constexpr int CTAS_PER_SM = NT <= 2 ? 3 : 2;
  static constexpr int NV = NT * 4;  // fp32 results per thread after the warp reduction
  static_assert(SMEM >= WARPS * MT * NV * 32 * 4, "the warp reduction reuses the rings");
  static_assert(CTAS_PER_SM * (SMEM + 1024) <= 228 * 1024, "CTAS_PER_SM CTAs must fit one SM");
};

enum OutKind { OUT_BF16 = 0, OUT_F16 = 1, OUT_F32 = 2 };

struct Params {
  const uint16_t* x;   // bf16 bits [m, n_in], rows 16-byte aligned
  long long stride_x;  // elements
  const uint8_t* w;    // packed codes [n_out, n_in / 2], contiguous, 16-byte aligned
  const uint8_t* s;    // e4m3 scale bytes [n_out, n_in / 16], contiguous, 4-byte aligned
  const float* sc2;    // scale_2, one fp32
  void* out;           // [m, n_out] of out_kind
  long long stride_o;  // elements
  float* part;         // [split, n_out / 64, NV, THREADS] fp32 partials (split > 1)
  int* counters;       // [n_out / 64] zeros
  int m, n_out, n_in, split, out_kind;
};

__device__ __forceinline__ void cp16_stream(uint32_t dst, const void* src, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::128B [%0], [%1], 16, %2;"
               ::"r"(dst), "l"(src), "l"(policy) : "memory");
}

__device__ __forceinline__ void cp16_zfill(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ uint16_t f16_bits(float v) {
  uint16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
}

// This lane's global sources and shared destinations (offsets within a stage) for one chunk's copies.
template <int NT>
struct Copies {
  const uint8_t* w;       // codes of row row0 + l / 2, bytes 16 (l & 1) of chunk 0, tile 0
  const uint8_t* s;       // scale word of row row0 + l, chunk 0
  const uint16_t* x[NT];  // x row 8j + g (row 0 where past m), inputs 16t of chunk 0
  uint32_t x_bytes[NT];   // 16, or 0: zero-fill (rows >= m)
  uint32_t x_dst[2];      // x units 2t, 2t + 1 of row g: swizzled slots (2t + h) ^ (g & 1)
  size_t w_row, s_row;    // bytes between rows
};

template <int NT>
__device__ __forceinline__ void issue_chunk(const Copies<NT>& cp, int c, uint32_t stage, int lane, uint64_t policy) {
  const uint8_t* w = cp.w + (size_t)c * (CHUNK / 2);
#pragma unroll
  for (int tt = 0; tt < MT; ++tt) cp16_stream(stage + tt * 512 + 16 * lane, w + (size_t)(16 * tt) * cp.w_row, policy);
  const uint8_t* s = cp.s + (size_t)c * (CHUNK / 16);
  cp_async4(stage + W_BYTES + 4 * lane, s);
  cp_async4(stage + W_BYTES + 4 * (lane + 32), s + 32 * cp.s_row);
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      cp16_zfill(stage + W_BYTES + S_BYTES + j * 1024 + cp.x_dst[h], cp.x[j] + (size_t)c * CHUNK + 8 * h,
                 cp.x_bytes[j]);
}

// One chunk from a stage (generic pointer `st`): the B registers of each n-tile from the lane's 16 x
// values, then per tile the lane's code words and scale bytes, decode and NT MMAs per step.
template <int NT>
__device__ __forceinline__ void compute_chunk(const uint8_t* st, int g, int t, uint32_t x_off0, uint32_t x_off1,
                                              uint32_t sel, float (&acc)[MT][NT][4]) {
  uint32_t xb[NT][4][2];  // the lane's 16 x values of each n-tile's row: b_fragments
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const uint8_t* xs = st + W_BYTES + S_BYTES + j * 1024;
    const uint4 x0 = *reinterpret_cast<const uint4*>(xs + x_off0);
    const uint4 x1 = *reinterpret_cast<const uint4*>(xs + x_off1);
    b_fragments(x0, x1, xb[j]);
  }
#pragma unroll
  for (int tt = 0; tt < MT; ++tt) {
    const uint8_t* codes = st + tt * 512 + 32 * g + 8 * t;
    const uint2 wg = *reinterpret_cast<const uint2*>(codes);          // row g, block t
    const uint2 wg8 = *reinterpret_cast<const uint2*>(codes + 256);   // row g + 8
    const uint32_t* sw = reinterpret_cast<const uint32_t*>(st + W_BYTES) + 16 * tt + g;
    chunk_tile_mma<NT>(wg, wg8, __byte_perm(sw[0], sw[8], sel), xb, acc[tt]);  // scale byte t of rows g, g + 8
  }
}

template <int NT, bool CLUSTER>
__global__ void __launch_bounds__(THREADS, Shape<NT>::CTAS_PER_SM) gemv_kernel(const Params p) {
  using S = Shape<NT>;
  constexpr int STAGES = S::STAGES, NV = S::NV;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int ticket;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * (16 * MT);
  const int kc = p.n_in / CHUNK;
  const int per_split = (kc + p.split - 1) / p.split;
  const int c_first = blockIdx.y * per_split + warp;  // this warp's chunks: c_first + WARPS i
  const int c_end = min(kc, (int)(blockIdx.y + 1) * per_split);
  const int n_mine = c_first < c_end ? (c_end - c_first + WARPS - 1) / WARPS : 0;

  Copies<NT> cp;
  cp.w_row = (size_t)(p.n_in / 2);
  cp.s_row = (size_t)(p.n_in / 16);
  cp.w = p.w + (size_t)(row0 + (lane >> 1)) * cp.w_row + 16 * (lane & 1);
  cp.s = p.s + (size_t)(row0 + lane) * cp.s_row;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int r = 8 * j + g;
    cp.x[j] = p.x + (long long)(r < p.m ? r : 0) * p.stride_x + 16 * t;
    cp.x_bytes[j] = r < p.m ? 16u : 0u;
  }
  cp.x_dst[0] = 128 * g + 16 * ((2 * t) ^ (g & 1));
  cp.x_dst[1] = 128 * g + 16 * ((2 * t + 1) ^ (g & 1));
  const uint64_t policy = evict_first_policy();

  float acc[MT][NT][4];
#pragma unroll
  for (int tt = 0; tt < MT; ++tt)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[tt][j][r] = 0.f;

  // The warp's ring: chunk i of the warp in stage i % STAGES. One commit group per chunk (empty
  // past the warp's last), so "chunk i has landed" is "at most STAGES - 2 groups pending".
  uint8_t* ring = smem + warp * STAGES * S::STAGE;
  const uint32_t ring_s = smem_u32(ring);
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < n_mine) issue_chunk<NT>(cp, c_first + WARPS * i, ring_s + i * S::STAGE, lane, policy);
    cp_async_commit();
  }
  const uint32_t sel = t | ((t + 4) << 4);  // prmt: byte t of the row-g word, byte t of the row-(g + 8) word
  int rd = 0, wr = STAGES - 1;
  for (int i = 0; i < n_mine; ++i) {
    cp_async_wait<STAGES - 2>();  // this lane's copies of chunk i are in shared memory
    __syncwarp();           // ... every lane's; and every lane is done reading stage wr (chunk i - 1)
    if (i + STAGES - 1 < n_mine) {
      issue_chunk<NT>(cp, c_first + WARPS * (i + STAGES - 1), ring_s + wr * S::STAGE, lane, policy);
    }
    cp_async_commit();
    compute_chunk<NT>(ring + rd * S::STAGE, g, t, cp.x_dst[0], cp.x_dst[1], sel, acc);
    rd = rd + 1 == STAGES ? 0 : rd + 1;
    wr = wr + 1 == STAGES ? 0 : wr + 1;
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with its ring: the reduction reuses the shared memory

  // Warp partials -> shared memory [warp][tile][n-tile][c r][lane]; thread (warp w, lane) then owns
  // tile w's C fragments at `lane`, summed in warp order.
  float* red = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int tt = 0; tt < MT; ++tt)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) red[((warp * MT + tt) * NV + 4 * j + r) * 32 + lane] = acc[tt][j][r];
  __syncthreads();
  float v[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const float* e = red + (warp * NV + i) * 32 + lane;  // warp ww's copy is MT * NV * 32 floats further
    v[i] = ((e[0] + e[MT * NV * 32]) + e[2 * MT * NV * 32]) + e[3 * MT * NV * 32];
  }
  // C element i = 4j + r holds x row 8j + 2t + (r & 1); rows >= m are padding (never stored).
  bool valid[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) valid[i] = 8 * (i >> 2) + 2 * t + (i & 1) < p.m;

  if constexpr (CLUSTER) {
    // The cluster is this column group's splits (rank = blockIdx.y): each CTA leaves its sums in its
    // shared memory; rank 0 adds them in rank order and stores; the second barrier keeps every CTA's
    // shared memory alive until rank 0 has read it.
    namespace cg = cooperative_groups;
    const cg::cluster_group cluster = cg::this_cluster();
    __syncthreads();  // every thread has read `red`: reuse it for the CTA's sums
    float* fin = reinterpret_cast<float*>(smem);  // [NV][THREADS]
#pragma unroll
    for (int i = 0; i < NV; ++i) fin[i * THREADS + threadIdx.x] = v[i];
    cluster.sync();
    const bool is_rank0 = cluster.block_rank() == 0;
    if (is_rank0) {
#pragma unroll
      for (int i = 0; i < NV; ++i) v[i] = 0.f;
      for (int r = 0; r < p.split; ++r) {
        const float* other = cluster.map_shared_rank(fin, r) + threadIdx.x;
#pragma unroll
        for (int i = 0; i < NV; ++i)
          if (valid[i]) v[i] += other[i * THREADS];
      }
    }
    cluster.sync();
    if (!is_rank0) return;
  } else if (p.split > 1) {
    // Serial split-K: partials at [split, group, NV, THREADS] (valid rows only); the CTA drawing the
    // group's last ticket sums all of them in split order (threadfence-reduction pattern) and resets
    // the counter for the next launch.
    const size_t n_groups = gridDim.x;
    float* mine = p.part + ((blockIdx.y * n_groups + blockIdx.x) * NV) * THREADS + threadIdx.x;
#pragma unroll
    for (int i = 0; i < NV; ++i)
      if (valid[i]) mine[i * THREADS] = v[i];
    if (!last_ticket(p.counters, blockIdx.x, p.split, ticket)) return;
#pragma unroll
    for (int i = 0; i < NV; ++i) v[i] = 0.f;
    for (int sp = 0; sp < p.split; ++sp) {
      const float* part = p.part + ((sp * n_groups + blockIdx.x) * NV) * THREADS + threadIdx.x;
#pragma unroll
      for (int i = 0; i < NV; ++i)
        if (valid[i]) v[i] += __ldcg(part + i * THREADS);
    }
    if (threadIdx.x == 0) p.counters[blockIdx.x] = 0;
  }

  // Epilogue: element 4j + r of tile `warp` = feature f0 + 8 (r >> 1), x row 8j + 2t + (r & 1).
  const float scale = *p.sc2 * 128.f;  // scale_2 and the decode's 2^7 (exact)
  const int f0 = row0 + 16 * warp + g;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    if (!valid[i]) continue;
    const long long o = (long long)(8 * (i >> 2) + 2 * t + (i & 1)) * p.stride_o + f0 + 8 * ((i >> 1) & 1);
    const float y = v[i] * scale;
    if (p.out_kind == OUT_BF16) {
      static_cast<uint16_t*>(p.out)[o] = bf16_bits(y);
    } else if (p.out_kind == OUT_F16) {
      static_cast<uint16_t*>(p.out)[o] = f16_bits(y);
    } else {
      static_cast<float*>(p.out)[o] = y;
    }
  }
}

}  // namespace cuda_gemv

#ifdef CUDA_GEMV_STANDALONE
template __global__ void cuda_gemv::gemv_kernel<1, false>(const cuda_gemv::Params);
template __global__ void cuda_gemv::gemv_kernel<2, false>(const cuda_gemv::Params);
template __global__ void cuda_gemv::gemv_kernel<4, false>(const cuda_gemv::Params);
template __global__ void cuda_gemv::gemv_kernel<1, true>(const cuda_gemv::Params);
template __global__ void cuda_gemv::gemv_kernel<2, true>(const cuda_gemv::Params);
template __global__ void cuda_gemv::gemv_kernel<4, true>(const cuda_gemv::Params);
#else
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

namespace cuda_gemv {

constexpr int MAX_CLUSTER = 8;  // the portable thread-block cluster size

template <int NT, bool CLUSTER>
void set_attributes(int dev) {
  static bool attr_set[64] = {};  // per device: opt in to > 48 KB of dynamic shared memory
  if (dev < 64 && attr_set[dev]) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(gemv_kernel<NT, CLUSTER>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      Shape<NT>::SMEM));
  C10_CUDA_CHECK(cudaFuncSetAttribute(gemv_kernel<NT, CLUSTER>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                      cudaSharedmemCarveoutMaxShared));
  if (dev < 64) attr_set[dev] = true;
}

// The cluster launch's configuration; `fits` (asked once per device, n-tiles and split: the answer
// depends on how the SMs fall into GPCs) whether every cluster of the grid is resident at once, as a
// ticket launch's one wave is. Where not, the caller takes the ticket path (same sums, same order).
template <int NT>
bool cluster_fits(const cudaLaunchConfig_t& cfg, int dev, int split, int groups) {
  static int max_clusters[64][MAX_CLUSTER + 1] = {};  // 0: not asked yet
  int n = dev < 64 ? max_clusters[dev][split] : 0;
  if (n == 0) {
    C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, gemv_kernel<NT, true>, &cfg));
    if (dev < 64) max_clusters[dev][split] = n > 0 ? n : -1;
  }
  return n >= groups;
}

}  // namespace cuda_gemv

// One launch. With want_cluster: the cluster reduction at the largest split <= p.split whose clusters
// are all resident at once (a GPC holds whole clusters only); returns that split, or 0 where none fits
// (split 1, or no such split) and the ticket path ran with p.split.
template <int NT>
static int launch_nt(cuda_gemv::Params p, bool want_cluster, int dev, cudaStream_t stream) {
  using namespace cuda_gemv;
  const unsigned groups = static_cast<unsigned>(p.n_out / (16 * MT));
  for (int split = min(p.split, MAX_CLUSTER); want_cluster && split > 1; --split) {
    set_attributes<NT, true>(dev);
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 1;
    attr[0].val.clusterDim.y = static_cast<unsigned>(split);
    attr[0].val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(groups, static_cast<unsigned>(split));
    cfg.blockDim = dim3(THREADS);
    cfg.dynamicSmemBytes = Shape<NT>::SMEM;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    if (cluster_fits<NT>(cfg, dev, split, static_cast<int>(groups))) {
      p.split = split;
      C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, gemv_kernel<NT, true>, p));
      return split;
    }
  }
  set_attributes<NT, false>(dev);
  gemv_kernel<NT, false><<<dim3(groups, static_cast<unsigned>(p.split)), THREADS, Shape<NT>::SMEM, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return 0;
}

// Host launcher (load_inline binds it): one launch for m <= 32 rows; cluster: reduce the K splits in
// thread-block clusters where they fit (see launch_nt), else by tickets. Returns the cluster split, or
// 0 (ticket path or one split). Shapes, dtypes, contiguity and alignment are checked by the Python
// wrapper (model/kernels/cuda_gemv.py).
int64_t gemv_launch(torch::Tensor x, torch::Tensor w, torch::Tensor s, torch::Tensor sc2, torch::Tensor out,
                 torch::Tensor part, torch::Tensor counters, int64_t split, bool cluster) {
  const c10::cuda::CUDAGuard device_guard(x.device());
  cuda_gemv::Params p;
  p.x = reinterpret_cast<const uint16_t*>(x.data_ptr());
  p.stride_x = x.stride(0);
  p.w = reinterpret_cast<const uint8_t*>(w.data_ptr());
  p.s = reinterpret_cast<const uint8_t*>(s.data_ptr());
  p.sc2 = sc2.data_ptr<float>();
  p.out = out.data_ptr();
  p.stride_o = out.stride(0);
  p.part = part.data_ptr<float>();
  p.counters = counters.data_ptr<int>();
  p.m = static_cast<int>(x.size(0));
  p.n_out = static_cast<int>(w.size(0));
  p.n_in = static_cast<int>(2 * w.size(1));
  p.split = static_cast<int>(split);
  p.out_kind = out.scalar_type() == at::kBFloat16 ? cuda_gemv::OUT_BF16
               : out.scalar_type() == at::kHalf   ? cuda_gemv::OUT_F16
                                                  : cuda_gemv::OUT_F32;
  const int dev = x.get_device();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (p.m <= 8) return launch_nt<1>(p, cluster, dev, stream);
  if (p.m <= 16) return launch_nt<2>(p, cluster, dev, stream);
  return launch_nt<4>(p, cluster, dev, stream);
}
#endif
