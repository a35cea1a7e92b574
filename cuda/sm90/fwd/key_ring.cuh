// A Hopper forward consumer's view of one tile's key blocks in the CTA's ring of K/V stages: block
// j of the tile is block it + j of the ring (the producer fills them in that order across tiles).
// S = Q K_j^T and O += P V_j are issued here (not waited for: the kernel waits, so that the
// softmax of one block runs under the products of the next), and the stages released.
#pragma once

#include <cstdint>

#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"
#include "sm90/fwd/products.cuh"
#include "sm90/fwd/shared_memory.cuh"
#include "sm90/common/head_dim_product.cuh"
#include "sm90/common/ignored_rows.cuh"

namespace jax_flash::sm90 {

template <typename Cfg>
struct FwdKeyRing {
  using T = typename Cfg::T;
  static constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  static constexpr int kStages = Cfg::kStages, kSRegs = kBlockN / 2;
  const FwdSharedMemory<Cfg>& shared;
  const int &it, &blocks;  // held as the kernel holds them (by value, the code changed)
  int consumer_uniform;  // this consumer's 64 rows of Q, known uniform across the warp (H13)

  __device__ __forceinline__ int stage_of(int j) const { return (it + j) % kStages; }
  __device__ __forceinline__ int phase_of(int j) const { return ((it + j) / kStages) & 1; }

  // S = Q K_j^T once K_j has landed (head_dim_product.cuh).
  __device__ __forceinline__ void issue_s(float (&s)[kSRegs], int j) const {
    const int stage = stage_of(j);
    const uint64_t q_desc = ptx::smem_desc_sw128(shared.q + consumer_uniform * 64 * 128, 0);
    const uint64_t k_desc = ptx::smem_desc_sw128(shared.k(stage), 0);
    ptx::mbarrier_wait(shared.k_full(stage), phase_of(j));
    ptx::wgmma_fence();
    wgmma_over_head_dim<T, kHeadDim, kBlockM, kBlockN>(s, q_desc, k_desc);
    ptx::wgmma_commit();
  }
  // S_j has landed: its K stage is free, and after the tile's last block so is Q's buffer. With
  // kStagedStore the last block's K stage stays taken: O is staged there, and each consumer frees
  // its half once the store has read it (the kernel's release_staging).
  __device__ __forceinline__ void release_k(int j) const {
    if (Cfg::kStagedStore && j == blocks - 1) {
      ptx::mbarrier_arrive(shared.last_s_landed());
    } else {
      ptx::mbarrier_arrive(shared.k_empty(stage_of(j)));
    }
    if (j == blocks - 1) ptx::mbarrier_arrive(shared.q_empty());
  }
  // O += P V_j once V_j has landed (products.cuh).
  __device__ __forceinline__ void issue_pv(float (&o)[Cfg::kOChunks][Cfg::kOChunkCols / 2],
                                           const uint32_t (&pa)[kBlockN / 16][4], int j) const {
    const int stage = stage_of(j);
    sm90::issue_pv<Cfg>(o, pa, shared.v(stage), shared.v_full(stage), phase_of(j));
  }
  // V_j's rows from `first_ignored` on set to 0 once V_j has landed, before P V_j reads them
  // (sm90/common/ignored_rows.cuh). Each consumer writes the same zeros, so it syncs its own warp group
  // alone (`barrier`, 128 threads).
  __device__ __forceinline__ void clear_v_rows(int j, int first_ignored, int barrier, int tid) const {
    const int stage = stage_of(j);
    ptx::mbarrier_wait(shared.v_full(stage), phase_of(j));
    zero_rows_from<Cfg::kVPanels, kBlockN, 128>(shared.v(stage), first_ignored, tid);
    ptx::named_barrier_sync(barrier, 128);
  }
  // P V_j has landed: V_j's stage is free.
  __device__ __forceinline__ void release_v(int j) const { ptx::mbarrier_arrive(shared.v_empty(stage_of(j))); }
};

}  // namespace jax_flash::sm90
