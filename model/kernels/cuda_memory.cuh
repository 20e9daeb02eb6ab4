// Memory-side device helpers every CUDA decode kernel shares: shared-memory addresses and loads,
// cp.async copies, mbarriers and TMA bulk copies, the L2 evict-first policy, index loads, split tickets.
//
// What: thin wrappers, one PTX instruction each (or one fixed sequence), used by cuda_moe.cu,
// cuda_gemv.cu (cp.async rings), cuda_indexer.cu and cuda_attention.cu (TMA rings on mbarriers).
// Why one header: the kernels were written in parallel and each carried its own copy; one copy means
// one set of qualifiers to review. Each kernel keeps the copies whose cache qualifiers are its own
// access policy (cuda_gemv.cu's 16-byte evict-first / zero-fill copies, cuda_moe.cu's 256-byte L2
// prefetch). Invariants: every wrapper is __forceinline__ and emits exactly the instruction it names
// with the operands and "memory" clobbers it had in the kernels (moving them here changed no SASS);
// shared-memory addresses are 32-bit (`smem_u32`); mbarriers of a ring sit 8 bytes apart.
#pragma once

#include <stdint.h>

namespace cuda_mem {

// ------------------------------------------------------------------------------ shared memory
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint32_t lds8(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u8 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}

__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}

__device__ __forceinline__ uint2 lds64(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

// ------------------------------------------------------------------------------ cp.async
// 4 bytes global -> shared, through L1 (.ca: scale words, whose 32-byte sectors serve several copies).
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// This thread's copies of all but the N most recent commit groups have landed.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// ------------------------------------------------------------------------------ mbarriers + TMA
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// A ring's STAGES mbarriers at bar, bar + 8, ... (one arrival each: the producer's expect_tx), then
// the fence that makes the initialisation visible to the async proxy. One thread.
template <int STAGES>
__device__ __forceinline__ void mbar_init_ring(uint32_t bar) {
#pragma unroll
  for (int s = 0; s < STAGES; ++s) mbar_init(bar + 8 * s, 1);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Spin until the phase of `parity` of the mbarrier has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}

// The producer's arrival on a stage's mbarrier, announcing `bytes` of TMA transactions to come.
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// One TMA bulk copy of `bytes` (a multiple of 16; 16-byte aligned ends) global -> shared, completing
// its bytes on the mbarrier `bar`, with the L2 cache policy `policy`.
__device__ __forceinline__ void tma_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar,
                                         uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(policy) : "memory");
}

// Before a stage that generic-proxy loads have read is refilled by the async proxy (TMA).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// ------------------------------------------------------------------------------ global memory
// L2 policy for data read once per launch (weights, cached K / V rows): evict first.
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// Element i of an int32 (is64 = 0) or int64 index tensor (block tables, sequence ids, positions).
__device__ __forceinline__ long long load_index(const void* p, long long i, int is64) {
  return is64 ? static_cast<const long long*>(p)[i] : static_cast<long long>(static_cast<const int*>(p)[i]);
}

// Split reduction ticket (the threadfence-reduction pattern), called by every thread of the CTA once
// its split's partial is stored: true in the CTA that draws the last of n tickets on counters[i],
// whose threads then see every split's partial (read them with __ldcg, and reset the counter to 0
// after reading). `ticket`: a __shared__ int of the kernel. `counters` is taken by reference (the
// kernel's Params field) so that it is read after the barrier, where the kernels always read it: a
// pointer argument is read before the fence, which reschedules cuda_gemv.cu's epilogue.
__device__ __forceinline__ bool last_ticket(int* const& counters, long long i, int n, int& ticket) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) ticket = atomicAdd(counters + i, 1);
  __syncthreads();
  if (ticket != n - 1) return false;
  __threadfence();
  return true;
}

}  // namespace cuda_mem
