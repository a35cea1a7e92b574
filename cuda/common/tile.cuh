// Shared-memory tiles of 16-bit elements and the swizzle that makes ldmatrix conflict-free.
//
// A [kRows, kCols] tile is stored as column panels of 8 (or, when kCols/8 is not a multiple of
// 8, 4) 16-byte chunks. Inside a panel, rows are contiguous and the chunk index is XORed with
// bits of the row, so the 8 row addresses of one ldmatrix matrix (8 consecutive rows, same
// chunk) fall in 8 different 16-byte bank groups: no bank conflicts, and no padding.
#pragma once

#include <cstdint>

#include "common/ptx.cuh"

namespace jax_flash {

template <int kRows_, int kCols_>
struct SmemTile {
  static constexpr int kRows = kRows_;
  static constexpr int kCols = kCols_;
  static constexpr int kChunks = kCols / 8;  // 16-byte chunks per row
  static constexpr int kPanelChunks = kChunks % 8 == 0 ? 8 : 4;
  static constexpr int kBytes = kRows * kCols * 2;
  static_assert(kCols % 32 == 0 && kRows % 8 == 0, "tiles are whole 8-row, 64-byte units");

  // Byte offset of chunk `chunk` (columns 8*chunk .. 8*chunk+7) of row `row`.
  __device__ __forceinline__ static int offset(int row, int chunk) {
    const int panel = chunk / kPanelChunks;
    const int c = chunk % kPanelChunks;
    const int swizzle = kPanelChunks == 8 ? (row & 7) : ((row >> 1) & 3);
    return ((panel * kRows + row) * kPanelChunks + (c ^ swizzle)) * 16;
  }
};

// Copy `rows_valid` rows of a [Tile::kRows, Tile::kCols] global tile (row stride in elements)
// into shared memory with cp.async; rows past rows_valid are zero-filled. One commit group is
// left to the caller. Unrolled, the compiler hoists every iteration's addresses out of the
// caller's main loop into registers: faster where S and O leave room (kUnroll), spills where not.
template <typename Tile, int kThreads, bool kUnroll, typename T>
__device__ __forceinline__ void load_tile_async(uint32_t smem, const T* gmem, int64_t row_stride,
                                                int rows_valid, int tid) {
  constexpr int kTotal = Tile::kRows * Tile::kChunks;
  constexpr int kIterations = (kTotal + kThreads - 1) / kThreads;
  constexpr int kUnrollCount = kUnroll ? kIterations : 1;
#pragma unroll kUnrollCount
  for (int it = 0; it < kIterations; ++it) {
    const int i = tid + it * kThreads;
    if (kTotal % kThreads != 0 && i >= kTotal) break;
    const int row = i / Tile::kChunks;
    const int chunk = i % Tile::kChunks;
    const bool valid = row < rows_valid;
    const T* src = gmem + (valid ? row * row_stride + chunk * 8 : 0);
    ptx::cp_async_16(smem + Tile::offset(row, chunk), src, valid);
  }
}

}  // namespace jax_flash
