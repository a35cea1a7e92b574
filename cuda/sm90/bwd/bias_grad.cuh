// The Hopper backward's dbias adds (kBiasGrad): d logit = P^T (dP^T - delta) of a consumer's
// step, added to the float32 dbias in global memory.
#pragma once

#include "common/bias.cuh"
#include "common/params.h"
#include "common/ptx.cuh"

namespace jax_flash::sm90 {

// grad[j]: d logit of elements 8 kk + 2 j, + 1 (key dbias_key + 8 (j % 2), queries
// dbias_query + 8 (j / 2) + 0, 1 of the kk-th 16). Where the keys of a row lie in aligned fours,
// the four lanes holding four adjacent keys exchange their values (a 4 x 4 transpose across
// lanes 4 apart), so that each adds four keys of one query in one request: a quarter of the
// requests of one add an element, which held the learned-bias backward at 1.5x the other's.
// Otherwise each element is added alone, from this thread's first element's address and
// constant multiples of the strides (addresses computed per element spilled more). Masked
// elements (P = 0) add nothing.
__device__ __forceinline__ void add_bias_grad(const BiasGrad& dbias, const BwdParams& p, const float2 (&grad)[4],
                                              int kk, int lane, int dbias_query, int dbias_key) {
  if (dbias.in_fours(p.seqlen_k)) {
    const int g = (lane / 4) % 4;  // which of the four lanes; queries m = 0..3 of each
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      uint32_t v[4] = {__float_as_uint(grad[r].x), __float_as_uint(grad[r].y), __float_as_uint(grad[r + 2].x),
                       __float_as_uint(grad[r + 2].y)};
      ptx::transpose_4x4(v, g, 4);  // now keys 0..3 of query m = g
      const int q = dbias_query + kk * 16 + (g % 2) + 8 * (g / 2), k = dbias_key - g + 8 * r;
      const bool any = (v[0] | v[1] | v[2] | v[3]) << 1;  // not all +-0
      if (any && q < p.seqlen_q && k < p.seqlen_k) {
        ptx::red_add_f32x4(dbias.dbias + q * dbias.row + k, __uint_as_float(v[0]), __uint_as_float(v[1]),
                           __uint_as_float(v[2]), __uint_as_float(v[3]));
      }
    }
    return;
  }
  float* at = dbias.dbias + dbias_query * dbias.row + dbias_key * dbias.col + kk * 16 * dbias.row;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int r = j % 2, q = dbias_query + kk * 16 + 8 * (j / 2);
    float* const row = at + 8 * (j / 2) * dbias.row + 8 * r * dbias.col;
    if (dbias_key + 8 * r < p.seqlen_k) {
      if (grad[j].x != 0.f && q < p.seqlen_q) atomicAdd(row, grad[j].x);
      if (grad[j].y != 0.f && q + 1 < p.seqlen_q) atomicAdd(row + dbias.row, grad[j].y);
    }
  }
}

}  // namespace jax_flash::sm90
