// The mma.sync backward's dQ adds: a warp's share of dS K for one step's query block, added into
// the fp32 dQ accumulator with atomics (in deterministic mode, in this key block's turn).
#pragma once

#include <cstdint>

#include "common/bwd_walk.cuh"
#include "common/mask.cuh"
#include "common/params.h"
#include "common/ptx.cuh"

namespace jax_flash::sm80 {

// acc_dq: the warp's rows dq_m + mt * 16 + r * 8 + lane / 4 of the block from q_first, columns
// from dq_d, of query head `head`.
template <typename Cfg, int kDqMTiles, int kDqNTiles>
__device__ __forceinline__ void add_dq(const float (&acc_dq)[kDqMTiles][kDqNTiles][4], const BwdParams& p,
                                       const Band& band, int batch, int head, int q_first, int n_block, int dq_m,
                                       int dq_d, int64_t q_row_stride, int tid) {
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  const int lane = tid % 32;
  // Deterministic mode: this key block's turn at the query block (common/bwd_walk.cuh).
  int* turn = nullptr;
  if (p.dq_turns != nullptr) {
    if (tid == 0) {
      turn = wait_dq_turn(p.dq_turns + (int64_t(batch) * p.heads + head) * (p.stats_stride / contract::kDqCounterRows),
                          band.without_segments(), q_first / kBlockM, n_block, kBlockM, kBlockN);
    }
    __syncthreads();
  }
  float* dq = p.dq_accum + (int64_t(batch) * p.seqlen_q + q_first) * q_row_stride + head * kHeadDim + dq_d;
#pragma unroll
  for (int mt = 0; mt < kDqMTiles; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int q = dq_m + mt * 16 + r * 8 + lane / 4;
      if (q_first + q < p.seqlen_q) {
#pragma unroll
        for (int d = 0; d < kDqNTiles; ++d)
          ptx::red_add_f32x2(dq + q * q_row_stride + d * 8 + (lane % 4) * 2, acc_dq[mt][d][2 * r],
                             acc_dq[mt][d][2 * r + 1]);
      }
    }
  if (p.dq_turns != nullptr) {
    __threadfence();
    __syncthreads();
    if (tid == 0) ptx::red_release_add(turn, 1);
  }
}

}  // namespace jax_flash::sm80
