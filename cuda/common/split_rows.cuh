// Query rows whose keys two halves of a CTA split: the forwards above head dim 256 (two consumer
// warpgroups on Hopper, two sets of four warps on the mma.sync path) each see half of every key
// block, so the rows' maxima, and at the end their sums, meet through shared memory:
// [2 halves][2: max, sum][64 rows] floats. The caller synchronises the CTA's halves between a put
// and the other half's read; a thread holds rows[0] and rows[1] in the accumulator layout, one
// quad of threads a row.
#pragma once

#include <cmath>

#include "common/ptx.cuh"
#include "common/row_total.cuh"

namespace jax_flash {

struct SplitRows {
  float* stats;
  int half;        // 0 or 1
  int rows[2];     // this thread's, of the 64
  bool quad_lead;  // lane % 4 == 0: the thread that writes its quad's value

  static constexpr int kBytes = 2 * 2 * 64 * 4;

  // This half's maxima of the block's rows.
  __device__ __forceinline__ void put_max(const float (&block_max)[2]) const {
    if (quad_lead) {
      stats[(half * 2 + 0) * 64 + rows[0]] = block_max[0];
      stats[(half * 2 + 0) * 64 + rows[1]] = block_max[1];
    }
  }
  // After the barrier: the rows' running maxima (logit units) over both halves' keys, the shift
  // of their exponentials (scale_log2 folded in) and the factor that rescales what came before.
  __device__ __forceinline__ void merge_max(const float (&block_max)[2], float (&row_max)[2], float scale_log2,
                                            float (&shift)[2], float (&rescale)[2]) const {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float other = stats[((1 - half) * 2 + 0) * 64 + rows[r]];
      const float new_max = fmaxf(row_max[r], fmaxf(block_max[r], other));
      // A row that has seen nothing visible keeps max -inf: shift by 0 so exp2 gives 0, not NaN.
      shift[r] = new_max == -INFINITY ? 0.f : new_max * scale_log2;
      rescale[r] = ptx::exp2(row_max[r] * scale_log2 - shift[r]);
      row_max[r] = new_max;
    }
  }
  // At the end: this half's sums of the rows (each summed over its quad).
  __device__ __forceinline__ void put_sums(const RowTotal (&own)[2]) const {
    if (quad_lead) {
      stats[(half * 2 + 1) * 64 + rows[0]] = own[0].sum;
      stats[(half * 2 + 1) * 64 + rows[1]] = own[1].sum;
    }
  }
  // After the barrier: row r's total over both halves.
  __device__ __forceinline__ RowTotal total(const RowTotal& own, int r) const {
    return own.plus(stats[((1 - half) * 2 + 1) * 64 + rows[r]]);
  }
};

}  // namespace jax_flash
