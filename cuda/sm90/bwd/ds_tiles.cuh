// dS^T = P^T (dP^T - delta) of a Hopper backward step, from the 16-bit P (the precision dV used),
// kept in registers as the A operand of dK += dS^T Q and stored to shared memory by stmatrix for
// dQ. With kBiasGrad, d logit = P^T (dP^T - delta) (before the slopes) goes into dbias.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/params.h"
#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"
#include "sm90/bwd/bias_grad.cuh"

namespace jax_flash::sm90 {

// dsa[kk][m] is the 8 x 8 tile of keys (m % 2) * 8 of this warp's 16 and queries (2 kk + m / 2) * 8;
// lane 8 m + r gives the address of the tile's row r in memory (ds_lane_addr, ds_chunk_bits: the
// kernel's ds_offsets). With a cap (kCappedStep), dpt holds (dP^T - delta) * slope already and
// delta is not read; with kSlopesApart the slopes come from `slopes`.
template <typename Cfg, bool kCappedStep, bool kSlopesApart, bool kBiasGrad, int kSRegs, int kSlopes>
__device__ __forceinline__ void make_ds_tiles(uint32_t (&dsa)[2 * kSRegs / 16][4], const float (&dpt)[kSRegs],
                                              const float2 (&delta)[2 * kSRegs / 8],
                                              const uint32_t (&pa)[2 * kSRegs / 16][4],
                                              const uint32_t (&slopes)[kSlopes], uint32_t ds_lane_addr,
                                              uint32_t ds_chunk_bits, const BiasGrad& dbias, const BwdParams& p,
                                              int lane, int dbias_query, int dbias_key) {
  using T = typename Cfg::T;
  constexpr int kBlockM = 2 * kSRegs;
#pragma unroll
  for (int kk = 0; kk < kBlockM / 16; ++kk) {
    float2 grad[4];  // kBiasGrad
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = 8 * kk + 2 * j;  // elements i, i + 1: one row, two adjacent queries
      float2 ds = {dpt[i], dpt[i + 1]};
      if constexpr (!kCappedStep) ds = {ds.x - delta[i / 4].x, ds.y - delta[i / 4].y};
      if constexpr (kBiasGrad) {
        const float2 prob = ptx::unpack2<T>(pa[kk][j]);
        grad[j] = {prob.x * ds.x, prob.y * ds.y};
      }
      if constexpr (kSlopesApart) {
        const float2 slope = ptx::unpack2<T>(slopes[i / 2]);
        ds = {ds.x * slope.x, ds.y * slope.y};
      }
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        // The product of the packed pairs: three instructions a pair fewer (no unpacking of P, one
        // multiply instead of two); the difference is rounded to bf16 first, one rounding more.
        // Not for fp16, whose range the difference could leave where the product does not.
        dsa[kk][j] = ptx::mul_bf16x2(pa[kk][j], ptx::pack2<T>(ds.x, ds.y));
      } else {
        const float2 prob = ptx::unpack2<T>(pa[kk][j]);
        dsa[kk][j] = ptx::pack2<T>(prob.x * ds.x, prob.y * ds.y);
      }
    }
    if constexpr (Cfg::kDqTransposed) {
      ptx::stmatrix_x4_trans(ds_lane_addr + kk * 2048, dsa[kk][0], dsa[kk][1], dsa[kk][2], dsa[kk][3]);
    } else {
      ptx::stmatrix_x4(ds_lane_addr + (kk / 4) * Cfg::kDsPanelBytes + (((2 * kk) % 8 * 16) ^ ds_chunk_bits),
                       dsa[kk][0], dsa[kk][1], dsa[kk][2], dsa[kk][3]);
    }
    if constexpr (kBiasGrad) add_bias_grad(dbias, p, grad, kk, lane, dbias_query, dbias_key);
  }
}

}  // namespace jax_flash::sm90
