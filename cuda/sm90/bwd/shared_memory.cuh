// Where the Hopper backward keeps its tiles and barriers in shared memory (the offsets of
// BwdConfig, from a base aligned up to the 1024 bytes the 128-byte swizzle repeats over): K and V
// once, kStages stages of Q, dO, lse and delta, dS, the consumers' dQ parts, the bias tiles'
// region, then the mbarriers: the stages' (BwdBarriers), the dQ parts' and the bias tiles'.
#pragma once

#include <cstdint>

#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"
#include "sm90/bwd/stages.cuh"

namespace jax_flash::sm90 {

template <typename Cfg>
struct BwdSharedMemory {
  static constexpr int kStages = Cfg::kStages;
  static constexpr int kDqSlots = Cfg::kConsumers * Cfg::kDqBuffers;
  char* base;          // the aligned base, generic address
  uint32_t base_addr;  // the same, shared-memory address

  __device__ __forceinline__ static BwdSharedMemory of(char* smem) {
    const uint32_t align = (1024 - (ptx::smem_addr(smem) & 1023)) & 1023;
    return {smem + align, ptx::smem_addr(smem) + align};
  }
  __device__ __forceinline__ uint32_t k() const { return base_addr + Cfg::kK; }
  __device__ __forceinline__ uint32_t v() const { return base_addr + Cfg::kV; }
  __device__ __forceinline__ uint32_t q(int stage) const { return base_addr + Cfg::kQ + stage * Cfg::kQBytes; }
  __device__ __forceinline__ uint32_t d_o(int stage) const { return base_addr + Cfg::kDo + stage * Cfg::kQBytes; }
  // Step s's dS (or dS^T) buffer.
  __device__ __forceinline__ uint32_t ds(int s) const {
    return base_addr + Cfg::kDs + (s % Cfg::kDsBuffers) * Cfg::kDsBytes;
  }
  __device__ __forceinline__ uint32_t lse(int stage) const { return base_addr + Cfg::kLse + stage * Cfg::kStatBytes; }
  __device__ __forceinline__ uint32_t delta(int stage) const {
    return base_addr + Cfg::kDelta + stage * Cfg::kStatBytes;
  }
  __device__ __forceinline__ uint32_t dq(int consumer, int buffer) const {
    return base_addr + Cfg::kDq + (consumer * Cfg::kDqBuffers + buffer) * Cfg::kDqBytes;
  }
  // A shared-memory address as a generic pointer.
  __device__ __forceinline__ const char* generic(uint32_t addr) const { return base + (addr - base_addr); }

  __device__ __forceinline__ BwdBarriers<kStages> stages() const { return {base_addr + Cfg::kBarriers}; }
  // After the stages' barriers, those of the dQ part buffers.
  __device__ __forceinline__ uint32_t dq_barriers() const { return stages().first + 8 * BwdBarriers<kStages>::kCount; }
  // A consumer's dQ part buffer: "full" when it has written it, "empty" when its add has read it.
  __device__ __forceinline__ uint32_t dq_full(int consumer, int buffer) const {
    return dq_barriers() + 8 * (consumer * Cfg::kDqBuffers + buffer);
  }
  __device__ __forceinline__ uint32_t dq_empty(int consumer, int buffer) const {
    return dq_barriers() + 8 * (kDqSlots + consumer * Cfg::kDqBuffers + buffer);
  }
  // kBias: the bias tiles' two "full" barriers, then two "empty" ones.
  __device__ __forceinline__ uint32_t bias_full() const { return dq_barriers() + 8 * 2 * kDqSlots; }
  __device__ __forceinline__ uint32_t bias_empty() const { return bias_full() + 16; }

  // By thread 0, before the CTA's first __syncthreads.
  template <bool kBias>
  __device__ __forceinline__ void init_barriers() const {
    constexpr int kConsumerThreads = 128 * Cfg::kConsumers;
    stages().init(kConsumerThreads);
    for (int c = 0; c < Cfg::kConsumers; ++c)
      for (int b = 0; b < Cfg::kDqBuffers; ++b) {
        ptx::mbarrier_init(dq_full(c, b), 128);
        ptx::mbarrier_init(dq_empty(c, b), 1);
      }
    if constexpr (kBias) {
      for (int stage = 0; stage < 2; ++stage) {
        ptx::mbarrier_init(bias_full() + 8 * stage, 1);
        ptx::mbarrier_init(bias_empty() + 8 * stage, kConsumerThreads);
      }
    }
    ptx::fence_barrier_init();
  }
};

}  // namespace jax_flash::sm90
