// dS of an mma.sync backward step: P (dP - delta) * scale (times the slope with a cap, inside
// p_for_ds: probabilities.cuh), to shared memory (16-bit, kDsFromP bytes past P) for dK and dQ;
// with a bias, d logit = P (dP - delta) into dbias, with P (no slope) read back from this
// thread's own stores. Every argument by reference, as the kernel holds it.
#pragma once

#include <cstdint>

#include "common/bias.cuh"
#include "common/params.h"
#include "common/ptx.cuh"

namespace jax_flash::sm80 {

// acc: dP of this warp's rows row(mt, r) and keys k_first + col(n, j); delta of row r at
// stats[kBlockM + row(mt, r)].
template <typename T, bool kBias, int kBlockM, uint32_t kDsFromP, int kMTiles, typename Row, typename Col,
          typename StoreP>
__device__ __forceinline__ void store_ds(const float (&acc)[kMTiles][4][4], const uint32_t (&p_for_ds)[kMTiles][4][2],
                                         const float* const& stats, const BiasGrad& dbias, const BwdParams& p,
                                         const int& q_first, const int& k_first, const Row& row, const Col& col,
                                         const StoreP& st_p) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float delta = stats[kBlockM + row(mt, r)];
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const float2 prob = ptx::unpack2<T>(p_for_ds[mt][n][r]);
        const float ds0 = prob.x * (acc[mt][n][2 * r] - delta) * p.scale;
        const float ds1 = prob.y * (acc[mt][n][2 * r + 1] - delta) * p.scale;
        ptx::st_shared_b32(st_p(n, mt * 16 + r * 8) + kDsFromP, ptx::pack2<T>(ds0, ds1));
        if constexpr (kBias) {
          const int q = q_first + row(mt, r);
          if (dbias.wanted() && q < p.seqlen_q) {
            const float2 plain = ptx::unpack2<T>(ptx::ld_shared_b32(st_p(n, mt * 16 + r * 8)));
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              const int k = k_first + col(n, j);
              const float prob_j = j ? plain.y : plain.x;
              if (prob_j != 0.f && k < p.seqlen_k) dbias.add(q, k, prob_j * (acc[mt][n][2 * r + j] - delta));
            }
          }
        }
      }
    }
}

}  // namespace jax_flash::sm80
