// The mma.sync forward's epilogue: a warp normalises its rows of O, stages them in its own rows of
// Q's tile (sQ) and stores them in 16-byte chunks, with each row's log-sum-exp.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/params.h"
#include "common/ptx.cuh"
#include "common/row_total.cuh"

namespace jax_flash::sm80 {

// row_sum: this thread's columns' share (the quad's four add up here); row_max in logit units over
// `unit` (the logits' scale). Rows from warp_row0; gO, gLse at the CTA's first row.
template <typename Cfg, int kMTiles>
__device__ __forceinline__ void store_output(const float (&acc_o)[kMTiles][Cfg::kHeadDim / 8][4],
                                             const float (&row_max)[kMTiles][2], const float (&row_sum)[kMTiles][2],
                                             float unit, const FwdParams& p, int batch, int head, uint32_t sQ,
                                             typename Cfg::T* gO, float* gLse,
                                             int64_t q_row_stride, int rows_valid, int warp_row0, int lane) {
  using T = typename Cfg::T;
  using QTile = typename Cfg::QTile;
  constexpr int kDTiles = Cfg::kHeadDim / 8;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp_row0 + mt * 16 + r * 8 + lane / 4;
    const RowTotal total(row_sum[mt][r]);
    float inv, lse;
    total.finish(row_max[mt][r], unit, p, batch, head, inv, lse);
#pragma unroll
    for (int d = 0; d < kDTiles; ++d) {
      const uint32_t packed = ptx::pack2<T>(acc_o[mt][d][2 * r] * inv, acc_o[mt][d][2 * r + 1] * inv);
      ptx::st_shared_b32(sQ + QTile::offset(row, d) + (lane % 4) * 4, packed);
    }
    if (lane % 4 == 0 && row < rows_valid) {
      gLse[row] = lse;
    }
  }
  __syncwarp();
  constexpr int kChunks = QTile::kChunks;
#pragma unroll
  for (int i = lane; i < Cfg::kWarpRows * kChunks; i += 32) {
    const int row = warp_row0 + i / kChunks, chunk = i % kChunks;
    if (row < rows_valid) {
      *reinterpret_cast<uint4*>(gO + row * q_row_stride + chunk * 8) = ptx::ld_shared_v4(sQ + QTile::offset(row, chunk));
    }
  }
}

}  // namespace jax_flash::sm80
