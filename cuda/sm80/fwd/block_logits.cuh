// What the mma.sync forward adds to a key block's logits before its band mask and softmax: the
// soft cap, then the bias and boolean mask (bias.cuh).
#pragma once

#include <cmath>

#include "common/bias.cuh"
#include "common/logits.cuh"

namespace jax_flash::sm80 {

// acc_s: S of the block's keys from k_first for this thread's rows thread_row(mt, r) of the tile
// from q_first (the mma accumulator layout).
template <bool kBias, int kMTiles, int kNTiles, typename Capped, typename Bias, typename ThreadRow>
__device__ __forceinline__ void cap_and_bias(float (&acc_s)[kMTiles][kNTiles][4], const Capped& logits,
                                             const Bias& bias, int q_first, int k_first, const ThreadRow& thread_row,
                                             int lane) {
  if (logits.capped()) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int n = 0; n < kNTiles; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc_s[mt][n][i] = logits.value(acc_s[mt][n][i]);
  }
  if constexpr (kBias) {
    // Bias and boolean mask: unconditional loads (bias.cuh), so that they issue together.
    bias.with_layout([&](auto pairs) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int n = 0; n < kNTiles; ++n) {
            const float2 add = bias.template pair<decltype(pairs)::value>(q_first + thread_row(mt, r),
                                                                           k_first + n * 8 + (lane % 4) * 2);
            acc_s[mt][n][2 * r] += add.x;
            acc_s[mt][n][2 * r + 1] += add.y;
          }
    });
  }
}

}  // namespace jax_flash::sm80
