// Tile sizes of the sm80 kernels, derived from the element type and head dim.
//
// Every warp owns 16 rows of each matrix product (the M of one mma.sync m16n8k16), so the row
// statistics of the softmax stay inside a quad of threads. The register budget sets the rest:
// the forward keeps O (16 x H fp32) per warp and, up to H = 128, the Q fragments too; the
// backward keeps dK and dV (2 x 16 x H fp32) per warp, which limits it to H <= 128.
#pragma once

#include "common/tile.cuh"

namespace jax_flash::sm80 {

template <typename T_, int kHeadDim_>
struct FwdConfig {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  // 8 warps x 16 rows amortise each K/V tile over 128 queries; above H = 128 the O accumulator
  // alone takes H / 2 registers, so 4 warps and Q re-read from shared memory.
  static constexpr int kBlockM = kHeadDim <= 128 ? 128 : 64;
  static constexpr int kBlockN = kHeadDim <= 64 ? 128 : (kHeadDim <= 192 ? 64 : 32);
  static constexpr int kWarps = kBlockM / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr bool kQInRegs = kHeadDim <= 128;
  using QTile = SmemTile<kBlockM, kHeadDim>;
  using KTile = SmemTile<kBlockN, kHeadDim>;
  static constexpr int kSmemBytes = QTile::kBytes + 2 * KTile::kBytes;
};

template <typename T_, int kHeadDim_>
struct BwdConfig {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim <= 128, "dK and dV accumulators of 16 x H fp32 per warp");
  static constexpr int kWarps = 8;
  static constexpr int kBlockN = 16 * kWarps;  // keys per CTA: 16 per warp
  // Queries per step: 32 at H = 128 keeps S^T and dP^T (16 x kBlockM fp32 each) in registers.
  static constexpr int kBlockM = kHeadDim == 128 ? 32 : 64;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStages = 2;  // Q/dO/lse/delta of the next step load during this one
  using KTile = SmemTile<kBlockN, kHeadDim>;
  using QTile = SmemTile<kBlockM, kHeadDim>;
  using DsTile = SmemTile<kBlockN, kBlockM>;  // dS^T, read back transposed for dQ = dS K
  static constexpr int kRowStatsBytes = 2 * kBlockM * 4;  // lse (log2 units) and delta
  static constexpr int kStageBytes = 2 * QTile::kBytes + kRowStatsBytes;
  static constexpr int kSmemBytes = 2 * KTile::kBytes + kStages * kStageBytes + DsTile::kBytes;
  // dQ = dS K is split over the warps: kBlockM / 16 row tiles, the head dim shared out.
  static constexpr int kDqWarpsPerRowTile = kWarps / (kBlockM / 16);
  static constexpr int kDqTilesPerWarp = kHeadDim / 8 / kDqWarpsPerRowTile;
  static_assert(kDqTilesPerWarp % 2 == 0, "dQ n8 tiles are loaded in pairs");
};

}  // namespace jax_flash::sm80
