// Where the Hopper dK/dV kernel of d = 192 and 256 (bwd_wide_kernel.cuh) keeps its tiles in
// shared memory, from a base aligned up to the 1024 bytes the 128-byte swizzle repeats over: K and
// V, two buffers each of P and dS (step parity), kStages of Q, dO and their rows' statistics, then
// the barriers (offsets in BwdWideConfig).
#pragma once

#include <cstdint>

#include "common/ptx.cuh"

namespace jax_flash::sm90 {

template <typename Cfg>
struct WideSharedMemory {
  char* base;          // generic address
  uint32_t base_addr;  // shared address

  __device__ __forceinline__ static WideSharedMemory of(char* smem) {
    const uint32_t align = (1024 - (ptx::smem_addr(smem) & 1023)) & 1023;
    return {smem + align, ptx::smem_addr(smem) + align};
  }
  __device__ __forceinline__ uint32_t k() const { return base_addr + Cfg::kK; }
  __device__ __forceinline__ uint32_t v() const { return base_addr + Cfg::kV; }
  __device__ __forceinline__ uint32_t p(int step) const { return base_addr + Cfg::kP + (step % 2) * Cfg::kTileBytes; }
  __device__ __forceinline__ uint32_t ds(int step) const { return base_addr + Cfg::kDs + (step % 2) * Cfg::kTileBytes; }
  __device__ __forceinline__ uint32_t q(int stage) const { return base_addr + Cfg::kQ + stage * Cfg::kQBytes; }
  __device__ __forceinline__ uint32_t d_o(int stage) const { return base_addr + Cfg::kDo + stage * Cfg::kDoBytes; }
  // Row `row`'s statistic (lse at Cfg::kLse, delta at Cfg::kDelta) of a stage.
  __device__ __forceinline__ float stat(int offset, int stage, int row) const {
    return reinterpret_cast<const float*>(base + offset + stage * Cfg::kStatBytes)[row];
  }
  __device__ __forceinline__ uint32_t barriers() const { return base_addr + Cfg::kBarriers; }
};

}  // namespace jax_flash::sm90
