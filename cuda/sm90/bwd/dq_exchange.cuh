// The end of the Hopper backward's dQ kernel: its two consumers' partial sums of dQ (each over
// half of every key block) meet through shared memory: consumer c gives the other the half of the
// columns it does not store (H / 4 floats a thread, thread-major: conflict-free) and adds the
// other's part of its own half, which it stores as T.
#pragma once

#include <cstdint>

#include "common/params.h"
#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"

namespace jax_flash::sm90 {

// exchange: 2 x 128 x H / 4 floats of shared memory (the K and V stages, free once both consumers'
// last products have landed); dq: this consumer's m64nH accumulator, whose first half of registers
// holds the first half of the columns; kKeep: the half this consumer stores (its index);
// tid, warp, lane: the thread's index in its warp group, its warp's and its lane.
template <typename T, int kHeadDim, int kExchangeBarrier, int kKeep>
__device__ __forceinline__ void exchange_and_store_dq(const BwdParams& p, float* exchange, float (&dq)[kHeadDim / 2],
                                                      int batch, int head, int q_first, int tid, int warp, int lane) {
  constexpr int kConsumerThreads = 2 * 128;  // the two consumer warp groups
  constexpr int kHalf = kHeadDim / 4;        // registers of half the columns
  constexpr int kGive = (1 - kKeep) * kHalf, kOwn = kKeep * kHalf;
  float* mine = exchange + kKeep * kHalf * 128;
  const float* theirs = exchange + (1 - kKeep) * kHalf * 128;
#pragma unroll
  for (int i = 0; i < kHalf; ++i) mine[i * 128 + tid] = dq[kGive + i];
  ptx::named_barrier_sync(kExchangeBarrier, kConsumerThreads);
#pragma unroll
  for (int i = 0; i < kHalf; ++i) dq[kOwn + i] += theirs[i * 128 + tid];
  // Rows past T are not stored; rows of a batch row's padding computed to 0 (lse_log2 = +inf).
  const int64_t row_stride = int64_t(p.heads) * kHeadDim;
  T* gdq = static_cast<T*>(p.dq) + (int64_t(batch) * p.seqlen_q + q_first) * row_stride + head * kHeadDim +
           kKeep * (kHeadDim / 2) + (lane % 4) * 2;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp * 16 + r * 8 + lane / 4;
    if (q_first + row < p.seqlen_q) {
      uint32_t* out = reinterpret_cast<uint32_t*>(gdq + row * row_stride);
#pragma unroll
      for (int n8 = 0; n8 < kHalf / 4; ++n8) {
        out[n8 * 4] = ptx::pack2<T>(dq[kOwn + 4 * n8 + 2 * r], dq[kOwn + 4 * n8 + 2 * r + 1]);
      }
    }
  }
}

}  // namespace jax_flash::sm90
