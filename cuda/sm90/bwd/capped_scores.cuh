// A capped step of the Hopper backward (a soft cap, or a bias call with one), once S^T and dP^T
// have landed: S^T becomes the tanh values (logits.cuh) and dP^T becomes (dP^T - delta) times the
// tanh's slopes. Where dbias wants d logit without the slopes (kSlopesApart), they go to `slopes`
// as packed pairs of elements 2 i, 2 i + 1 instead (kept apart as floats until dS^T, the slopes
// took 32-64 more registers and spilled). delta is the stage's (sm.delta(stage)).
#pragma once

#include <cstdint>

#include "common/accumulator.cuh"
#include "common/ptx.cuh"

namespace jax_flash::sm90 {

template <typename T, bool kSlopesApart, int kSRegs, int kSlopes, typename Logits, typename SharedMemory>
__device__ __forceinline__ void cap_scores(float (&st)[kSRegs], float (&dpt)[kSRegs], uint32_t (&slopes)[kSlopes],
                                           const Logits& logits, const SharedMemory& sm, int stage,
                                           const AccumulatorLayout& accum) {
  constexpr int kBlockM = 2 * kSRegs;
#pragma unroll
  for (int n = 0; n < kBlockM / 8; ++n) {
    // delta by volatile loads, one n8 tile at a time: as plain loads ptxas hoisted them all ahead
    // of the loop, and at H = 64 (128-query steps) spilled 8 bytes.
    const uint32_t d_addr = sm.delta(stage) + accum.col(4 * n) * 4;
    const float2 d = {__uint_as_float(ptx::ld_shared_b32(d_addr)), __uint_as_float(ptx::ld_shared_b32(d_addr + 4))};
#pragma unroll
    for (int i = 4 * n; i < 4 * n + 4; ++i) {
      st[i] = logits.value(st[i]);
      dpt[i] = dpt[i] - (i % 2 ? d.y : d.x);
      if constexpr (!kSlopesApart) dpt[i] *= logits.slope(st[i]);
    }
    if constexpr (kSlopesApart) {
      slopes[2 * n] = ptx::pack2<T>(logits.slope(st[4 * n]), logits.slope(st[4 * n + 1]));
      slopes[2 * n + 1] = ptx::pack2<T>(logits.slope(st[4 * n + 2]), logits.slope(st[4 * n + 3]));
    }
  }
}

}  // namespace jax_flash::sm90
