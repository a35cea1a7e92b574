// Where a Hopper backward consumer thread's lane addresses dS's 8 x 8 tiles for stmatrix (the
// kernel's dS loop, ds_tiles.cuh) in the step's dS buffer: lane 8 m + r gives tile m's row r.
#pragma once

#include <cstdint>

namespace jax_flash::sm90 {

// panel: this consumer's 64-key panel (the consumer index).
template <typename Cfg>
__device__ __forceinline__ void ds_lane_offsets(int warp, int lane, int panel, int consumer, uint32_t& lane_offset,
                                                uint32_t& chunk_bits) {
  const int m = lane / 8, r = lane % 8;
  if constexpr (Cfg::kDqTransposed) {
    // dS (row = query, 16-byte chunk = 8 keys: this consumer's keys are its own 64-key panel), the
    // tiles transposed: row r of tile m is query kk * 16 + (m / 2) * 8 + r, whose row in its group
    // of 8 is r, so the swizzle is the same at every kk.
    lane_offset = panel * Cfg::kDsPanelBytes + ((m / 2) * 8 + r) * 128 + (((warp * 2 + m % 2) ^ r) * 16);
  } else {
    // dS^T (row = key of the CTA's 128, 16-byte chunk = 8 queries). ptx::sw128_offset(row,
    // 2 kk + m / 2) with the swizzle hoisted out of the loop: (2 kk + m / 2) ^ (row % 8) =
    // 2 kk ^ (m / 2 ^ row % 8), one XOR a tile (the helper cost 8 more instructions a step at
    // H = 64).
    lane_offset = (consumer * 64 + warp * 16 + (m % 2) * 8 + r) * 128;
    chunk_bits = ((m / 2) ^ r) * 16;
  }
}

}  // namespace jax_flash::sm90
