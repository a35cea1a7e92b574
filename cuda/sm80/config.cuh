// Tile sizes of the mma.sync kernels, derived from the element type, head dim and instruction set:
// the sm80 family's (Isa::kSm80), and the Turing family's (Isa::kSm75), whose tiles fit sm_75's
// 64 KB of shared memory a block.
//
// Every warp owns whole m16 tiles (the M of mma.sync m16n8k16), so the row statistics of the
// softmax stay inside a quad of threads. The register budget sets the rest: the forward keeps O
// (rows x H fp32) per warp, the backward dK and dV (2 x 32 x H/2 fp32), which limits it to H <= 128.
#pragma once

#include <cuda_fp16.h>

#include <type_traits>

#include "common/params.h"
#include "common/ptx.cuh"
#include "common/tile.cuh"

namespace jax_flash::sm80 {

// Shared memory a block may take on Turing (sm_75, opt-in).
inline constexpr int kTuringSmemBytes = 64 * 1024;

// kPagedKeys: K and V through a page table (a ragged batch's prefill items), whose per-row
// addresses take registers: one m16 tile a warp.
template <typename T_, int kHeadDim_, Variant kVariant = Variant::kPlain, Isa kIsa_ = Isa::kSm80,
          bool kPagedKeys = false>
struct FwdConfig {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr Isa kIsa = kIsa_;
  static constexpr bool kTuring = kIsa == Isa::kSm75;
  static_assert(!kTuring || (std::is_same_v<T, __half> && kHeadDim >= 64 && kHeadDim <= 128),
                "the Turing family: fp16, head dims 64-128");
  // Two m16 tiles per warp (FlashAttention-2's 128 x 64 tile with 4 warps) where registers allow:
  // each K/V fragment read from shared memory then feeds two mma.sync, halving shared-memory
  // traffic per FLOP. At H = 128 only the plain kernel (step 15), with Q read from shared memory
  // and a few bytes spilled; the masks, the soft cap and the bias would spill far more, and H = 96
  // and 192-256 keep one tile too. 4 warps a CTA, so that two or more CTAs share an SM and one's
  // barriers hide behind another's work (step 5).
  // Turing: one m16 tile, so that Q and two stages of K and V fit 64 KB.
  static constexpr int kWarpRows =
      !kTuring && !kPagedKeys && (kHeadDim <= 64 || (kHeadDim == 128 && kVariant == Variant::kPlain)) ? 32 : 16;
  static constexpr int kWarps = 4;
  static constexpr int kBlockM = kWarps * kWarpRows;
  // S (rows x kBlockN fp32) and O share the register file, and two stages of K and V must leave
  // room for two CTAs per SM: narrower key blocks above H = 128 (above 64 on Turing: 36 and 48 KB
  // at H = 96 and 128).
  static constexpr int kBlockN = kHeadDim <= (kTuring ? 64 : 128) ? 64 : 32;
  static constexpr int kThreads = kWarps * 32;
  // Q fragments (kWarpRows * H / 64 registers a thread) stay in registers where they fit beside S
  // and O: up to 32 registers.
  static constexpr bool kQInRegs = kWarpRows * kHeadDim <= 32 * 64;
  // K one key block ahead of V: S of the next block is computed beside the softmax of this one
  // (two S accumulators, which fit where one m16 tile per warp leaves room).
  static constexpr bool kKLead = kWarpRows == 16;
  // Unrolled tile loads where they do not spill (steps 3-4).
  static constexpr bool kUnrollLoads = kHeadDim == 96;
  using QTile = SmemTile<kBlockM, kHeadDim>;
  using KTile = SmemTile<kBlockN, kHeadDim>;
  static constexpr int kStageBytes = 2 * KTile::kBytes;  // K and V of one key block
  static constexpr int kSmemBytes = QTile::kBytes + 2 * kStageBytes;
  static_assert(!kTuring || kSmemBytes <= kTuringSmemBytes);
};

// kCompact: the tiles of GPUs with less shared memory a block than the others take (99 KB on
// sm_86/89: 114-209 KB; 163 KB on sm_80/87: 209 KB at H = 256), at some cost in speed: 64-query
// steps where H <= 64, 64 keys a CTA at H = 96 (two stages; a warp's 24 columns of dK and dV are
// an odd 3 n8 tiles), and 64 keys with one stage (Q and dO of the next step load after this
// one's dK and dV instead of during its products) from H = 128: 65, 97, 89, 80 and 145 KB at
// H = 32, 64, 96, 128 and 256.

// Isa::kSm75 (Turing): 4 warps, 64 keys a CTA and 32-query steps (32 and 64 at H = 128), one stage:
// 32, 44 and 56 KB at H = 64, 96 and 128, within sm_75's 64 KB.
template <typename T_, int kHeadDim_, bool kCompact_ = false, Isa kIsa_ = Isa::kSm80>
struct BwdConfig {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kCompact = kCompact_;
  static constexpr Isa kIsa = kIsa_;
  static constexpr bool kTuring = kIsa == Isa::kSm75;
  static_assert(kHeadDim <= 256, "dK and dV accumulators of 32 keys x H/2 (H/4 at H = 256) fp32 per warp");
  static_assert(!kTuring || (std::is_same_v<T, __half> && kHeadDim >= 64 && kHeadDim <= 128 && !kCompact),
                "the Turing family: fp16, head dims 64-128");
  static constexpr int kWarps = kTuring ? 4 : 8;
  // Turing: 64 keys x 32 queries a step, 32 x 64 at H = 128, whose dK and dV of 64 keys (128
  // registers a thread) beside the registers that Turing's loads fill spilled.
  static constexpr int kTuringBlockN = kHeadDim == 128 ? 32 : 64;
  static constexpr int kThreads = kWarps * 32;
  // Keys per CTA, resident with their dK and dV: 128, or 64 at H = 256, where 128 keys' dK and dV
  // would need 256 registers a thread (and at H = 96 and 128 with compact tiles).
  static constexpr int kBlockN = kTuring ? kTuringBlockN : kHeadDim <= 128 && !(kCompact && kHeadDim >= 96) ? 128 : 64;
  // Queries per step: 128 where H <= 64, whose products are too short to hide the fixed cost of a
  // step (two barriers, the softmax, P and dS through shared memory) at 64 queries (64 with
  // compact tiles).
  static constexpr int kBlockM = kTuring ? 2048 / kTuringBlockN : kHeadDim <= 64 && !kCompact ? 128 : 64;
  // Each product gets its own warp grid, so that every warp's tile is 32 x 32 or larger (a loaded
  // fragment feeds two or more mma.sync):
  //   S = Q K^T, dP = dO V^T      2 x 4 warps of kBlockM/2 queries x 32 keys (4 x 2 of
  //                               kBlockM/4 x 32 with 64 keys)
  //   dV += P^T dO, dK += dS^T Q  4 x 2 warps of 32 keys x H/2 (2 x 4 of 32 x H/4 with 64 keys)
  //   dQ = dS K                   2 x 4 warps of 32 queries x H/4 (kBlockM = 64), or 4 x 2 of
  //                               kBlockM/4 x H/2 where H/4 is not a whole number of n8 pairs
  //                               (H = 32, 96) or the steps are 128 queries
  //   Turing (4 warps): 32 queries x 64 keys, S and dP 2 x 2 warps of 16 x 32, dK and dV 2 x 2 of
  //   32 x H/2, dQ 2 x 2 of 16 x H/2; at H = 128 64 queries x 32 keys, S and dP 4 x 1 warps of
  //   16 x 32, dK and dV 1 x 4 of 32 x 32, dQ 2 x 2 of 32 x 64
  static constexpr int kSdpWarpsN = kBlockN / 32;
  static constexpr int kSdpRowsPerWarp = kBlockM / (kWarps / kSdpWarpsN);
  static constexpr int kDkvWarpsD = kWarps / (kBlockN / 32);
  static constexpr int kDqWarpsM = kTuring || (kBlockM == 64 && (kHeadDim / 4) % 16 == 0) ? 2 : 4;
  static constexpr int kDqWarpsD = kWarps / kDqWarpsM;
  static constexpr int kDqRowsPerWarp = kBlockM / kDqWarpsM;
  static constexpr int kDqColsPerWarp = kHeadDim / kDqWarpsD;
  static_assert(2 * kBlockM <= kThreads, "one thread per lse or delta value of a step");
  // Q/dO/lse/delta of the next step load during this one (2), or after its dK and dV (1).
  static constexpr int kStages = kTuring || (kCompact && kHeadDim >= 128) ? 1 : 2;
  using KTile = SmemTile<kBlockN, kHeadDim>;
  using QTile = SmemTile<kBlockM, kHeadDim>;
  using PTile = SmemTile<kBlockM, kBlockN>;  // P and dS, [query][key]
  static constexpr int kRowStatsBytes = 2 * kBlockM * 4;  // lse and delta, float32
  static constexpr int kStageBytes = 2 * QTile::kBytes + kRowStatsBytes;
  static constexpr int kSmemBytes = 2 * KTile::kBytes + kStages * kStageBytes + 2 * PTile::kBytes;
  static_assert(!kTuring || kSmemBytes <= kTuringSmemBytes);
};

}  // namespace jax_flash::sm80
