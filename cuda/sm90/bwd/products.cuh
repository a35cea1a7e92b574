// The Hopper backward's wgmma products over one step's queries, issued (not waited for), by a
// consumer warp group of 64 keys.
#pragma once

#include <cstdint>

#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"
#include "sm90/common/head_dim_product.cuh"

namespace jax_flash::sm90 {

// S^T = K Q^T or dP^T = V dO^T of step s (head_dim_product.cuh);
// `keys` is K or V (this consumer's 64 rows of them), `queries` the stage's Q or dO, `full` its
// barrier (0: already waited for).
template <typename Cfg>
__device__ __forceinline__ void issue_transposed(float (&acc)[Cfg::kBlockM / 2], uint32_t keys, uint32_t queries,
                                                 uint32_t full, int s, int consumer) {
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN;
  const uint64_t key_desc = ptx::smem_desc_sw128(keys + consumer * 64 * 128, 0);
  const uint64_t query_desc = ptx::smem_desc_sw128(queries, 0);
  if (full != 0) ptx::mbarrier_wait(full, (s / Cfg::kStages) & 1);
  ptx::wgmma_fence();
  wgmma_over_head_dim<typename Cfg::T, Cfg::kHeadDim, kBlockN, kBlockM>(acc, key_desc, query_desc);
  ptx::wgmma_commit();
}

// acc (dK or dV) += A B, A from registers (dS^T or P^T: k16 steps over the step's queries), B the
// stage's Q or dO, MN-major here (queries are K, columns N).
template <typename Cfg>
__device__ __forceinline__ void issue_over_queries(float (&acc)[Cfg::kHeadDim / 2],
                                                   const uint32_t (&a)[Cfg::kBlockM / 16][4], uint32_t queries) {
  const uint64_t desc = ptx::smem_desc_sw128(queries, Cfg::kBlockM * 128);
#pragma unroll
  for (int kk = 0; kk < Cfg::kBlockM / 16; ++kk) {
    ptx::wgmma_rs(acc, a[kk], ptx::desc_advance(desc, kk * 2048), typename Cfg::T{});
  }
  ptx::wgmma_commit();
}

// A consumer's dQ part over all the CTA's keys, from dS (or dS^T) in shared memory (`ds`, the
// step's buffer) and K (`keys`): dQ = dS K, or with Cfg::kDqTransposed dQ^T = K^T dS^T.
template <typename Cfg>
__device__ __forceinline__ void issue_dq(float (&dq)[Cfg::Dq::kChunks * 4], uint32_t keys, uint32_t ds, int consumer) {
  using T = typename Cfg::T;
  constexpr int kBlockN = Cfg::kBlockN;
  ptx::wgmma_fence();
  if constexpr (Cfg::kDqTransposed) {
    // K^T (this consumer's 64-column panel of K) is A MN-major, dS^T is B K-major (dS rows are
    // queries, in 64-key panels).
    const uint64_t k_desc = ptx::smem_desc_sw128(keys + (Cfg::dq_column0(consumer) / 64) * kBlockN * 128, 0);
    const uint64_t ds_desc = ptx::smem_desc_sw128(ds, 0);
#pragma unroll
    for (int ks = 0; ks < kBlockN / 16; ++ks) {
      ptx::wgmma_ss<1, 0>(dq, ptx::desc_advance(k_desc, ks * 2048),
                          ptx::desc_advance(ds_desc, (ks / 4) * Cfg::kDsPanelBytes + (ks % 4) * 32), ks > 0, T{});
    }
  } else {
    // dS^T (keys x queries) is A MN-major, K is B MN-major.
    const uint64_t ds_desc = ptx::smem_desc_sw128(ds + (Cfg::dq_row0(consumer) / 64) * Cfg::kDsPanelBytes, 0);
    const uint64_t k_desc = ptx::smem_desc_sw128(keys + (Cfg::dq_column0(consumer) / 64) * kBlockN * 128, 0);
#pragma unroll
    for (int ks = 0; ks < kBlockN / 16; ++ks) {
      ptx::wgmma_ss<1, 1>(dq, ptx::desc_advance(ds_desc, ks * 2048), ptx::desc_advance(k_desc, ks * 2048), ks > 0,
                          T{});
    }
  }
  ptx::wgmma_commit();
}

}  // namespace jax_flash::sm90
