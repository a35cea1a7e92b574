// The end of the d = 256 dK/dV kernel: dK^T and dV^T, transposed, into this consumer's column
// panels of the K and V tiles ([key][column], as the dk and dv tensor maps expect; every S and dP
// has landed before the last step's kTilesReady, which both consumers passed, so K and V are
// unread), then TMA stores, which clip rows past seqlen_k. Every argument by reference, as the
// kernel holds it.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "common/params.h"
#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"

namespace jax_flash::sm90 {

// row0: this consumer's first head-dim column; accum_row(i), col(i): element i's key-major place;
// kBarrier + consumer: the named barrier of this consumer's epilogue.
template <typename Cfg, int kBarrier, typename AccumRow, typename Accum>
__device__ __forceinline__ void store_wide_dkdv(const CUtensorMap* const& dk, const CUtensorMap* const& dv,
                                                const float (&dkt)[2][32],
                                                const float (&dvt)[2][32], const uint32_t& sK, const uint32_t& sV,
                                                const int& row0, const AccumRow& accum_row, const Accum& accum,
                                                const int& consumer, const int& tid, const int& kv_head,
                                                const int& k_first, const int& batch) {
  using T = typename Cfg::T;
  constexpr int kBlockN = Cfg::kBlockN;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int column = row0 + mt * 64 + accum_row(i), key = accum.col(i);
      const uint32_t off = (column / 64) * kBlockN * 128 + ptx::sw128_offset(key, (column % 64) / 8) + (column % 8) * 2;
      ptx::st_shared_b16(sK + off, ptx::pack2<T>(dkt[mt][i], 0.f) & 0xffff);
      ptx::st_shared_b16(sV + off, ptx::pack2<T>(dvt[mt][i], 0.f) & 0xffff);
    }
  ptx::fence_proxy_async_shared();
  ptx::named_barrier_sync(kBarrier + consumer, 128);
  if (tid == 0) {
    for (int panel = row0 / 64; panel < (row0 + 128) / 64; ++panel) {
      const uint32_t off = panel * kBlockN * 128;
      ptx::tma_store_4d(dk, sK + off, panel * 64, kv_head, k_first, batch);
      ptx::tma_store_4d(dv, sV + off, panel * 64, kv_head, k_first, batch);
    }
    ptx::tma_store_commit();
    ptx::tma_store_wait_read();
  }
}

}  // namespace jax_flash::sm90
