// The Hopper kernels' products over the head dim (S = Q K^T, dP = dO V^T and their transposes):
// both operands K-major in the 128-byte swizzle's 64-column panels, issued by wgmma in k16 steps,
// four a panel (32 bytes each). Issued only: the caller fences before, commits and waits after.
#pragma once

#include <cstdint>

#include "common/ptx_sm90.cuh"

namespace jax_flash::sm90 {

// acc = A B^T, A's panels kRowsA rows of 128 bytes apart, B's kRowsB.
template <typename T, int kHeadDim, int kRowsA, int kRowsB, int kRegs>
__device__ __forceinline__ void wgmma_over_head_dim(float (&acc)[kRegs], uint64_t a_desc, uint64_t b_desc) {
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    ptx::wgmma_ss(acc, ptx::desc_advance(a_desc, (ks / 4) * kRowsA * 128 + (ks % 4) * 32),
                  ptx::desc_advance(b_desc, (ks / 4) * kRowsB * 128 + (ks % 4) * 32), ks > 0, T{});
  }
}

}  // namespace jax_flash::sm90
