// The bias and boolean mask of the sm90 backward (kBias), staged in shared memory a step's tile
// at a time: [kBlockM queries x kBlockN keys] of each, copied by a producer thread with TMA,
// read by the consumers with shared loads. Read from global memory by the consumers instead, one
// element at a time (S^T's elements pair two queries, rows apart), each step waited for its loads
// in turn and the biased backward took 5x the plain one. (A producer warp's cp.async copies
// spilled: the producer has 24 registers.)
#pragma once

#include <cuda.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/bwd_walk.cuh"
#include "common/params.h"
#include "common/ptx_sm90.cuh"

namespace jax_flash::sm90 {

// The arrays the tiles copy from: whole [T, S] rows (a broadcast over queries or keys is not one),
// unit key strides, 16-byte aligned rows (a bf16 S a multiple of 8, a float32 one of 4, a mask's of
// 16): as TMA copies them.
__host__ __device__ inline bool copies_by_rows(const void* array, const Strides4& s, int seqlen_k, int elem_bytes) {
  return s.col == 1 && s.row == seqlen_k && (seqlen_k * elem_bytes) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(array) % 16 == 0;
}

// The staging region's use by one call (host and device derive the same): a stage holds the bias
// tile, then the mask tile, each in boxes of 64 rows x 128 bytes with the 128-byte swizzle. For the
// one kernel with a bias: H = 128, 64-query steps, 128 keys.
struct BiasTiles {
  static constexpr int kBlockM = 64, kBlockN = 128;
  static constexpr int kRegionBytes = 32 * 1024;  // two bf16 tiles, or one float32 tile
  static constexpr int kBoxBytes = kBlockM * 128;
  int bias_bytes;  // of one tile; 0: no bias
  int mask_bytes;  // 0: no mask
  int stages;      // 1 or 2; 0: the call cannot take this kernel (dispatch.cu)

  __host__ __device__ static BiasTiles of(const BwdParams& p, int elem_bytes) {
    const int bias_elem = p.bias_fp32 ? 4 : elem_bytes;
    const bool rows = (p.bias == nullptr || copies_by_rows(p.bias, p.bias_strides, p.seqlen_k, bias_elem)) &&
                      (p.mask == nullptr || copies_by_rows(p.mask, p.mask_strides, p.seqlen_k, 1));
    BiasTiles t{p.bias ? kBlockM * kBlockN * bias_elem : 0, p.mask ? kBlockM * kBlockN : 0, 0};
    const int tile = t.bias_bytes + t.mask_bytes;
    t.stages = rows && tile > 0 ? (2 * tile <= kRegionBytes ? 2 : tile <= kRegionBytes ? 1 : 0) : 0;
    return t;
  }
  __device__ uint32_t stage_of(int s) const { return stages == 1 ? 0 : s % 2; }
  __device__ uint32_t use_of(int s) const { return stages == 1 ? s : s / 2; }
  __device__ uint32_t tile_bytes() const { return bias_bytes + mask_bytes; }
};

// Byte offset of element (row r, key column k) in a tile: 128-byte rows of 64-row boxes, their
// 16-byte chunks XOR-swizzled by the row (TMA's 128-byte swizzle), so that the four rows a warp
// reads at once (two apart: S^T's query pairs) fall in different banks.
__device__ __forceinline__ uint32_t tile_offset(int r, int k, int elem_bytes) {
  const int byte = k * elem_bytes, in_row = byte % 128;
  return (byte / 128) * BiasTiles::kBoxBytes + r * 128 + (((in_row >> 4) ^ (r % 8)) << 4) + (in_row & 15);
}

// A producer thread's copies of the walk's tiles, in the consumers' order: the n-th
// use of a stage waits for the consumers' release of use n - 1; `full` and `empty` are the
// stages' barriers (stage i at + 8 i). Rows and keys past the arrays read as zeros (the band
// masks them). Not the thread that copies Q and dO: in its 24 registers these spilled.
template <typename T>
__device__ void load_bias_tiles(const CUtensorMap* bias_map, const CUtensorMap* mask_map, const BwdParams& p,
                                const BwdWalk& walk, uint32_t region, uint32_t full, uint32_t empty, int batch,
                                int kv_head, int k_first) {
  const auto tiles = BiasTiles::of(p, sizeof(T));
  const int keys_per_box = p.bias_fp32 ? 32 : 64;
  BwdStep step = BwdStep::first(walk, kv_head * (p.heads / p.kv_heads));
  for (int s = 0; s < walk.steps; ++s, step.advance(walk)) {
    const uint32_t stage = tiles.stage_of(s), use = tiles.use_of(s);
    if (use > 0) ptx::mbarrier_wait(empty + 8 * stage, (use - 1) & 1);
    ptx::mbarrier_arrive_expect_tx(full + 8 * stage, tiles.tile_bytes());
    const uint32_t tile = region + stage * tiles.tile_bytes();
    const int q_first = step.m_block * BiasTiles::kBlockM;
    if (p.bias != nullptr) {
      const int b = p.bias_strides.batch ? batch : 0, h = p.bias_strides.head ? step.head : 0;
      for (int box = 0; box * BiasTiles::kBoxBytes < tiles.bias_bytes; ++box) {
        ptx::tma_load_4d(tile + box * BiasTiles::kBoxBytes, bias_map, full + 8 * stage, k_first + box * keys_per_box,
                         q_first, h, b);
      }
    }
    if (p.mask != nullptr) {
      ptx::tma_load_4d(tile + tiles.bias_bytes, mask_map, full + 8 * stage, k_first, q_first,
                       p.mask_strides.head ? step.head : 0, p.mask_strides.batch ? batch : 0);
    }
  }
}

// x[i] of S^T (key k0 + 8 ((i % 4) / 2), query row col0 + (i / 4) * 8 + i % 2 of the step's tile)
// plus its bias / unit, or -inf where the mask hides it; `tile` at the stage. col0 = accum_col(0)
// is even and k0 = 16 w + l (l < 8), as for S^T's accumulator. One straight run of shared loads per
// layout, so that they issue together, each at a register offset plus a constant: rows 8 apart
// share their swizzle, and for 16-bit biases and the mask the thread's other elements sit at
// constant distances from its first (with an offset per element, ptxas spilled).
template <typename T, int kRegs>
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
          const uint32_t first = tile_offset(col0, k0, 2);
          bias_at[e][0] = first + e * 144, bias_at[e][1] = first + (e ? 128 : 16);
        } else {
          bias_at[e][0] = tile_offset(col0 + e, k0, 4), bias_at[e][1] = tile_offset(col0 + e, k0 + 8, 4);
        }
      }
      if constexpr (kMasked) {
        mask_at[e][0] = bias_bytes + tile_offset(col0 + e, k0, 1), mask_at[e][1] = mask_at[e][0] + 8;
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
  if (bias_bytes == 0) {
    add(static_cast<void*>(nullptr), std::true_type{});
  } else if (bias_fp32) {
    has_mask ? add(float{}, std::true_type{}) : add(float{}, std::false_type{});
  } else {
    has_mask ? add(T{}, std::true_type{}) : add(T{}, std::false_type{});
  }
}

}  // namespace jax_flash::sm90
