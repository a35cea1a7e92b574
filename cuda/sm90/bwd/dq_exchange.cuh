// The end of the Hopper backward's dQ kernel: its two consumers' partial sums of dQ (each over
// half of every key block) meet through shared memory: consumer c gives the other its half of the
// columns (128 floats a thread, thread-major: conflict-free) and adds the other's part of its own
// half, which it stores as T.
#pragma once

#include <cstdint>

#include "common/params.h"
#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"

namespace jax_flash::sm90 {

// exchange: 2 x 64 x 128 floats of shared memory (the K stages, free once both consumers' last
// products have landed); give / keep: the 128 columns of dQ the other consumer / this one stores;
// tid, warp, lane: the thread's index in its warp group, its warp's and its lane.
template <typename T, int kHeadDim, int kExchangeBarrier>
__device__ __forceinline__ void exchange_and_store_dq(const BwdParams& p, float* exchange, const float (&give)[64],
                                                      float (&keep)[64], int consumer, int batch, int head,
                                                      int q_first, int tid, int warp, int lane) {
  constexpr int kConsumerThreads = 2 * 128;  // the two consumer warp groups
  float* mine = exchange + consumer * 64 * 128;
  const float* theirs = exchange + (1 - consumer) * 64 * 128;
#pragma unroll
  for (int i = 0; i < 64; ++i) mine[i * 128 + tid] = give[i];
  ptx::named_barrier_sync(kExchangeBarrier, kConsumerThreads);
#pragma unroll
  for (int i = 0; i < 64; ++i) keep[i] += theirs[i * 128 + tid];
  // Rows past T are not stored; rows of a batch row's padding computed to 0 (lse_log2 = +inf).
  const int64_t row_stride = int64_t(p.heads) * kHeadDim;
  T* gdq = static_cast<T*>(p.dq) + (int64_t(batch) * p.seqlen_q + q_first) * row_stride + head * kHeadDim +
           consumer * 128 + (lane % 4) * 2;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp * 16 + r * 8 + lane / 4;
    if (q_first + row < p.seqlen_q) {
      uint32_t* out = reinterpret_cast<uint32_t*>(gdq + row * row_stride);
#pragma unroll
      for (int n8 = 0; n8 < 16; ++n8) out[n8 * 4] = ptx::pack2<T>(keep[4 * n8 + 2 * r], keep[4 * n8 + 2 * r + 1]);
    }
  }
}

}  // namespace jax_flash::sm90
