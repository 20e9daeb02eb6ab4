// NVFP4 operands on bf16 tensor cores: the device helpers every CUDA decode kernel shares.
//
// What: the bf16 m16n8k16 MMA, the E2M1 register decode and the e4m3 block-scale splats, for kernels
// that hold packed codes (never a decoded tile) and decode straight into A fragments
// (cuda_moe.cu: expert weights; cuda_indexer.cu: index keys). Why one header: one design, one copy of
// its bit tricks. Invariants (the decode is exact): a word's nibble n and n + 4 land in the two bf16
// halves of one register as e2m1 * 2^-126 (code 1 = 0.5 is the subnormal 2^-127; PTX's bf16 fma has
// no .ftz, so subnormals survive, checked on the H200); one bf16x2 multiply by s * 2^119 gives
// e2m1 * s * 2^-7 exactly (<= 6 significant bits, in [2^-17, 21]); callers scale fp32 sums by 2^7.
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

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Scale bytes of rows g (low byte) and g + 8 (next byte) of one block -> bf16x2 splats {s * 2^119}
// of row g and of row g + 8 (exact: e4m3 -> f16 is exact, subnormal and zero scales included; s has
// <= 4 significant bits and s * 2^119 <= 1.75 * 2^127).
__device__ __forceinline__ void scale_splats(uint32_t pair, uint32_t& s_g, uint32_t& s_g8) {
  uint32_t h2;
  asm("{ .reg .b16 t; cvt.u16.u32 t, %1; cvt.rn.f16x2.e4m3x2 %0, t; }" : "=r"(h2) : "r"(pair));
  float lo, hi;
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }"
      : "=f"(lo), "=f"(hi) : "r"(h2));
  s_g = pack_bf16x2(lo * 0x1p119f, lo * 0x1p119f);
  s_g8 = pack_bf16x2(hi * 0x1p119f, hi * 0x1p119f);
}

// One MMA step's A registers from code words qg / qg8 of rows g / g + 8 (this step's codes in
// nibbles 0, 1, 4, 5; callers pass q >> 8 for nibbles 2, 3, 6, 7): e2m1 * s * 2^-7 as bf16. The
// multiply copies each nibble twice without carries, its sign to bit 15 and its magnitude to bits 6-8.
__device__ __forceinline__ void decode_a(uint32_t qg, uint32_t qg8, uint32_t s_g, uint32_t s_g8,
                                         uint32_t (&a)[4]) {
  const uint32_t M = 0x81C081C0u;  // bf16 sign, exponent bits 7-8, mantissa msb (both halves)
  a[0] = bmul2(((qg & 0x000F000Fu) * 0x1040u) & M, s_g);   // nibbles 0, 4: x 2^12 (sign), 2^6
  a[1] = bmul2(((qg8 & 0x000F000Fu) * 0x1040u) & M, s_g8);
  a[2] = bmul2(((qg & 0x00F000F0u) * 0x0104u) & M, s_g);   // nibbles 1, 5: x 2^8, 2^2
  a[3] = bmul2(((qg8 & 0x00F000F0u) * 0x0104u) & M, s_g8);
}

}  // namespace nvfp4_mma
