// The Hopper forward's tile shapes and shared-memory layout (FwdConfig) and its tensor maps.
#pragma once

#include <cuda.h>

#include "common/ptx_sm90.cuh"
#include "sm90/fwd/bias_tiles.cuh"

namespace jax_flash::sm90 {

// kConsumers: warp groups of 64 query rows. Three (192-row tiles, as FlashAttention-3) only at
// H = 64, where the softmax is half the work and a third group's products give it more to hide
// under; the plan picks them (jax_flash/_plan.py, forward_tiles: Tiles::kTall).
// kWideBlocks: 176-key blocks at H = 128, 80 at H = 256 (FlashAttention-3's non-causal tiles),
// which spread a block's fixed cost (waits, turns, row maxima) over more keys; two stages then
// fill the shared memory. The plan says where they pay (forward_tiles: Tiles::kWideKeys).
// kBiasTiles (kBias): the bias and mask staged by TMA a key block at a time (fwd_bias_tiles.cuh),
// at H = 128 in a region that takes the third K/V stage's place.
// kValueDim_: V's and O's head dim where it differs from Q's and K's (MLA's 192 / 128): V's stages
// and O's accumulators take its columns, S and the tiles' shapes are the query head dim's.
template <typename T_, int kHeadDim_, int kConsumers_ = 2, bool kWideBlocks = false, bool kBiasTiles = false,
          int kValueDim_ = kHeadDim_>
struct FwdConfig {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_, kValueDim = kValueDim_;
  static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256, "whole 64-column panels");
  static_assert(kValueDim % 64 == 0 && kValueDim <= kHeadDim, "V's panels fit where Q's do");
  static_assert(kValueDim == kHeadDim || (!kWideBlocks && !kBiasTiles), "unequal head dims: the plain tiles");
  static constexpr int kConsumers = kConsumers_;
  static_assert(kConsumers == 2 || (kConsumers == 3 && kHeadDim == 64), "registers for three at H = 64 only");
  static constexpr int kBlockM = 64 * kConsumers;
  // S (64 x kBlockN fp32 per warp group) and O (64 x kValueDim) share a consumer's 232 registers:
  // 128 keys where O has at most 128 columns (Q and K of 192 columns still fit two stages).
  static_assert(!kWideBlocks || kHeadDim == 128 || kHeadDim == 256, "wide blocks at H = 128 and 256");
  static constexpr int kBlockN = kValueDim <= 128 ? (kWideBlocks ? 176 : 128) : (kWideBlocks ? 80 : 64);
  // K/V stages: three at H = 128 (225 KB; H4), two elsewhere (all that fits at H = 256; four were
  // slower at H = 64, H4).
  static constexpr int kStages = kHeadDim == 128 && !kWideBlocks && !kBiasTiles ? 3 : 2;
  using BiasTiles = FwdBiasTiles<kHeadDim>;
  static_assert(!kBiasTiles || (kBlockM == BiasTiles::kBlockM && kBlockN == BiasTiles::kBlockN),
                "the bias tiles' shape");
  static constexpr int kBiasRegionBytes = kBiasTiles ? BiasTiles::kRegionBytes : 0;
  // O staged in the last key block's K stage (held until the store has read it) and stored by
  // TMA, with three stages only: with two, the held stage delays the next tile's second block
  // (H18). Both consumers' rows must fit in one K stage.
  static constexpr bool kStagedStore = kStages >= 3 && kConsumers * 64 <= kBlockN;
  // A window's first key block, cut by its left edge, visited last, so that the tile starts on a
  // whole block (as a causal one does); in the same kernels only (slower at d = 64, H18).
  static constexpr bool kWindowEdgeLast = kStages >= 3;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kPanels = kHeadDim / 64, kVPanels = kValueDim / 64;  // of Q and K / of V and O
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKBytes = kBlockN * kHeadDim * 2, kVBytes = kBlockN * kValueDim * 2;  // one K / V tile
  // Barriers: q_full, q_empty, four per stage, last_s_landed (the staged O store), with bias tiles
  // two "full" and two "empty"; then, 16-byte aligned, three slots of 48 bytes holding a tile's
  // work (FwdWork::store).
  static constexpr int kSlotsOffset = (8 * (3 + 4 * kStages + (kBiasTiles ? 4 : 0)) + 15) / 16 * 16;
  static constexpr int kBarrierBytes = kSlotsOffset + 3 * 48;
  // + 1024: the dynamic shared memory is aligned up to the 1024 bytes the swizzle repeats over.
  static constexpr int kSmemBytes =
      kQBytes + kStages * (kKBytes + kVBytes) + kBiasRegionBytes + kBarrierBytes + 1024;
  // O is computed in chunks of at most 128 columns (one wgmma n128 each; n64 at H = 192).
  static constexpr int kOChunkCols = kValueDim < 128 ? kValueDim : kValueDim % 128 == 0 ? 128 : 64;
  static constexpr int kOChunks = kValueDim / kOChunkCols;
  static constexpr int kProducerRegs = kConsumers == 3 ? 32 : 40;
  static constexpr int kConsumerRegs = kConsumers == 3 ? 160 : 232;
  static_assert(128 * kProducerRegs + 128 * kConsumers * kConsumerRegs <= ptx::launch_registers(kThreads),
                "registers at launch");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA");
};

// The tensor maps view q/k/v as 4-d [batch, row, head, column] (innermost last) with boxes of
// 64 columns and a whole tile's rows.
struct FwdTensorMaps {
  CUtensorMap q, k, v, o;  // o (boxes of a consumer's 64 rows): made only where O is staged
  CUtensorMap bias, mask;  // made only with kBiasTiles
};

}  // namespace jax_flash::sm90
