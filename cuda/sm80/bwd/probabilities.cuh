// P of an mma.sync backward step from its S accumulators: the soft cap, the bias (bias.cuh),
// exp2 against the rows' lse (log2 units; +inf for rows that see no key, so P = 0 there), and the
// band mask (keys outside a row's band or past seqlen_k give 0). P goes to shared memory (16-bit)
// for dV, and to p_for_ds for dS: with a cap, P times the tanh's slope (logits.cuh), so that the
// slopes need no registers of their own while dP is computed. Every argument by reference, as the
// kernel holds it.
#pragma once

#include <cstdint>

#include "common/mask.cuh"
#include "common/ptx.cuh"

namespace jax_flash::sm80 {

// acc: S of this warp's rows row(mt, r) (of the step from q_first) and keys k_first + col(n, j);
// lse_log2 of row r at stats[row(mt, r)]. `pairs`: the bias's layout (kBias only).
template <typename T, bool kBias, typename LogitsT, int kMTiles, typename Pairs, typename Bias, typename Row,
          typename Col, typename StoreP>
__device__ __forceinline__ void probabilities(Pairs pairs, const float (&acc)[kMTiles][4][4],
                                              uint32_t (&p_for_ds)[kMTiles][4][2], const float* const& stats,
                                              const Band& band, const Bias& bias, const LogitsT& logits,
                                              const float& scale_log2, const int& q_first, const int& k_first,
                                              const bool& masked, const Row& row, const Col& col,
                                              const StoreP& st_p) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float lse_log2 = stats[row(mt, r)];
      const int q = q_first + row(mt, r);
      const Range seen = band.keys_seen_by(q);
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        float2 add{0.f, 0.f};
        if constexpr (kBias) add = bias.template pair<decltype(pairs)::value>(q, k_first + col(n, 0));
        float prob[2], slope[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int k = k_first + col(n, j);
          const float x = logits.value(acc[mt][n][2 * r + j]);
          slope[j] = logits.slope(x);
          const float biased = kBias ? x + (j ? add.y : add.x) : x;
          prob[j] = ptx::exp2(biased * scale_log2 - lse_log2);
          if (masked) hide_outside(prob[j], 0.f, seen, k, [&] { return !band.same_segment(q, k); });
        }
        const uint32_t packed = ptx::pack2<T>(prob[0], prob[1]);
        ptx::st_shared_b32(st_p(n, mt * 16 + r * 8), packed);
        p_for_ds[mt][n][r] = LogitsT::kMayCap ? ptx::pack2<T>(prob[0] * slope[0], prob[1] * slope[1]) : packed;
      }
    }
}

}  // namespace jax_flash::sm80
