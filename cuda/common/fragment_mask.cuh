// The band mask of one query row of an accumulator fragment (common/accumulator.cuh's layout), the
// loop of the mma.sync forward and of the Hopper d = 256 dK/dV and dQ kernels: elements whose keys
// the query does not see (outside its band, past the keys, another segment) become `fill`.
// at(n8, c) is this thread's element of n8 tile n8 and column c of its pair: key
// k_first + 8 n8 + 2 (lane % 4) + c. The test is hide_outside's (mask.cuh) written out: through
// any function the mma.sync forward compiled to other code (its d = 64 masked kernel's spills
// 4 -> 40 bytes).
#pragma once

#include "common/mask.cuh"

namespace jax_flash {

template <int kN8, typename At>
__device__ __forceinline__ void mask_query_row(const Band& band, const int& q, const int& k_first, const int& lane,
                                               const float& fill, const At& at) {
  const Range seen = band.keys_seen_by(q);
#pragma unroll
  for (int n8 = 0; n8 < kN8; ++n8)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int k = k_first + n8 * 8 + (lane % 4) * 2 + c;
      if (k < seen.begin || k >= seen.end || !band.same_segment(q, k)) at(n8, c) = fill;
    }
}

}  // namespace jax_flash
