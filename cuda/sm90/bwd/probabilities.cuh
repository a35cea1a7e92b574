// P^T of a Hopper backward step from its (capped, biased, masked) S^T: exp2 against the rows' lse
// (log2 units, from the forward), then packed as the A operands of k16 steps over the step's
// queries for dV += P^T dO (the accumulator and A layouts agree). Every argument by reference,
// as the kernel holds it (by value, the code changed).
#pragma once

#include <cstdint>

#include "common/ptx.cuh"

namespace jax_flash::sm90 {

// kEarlyLse: the lse is in registers (`lse`); otherwise read here from the stage (stats.tile).
template <typename T, bool kEarlyLse, int kSRegs, typename Stats>
__device__ __forceinline__ void probabilities(float (&st)[kSRegs], uint32_t (&pa)[2 * kSRegs / 16][4],
                                              const float& scale_log2, const float2 (&lse)[2 * kSRegs / 8],
                                              const Stats& stats, const uint32_t& lse_stats) {
  constexpr int kBlockM = 2 * kSRegs;
#pragma unroll
  for (int n = 0; n < kBlockM / 8; ++n) {
    const float2 l = kEarlyLse ? lse[n] : stats.tile(lse_stats, n);
#pragma unroll
    for (int i = 4 * n; i < 4 * n + 4; ++i) st[i] = ptx::exp2(st[i] * scale_log2 - (i % 2 ? l.y : l.x));
  }
#pragma unroll
  for (int kk = 0; kk < kBlockM / 16; ++kk)
#pragma unroll
    for (int j = 0; j < 4; ++j) pa[kk][j] = ptx::pack2<T>(st[8 * kk + 2 * j], st[8 * kk + 2 * j + 1]);
}

}  // namespace jax_flash::sm90
