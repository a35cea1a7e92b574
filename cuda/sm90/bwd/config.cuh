// The Hopper backward's tile shapes and shared-memory layouts: BwdConfig (H = 64 and 128),
// BwdWideConfig (bwd_wide_kernel.cuh, dK and dV above 128, and (192, 128)) and BwdDqConfig (its dQ
// kernel, bwd_dq_kernel.cuh).
#pragma once

#include "common/params.h"
#include "common/ptx_sm90.cuh"
#include "sm90/bwd/bias_tiles.cuh"
#include "sm90/bwd/dq_tiles.cuh"

namespace jax_flash::sm90 {

// Whether a backward config's warp groups (one producer, the consumers) get their registers at
// launch (setmaxnreg moves them between the groups later) and its shared memory fits one CTA.
constexpr bool fits_one_cta(int threads, int consumers, int producer_regs, int consumer_regs, int smem_bytes) {
  return 128 * producer_regs + 128 * consumers * consumer_regs <= ptx::launch_registers(threads) &&
         smem_bytes <= 227 * 1024;
}

// kBias_: the kBias kernel's layout, with a region where the bias and mask tiles of the steps are
// staged (bwd_bias_tiles.cuh), in place of dQ's second buffers.
template <typename T_, int kHeadDim_, int kBlockM_ = kHeadDim_ == 64 ? 128 : 64, bool kBias_ = false>
struct BwdConfig {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "dK and dV (64 x H fp32 each) fill a consumer's registers");
  static constexpr int kConsumers = 2;  // warp groups of 64 keys
  static constexpr int kBlockN = 64 * kConsumers;
  // Query rows a step: 128 at H = 64, where the products of 64 rows are too small to keep the
  // tensor cores busy (S^T then takes 64 registers, which H = 128's dK and dV leave no room for).
  // At H = 128: 64, or 80 without masks or band (FlashAttention-3's non-causal tile, run_sm90.cuh),
  // where each step's fixed costs spread over 25% more rows, in 8 more registers for S^T and dP^T.
  static constexpr int kBlockM = kBlockM_;
  static_assert(kStatsRowMultiple % kBlockM == 0, "statistics rows are padded to whole query blocks");
  static constexpr int kStages = 2;
  // A consumer's dQ part. With 64 or 128 query rows, a 64 x 64 part of dQ = dS K, rows first
  // (kBlockM / 64 parts a column panel). With 80, whose rows are no wgmma M, dQ^T = K^T dS^T:
  // each consumer takes 64 columns of dQ over all rows, and dS goes to shared memory untransposed.
  static constexpr bool kDqTransposed = kBlockM % 64 != 0;
  static_assert(kDqTransposed ? kHeadDim == 64 * kConsumers : (kBlockM / 64) * (kHeadDim / 64) == kConsumers,
                "one dQ part a consumer");
  using Dq = DqTiles<kDqTransposed ? kBlockM : 64, kDqTransposed>;
  static constexpr int dq_row0(int consumer) { return kDqTransposed ? 0 : (consumer % (kBlockM / 64)) * 64; }
  static constexpr int dq_column0(int consumer) { return (kDqTransposed ? consumer : consumer / (kBlockM / 64)) * 64; }
  // Deterministic mode counts dQ turns per 64 query rows (common/bwd_walk.cuh): only whole 64-row
  // query blocks run it.
  static constexpr bool kRunsDeterministic = kBlockM % 64 == 0;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kPanels = kHeadDim / 64;
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;  // K or V
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;   // one stage of Q or dO
  static constexpr int kStatBytes = kBlockM * 4;           // one stage of lse_log2 or delta
  // V and dO as wide as K and Q (bwd_wide_kernel.cuh's BwdWideConfig may make them narrower).
  static constexpr int kValueDim = kHeadDim, kValuePanels = kPanels;
  static constexpr int kKBytes = kKVBytes, kVBytes = kKVBytes, kDoBytes = kQBytes;
  // dS^T: 64-query panels of 128-byte rows (keys); with kDqTransposed dS: 64-key panels of
  // 128-byte rows (queries). Two buffers, since dQ reads the other consumer's part (one step's
  // dQ may still read one while the next step writes the other); one with the bias tiles at
  // 128-query steps, whose region takes the other's place: there a consumer writes a step's dS
  // only once both have finished the step before (named barrier 4).
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;
  static constexpr int kDsPanelBytes = (kDqTransposed ? kBlockM : kBlockN) * 128;
  static constexpr int kDsBuffers = kBias_ && kBlockM == 128 ? 1 : 2;
  // A consumer's dQ part: one fp32 tile of the accumulator (sm90/bwd/dq_tiles.cuh).
  static constexpr int kDqBytes = Dq::kFloats * 4;
  static constexpr int kDqBuffers = kBlockM == 64 && !kBias_ ? 2 : 1;  // per consumer, as shared memory allows
  using BiasTiles = BwdBiasTiles<kHeadDim>;
  static_assert(!kBias_ || (kBlockM == BiasTiles::kBlockM && kBlockN == BiasTiles::kBlockN), "the bias tiles' shape");
  static constexpr int kBiasRegionBytes = kBias_ ? BiasTiles::kRegionBytes : 0;
  // Offsets from the 1024-byte aligned base (the swizzle repeats every 1024 bytes).
  static constexpr int kK = 0, kV = kKVBytes, kQ = 2 * kKVBytes, kDo = kQ + kStages * kQBytes;
  static constexpr int kDs = kDo + kStages * kQBytes;
  static constexpr int kDq = kDs + kDsBuffers * kDsBytes;
  static constexpr int kLse = kDq + kConsumers * kDqBuffers * kDqBytes, kDelta = kLse + kStages * kStatBytes;
  static constexpr int kBiasTiles = kDelta + kStages * kStatBytes;
  static_assert(!kBias_ || kBiasTiles % 1024 == 0, "the bias tiles' boxes are swizzled in 1024-byte units");
  static constexpr int kBarriers = kBiasTiles + kBiasRegionBytes;
  static constexpr int kSmemBytes =
      kBarriers + 8 * (1 + 4 * kStages + 2 * kConsumers * kDqBuffers + (kBias_ ? 4 : 0)) + 1024;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static_assert(fits_one_cta(kThreads, kConsumers, kProducerRegs, kConsumerRegs, kSmemBytes), "registers, shared memory");
};

// The wide backward's dK and dV kernel: 64 keys a CTA, two consumers that split dK^T and dV^T's
// m64 tiles.
template <typename T_, int kHeadDim_ = 256, int kValueDim_ = kHeadDim_>
struct BwdWideConfig {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_, kValueDim = kValueDim_;  // of Q and K; of V and dO
  static_assert(kHeadDim % 64 == 0 && kValueDim % 64 == 0 && kValueDim <= kHeadDim && kHeadDim <= 256,
                "whole 64-column panels, V no wider than K");
  static constexpr int kConsumers = 2;
  static constexpr int kBlockN = 64;    // keys a CTA
  static constexpr int kBlockM = 64;    // queries a step
  static_assert(kStatsRowMultiple % kBlockM == 0, "statistics rows are padded to whole query blocks");
  static constexpr int kStages = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kPanels = kHeadDim / 64, kValuePanels = kValueDim / 64;  // 64-column panels of 128-byte rows
  static constexpr int kKBytes = kBlockN * kHeadDim * 2, kVBytes = kBlockN * kValueDim * 2;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2, kDoBytes = kBlockM * kValueDim * 2;  // one stage
  static constexpr int kTileBytes = kBlockM * kBlockN * 2;  // P or dS: [query][key], one panel
  static constexpr int kStatBytes = kBlockM * 4;
  static constexpr int kK = 0, kV = kKBytes, kQ = kV + kVBytes, kDo = kQ + kStages * kQBytes;
  // P and dS have two buffers each: a step's are stored while the other consumer's products of
  // the step before may still read the last ones.
  static constexpr int kP = kDo + kStages * kDoBytes, kDs = kP + 2 * kTileBytes;
  static constexpr int kLse = kDs + 2 * kTileBytes, kDelta = kLse + kStages * kStatBytes;
  static constexpr int kBarriers = kDelta + kStages * kStatBytes;
  static constexpr int kBiasRegionBytes = 0;  // no bias tiles (make_bwd_tensor_maps)
  static constexpr int kSmemBytes = kBarriers + 8 * (1 + 4 * kStages) + 1024;
  // The m64 tiles of head-dim rows of dV^T (kValuePanels) and dK^T (kPanels), interleaved by
  // rows (dV^T 0, dK^T 0, dV^T 64, ...): consumer 0 holds the first kTiles0, consumer 1 the
  // other kTiles1, 32 registers each.
  static constexpr int kTiles = kValuePanels + kPanels, kTiles0 = (kTiles + 1) / 2, kTiles1 = kTiles / 2;
  static constexpr bool tile_is_dk(int tile) { return tile < 2 * kValuePanels ? tile % 2 : true; }
  static constexpr int tile_row0(int tile) {
    return 64 * (tile < 2 * kValuePanels ? tile / 2 : tile - kValuePanels);
  }
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static_assert(fits_one_cta(kThreads, kConsumers, kProducerRegs, kConsumerRegs, kSmemBytes), "registers, shared memory");
};

// The wide backward's dQ kernel: 64 queries a CTA, two consumers of 32 keys a stage each.
template <typename T_, int kHeadDim_ = 256, int kValueDim_ = kHeadDim_>
struct BwdDqConfig {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_, kValueDim = kValueDim_;  // of Q, K and dQ; of V and dO
  static_assert(kHeadDim % 64 == 0 && kValueDim % 64 == 0 && kHeadDim <= 256, "whole 64-column panels");
  static constexpr int kConsumers = 2;
  static constexpr int kBlockM = 64;                      // queries a CTA
  static constexpr int kBlockN = 64;                      // keys a stage
  static constexpr int kHalfN = kBlockN / kConsumers;     // keys a consumer
  static constexpr int kStages = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kPanels = kHeadDim / 64, kValuePanels = kValueDim / 64;  // 64-column panels of 128-byte rows
  static constexpr int kQBytes = kBlockM * kHeadDim * 2, kDoBytes = kBlockM * kValueDim * 2;
  static constexpr int kKBytes = kBlockN * kHeadDim * 2, kVBytes = kBlockN * kValueDim * 2;  // one stage
  static constexpr int kQ = 0, kDo = kQBytes, kK = kDo + kDoBytes, kV = kK + kStages * kKBytes;
  static constexpr int kBarriers = kV + kStages * kVBytes;
  static constexpr int kSmemBytes = kBarriers + 8 * (1 + 4 * kStages) + 1024;
  // The consumers' exchange of dQ halves at the end reuses the K/V stages: a quarter of dQ's
  // columns a thread, each way.
  static_assert(2 * 128 * (kHeadDim / 4) * 4 <= kStages * (kKBytes + kVBytes), "exchange buffer inside the stages");
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static_assert(fits_one_cta(kThreads, kConsumers, kProducerRegs, kConsumerRegs, kSmemBytes), "registers, shared memory");
};

}  // namespace jax_flash::sm90
