// The Hopper forward for head dims above 256 (320, 384, 448, 512; DESIGN.md, "Head dims above
// 256"): tile shapes, shared-memory layout and register split. A CTA holds 64 query rows; two
// consumer warpgroups split each key block's S by keys (32 each) and O by 64-column panels (at
// most 256 columns each: 128 registers), so that O of 64 rows fits the register file.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "common/ptx_sm90.cuh"
#include "common/split_rows.cuh"

namespace jax_flash::sm90 {

template <typename T_, int kHeadDim_>
struct WideFwdConfig {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim % 64 == 0 && kHeadDim > 256 && kHeadDim <= 512, "whole 64-column panels");
  static constexpr int kBlockM = 64, kBlockN = 64;
  static constexpr int kKeysPerConsumer = kBlockN / 2;  // S = Q K^T of a block: m64n32 a warpgroup
  static constexpr int kPanels = kHeadDim / 64;         // 64-column panels of 128-byte rows (TMA boxes)
  // O's columns by panels: consumer 0 the first kOChunks0 (m64n64 accumulators), consumer 1 the rest
  // (at 320 and 448 one fewer).
  static constexpr int kOChunks0 = (kPanels + 1) / 2, kOChunks1 = kPanels / 2;
  static constexpr int kThreads = 384;                  // producer warpgroup, two consumers
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= ptx::launch_registers(kThreads), "registers at launch");

  // Shared memory, from a 1024-byte aligned base: Q, one K block, one V block (each kPanels
  // panels of 64 rows), P (64 rows x 64 keys, one panel), the rows' maxima and sums of each
  // consumer, the barriers.
  static constexpr int kPanelBytes = 64 * 128;
  static constexpr int kTileBytes = kPanels * kPanelBytes;
  static constexpr int kQ = 0, kK = kTileBytes, kV = 2 * kTileBytes, kP = 3 * kTileBytes;
  static constexpr int kRowStats = kP + kPanelBytes;  // the consumers' row statistics (common/split_rows.cuh)
  static constexpr int kBarriers = kRowStats + SplitRows::kBytes;
  enum Barrier : int { kQFull, kKFull, kKEmpty, kVFull, kVEmpty, kBarrierCount };
  static constexpr int kSmemBytes = kBarriers + 8 * kBarrierCount + 1024;  // + alignment
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA");
};

struct WideFwdTensorMaps {
  CUtensorMap q, k, v;  // boxes of 64 rows x 64 columns
};

}  // namespace jax_flash::sm90
