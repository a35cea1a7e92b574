// The Hopper forward for head dims above 256 (320-512, and 640-1024 as pairs; DESIGN.md, "Head
// dims above 256"): tile shapes, shared-memory layout and register split. A CTA holds 64 query
// rows; two consumer warpgroups split each key block's S by keys (32 each) and O by 64-column
// panels (at most 256 columns each: 128 registers), so that O of 64 rows fits the register file.
// Above 512 (kSplit = 2) a cluster of two CTAs splits the head dim: each loads and computes with
// its half of the columns of Q, K, V and O (a 320-512 CTA), and the two add their partial scores
// (sm90/wide_fwd/score_exchange.cuh).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "common/ptx_sm90.cuh"
#include "common/split_rows.cuh"
#include "sm90/wide_fwd/score_exchange.cuh"

namespace jax_flash::sm90 {

template <typename T_, int kHeadDim_>
struct WideFwdConfig {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kSplit = kHeadDim > 512 ? 2 : 1;  // CTAs of a cluster, each its columns
  static constexpr int kCtaHeadDim = kHeadDim / kSplit;  // one CTA's columns of Q, K, V and O
  static_assert(kCtaHeadDim * kSplit == kHeadDim && kCtaHeadDim % 64 == 0 && kCtaHeadDim > 256 && kCtaHeadDim <= 512,
                "whole 64-column panels, 257-512 a CTA");
  static constexpr int kBlockM = 64, kBlockN = 64;
  static constexpr int kKeysPerConsumer = kBlockN / 2;  // S = Q K^T of a block: m64n32 a warpgroup
  static constexpr int kPanels = kCtaHeadDim / 64;      // 64-column panels of 128-byte rows (TMA boxes)
  using Exchange = ScoreExchange<kKeysPerConsumer / 2>;  // a consumer thread's S: 16 floats
  // O's columns by panels: consumer 0 the first kOChunks0 (m64n64 accumulators), consumer 1 the rest
  // (at 320 and 448 one fewer).
  static constexpr int kOChunks0 = (kPanels + 1) / 2, kOChunks1 = kPanels / 2;
  static constexpr int kThreads = 384;                  // producer warpgroup, two consumers
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= ptx::launch_registers(kThreads), "registers at launch");

  // Shared memory, from a 1024-byte aligned base: Q, one K block, one V block (each kPanels
  // panels of 64 rows), P (64 rows x 64 keys, one panel), the rows' maxima and sums of each
  // consumer, each consumer's inbox of the peer's scores (pairs only), the barriers.
  static constexpr int kPanelBytes = 64 * 128;
  static constexpr int kTileBytes = kPanels * kPanelBytes;
  static constexpr int kQ = 0, kK = kTileBytes, kV = 2 * kTileBytes, kP = 3 * kTileBytes;
  static constexpr int kRowStats = kP + kPanelBytes;  // the consumers' row statistics (common/split_rows.cuh)
  static constexpr int kInboxes = kRowStats + SplitRows::kBytes;
  static constexpr int kBarriers = kInboxes + (kSplit == 2 ? 2 * Exchange::kInboxBytes : 0);
  // kScoresFull/Empty + consumer: that consumer's inbox (pairs only).
  enum Barrier : int { kQFull, kKFull, kKEmpty, kVFull, kVEmpty, kScoresFull, kScoresEmpty = kScoresFull + 2,
                       kBarrierCount = kScoresEmpty + 2 };
  static constexpr int kSmemBytes = kBarriers + 8 * kBarrierCount + 1024;  // + alignment
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA");
};

struct WideFwdTensorMaps {
  CUtensorMap q, k, v;  // boxes of 64 rows x 64 columns
};

}  // namespace jax_flash::sm90
