// Tiles and shared-memory layout of the mma.sync forward at head dims 320-512
// (sm80/wide_fwd_kernel.cuh): 64 query rows a CTA in 8 warps, 32-key blocks, Q, one K and one V
// block resident (85 KB at 320, 101 at 384, 117 at 448, 133 at 512: every head dim on an A100,
// 320 on sm_86/89's 99 KB; _ffi.wide_forward_fits).
#pragma once

#include "common/split_rows.cuh"
#include "common/tile.cuh"

namespace jax_flash::sm80 {

template <typename T_, int kHeadDim_>
struct WideFwdConfig {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim % 64 == 0 && kHeadDim > 256 && kHeadDim <= 512, "the wide head dims");
  static constexpr int kBlockM = 64, kBlockN = 32, kWarps = 8, kThreads = 32 * kWarps;
  static constexpr int kHalfKeys = kBlockN / 2;       // S of a warp: m16 x 16 keys
  static constexpr int kHalfCols = kHeadDim / 2;      // O of a warp: m16 x kHalfCols
  static_assert(kHalfCols % 16 == 0, "O's columns in pairs of n8 tiles");
  using QTile = SmemTile<kBlockM, kHeadDim>;
  using KTile = SmemTile<kBlockN, kHeadDim>;  // K and V
  using PTile = SmemTile<kBlockM, kBlockN>;
  static constexpr int kQ = 0, kK = QTile::kBytes, kV = kK + KTile::kBytes, kP = kV + KTile::kBytes;
  static constexpr int kRowStats = kP + PTile::kBytes;  // the halves' row statistics (common/split_rows.cuh)
  static constexpr int kSmemBytes = kRowStats + SplitRows::kBytes;  // 85-133 KB
};

}  // namespace jax_flash::sm80
