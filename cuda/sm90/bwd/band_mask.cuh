// The Hopper backward's mask of a step's S^T (keys as rows): -inf outside the band and past
// seqlen_k (common/mask.cuh), for a consumer's 64 keys from key0 and kBlockM queries from q_first.
#pragma once

#include <cmath>

#include "common/accumulator.cuh"
#include "common/mask.cuh"
#include "common/params.h"

namespace jax_flash::sm90 {

template <Variant kVariant, int kSRegs>
__device__ __forceinline__ void mask_transposed_scores(float (&st)[kSRegs], const Band& band, int q_first, int key0,
                                                       int warp, int lane) {
  constexpr int kBlockM = 2 * kSRegs;
  const int k0 = key0 + warp * 16 + lane / 4;  // this thread's keys: k0 and k0 + 8
  const Range seeing[2] = {band.queries_seeing(k0), band.queries_seeing(k0 + 8)};
  // A step inside one document (its diagonal) compares no ids, two loads an element (only in the
  // masked kernel: the test's registers made the capped and bias kernels spill).
  const Range one = kVariant == Variant::kMasked ? band.queries_of_one_segment(key0, key0 + 63) : Range{0, 0};
  const bool compare_ids = q_first < one.begin || q_first + kBlockM > one.end;
  const AccumulatorLayout accum{lane};  // element i: key row warp * 16 + accum.row(i), query accum.col(i)
  // hide_outside's test (common/mask.cuh) written out: through it, the d = 64 documents backward
  // ran 5% slower (perf log, session 49).
#pragma unroll
  for (int i = 0; i < kSRegs; ++i) {
    const int r = (i % 4) / 2, q = q_first + accum.col(i);
    if (q < seeing[r].begin || q >= seeing[r].end || (compare_ids && !band.same_segment(q, k0 + 8 * r))) {
      st[i] = -INFINITY;
    }
  }
}

}  // namespace jax_flash::sm90
