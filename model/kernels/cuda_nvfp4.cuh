// NVFP4 operands on bf16 tensor cores: the arithmetic device helpers every CUDA decode kernel shares.
//
// What: the bf16 m16n8k16 MMA, bf16 conversions, the E2M1 register decode (`nibble_pair`, `decode_a`),
// the e4m3 block-scale multipliers (`scale_splats` for A operands, `scale_pair` for B operands holding
// two rows), the B-register pairing of 16 bf16 values (`b_fragments`) and one weight tile's share of a
// 64-input chunk (`chunk_tile_mma`), for kernels that hold packed codes (never a decoded tile) and
// decode straight into MMA fragments: cuda_moe.cu and cuda_gemv.cu (weights), cuda_indexer.cu (index
// keys), cuda_attention.cu (K and V). Memory-side helpers: cuda_memory.cuh. Why one header: one design,
// one copy of its bit tricks. Invariants (the decode is exact): a word's nibble n and n + 4 land in the
// two bf16 halves of one register as e2m1 * 2^-126 (code 1 = 0.5 is the subnormal 2^-127; PTX's bf16
// fma has no .ftz, so subnormals survive, checked on the H200); one bf16x2 multiply by s * 2^119 gives
// e2m1 * s * 2^-7 exactly (<= 6 significant bits, in [2^-17, 21]); callers scale fp32 sums by 2^7.
// Moving these here from the kernels changed no SASS (nvcc 13.0, sm_90a).
#pragma once

#include <stdint.h>

namespace nvfp4_mma {

__device__ __forceinline__ uint32_t bmul2(uint32_t a, uint32_t b) {
  uint32_t d;  // bf16x2 a * b (+ -0: exact products keep their sign)
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

__device__ __forceinline__ uint16_t bf16_bits(float v) {
  uint16_t h;  // round to nearest even
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The two e4m3 scale bytes in the low 16 bits of `pair` (low byte -> lo) as fp32, exactly (e4m3 ->
// f16 is exact, subnormal and zero scales included).
__device__ __forceinline__ void e4m3x2_f32(uint32_t pair, float& lo, float& hi) {
  uint32_t h2;
  asm("{ .reg .b16 t; cvt.u16.u32 t, %1; cvt.rn.f16x2.e4m3x2 %0, t; }" : "=r"(h2) : "r"(pair));
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }"
      : "=f"(lo), "=f"(hi) : "r"(h2));
}

// Scale bytes of rows g (low byte) and g + 8 (next byte) of one block -> bf16x2 splats {s * 2^119}
// of row g and of row g + 8 (exact: s has <= 4 significant bits and s * 2^119 <= 1.75 * 2^127).
// For A operands, whose registers hold two values of one row.
__device__ __forceinline__ void scale_splats(uint32_t pair, uint32_t& s_g, uint32_t& s_g8) {
  float lo, hi;
  e4m3x2_f32(pair, lo, hi);
  s_g = pack_bf16x2(lo * 0x1p119f, lo * 0x1p119f);
  s_g8 = pack_bf16x2(hi * 0x1p119f, hi * 0x1p119f);
}

// Scale bytes of key a (low byte) and key b (next byte) -> the bf16x2 multiplier {s_a, s_b} * 2^119
// (exact, as scale_splats). For B operands whose registers hold one value of each of two rows.
__device__ __forceinline__ uint32_t scale_pair(uint32_t pair) {
  float lo, hi;
  e4m3x2_f32(pair, lo, hi);
  return pack_bf16x2(lo * 0x1p119f, hi * 0x1p119f);
}

// Nibble 0 (ODD = 0) or 1 (ODD = 1) of each 16-bit half of q -> bf16x2 e2m1 * 2^-126. The multiply
// copies the nibble twice without carries, its sign to bit 15 and its magnitude to bits 6-8 (bf16
// exponent lsbs and mantissa msb; the mask keeps those).
template <int ODD>
__device__ __forceinline__ uint32_t nibble_pair(uint32_t q) {
  return ODD ? ((q & 0x00F000F0u) * 0x0104u) & 0x81C081C0u   // nibbles 1, 5: x 2^8 (sign), 2^2
             : ((q & 0x000F000Fu) * 0x1040u) & 0x81C081C0u;  // nibbles 0, 4: x 2^12 (sign), 2^6
}

// One MMA step's A registers from code words qg / qg8 of rows g / g + 8 (this step's codes in
// nibbles 0, 1, 4, 5; callers pass q >> 8 for nibbles 2, 3, 6, 7): e2m1 * s * 2^-7 as bf16.
__device__ __forceinline__ void decode_a(uint32_t qg, uint32_t qg8, uint32_t s_g, uint32_t s_g8,
                                         uint32_t (&a)[4]) {
  a[0] = bmul2(nibble_pair<0>(qg), s_g);
  a[1] = bmul2(nibble_pair<0>(qg8), s_g8);
  a[2] = bmul2(nibble_pair<1>(qg), s_g);
  a[3] = bmul2(nibble_pair<1>(qg8), s_g8);
}

// B registers b[i][0 / 1] of the 4 k-steps i that take one 16-value block of bf16 values (v0: values
// 0-7, v1: values 8-15): register 0 = values o, o + 4 and register 1 = values o + 1, o + 5 (low half first),
// o = 8 (i >> 1) + 2 (i & 1). Every kernel here uses this k permutation (free: A and B use the same
// map), so that B pairs values 4 apart as decode_a pairs nibbles n and n + 4 of a code word.
__device__ __forceinline__ void b_fragments(uint4 v0, uint4 v1, uint32_t (&b)[4][2]) {
  const uint32_t w[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};  // value pairs (2m, 2m + 1)
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = w[4 * (i >> 1) + (i & 1)], hi = w[4 * (i >> 1) + (i & 1) + 2];
    b[i][0] = __byte_perm(lo, hi, 0x5410);
    b[i][1] = __byte_perm(lo, hi, 0x7632);
  }
}

// One 16-row weight tile's share of a 64-input chunk in the layout of cuda_moe.cu and cuda_gemv.cu
// (lane t holds NVFP4 block t of rows g and g + 8: code words wg / wg8, their scale bytes in `pair`,
// row g's low): its 4 k-steps decoded and multiplied by N 8-column B operands (b_fragments order).
template <int N>
__device__ __forceinline__ void chunk_tile_mma(uint2 wg, uint2 wg8, uint32_t pair, const uint32_t (&xb)[N][4][2],
                                               float (&acc)[N][4]) {
  uint32_t s_g, s_g8;
  scale_splats(pair, s_g, s_g8);
  const uint32_t qg[2] = {wg.x, wg.y}, qg8[2] = {wg8.x, wg8.y};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int sh = 8 * (i & 1);  // odd steps: nibbles 2, 3, 6, 7 of the word
    uint32_t a[4];
    decode_a(qg[i >> 1] >> sh, qg8[i >> 1] >> sh, s_g, s_g8, a);
#pragma unroll
    for (int j = 0; j < N; ++j) mma_bf16(acc[j], a, xb[j][i][0], xb[j][i][1]);
  }
}

}  // namespace nvfp4_mma
