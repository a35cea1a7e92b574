// The Hopper backward's tile shapes and shared-memory layout (BwdConfig), at H = 64 and 128.
#pragma once

#include "common/params.h"
#include "common/ptx_sm90.cuh"
#include "sm90/bwd/bias_tiles.cuh"
#include "sm90/bwd/dq_tiles.cuh"

namespace jax_flash::sm90 {

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
  static_assert(128 * kProducerRegs + 128 * kConsumers * kConsumerRegs <= ptx::launch_registers(kThreads),
                "registers at launch");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA");
};

}  // namespace jax_flash::sm90
