// NVFP4 lightning-indexer decode scores on tensor cores (v7): the kernel of model/kernels/cuda_indexer.py.
//
// out[r, n, blk] = scale_2 * max over the causally visible keys j of block blk of dot(q[r, n], key_j),
// for query row r (all N <= 8 index heads at once), blocks 0 .. pos_r / page (later entries untouched),
// keys NVFP4 rows of C = 128 values: 64 code bytes then 8 e4m3 block-scale bytes (72 B, packed in the
// page, uint8 [pages, page, 72]); scale_2 the fp32 dequant-side global (one per layer).
//
// Grid (T rows, splits); CTA = 4 independent warps over the split's BPS blocks: warp w takes blocks
// blk0 + w, blk0 + w + 4, ... Each block is read as page / 64 chunks of 64 key rows (4608 contiguous
// bytes: one cp.async.bulk (TMA) copy into a per-warp ring of STAGES shared-memory stages, completion
// on an mbarrier; evict-first in L2). Every byte of the chunk is used, so every DRAM sector is read
// once and whole. Lane 0 of the warp refills a stage once the warp has consumed it. No __syncthreads:
// the warps share nothing; each writes the N maxima of its own blocks (deterministic, no atomics).
//
// mma.sync.m16n8k16 bf16 x bf16 -> fp32 per 16-key tile: A (16 x 16) = 16 keys (M) x one NVFP4 scale
// block (k16), B (16 x 8) = the query's heads (N, heads >= N_heads zero), lane = 4 g + t (PTX layout):
//   A reg 0: row g, kappa 2t, 2t+1; reg 1: row g+8, same; reg 2: row g, kappa 2t+8, 2t+9; reg 3: row g+8
//   B reg j: kappa 2t + 8j + {0, 1}, column (head) g;   C c0..c3: row g + 8 (r >> 1), head 2t + (r & 1)
// k permutation (free: the 128 dims are summed in full inside the warp; A and B use the same map):
// step i (0..7), kappa -> dim k = 16 (t + 4 (i >> 2)) + 8 ((i >> 1) & 1) + 4 (kappa & 1) + 2 (i & 1)
// + (kappa >= 8). So a lane holds whole scale blocks t and t + 4 of its two rows (steps 0-3, 4-7): one
// 8-byte shared load of codes per (row, block), one of the row's 8 scale bytes, and its A registers
// are the row's raw 32-bit code words decoded in place (register halves = values e and e + 4 of a
// word: nibbles 16 bits apart, the distance the decode multiply needs).
// Row permutation (free too: scores are per key): tile row m = g + 8h -> key 4 (g & 3) + (g >> 2) + 2h
// of the tile, so the 8-byte loads of a half-warp hit 16 distinct bank pairs (72-byte rows: bank pair
// (9 row + word) mod 16).
//
// Decode (cuda_moe.cu's): A reg of a code word q is ((q' & 0x000F000F or 0x00F000F0) * (2^12 + 2^6 or
// 2^8 + 2^2)) & 0x81C081C0, q' = q or q >> 8: sign to bit 15, magnitude to bf16 exponent lsbs +
// mantissa msb, = e2m1 * 2^-126 exactly (0.5 a bf16 subnormal). One bf16x2 FMA by the block scale
// s * 2^119 gives e2m1 * s * 2^-7 exactly; the products with the bf16 query are exact in fp32. The
// epilogue masks keys past pos with -inf, takes the max over the block's keys (per lane, then over the
// 8 lanes g holding the same head pair), and multiplies by scale_2 * 2^7 (> 0: after the max, as the reference).
//
// Standalone compile check (no torch, no GPU): nvcc -DCUDA_INDEXER_STANDALONE -std=c++17 -O3 -arch=sm_90a
// -cubin -Xptxas -v -I model/kernels -x cu model/kernels/cuda_indexer.cu -o /tmp/idx.cubin: 94 registers, 0 spills (nvcc
// 13.0); per lane and 16-key tile ~175 PTX instructions for its 64 key values (136 of them the decode).

#include <stdint.h>

#include "cuda_memory.cuh"
#include "cuda_nvfp4.cuh"

namespace cuda_indexer {

using namespace cuda_mem;
using namespace nvfp4_mma;

constexpr int C = 128;                       // index head dim (the only one served)
constexpr int ROW_BYTES = C / 2 + C / 16;    // 72: 64 code bytes, 8 scale bytes
constexpr int WARPS = 4;                     // independent warps per CTA
constexpr int THREADS = 32 * WARPS;
constexpr int CHUNK = 64;                    // key rows per stage (page must be a multiple)
constexpr int TILES = CHUNK / 16;            // mma tiles per stage
constexpr int STAGE_BYTES = CHUNK * ROW_BYTES;  // 4608, a multiple of 16 (TMA)
constexpr int STAGES = 3;                    // ring depth per warp
constexpr int SMEM_BYTES = WARPS * STAGES * STAGE_BYTES;  // 55296: 4 CTAs (16 warps) per SM
constexpr int CTAS_PER_SM = 4;
static_assert(CTAS_PER_SM * (SMEM_BYTES + 1024) <= 228 * 1024, "4 CTAs must fit in the 228 KB of an SM");

struct Params {
  const uint16_t* q;          // bf16 bits [T, N, C], unit last stride, 16-byte aligned rows
  long long stride_qt, stride_qn;
  const uint8_t* pages;       // [P, page, 72], 16-byte aligned pages
  long long stride_pp;        // bytes
  const void* bt;             // [B, width] int32 / int64 page ids
  long long stride_bb;
  const void* seq;            // [T] int32 / int64 row of bt
  const void* pos;            // [T] int32 / int64 position
  const float* scale;         // fp32 scale_2
  float* out;                 // [T, N, width] fp32
  long long stride_ot, stride_on;
  int n_heads, page, bps;
  int bt64, seq64, pos64;
};

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xFF800000); }

// One 16-key tile: `row` = shared address of this lane's row g (row g + 8 is 2 rows further).
__device__ __forceinline__ void tile_scores(uint32_t row, uint32_t off_t, uint32_t sel, const uint32_t (&bq)[8][2],
                                            float (&acc)[4]) {
  const uint2 cg0 = lds64(row + off_t), cg1 = lds64(row + off_t + 32), sg = lds64(row + 64);
  const uint32_t row8 = row + 2 * ROW_BYTES;
  const uint2 ch0 = lds64(row8 + off_t), ch1 = lds64(row8 + off_t + 32), sh = lds64(row8 + 64);
  const uint32_t xg[2][2] = {{cg0.x, cg0.y}, {cg1.x, cg1.y}};
  const uint32_t xh[2][2] = {{ch0.x, ch0.y}, {ch1.x, ch1.y}};
  const uint32_t pairs[2] = {__byte_perm(sg.x, sh.x, sel), __byte_perm(sg.y, sh.y, sel)};
#pragma unroll
  for (int bb = 0; bb < 2; ++bb) {  // block t, then block t + 4
    uint32_t s_g, s_g8;
    scale_splats(pairs[bb], s_g, s_g8);
#pragma unroll
    for (int w = 0; w < 2; ++w) {  // code word: values 0-7, 8-15 of the block
#pragma unroll
      for (int p = 0; p < 2; ++p) {  // nibbles 0-1 / 2-3 of each half
        const uint32_t qg = p ? xg[bb][w] >> 8 : xg[bb][w];
        const uint32_t qh = p ? xh[bb][w] >> 8 : xh[bb][w];
        uint32_t a[4];  // rows g, g + 8: values 2p, 2p + 4 and 2p + 1, 2p + 5 of the word
        decode_a(qg, qh, s_g, s_g8, a);
        const int i = 4 * bb + 2 * w + p;
        mma_bf16(acc, a, bq[i][0], bq[i][1]);
      }
    }
  }
}

__global__ void __launch_bounds__(THREADS, CTAS_PER_SM) index_scores_kernel(const Params p) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t bars[WARPS][STAGES];

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int r = blockIdx.x;
  const long long seq = load_index(p.seq, r, p.seq64);
  const long long pos = load_index(p.pos, r, p.pos64);
  if (pos < 0) return;  // no candidate blocks
  const int n_blocks = static_cast<int>(pos / p.page) + 1;  // candidates: blocks 0 .. pos / page
  const int blk0 = blockIdx.y * p.bps + warp;               // this warp's first block, then + WARPS
  const int blk_end = min(blockIdx.y * p.bps + p.bps, n_blocks);
  if (blk0 >= blk_end) return;  // warps share nothing: an idle warp may leave at once
  const int n_mine = (blk_end - blk0 + WARPS - 1) / WARPS;
  const int cpb = p.page / CHUNK;  // chunks per block
  const int last_blk = blk0 + WARPS * (n_mine - 1);
  // The query's own block reads only the chunks up to pos (later rows are masked anyway).
  const int last_chunks = last_blk == n_blocks - 1 ? static_cast<int>((pos % p.page) / CHUNK) + 1 : cpb;
  const int n_chunks = (n_mine - 1) * cpb + last_chunks;

  const uint32_t ring = smem_u32(smem + warp * STAGES * STAGE_BYTES);
  const uint32_t bar0 = smem_u32(&bars[warp][0]);
  const void* bt_row = static_cast<const uint8_t*>(p.bt) + seq * p.stride_bb * (p.bt64 ? 8 : 4);
  uint64_t policy = 0;
  if (lane == 0) {
    mbar_init_ring<STAGES>(bar0);
    policy = evict_first_policy();
  }
  __syncwarp();
  // Lane 0's producer: the warp's chunks in order (block blk0 + WARPS j, rows CHUNK sub ...), chunk c
  // into stage c % STAGES.
  int next_blk = blk0, next_sub = 0, next_stage = 0;
  auto issue = [&]() {
    const long long page_id = load_index(bt_row, next_blk, p.bt64);
    const uint8_t* src = p.pages + page_id * p.stride_pp + next_sub * STAGE_BYTES;
    mbar_expect_tx(bar0 + 8 * next_stage, STAGE_BYTES);  // one chunk, completing on its stage's mbarrier
    tma_load(ring + next_stage * STAGE_BYTES, src, STAGE_BYTES, bar0 + 8 * next_stage, policy);
    if (++next_sub == cpb) next_sub = 0, next_blk += WARPS;
    if (++next_stage == STAGES) next_stage = 0;
  };
  if (lane == 0) {
    for (int c = 0; c < min(STAGES, n_chunks); ++c) issue();
  }

  // B fragments (the query), once: step i, reg j = q[g, base + j], q[g, base + j + 4] for the lane's
  // block b = t + 4 (i >> 2), base = 16 b + 8 ((i >> 1) & 1) + 2 (i & 1). Heads >= N are zero.
  uint32_t bq[8][2];
  if (g < p.n_heads) {
    const uint16_t* qrow = p.q + r * p.stride_qt + g * p.stride_qn;
#pragma unroll
    for (int bb = 0; bb < 2; ++bb) {
      const uint4* src = reinterpret_cast<const uint4*>(qrow + 16 * (t + 4 * bb));
      const uint4 v0 = __ldg(src), v1 = __ldg(src + 1);
      uint32_t b[4][2];  // then copied: b_fragments into bq in place renumbers the PTX (other SASS)
      b_fragments(v0, v1, b);
#pragma unroll
      for (int i = 0; i < 4; ++i) bq[4 * bb + i][0] = b[i][0], bq[4 * bb + i][1] = b[i][1];
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) bq[i][0] = bq[i][1] = 0u;
  }
  const float out_scale = *p.scale * 128.f;  // scale_2 and the decode's 2^7 (exact)
  const int key_g = 4 * (g & 3) + (g >> 2);  // tile row g's key; row g + 8's is key_g + 2
  const uint32_t row_off = key_g * ROW_BYTES;
  const uint32_t off_t = 8 * t;              // block t's code bytes (block t + 4: + 32)
  const uint32_t sel = t | ((t + 4) << 4);   // scale byte t of rows g (low) and g + 8 (high)

  float mx0 = neg_inf(), mx1 = neg_inf();  // heads 2t, 2t + 1
  int blk = blk0, sub = 0, s = 0;          // chunk c's block, chunk within it, stage
  uint32_t parity = 0;                     // of stage s's mbarrier phase: (c / STAGES) & 1
  for (int c = 0; c < n_chunks; ++c) {
    mbar_wait(bar0 + 8 * s, parity);
    const uint32_t stage = ring + s * STAGE_BYTES + row_off;
    float acc[TILES][4];
#pragma unroll
    for (int tt = 0; tt < TILES; ++tt) {
#pragma unroll
      for (int k = 0; k < 4; ++k) acc[tt][k] = 0.f;
      tile_scores(stage + tt * 16 * ROW_BYTES, off_t, sel, bq, acc[tt]);
    }
    const long long key0 = static_cast<long long>(blk) * p.page + sub * CHUNK;
    if (key0 + CHUNK - 1 <= pos) {
#pragma unroll
      for (int tt = 0; tt < TILES; ++tt) {
        mx0 = fmaxf(mx0, fmaxf(acc[tt][0], acc[tt][2]));
        mx1 = fmaxf(mx1, fmaxf(acc[tt][1], acc[tt][3]));
      }
    } else {  // the query's own chunk: keys after pos are not visible
#pragma unroll
      for (int tt = 0; tt < TILES; ++tt) {
        const long long kg = key0 + 16 * tt + key_g;
        const bool vis_g = kg <= pos, vis_g8 = kg + 2 <= pos;
        mx0 = fmaxf(mx0, fmaxf(vis_g ? acc[tt][0] : neg_inf(), vis_g8 ? acc[tt][2] : neg_inf()));
        mx1 = fmaxf(mx1, fmaxf(vis_g ? acc[tt][1] : neg_inf(), vis_g8 ? acc[tt][3] : neg_inf()));
      }
    }
    if (sub == cpb - 1 || c == n_chunks - 1) {  // the block's last chunk: max over g, store
#pragma unroll
      for (int m = 4; m < 32; m <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xFFFFFFFFu, mx0, m));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xFFFFFFFFu, mx1, m));
      }
      if (g == 0) {
        float* o = p.out + r * p.stride_ot + blk;
        if (2 * t < p.n_heads) o[(2 * t) * p.stride_on] = mx0 * out_scale;
        if (2 * t + 1 < p.n_heads) o[(2 * t + 1) * p.stride_on] = mx1 * out_scale;
      }
      mx0 = mx1 = neg_inf();
    }
    // Every lane has consumed stage s (its accumulators are used above): lane 0 refills it.
    __syncwarp();
    if (lane == 0 && c + STAGES < n_chunks) {
      fence_proxy_async();
      issue();
    }
    if (++sub == cpb) sub = 0, blk += WARPS;
    if (++s == STAGES) s = 0, parity ^= 1u;
  }
}

}  // namespace cuda_indexer

#ifndef CUDA_INDEXER_STANDALONE
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

// Host launcher (load_inline binds it). Shapes, dtypes and alignment are checked by the Python
// wrapper (model/kernels/cuda_indexer.py).
void index_scores_launch(torch::Tensor q, torch::Tensor pages, torch::Tensor bt, torch::Tensor seq,
                         torch::Tensor pos, torch::Tensor scale, torch::Tensor out, int64_t bps, int64_t splits) {
  const c10::cuda::CUDAGuard device_guard(q.device());
  cuda_indexer::Params p;
  p.q = reinterpret_cast<const uint16_t*>(q.data_ptr());
  p.stride_qt = q.stride(0);
  p.stride_qn = q.stride(1);
  p.pages = pages.data_ptr<uint8_t>();
  p.stride_pp = pages.stride(0);
  p.bt = bt.data_ptr();
  p.stride_bb = bt.stride(0);
  p.seq = seq.data_ptr();
  p.pos = pos.data_ptr();
  p.scale = scale.data_ptr<float>();
  p.out = out.data_ptr<float>();
  p.stride_ot = out.stride(0);
  p.stride_on = out.stride(1);
  p.n_heads = static_cast<int>(q.size(1));
  p.page = static_cast<int>(pages.size(1));
  p.bps = static_cast<int>(bps);
  p.bt64 = bt.scalar_type() == at::kLong;
  p.seq64 = seq.scalar_type() == at::kLong;
  p.pos64 = pos.scalar_type() == at::kLong;
  static bool attr_set[64] = {};  // per device: opt in to > 48 KB of dynamic shared memory
  const int dev = q.get_device();
  if (dev >= 64 || !attr_set[dev]) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(cuda_indexer::index_scores_kernel,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, cuda_indexer::SMEM_BYTES));
    if (dev < 64) attr_set[dev] = true;
  }
  const dim3 grid(static_cast<unsigned>(q.size(0)), static_cast<unsigned>(splits));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cuda_indexer::index_scores_kernel<<<grid, cuda_indexer::THREADS, cuda_indexer::SMEM_BYTES, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
#endif
