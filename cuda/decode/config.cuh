// Tile sizes of the decode kernels, from the element types (the queries', and the cache's K and V)
// and the head dim.
//
// A CTA holds one m16 tile of query rows (the queries x query heads of one kv head) and a few
// warps; each warp streams its own blocks of kDecodeBlockKeys keys through a ring of cp.async
// stages, with no barrier between warps, and the warps' softmax states merge once at the end.
// Shared memory stays within 96 KB, so that the kernels fit every GPU from sm_80 on (99 KB on
// sm_86/89) and two CTAs share an H100 SM.
#pragma once

#include "common/tile.cuh"
#include "decode/params.h"

namespace jax_flash::decode {

// kOneAnSm (H <= 128): the configuration of grids that take whole waves of one CTA an SM
// (run_decode.cuh launches it so): each warp keeps one block in flight, not two. With 264 CTAs
// (two an SM) or 132 of deeper rings streaming at once, HBM served 1-2% fewer bytes than with 132
// of these (decode D9): past what hides the latency, more loads in flight only cost.
// KvT: the cache's element type, the queries' or fp8 (decode/fp8.cuh: 8-bit tiles, half the
// stage bytes, widened to T in registers before the mma.sync), at H = 64 and 128: whole 64-byte
// rows of the tile, and Q in registers, where its fragments take the fp8 layout (query_tile.cuh).
template <typename T_, typename KvT_, int kHeadDim_, bool kOneAnSm_ = false>
struct Config {
  using T = T_;
  using KvT = KvT_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kOneAnSm = kOneAnSm_;
  static constexpr bool kFp8 = sizeof(KvT) == 1;
  static_assert(sizeof(KvT) == sizeof(T) || (kFp8 && (kHeadDim == 64 || kHeadDim == 128)),
                "K/V in T, or fp8 at H = 64 and 128");
  static_assert(!kOneAnSm || kHeadDim <= 128, "one CTA an SM: four warps, H <= 128");
  // Two warps above H = 128: each warp keeps O (H / 2 fp32 a thread) and Q (H / 4 registers).
  static constexpr int kWarps = kHeadDim <= 128 ? 4 : 2;
  static constexpr int kThreads = kWarps * 32;
  using KvTile = SmemTile<kDecodeBlockKeys, kHeadDim, sizeof(KvT)>;  // K or V of one warp's step
  static constexpr int kStageBytes = 2 * KvTile::kBytes;
  // Q fragments in registers up to H = 128; above, beside O they would spill, and each warp keeps
  // a copy of the tile in shared memory instead (query_tile.cuh).
  static constexpr bool kQInSmem = kHeadDim > 128;
  using QTile = SmemTile<kDecodeTileRows, kHeadDim>;
  static constexpr int kQBytes = kQInSmem ? kWarps * QTile::kBytes : 0;
  static constexpr int kSmemBudget = 96 * 1024;
  // Ring depth per warp: as deep as the budget allows, at most 8 (bytes in flight per SM are
  // then far above what hides the HBM latency); two stages (one in flight) one CTA an SM.
  static constexpr int kFitStages = (kSmemBudget - kQBytes) / (kWarps * kStageBytes);
  static constexpr int kStages = kOneAnSm ? 2 : kFitStages < 8 ? kFitStages : 8;
  static_assert(kStages >= 2, "a ring needs two stages");
  static constexpr int kRingBytes = kWarps * kStages * kStageBytes;
  // The warps' O, m and l for the final merge (fp32, rows padded by 8 floats against bank
  // conflicts), reusing the rings.
  static constexpr int kMergeRowFloats = kHeadDim + 8;
  static constexpr int kMergeBytes = kWarps * kDecodeTileRows * (kMergeRowFloats + 2) * 4;
  static constexpr int kAreaBytes = kRingBytes > kMergeBytes ? kRingBytes : kMergeBytes;
  static constexpr int kSmemBytes = kAreaBytes + kQBytes;
};

}  // namespace jax_flash::decode
