// The mma.sync dK/dV kernel's loads of one step: its Q and dO tiles and the lse and delta of their
// rows into a stage (cp.async, and the caller commits; or Turing's loads and stores). Rows past
// seqlen_q are zero-filled in Q and dO and have lse_log2 = +inf (bwd_preprocess), so they give
// P = 0 and dS = 0 and add nothing to dK or dV. Every argument by reference, as the kernel holds it.
#pragma once

#include <cstdint>

#include "common/bwd_walk.cuh"
#include "common/params.h"
#include "common/ptx.cuh"
#include "common/tile.cuh"

namespace jax_flash::sm80 {

// q_stage, do_stage, stats_stage: the stage's Q tile, dO tile and statistics (shared addresses).
template <typename Cfg>
__device__ __forceinline__ void load_step(const BwdParams& p, const BwdStep& c, const int& batch,
                                          const int64_t& q_row_stride, const uint32_t& q_stage,
                                          const uint32_t& do_stage, const uint32_t& stats_stage, const int& tid) {
  using T = typename Cfg::T;
  using QTile = typename Cfg::QTile;
  constexpr int kBlockM = Cfg::kBlockM, kHeadDim = Cfg::kHeadDim;
  const int q_first = c.m_block * kBlockM;
  const int64_t offset = (int64_t(batch) * p.seqlen_q + q_first) * q_row_stride + c.head * kHeadDim;
  const int rows = p.seqlen_q - q_first;
  load_tile<QTile, Cfg::kThreads, false, false, Cfg::kIsa>(q_stage, static_cast<const T*>(p.q) + offset, q_row_stride, rows,
                                               tid);
  load_tile<QTile, Cfg::kThreads, false, false, Cfg::kIsa>(do_stage, static_cast<const T*>(p.dout) + offset, q_row_stride,
                                               rows, tid);
  // The statistics rows are padded to whole blocks (params.h).
  const int64_t row_offset = (int64_t(batch) * p.heads + c.head) * p.stats_stride + q_first;
  if (tid < 2 * kBlockM) {
    const float* src = (tid < kBlockM ? p.lse_log2 : p.delta) + row_offset + tid % kBlockM;
    ptx::copy_4<Cfg::kIsa>(stats_stage + tid * 4, src, true);
  }
}

}  // namespace jax_flash::sm80
