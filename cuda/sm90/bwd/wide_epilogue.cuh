// The end of the Hopper dK/dV kernel for head dims 192 and 256 (bwd_wide_kernel.cuh): this
// consumer's tiles of dK^T and dV^T, transposed, into their column panels of the K and V tiles
// ([key][column], as the dk and dv tensor maps expect; every S and dP has landed before the last
// step's kTilesReady, which both consumers passed, so K and V are unread), then TMA stores, which
// clip rows past seqlen_k. Every argument by reference, as the kernel holds it.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "common/params.h"
#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"

namespace jax_flash::sm90 {

// acc[t]: tile first_tile + t (Cfg::tile_is_dk, Cfg::tile_row0: its first head-dim column);
// accum_row(i), col(i): element i's key-major place; kBarrier + consumer: the named barrier of
// this consumer's epilogue.
template <typename Cfg, int kBarrier, int kTiles, typename AccumRow, typename Accum>
__device__ __forceinline__ void store_wide_dkdv(const CUtensorMap* const& dk, const CUtensorMap* const& dv,
                                                const float (&acc)[kTiles][32], const int& first_tile,
                                                const uint32_t& sK, const uint32_t& sV, const AccumRow& accum_row,
                                                const Accum& accum, const int& consumer, const int& tid,
                                                const int& kv_head, const int& k_first, const int& batch) {
  using T = typename Cfg::T;
  constexpr int kBlockN = Cfg::kBlockN;
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    const uint32_t tile = Cfg::tile_is_dk(first_tile + t) ? sK : sV;
    const int row0 = Cfg::tile_row0(first_tile + t);
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int column = row0 + accum_row(i), key = accum.col(i);
      const uint32_t off = (column / 64) * kBlockN * 128 + ptx::sw128_offset(key, (column % 64) / 8) + (column % 8) * 2;
      ptx::st_shared_b16(tile + off, ptx::pack2<T>(acc[t][i], 0.f) & 0xffff);
    }
  }
  ptx::fence_proxy_async_shared();
  ptx::named_barrier_sync(kBarrier + consumer, 128);
  if (tid == 0) {
    for (int t = 0; t < kTiles; ++t) {
      const bool is_dk = Cfg::tile_is_dk(first_tile + t);
      const int panel = Cfg::tile_row0(first_tile + t) / 64;
      ptx::tma_store_4d(is_dk ? dk : dv, (is_dk ? sK : sV) + panel * kBlockN * 128, panel * 64, kv_head, k_first,
                        batch);
    }
    ptx::tma_store_commit();
    ptx::tma_store_wait_read();
  }
}

}  // namespace jax_flash::sm90
