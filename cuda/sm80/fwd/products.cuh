// The mma.sync forward's two products over one key block, for a warp's kMTiles m16 tiles of rows:
// S = Q K^T and O += P V. The fragment walks (common/tile.cuh) address stage 0's K and V;
// stage_offset moves them to the block's stage.
#pragma once

#include <cstdint>

#include "common/ptx.cuh"

namespace jax_flash::sm80 {

// S = Q K_j^T for this warp's rows x kBlockN keys; each K fragment serves every m16 tile. Q's
// fragments come from q_frag (Cfg::kQInRegs) or are read again from shared memory at each k16 step.
template <typename Cfg, int kMTiles, int kQFrags, typename QWalk, typename KWalk>
__device__ __forceinline__ void qk_product(float (&acc_s)[kMTiles][Cfg::kBlockN / 8][4],
                                           const uint32_t (&q_frag)[kMTiles][kQFrags][4], const QWalk& a_q,
                                           const KWalk& b_k, uint32_t stage_offset) {
  using T = typename Cfg::T;
  constexpr int kNTiles = Cfg::kBlockN / 8, kKSteps = Cfg::kHeadDim / 16;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int n = 0; n < kNTiles; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_s[mt][n][i] = 0.f;
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    uint32_t q_reload[kMTiles][4];
    if constexpr (!Cfg::kQInRegs) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) ptx::ldmatrix_x4(q_reload[mt], a_q(ks, mt * 16));
    }
#pragma unroll
    for (int n = 0; n < kNTiles; n += 2) {
      uint32_t b[4];
      ptx::ldmatrix_x4(b, b_k(ks, n * 8) + stage_offset);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        const uint32_t(&reloaded)[4] = q_reload[mt];
        const uint32_t(&a)[4] = Cfg::kQInRegs ? q_frag[mt][Cfg::kQInRegs ? ks : 0] : reloaded;
        ptx::mma_16816<T, Cfg::kIsa>(acc_s[mt][n], a, b[0], b[1]);
        ptx::mma_16816<T, Cfg::kIsa>(acc_s[mt][n + 1], a, b[2], b[3]);
      }
    }
  }
}

// O += P V_j: the S accumulators (P) of two n8 tiles form the A fragment of one k16 step.
template <typename Cfg, int kMTiles, typename VWalk>
__device__ __forceinline__ void pv_product(float (&acc_o)[kMTiles][Cfg::kHeadDim / 8][4],
                                           const float (&acc_s)[kMTiles][Cfg::kBlockN / 8][4], const VWalk& bt_v,
                                           uint32_t stage_offset) {
  using T = typename Cfg::T;
  constexpr int kDTiles = Cfg::kHeadDim / 8;
#pragma unroll
  for (int ks = 0; ks < Cfg::kBlockN / 16; ++ks) {
    uint32_t a[kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) ptx::accumulators_to_a<T>(a[mt], acc_s[mt][2 * ks], acc_s[mt][2 * ks + 1]);
#pragma unroll
    for (int d = 0; d < kDTiles; d += 2) {
      uint32_t b[4];
      ptx::ldmatrix_x4_trans(b, bt_v(d / 2, ks * 16) + stage_offset);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        ptx::mma_16816<T, Cfg::kIsa>(acc_o[mt][d], a[mt], b[0], b[1]);
        ptx::mma_16816<T, Cfg::kIsa>(acc_o[mt][d + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

}  // namespace jax_flash::sm80
