// The end of a consumer's tile in the Hopper forward: O normalised by the rows' sums and stored,
// staged in shared memory for a TMA store (FwdConfig::kStagedStore) or straight from registers.
#pragma once

#include <cuda.h>

#include <cmath>
#include <cstdint>

#include "common/params.h"
#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"
#include "common/row_total.cuh"

namespace jax_flash::sm90 {

// The rows' log-sum-exp to p.lse (one thread of each quad, rows below rows_valid) and the factors
// that normalise O (0 for a row that saw nothing visible, whose lse is -inf). row_in_tile(r):
// this thread's rows of the tile from q_first of (batch, head). Everything by reference, as the
// kernel holds it (by value, the code changed).
template <typename RowInTile>
__device__ __forceinline__ void write_lse(const FwdParams& p, const int& batch, const int& head, const int& q_first,
                                          const int& rows_valid, const float (&row_max)[2], const float (&row_sum)[2],
                                          const float& unit, const RowInTile& row_in_tile, const int& lane,
                                          float (&inv)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const RowTotal total(row_sum[r]);
    float lse;
    total.finish(row_max[r], unit, p, batch, head, inv[r], lse);
    const int row = row_in_tile(r);
    if (lane % 4 == 0 && row < rows_valid) {
      p.lse[(int64_t(batch) * p.heads + head) * p.seqlen_q + q_first + row] = lse;
    }
  }
}

// O from registers: a quad holds 8 consecutive columns of its row as four 4-byte pairs, one a
// thread; a 4 x 4 transpose across the quad (ptx::quad_transpose) gives each thread the 16 bytes
// of one n8 tile of four, so a warp's store writes 64 contiguous bytes of each of its 8 rows, with
// a quarter of the store instructions (H16). `out` is the tile's first row; rows at or past
// rows_valid are not stored.
template <typename Cfg>
__device__ __forceinline__ void store_o(typename Cfg::T* out, int64_t row_stride, int rows_valid,
                                        const float (&o)[Cfg::kOChunks][Cfg::kOChunkCols / 2], const float (&inv)[2],
                                        const int (&rows)[2], int lane) {
  using T = typename Cfg::T;
  constexpr int kChunkN8 = Cfg::kOChunkCols / 8;
  static_assert(kChunkN8 % 4 == 0, "whole groups of four n8 tiles in a chunk");
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = rows[r];
    uint4* out_row = reinterpret_cast<uint4*>(out + row * row_stride);
#pragma unroll
    for (int group = 0; group < Cfg::kValueDim / 32; ++group) {
      uint32_t pairs[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int c = (4 * group + i) / kChunkN8, n8 = (4 * group + i) % kChunkN8;
        pairs[i] = ptx::pack2<T>(o[c][4 * n8 + 2 * r] * inv[r], o[c][4 * n8 + 2 * r + 1] * inv[r]);
      }
      ptx::quad_transpose(pairs, lane % 4);
      if (row < rows_valid) out_row[4 * group + lane % 4] = make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
    }
  }
}

// O as T into this consumer's rows of `staging` (its part of the last key block's K stage:
// 64-column panels of 128-byte rows, swizzled as TMA reads them), by stmatrix: tile m of four is
// rows (m % 2) * 8 and n8 tile 2 g + m / 2; then, once the consumer's 128 threads have written
// (named barrier `store_barrier`), one thread stores them by TMA at (head, first_row, batch),
// which clips rows past the sequence.
template <typename Cfg>
__device__ __forceinline__ void store_o_staged(const CUtensorMap* map, int head, int first_row, int batch,
                                               const float (&o)[Cfg::kOChunks][Cfg::kOChunkCols / 2],
                                               const float (&inv)[2], uint32_t staging, int store_barrier, int tid,
                                               int warp, int lane) {
  using T = typename Cfg::T;
  constexpr int kChunkN8 = Cfg::kOChunkCols / 8;
  const int m = lane / 8, i = lane % 8;
  const uint32_t lane_addr = staging + (warp * 16 + (m % 2) * 8 + i) * 128;
  const uint32_t lane_bits = ((m / 2) ^ i) * 16;
#pragma unroll
  for (int g = 0; g < Cfg::kValueDim / 16; ++g) {
    uint32_t r[4];
#pragma unroll
    for (int mm = 0; mm < 4; ++mm) {
      const int n8 = 2 * g + mm / 2, rr = mm % 2, c = n8 / kChunkN8, n8l = n8 % kChunkN8;
      r[mm] = ptx::pack2<T>(o[c][4 * n8l + 2 * rr] * inv[rr], o[c][4 * n8l + 2 * rr + 1] * inv[rr]);
    }
    ptx::stmatrix_x4(lane_addr + (g / 4) * 64 * 128 + (((2 * g) % 8 * 16) ^ lane_bits), r[0], r[1], r[2], r[3]);
  }
  ptx::fence_proxy_async_shared();
  ptx::named_barrier_sync(store_barrier, 128);
  if (tid == 0) {
    for (int panel = 0; panel < Cfg::kVPanels; ++panel) {
      ptx::tma_store_4d(map, staging + panel * 64 * 128, panel * 64, head, first_row, batch);
    }
    ptx::tma_store_commit();
  }
}

// kStagedStore: O of this consumer's 64 rows into the last key block's K stage (`stage`), once
// every consumer's last S has read it (`staged_tiles` counts the tiles staged: the barrier's
// phase), then stored by TMA; `staged_stage` keeps the stage until release_staged_o frees it. By
// reference, as the kernel holds them.
template <typename Cfg, typename SharedMemory>
__device__ __forceinline__ void store_o_staged_tile(const SharedMemory& shared, const CUtensorMap* map, const int& head,
                                                    const int& q_first, const int& batch,
                                                    const float (&o)[Cfg::kOChunks][Cfg::kOChunkCols / 2],
                                                    const float (&inv)[2], const int& stage,
                                                    const int& consumer_uniform, const int& barrier, int& staged_tiles,
                                                    int& staged_stage, const int& tid, const int& warp,
                                                    const int& lane) {
  const uint32_t staging = shared.k(stage) + consumer_uniform * Cfg::kVPanels * 64 * 128;
  ptx::mbarrier_wait(shared.last_s_landed(), staged_tiles & 1);
  ++staged_tiles;
  store_o_staged<Cfg>(map, head, q_first + consumer_uniform * 64, batch, o, inv, staging, barrier, tid, warp, lane);
  staged_stage = stage;
}

// kStagedStore: the staged O's K stage back to the producer once the TMA store has read it.
template <typename Cfg, typename SharedMemory>
__device__ __forceinline__ void release_staged_o(const SharedMemory& shared, int& staged_stage, const int& tid) {
  if (!Cfg::kStagedStore || staged_stage < 0) return;
  if (tid == 0) {
    ptx::tma_store_wait_read();
    ptx::mbarrier_arrive(shared.k_empty(staged_stage), 128u);
  }
  staged_stage = -1;
}

}  // namespace jax_flash::sm90
