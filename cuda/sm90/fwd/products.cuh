// The Hopper forward consumers' P V product, issued by wgmma and not waited for (the caller
// waits, so that the softmax of one block runs under the products of the next). (S = Q K^T is
// issued in the kernel: as a function here it changed the capped d = 256 kernel's code.)
#pragma once

#include <cstdint>

#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"

namespace jax_flash::sm90 {

// O += P V once V's stage has landed (`v_full` at `phase`). V is MN-major for this product (keys
// are K, head-dim columns N): 16 keys a step (2048 bytes of a panel), 64-column panels
// kBlockN * 128 bytes apart; O in chunks of Cfg::kOChunkCols columns.
template <typename Cfg>
__device__ __forceinline__ void issue_pv(float (&o)[Cfg::kOChunks][Cfg::kOChunkCols / 2],
                                         const uint32_t (&pa)[Cfg::kBlockN / 16][4], uint32_t v_tile,
                                         uint32_t v_full, int phase) {
  using T = typename Cfg::T;
  constexpr int kBlockN = Cfg::kBlockN;
  const uint64_t v_desc = ptx::smem_desc_sw128(v_tile, kBlockN * 128);
  ptx::mbarrier_wait(v_full, phase);
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kBlockN / 16; ++kk)
#pragma unroll
    for (int c = 0; c < Cfg::kOChunks; ++c) {
      ptx::wgmma_rs(o[c], pa[kk], ptx::desc_advance(v_desc, c * (Cfg::kOChunkCols / 64) * kBlockN * 128 + kk * 2048),
                    T{});
    }
  ptx::wgmma_commit();
}

}  // namespace jax_flash::sm90
