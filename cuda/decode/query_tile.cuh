// The packed query rows of a decode CTA as mma A fragments (row lane / 4 in a[0], a[2], row
// lane / 4 + 8 in a[1], a[3]; columns 2 * (lane % 4) and 8 further). Up to H = 128 they live in
// registers, loaded once straight from global memory; above, beside O's H / 2 accumulators they
// would spill, so each warp copies the tile into its own shared memory (in the ring's first
// commit group) and reads the fragments with ldmatrix at every step. Rows past the packed rows
// are zero.
#pragma once

#include <cstdint>

#include "common/ptx.cuh"
#include "common/tile.cuh"
#include "decode/packed_rows.cuh"

namespace jax_flash::decode {

template <typename Cfg, bool kInSmem = Cfg::kQInSmem>
struct QueryTile;

// With an fp8 cache (Cfg::kFp8) the k16 steps' columns are permuted as K's fragments land
// (split_kernel.cuh): a thread's a[0] / a[2] hold columns 4 (lane % 4) + 0, 1 / + 2, 3 of the
// step, not 2 (lane % 4) + 0, 1 / + 8, 9. A product over k is the same under any permutation of
// k shared by both operands.
template <typename Cfg>
struct QueryTile<Cfg, false> {
  static constexpr int kKSteps = Cfg::kHeadDim / 16;
  uint32_t frag[kKSteps][4];

  template <typename Rows>
  __device__ __forceinline__ void load(const FwdParams& p, const Rows& rows, int batch, uint32_t, int lane) {
    using T = typename Cfg::T;
    constexpr int kColsPerLane = Cfg::kFp8 ? 4 : 2, kHalfCols = Cfg::kFp8 ? 2 : 8;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = lane / 4 + 8 * r;
      const bool valid = rows.valid(row);
      const T* q = static_cast<const T*>(p.q) + rows.output_row(p, batch, valid ? row : 0) * Cfg::kHeadDim +
                   kColsPerLane * (lane % 4);
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          frag[ks][2 * half + r] = valid ? __ldg(reinterpret_cast<const uint32_t*>(q + ks * 16 + half * kHalfCols)) : 0u;
        }
    }
  }
  template <typename Fn>
  __device__ __forceinline__ void with_fragment(int ks, Fn&& fn) const {
    fn(frag[ks]);
  }
};

template <typename Cfg>
struct QueryTile<Cfg, true> {
  static_assert(!Cfg::kFp8, "fp8 caches: Q in registers (H <= 128)");
  using Tile = typename Cfg::QTile;
  static constexpr int kKSteps = Cfg::kHeadDim / 16;
  ChunkWalk<Tile, kKSteps> a_q;  // lanes 0-15 give rows, lanes 16-31 the second 8 columns

  // `tile`: this warp's copy. Starts the copy (one commit group is left to the caller).
  template <typename Rows>
  __device__ __forceinline__ void load(const FwdParams& p, const Rows& rows, int batch, uint32_t tile,
                                       int lane) {
    using T = typename Cfg::T;
    for (int i = lane; i < Tile::kRows * Tile::kChunks; i += 32) {
      const int row = i / Tile::kChunks, chunk = i % Tile::kChunks;
      const bool valid = rows.valid(row);
      const T* src = static_cast<const T*>(p.q) + rows.output_row(p, batch, valid ? row : 0) * Cfg::kHeadDim + chunk * 8;
      ptx::cp_async_16(tile + Tile::offset(row, chunk), src, valid);
    }
    a_q = ChunkWalk<Tile, kKSteps>(tile, lane % 16, lane / 16);
  }
  template <typename Fn>
  __device__ __forceinline__ void with_fragment(int ks, Fn&& fn) const {
    uint32_t a[4];
    ptx::ldmatrix_x4(a, a_q(ks));
    fn(a);
  }
};

}  // namespace jax_flash::decode
