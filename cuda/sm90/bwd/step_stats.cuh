// A Hopper backward consumer thread's columns of a step's statistics (lse or delta, one float a
// query, in the stage's shared memory): two adjacent queries per n8 tile of its accumulators,
// tile(stats, n) = the values of columns accum.col(4 n) and + 1.
#pragma once

#include <cstdint>

#include "common/accumulator.cuh"

namespace jax_flash::sm90 {

template <typename SharedMemory, bool kCappedStep, int kTiles>
struct StepStats {
  const SharedMemory& sm;
  const uint32_t& offset;  // accum.col(0) * 4, kept in a register by the kernel
  const AccumulatorLayout& accum;

  __device__ __forceinline__ float2 tile(uint32_t stats, int n) const {
    const char* stage_stats = sm.generic(stats);
    if constexpr (kCappedStep) {
      // The same address from accum.col: with a cap, this form (not offset + n * 32) is the one
      // that keeps the H = 64 kernel free of spills.
      return *reinterpret_cast<const float2*>(reinterpret_cast<const float*>(stage_stats) + accum.col(4 * n));
    }
    return *reinterpret_cast<const float2*>(stage_stats + offset + n * 32);
  }
  __device__ __forceinline__ void load(uint32_t stats, float2 (&v)[kTiles]) const {
#pragma unroll
    for (int n = 0; n < kTiles; ++n) v[n] = tile(stats, n);
  }
};

}  // namespace jax_flash::sm90
