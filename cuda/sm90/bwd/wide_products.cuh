// The wgmma products of the Hopper d = 256 dK/dV kernel (bwd_wide_kernel.cuh), issued and
// committed, not waited for.
#pragma once

#include <cstdint>

#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"

namespace jax_flash::sm90 {

// acc = rows (queries) x keys of one product, S = Q K^T or dP = dO V^T, from its query tile and its
// key tile's first key: k16 steps along the head dim, both operands K-major.
template <typename Cfg>
__device__ __forceinline__ void issue_wide_scores(float (&acc)[16], uint32_t query_tile, uint32_t keys) {
  using T = typename Cfg::T;
  ptx::wgmma_fence();  // after the stage wait's branch
#pragma unroll
  for (int ks = 0; ks < Cfg::kHeadDim / 16; ++ks) {
    const uint32_t off_q = (ks / 4) * Cfg::kBlockM * 128 + (ks % 4) * 32;
    const uint32_t off_k = (ks / 4) * Cfg::kBlockN * 128 + (ks % 4) * 32;
    ptx::wgmma_ss(acc, ptx::smem_desc_sw128(query_tile + off_q, 0), ptx::smem_desc_sw128(keys + off_k, 0), ks > 0, T{});
  }
  ptx::wgmma_commit();
}

// acc[mt] += X^T B over the step's queries, for this consumer's head-dim rows from row0: X (Q or
// dO, [query][column] panels) read MN-major as A, B (P or dS, [query][key]) MN-major: queries are
// the k16 steps.
template <typename Cfg>
__device__ __forceinline__ void issue_wide_transposed(float (&acc)[2][32], uint32_t x, uint32_t b, int row0) {
  using T = typename Cfg::T;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int ks = 0; ks < Cfg::kBlockM / 16; ++ks) {
      const uint32_t panel = x + ((row0 + mt * 64) / 64) * Cfg::kBlockM * 128;
      ptx::wgmma_ss<1, 1>(acc[mt], ptx::smem_desc_sw128(panel + ks * 2048, 0), ptx::smem_desc_sw128(b + ks * 2048, 0),
                          true, T{});
    }
  ptx::wgmma_commit();
}

}  // namespace jax_flash::sm90
