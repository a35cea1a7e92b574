// The mma.sync backward's S and dP products of one step, a warp's share in its warp grid
// (config.cuh), operands in shared memory through fragment walks (common/tile.cuh). (dK, dV and
// dQ's products stay in the kernel: moved here, they changed its register allocation and spills.)
#pragma once

#include <cstdint>

#include "common/ptx.cuh"

namespace jax_flash::sm80 {

// acc = A B^T for the warp's kSdpRowsPerWarp queries x 32 keys: S = Q K^T, or dP = dO V^T with
// the walks shifted by a_shift / b_shift bytes (dO sits at a fixed distance from Q, V from K).
template <typename Cfg, typename QWalk, typename KWalk>
__device__ __forceinline__ void sdp_product(float (&acc)[Cfg::kSdpRowsPerWarp / 16][4][4], const QWalk& a_q,
                                            const KWalk& b_k, uint32_t a_shift, uint32_t b_shift) {
  using T = typename Cfg::T;
  constexpr int kSdpMTiles = Cfg::kSdpRowsPerWarp / 16, kKSteps = Cfg::kHeadDim / 16;
#pragma unroll
  for (int mt = 0; mt < kSdpMTiles; ++mt)
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][n][i] = 0.f;
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    uint32_t a[kSdpMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kSdpMTiles; ++mt) ptx::ldmatrix_x4(a[mt], a_q(ks, mt * 16) + a_shift);
#pragma unroll
    for (int n = 0; n < 4; n += 2) {
      uint32_t b[4];
      ptx::ldmatrix_x4(b, b_k(ks, n * 8) + b_shift);
#pragma unroll
      for (int mt = 0; mt < kSdpMTiles; ++mt) {
        ptx::mma_16816<T, Cfg::kIsa>(acc[mt][n], a[mt], b[0], b[1]);
        ptx::mma_16816<T, Cfg::kIsa>(acc[mt][n + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

}  // namespace jax_flash::sm80
