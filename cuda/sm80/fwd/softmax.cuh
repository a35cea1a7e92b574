// The mma.sync forward's online softmax over one key block: each row's running maximum and sum
// (row_max, and row_sum over this thread's columns) absorb the block's logits, O is rescaled, and
// the block's logits become P = exp2(S * scale_log2 - max * scale_log2). A row's four threads are
// one quad, so its maximum needs two shuffles and no shared memory.
#pragma once

#include <cmath>

#include "common/ptx.cuh"

namespace jax_flash::sm80 {

// scale_log2: the logits' scale times log2 e (base 2 with the scale folded in: one FFMA an element).
template <int kMTiles, int kNTiles, int kDTiles>
__device__ __forceinline__ void online_softmax(float (&acc_s)[kMTiles][kNTiles][4], float (&row_max)[kMTiles][2],
                                               float (&row_sum)[kMTiles][2], float (&acc_o)[kMTiles][kDTiles][4],
                                               float scale_log2) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float block_max = row_max[mt][r];
#pragma unroll
    for (int n = 0; n < kNTiles; ++n) block_max = fmaxf(block_max, fmaxf(acc_s[mt][n][2 * r], acc_s[mt][n][2 * r + 1]));
    block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffff, block_max, 1));
    block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffff, block_max, 2));
    // A row that has seen nothing visible keeps max -inf: shift by 0 so exp2 gives 0, not NaN.
    const float shift = block_max == -INFINITY ? 0.f : block_max * scale_log2;
    const float rescale = ptx::exp2(row_max[mt][r] * scale_log2 - shift);
    row_max[mt][r] = block_max;
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < kNTiles; ++n)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        float& s = acc_s[mt][n][2 * r + c];
        s = ptx::exp2(s * scale_log2 - shift);
        sum += s;
      }
    row_sum[mt][r] = row_sum[mt][r] * rescale + sum;
#pragma unroll
    for (int d = 0; d < kDTiles; ++d) {
      acc_o[mt][d][2 * r] *= rescale;
      acc_o[mt][d][2 * r + 1] *= rescale;
    }
  }
}

}  // namespace jax_flash::sm80
