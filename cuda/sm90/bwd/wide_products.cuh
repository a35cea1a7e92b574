// The wgmma products of the Hopper dK/dV kernel for head dims 192 and 256 (bwd_wide_kernel.cuh),
// issued and committed, not waited for.
#pragma once

#include <cstdint>

#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"

namespace jax_flash::sm90 {

// acc = rows (queries) x keys of one product, S = Q K^T or dP = dO V^T (kDim: the head dim of Q
// and K, or the value dim of dO and V), from its query tile and its key tile's first key: k16
// steps along kDim, both operands K-major.
template <typename Cfg, int kDim>
__device__ __forceinline__ void issue_wide_scores(float (&acc)[16], uint32_t query_tile, uint32_t keys) {
  using T = typename Cfg::T;
  ptx::wgmma_fence();  // after the stage wait's branch
#pragma unroll
  for (int ks = 0; ks < kDim / 16; ++ks) {
    const uint32_t off_q = (ks / 4) * Cfg::kBlockM * 128 + (ks % 4) * 32;
    const uint32_t off_k = (ks / 4) * Cfg::kBlockN * 128 + (ks % 4) * 32;
    ptx::wgmma_ss(acc, ptx::smem_desc_sw128(query_tile + off_q, 0), ptx::smem_desc_sw128(keys + off_k, 0), ks > 0, T{});
  }
  ptx::wgmma_commit();
}

// acc[t] += X^T B over the step's queries for this consumer's tiles first_tile + t (Cfg::tile_is_dk,
// Cfg::tile_row0): dV^T's take X = dO and B = P, dK^T's X = Q and B = dS. X ([query][column]
// panels) is read MN-major as A, B ([query][key]) MN-major: queries are the k16 steps.
template <typename Cfg, int kTiles>
__device__ __forceinline__ void issue_wide_transposed(float (&acc)[kTiles][32], int first_tile, uint32_t q,
                                                      uint32_t d_o, uint32_t p, uint32_t ds) {
  using T = typename Cfg::T;
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    const bool dk = Cfg::tile_is_dk(first_tile + t);
    const uint32_t panel = (dk ? q : d_o) + (Cfg::tile_row0(first_tile + t) / 64) * Cfg::kBlockM * 128;
    const uint32_t b = dk ? ds : p;
#pragma unroll
    for (int ks = 0; ks < Cfg::kBlockM / 16; ++ks) {
      ptx::wgmma_ss<1, 1>(acc[t], ptx::smem_desc_sw128(panel + ks * 2048, 0), ptx::smem_desc_sw128(b + ks * 2048, 0),
                          true, T{});
    }
  }
  ptx::wgmma_commit();
}

}  // namespace jax_flash::sm90
