// Where the Hopper backward's dQ kernel keeps its tiles and barriers in shared memory (the offsets
// of its config, from a base aligned up to 1024 bytes): Q and dO once, kStages stages of K and V;
// the barriers: Q and dO loaded, then per stage K loaded, V loaded, K released, V released.
#pragma once

#include <cstdint>

namespace jax_flash::sm90 {

template <typename Cfg>
struct DqKernelSharedMemory {
  static constexpr int kStages = Cfg::kStages;
  uint32_t base;  // the aligned base

  __device__ __forceinline__ uint32_t q() const { return base + Cfg::kQ; }
  __device__ __forceinline__ uint32_t d_o() const { return base + Cfg::kDo; }
  __device__ __forceinline__ uint32_t k(int stage) const { return base + Cfg::kK + stage * Cfg::kKBytes; }
  __device__ __forceinline__ uint32_t v(int stage) const { return base + Cfg::kV + stage * Cfg::kVBytes; }
  __device__ __forceinline__ uint32_t qdo_full() const { return base + Cfg::kBarriers; }
  __device__ __forceinline__ uint32_t k_full(int stage) const { return qdo_full() + 8 * (1 + stage); }
  __device__ __forceinline__ uint32_t v_full(int stage) const { return qdo_full() + 8 * (1 + kStages + stage); }
  __device__ __forceinline__ uint32_t k_empty(int stage) const { return qdo_full() + 8 * (1 + 2 * kStages + stage); }
  __device__ __forceinline__ uint32_t v_empty(int stage) const { return qdo_full() + 8 * (1 + 3 * kStages + stage); }
};

}  // namespace jax_flash::sm90
