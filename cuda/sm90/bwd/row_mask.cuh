// The band mask of a warp's rows of S (queries as rows, keys as columns, the accumulator layout):
// -inf where a query does not see a key (outside the band, past the keys, another segment;
// common/mask.cuh). Used by the Hopper kernels that hold S with queries as rows, the d = 256 dK/dV
// kernel and the dQ kernel.
#pragma once

#include <cmath>

#include "common/accumulator.cuh"
#include "common/fragment_mask.cuh"
#include "common/mask.cuh"

namespace jax_flash::sm90 {

// The warp's 16 rows are queries q_first + warp * 16 + ..., the columns keys from k_first.
template <int kSRegs>
__device__ __forceinline__ void mask_rows(float (&s)[kSRegs], const Band& band, int q_first, int k_first, int warp,
                                          int lane) {
  const AccumulatorLayout accum{lane};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int q = q_first + (warp * 16 + accum.row(2 * r));
    mask_query_row<kSRegs / 4>(band, q, k_first, lane, -INFINITY,
                               [&](int n8, int c) -> float& { return s[4 * n8 + 2 * r + c]; });
  }
}

}  // namespace jax_flash::sm90
