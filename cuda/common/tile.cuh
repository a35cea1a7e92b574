// Shared-memory tiles of 16-bit (or 8-bit) elements and the swizzle that makes ldmatrix
// conflict-free.
//
// A [kRows, kCols] tile is stored as column panels of 8 (or, when its chunks a row are not a
// multiple of 8, 4) 16-byte chunks. Inside a panel, rows are contiguous and the chunk index is XORed with
// bits of the row, so the 8 row addresses of one ldmatrix matrix (8 consecutive rows, same
// chunk) fall in 8 different 16-byte bank groups: no bank conflicts, and no padding.
#pragma once

#include <cstdint>

#include "common/ptx.cuh"

namespace jax_flash {

template <int kRows_, int kCols_, int kElemBytes_ = 2>
struct SmemTile {
  static constexpr int kRows = kRows_;
  static constexpr int kCols = kCols_;
  static constexpr int kElemBytes = kElemBytes_;
  static_assert(kElemBytes == 1 || kElemBytes == 2, "8- or 16-bit elements");
  static constexpr int kChunkElems = 16 / kElemBytes;  // elements of one 16-byte chunk
  static constexpr int kChunks = kCols / kChunkElems;  // 16-byte chunks per row
  static constexpr int kPanelChunks = kChunks % 8 == 0 ? 8 : 4;
  static constexpr int kBytes = kRows * kCols * kElemBytes;
  static_assert(kCols * kElemBytes % 64 == 0 && kRows % 8 == 0, "tiles are whole 8-row, 64-byte units");

  // Byte offset of chunk `chunk` (columns kChunkElems * chunk on) of row `row`.
  __device__ __forceinline__ static int offset(int row, int chunk) {
    const int panel = chunk / kPanelChunks;
    const int c = chunk % kPanelChunks;
    const int swizzle = kPanelChunks == 8 ? (row & 7) : ((row >> 1) & 3);
    return ((panel * kRows + row) * kPanelChunks + (c ^ swizzle)) * 16;
  }
};

// One thread's shared-memory addresses for an unrolled walk over the chunks chunk0 + kStep * i
// (i < kCount) of rows row0 + 8m of a tile. The swizzle repeats every 8 rows, and a walk that
// starts at a panel boundary (chunk0 % kPanelChunks < kStep) repeats it every panel, so a few
// registers computed once serve the whole walk: each access is a register plus an immediate,
// where the swizzle computed per access cost more integer instructions than there were mma.sync.
template <typename Tile, int kCount, int kStep = 2>
struct ChunkWalk {
  static constexpr int kRegs = kCount <= 4 ? kCount : Tile::kPanelChunks / kStep;
  static constexpr int kRowBytes = Tile::kPanelChunks * 16;
  static constexpr int kPanelBytes = Tile::kRows * kRowBytes;
  uint32_t addr[kRegs];

  ChunkWalk() = default;
  __device__ __forceinline__ ChunkWalk(uint32_t tile, int row0, int chunk0) {
#pragma unroll
    for (int j = 0; j < kRegs; ++j) addr[j] = tile + Tile::offset(row0, chunk0 + kStep * j);
  }
  // Step i, `rows` (a multiple of 8) further down; both compile-time constants once unrolled.
  __device__ __forceinline__ uint32_t operator()(int i, int rows = 0) const {
    return addr[i % kRegs] + (i / kRegs) * kPanelBytes + rows * kRowBytes;
  }
};

// Copy `rows_valid` rows of a [Tile::kRows, Tile::kCols] global tile (row stride in elements)
// into shared memory with cp.async (one commit group is left to the caller), or with Isa::kSm75
// with loads and stores (ptx::copy_16); rows past rows_valid are zero-filled.
//
// When the threads cover whole rows and step a multiple of 8 rows per pass, every pass of a
// thread keeps its chunk and swizzle: one address pair is computed and the passes add constants
// (cheap in instructions and registers); with kWholeTilePath a whole tile also skips the per-row
// predicates (fewer instructions, a few more registers: the backward spills with it). Otherwise
// each pass computes its own addresses; unrolled, the compiler hoists all of them out of the
// caller's main loop into registers: faster where the accumulators leave room (kUnroll), spills
// where not.
template <typename Tile, int kThreads, bool kUnroll, bool kWholeTilePath = false, Isa kIsa = Isa::kSm80,
          typename T>
__device__ __forceinline__ void load_tile(uint32_t smem, const T* gmem, int64_t row_stride,
                                          int rows_valid, int tid) {
  static_assert(sizeof(T) == Tile::kElemBytes, "the tile holds the global tile's elements");
  constexpr int kRowsPerPass = kThreads / Tile::kChunks;
  if constexpr (kThreads % Tile::kChunks == 0 && kRowsPerPass % 8 == 0 &&
                Tile::kRows % kRowsPerPass == 0) {
    const int row0 = tid / Tile::kChunks, chunk = tid % Tile::kChunks;
    const uint32_t dst = smem + Tile::offset(row0, chunk);
    const T* src = gmem + row0 * row_stride + chunk * Tile::kChunkElems;
    const int64_t pass_stride = kRowsPerPass * row_stride;
    constexpr int kPasses = Tile::kRows / kRowsPerPass;
    // Row + 8k keeps the swizzle, so the shared-memory offset grows by whole rows of chunks.
    constexpr int kPassBytes = kRowsPerPass * Tile::kPanelChunks * 16;
    if constexpr (kIsa == Isa::kSm75) {
      // Turing: every pass's load, then every store, at the caller's place in its code.
      uint4 data[kPasses];
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass, src += pass_stride) {
        data[pass] = make_uint4(0, 0, 0, 0);
        if (row0 + pass * kRowsPerPass < rows_valid) data[pass] = ptx::ld_global_nc_v4(src);
      }
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        ptx::st_shared_v4(dst + pass * kPassBytes, data[pass].x, data[pass].y, data[pass].z, data[pass].w);
      }
    } else if (kWholeTilePath && rows_valid >= Tile::kRows) {
      // Whole tile (every tile but a sequence's last): no per-row predicate and address select,
      // three of the four instructions per copy.
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass, src += pass_stride) {
        ptx::copy_16<kIsa>(dst + pass * kPassBytes, src, true);
      }
    } else {
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass, src += pass_stride) {
        const bool valid = row0 + pass * kRowsPerPass < rows_valid;
        ptx::copy_16<kIsa>(dst + pass * kPassBytes, valid ? src : gmem, valid);
      }
    }
  } else {
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
      const T* src = gmem + (valid ? row * row_stride + chunk * Tile::kChunkElems : 0);
      ptx::copy_16<kIsa>(smem + Tile::offset(row, chunk), src, valid);
    }
  }
}

// Copy `rows_valid` rows of a tile whose rows lie anywhere (a page table's keys): row r from
// gmem + row_offset(r) (elements), rows past rows_valid zero-filled, with cp.async (no commit).
// One row address a copy, in a loop kept rolled so that the lookups do not stay in registers
// across the caller's main loop.
template <typename Tile, int kThreads, typename T, typename RowOffset>
__device__ __forceinline__ void load_tile_rows(uint32_t smem, const T* gmem, const RowOffset& row_offset,
                                               int rows_valid, int tid) {
  static_assert(sizeof(T) == Tile::kElemBytes, "the tile holds the global tile's elements");
  constexpr int kTotal = Tile::kRows * Tile::kChunks;
  constexpr int kIterations = (kTotal + kThreads - 1) / kThreads;
#pragma unroll 1
  for (int it = 0; it < kIterations; ++it) {
    const int i = tid + it * kThreads;
    if (kTotal % kThreads != 0 && i >= kTotal) break;
    const int row = i / Tile::kChunks, chunk = i % Tile::kChunks;
    const bool valid = row < rows_valid;
    const T* src = valid ? gmem + row_offset(row) + chunk * Tile::kChunkElems : gmem;
    ptx::copy_16<Isa::kSm80>(smem + Tile::offset(row, chunk), src, valid);
  }
}

}  // namespace jax_flash
