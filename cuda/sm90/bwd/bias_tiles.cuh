// The bias and boolean mask of the sm90 backward (kBias), a step's tile at a time (bias_tiles.cuh):
// copied by a producer thread, added to S^T by the consumers. (A producer warp's cp.async copies
// spilled: the producer has 24 registers.)
#pragma once

#include <cuda.h>

#include <type_traits>

#include "common/bwd_walk.cuh"
#include "common/params.h"
#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"
#include "sm90/common/bias_tiles.cuh"

namespace jax_flash::sm90 {

// The backward's tiles: a step's queries x 128 keys. At H = 128 (64-query steps) a 32 KB region in
// place of dQ's second buffers: two bf16 tiles or one float32. At H = 64 (128-query steps) 48 KB in
// place of dS's second buffer (BwdConfig): one bf16 tile, a bf16 tile and a mask, two masks; a
// float32 tile (64 KB) does not fit.
template <int kHeadDim>
using BwdBiasTiles = BiasTiles<kHeadDim == 64 ? 128 : 64, 128, kHeadDim == 64 ? 48 * 1024 : 32 * 1024>;

// A producer thread's copies of the walk's tiles, in the consumers' order (BiasTiles::load). Not
// the thread that copies Q and dO: in its 24 registers these spilled.
template <typename T, typename Tiles>
__device__ void load_bias_tiles(const CUtensorMap* bias_map, const CUtensorMap* mask_map, const BwdParams& p,
                                const BwdWalk& walk, uint32_t region, uint32_t full, uint32_t empty, int batch,
                                int kv_head, int k_first) {
  const auto tiles = Tiles::of(p, sizeof(T));
  BwdStep step = BwdStep::first(walk, kv_head * (p.heads / p.kv_heads));
  for (int s = 0; s < walk.steps; ++s, step.advance(walk)) {
    tiles.load(bias_map, mask_map, p, s, region, full, empty, batch, step.head, step.m_block * Tiles::kBlockM, k_first);
  }
}

// x[i] of S^T (key k0 + 8 ((i % 4) / 2), query row col0 + (i / 4) * 8 + i % 2 of the step's tile)
// plus its bias / unit, or -inf where the mask hides it; `tile` at the stage. col0 = accum_col(0)
// is even and k0 = 16 w + l (l < 8), as for S^T's accumulator. One straight run of shared loads per
// layout, so that they issue together, each at a register offset plus a constant: rows 8 apart
// share their swizzle, and for 16-bit biases and the mask the thread's other elements sit at
// constant distances from its first (with an offset per element, ptxas spilled).
template <typename T, typename Tiles, int kRegs>
__device__ __forceinline__ void add_tile_bias(float (&x)[kRegs], const char* tile, int bias_bytes, bool bias_fp32,
                                              bool has_mask, int k0, int col0, float inv_unit) {
  auto add = [&](auto bias_type, auto masked) {
    using B = decltype(bias_type);
    constexpr bool kBias = !std::is_same_v<B, void*>, kMasked = decltype(masked)::value;
    // [query parity][key + 8?]. 16-bit: key k0's chunk is even, so key k0 + 8 is the next chunk,
    // and the odd row's swizzle flips the chunk's lowest bit: +16, +144, +128 bytes.
    // Mask: keys k0 and k0 + 8 share a chunk, 8 bytes apart.
    uint32_t bias_at[2][2], mask_at[2][2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      if constexpr (kBias) {
        if constexpr (sizeof(B) == 2) {
          const uint32_t first = Tiles::offset(col0, k0, 2);
          bias_at[e][0] = first + e * 144, bias_at[e][1] = first + (e ? 128 : 16);
        } else {
          bias_at[e][0] = Tiles::offset(col0 + e, k0, 4);
          bias_at[e][1] = Tiles::offset(col0 + e, k0 + 8, 4);
        }
      }
      if constexpr (kMasked) {
        mask_at[e][0] = bias_bytes + Tiles::offset(col0 + e, k0, 1), mask_at[e][1] = mask_at[e][0] + 8;
      }
    }
#pragma unroll
    for (int i = 0; i < kRegs; ++i) {
      const int e = i % 2, j = (i % 4) / 2, rows = (i / 4) * 8 * 128;
      if constexpr (kBias) {
        x[i] += static_cast<float>(*reinterpret_cast<const B*>(tile + bias_at[e][j] + rows)) * inv_unit;
      }
      if constexpr (kMasked) {
        if (!tile[mask_at[e][j] + rows]) x[i] = -INFINITY;
      }
    }
  };
  with_tile_layout<T>(bias_bytes, bias_fp32, has_mask, add);
}

// A consumer's step s: its bias tile (stage s of the ring) waited for, added to S^T (this thread's
// key rows from k0 of the tile, queries from col0), and released to the producer.
template <typename Cfg, int kSRegs, typename SharedMemory>
__device__ __forceinline__ void add_step_bias(float (&st)[kSRegs], const BwdParams& p, const SharedMemory& sm, int s,
                                              int k0, int col0, float inv_unit) {
  using T = typename Cfg::T;
  const auto tiles = Cfg::BiasTiles::of(p, sizeof(T));
  const uint32_t bias_stage = tiles.stage_of(s);
  ptx::mbarrier_wait(sm.bias_full() + 8 * bias_stage, tiles.use_of(s) & 1);
  const char* tile = sm.base + Cfg::kBiasTiles + bias_stage * tiles.tile_bytes();
  add_tile_bias<T, typename Cfg::BiasTiles>(st, tile, tiles.bias_bytes, p.bias_fp32, tiles.mask_bytes != 0, k0, col0,
                                            inv_unit);
  ptx::mbarrier_arrive(sm.bias_empty() + 8 * bias_stage);
}

}  // namespace jax_flash::sm90
