// The online softmax of one m16 tile in the mma.sync accumulator layout (the mma.sync forward and
// the decode kernel): each thread holds two rows (lane / 4 and lane / 4 + 8) of a block of
// logits, over n8 tiles; a row's four threads form a quad, so its statistics need two shuffles
// and no shared memory.
#pragma once

#include <cmath>

#include "common/ptx.cuh"

namespace jax_flash {

// One step of the online softmax for a thread's two rows (r = 0, 1) of an m16 tile: a block of
// values s [kNTiles][4] (masked ones -inf) becomes exp2(s * scale_log2 - running max), the rows'
// max and this thread's part of their sums absorb the block, and the output accumulators o
// [kDTiles][4] are rescaled to the new max. max is in the units of the values before scale_log2.
template <int kNTiles, int kDTiles>
__device__ __forceinline__ void online_softmax_step(float (&s)[kNTiles][4], float (&o)[kDTiles][4], float (&max)[2],
                                                    float (&sum)[2], float scale_log2) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float block_max = max[r];
#pragma unroll
    for (int n = 0; n < kNTiles; ++n) block_max = fmaxf(block_max, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
    block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffff, block_max, 1));
    block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffff, block_max, 2));
    // A row that has seen nothing visible keeps max -inf: shift by 0 so exp2 gives 0, not NaN.
    const float shift = block_max == -INFINITY ? 0.f : block_max * scale_log2;
    const float rescale = ptx::exp2(max[r] * scale_log2 - shift);
    max[r] = block_max;
    float block_sum = 0.f;
#pragma unroll
    for (int n = 0; n < kNTiles; ++n)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        float& x = s[n][2 * r + c];
        x = ptx::exp2(x * scale_log2 - shift);
        block_sum += x;
      }
    sum[r] = sum[r] * rescale + block_sum;
#pragma unroll
    for (int d = 0; d < kDTiles; ++d) {
      o[d][2 * r] *= rescale;
      o[d][2 * r + 1] *= rescale;
    }
  }
}

// The same state as an object (the decode kernel's warps).
struct OnlineSoftmax {
  // Per row: the largest value seen (in the units of the logits before `scale_log2`) and this
  // thread's part of the sum of exponentials (the quad's parts add up in `row_sum`).
  float max[2] = {-INFINITY, -INFINITY};
  float sum[2] = {0.f, 0.f};

  template <int kNTiles, int kDTiles>
  __device__ __forceinline__ void update(float (&s)[kNTiles][4], float (&o)[kDTiles][4], float scale_log2) {
    online_softmax_step(s, o, max, sum, scale_log2);
  }

  // The whole row's sum of exponentials (the quad's parts added), in every thread of the quad.
  __device__ __forceinline__ float row_sum(int r) const {
    float total = sum[r];
    total += __shfl_xor_sync(0xffffffff, total, 1);
    total += __shfl_xor_sync(0xffffffff, total, 2);
    return total;
  }
};

}  // namespace jax_flash
