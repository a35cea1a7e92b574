// The combine step of split-KV decode, done by the last split of each row tile to finish: it
// takes a ticket from the tile's counter (zeroed by the handler) after storing its own part, and
// the CTA that draws the last ticket weighs every split's part (each normalised over its own keys)
// by exp(lse_split - lse), with lse = log(sum exp(lse_split)). No second kernel: a launch and its
// gap cost more than this at decode sizes.
#pragma once

#include <cmath>

#include "common/ptx.cuh"
#include "decode/packed_rows.cuh"
#include "decode/params.h"

namespace jax_flash::decode {

// Returns in every CTA but the last of its tile; `smem` is free (the tile's part is stored).
template <typename Cfg>
__device__ __forceinline__ void combine_if_last(const DecodeParams& p, const PackedRows& rows, int batch, char* smem) {
  using T = typename Cfg::T;
  constexpr int kHeadDim = Cfg::kHeadDim, kRows = kDecodeTileRows;
  int* is_last = reinterpret_cast<int*>(smem);
  float* weights = reinterpret_cast<float*>(smem) + 32;  // [row][split]: lse, then weights
  float* row_lse = weights + kRows * kMaxDecodeSplits;     // [row]
  __threadfence();  // this CTA's part is visible to the last CTA before its ticket is
  __syncthreads();
  if (threadIdx.x == 0) {
    const int64_t tile = int64_t(batch) * gridDim.y + blockIdx.y;
    *is_last = atomicAdd(p.split_tickets + tile, 1) == p.splits - 1;
  }
  __syncthreads();
  if (!*is_last) return;
  __threadfence();  // every other split's part, stored before its ticket, is read after ours

  const int64_t rows_per_split = int64_t(p.batch) * p.seqlen_q * p.heads;
  for (int i = threadIdx.x; i < kRows * p.splits; i += Cfg::kThreads) {
    const int row = i / p.splits, split = i % p.splits;
    weights[row * kMaxDecodeSplits + split] =
        rows.valid(row) ? __ldcg(p.lse_partial + split * rows_per_split + rows.output_row(p, batch, row)) : -INFINITY;
  }
  __syncthreads();
  if (threadIdx.x < kRows) {
    float* w = weights + threadIdx.x * kMaxDecodeSplits;
    float max = -INFINITY, sum = 0.f;
    for (int s = 0; s < p.splits; ++s) max = fmaxf(max, w[s]);
    for (int s = 0; s < p.splits; ++s) {
      w[s] = max == -INFINITY ? 0.f : __expf(w[s] - max);  // an empty split (lse -inf) weighs 0
      sum += w[s];
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;  // a row that saw no key: output 0, lse -inf
    for (int s = 0; s < p.splits; ++s) w[s] *= inv;
    row_lse[threadIdx.x] = sum > 0.f ? max + logf(sum) : -INFINITY;
  }
  __syncthreads();

  for (int i = threadIdx.x; i < kRows * (kHeadDim / 4); i += Cfg::kThreads) {
    const int row = i / (kHeadDim / 4), col = (i % (kHeadDim / 4)) * 4;
    if (!rows.valid(row)) continue;
    const int64_t out_row = rows.output_row(p, batch, row);
    const float* part = p.o_partial + out_row * kHeadDim + col;
    const float* w = weights + row * kMaxDecodeSplits;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int s = 0; s < p.splits; ++s) {
      const float4 x = __ldcg(reinterpret_cast<const float4*>(part + s * rows_per_split * kHeadDim));
      o.x += w[s] * x.x, o.y += w[s] * x.y, o.z += w[s] * x.z, o.w += w[s] * x.w;
    }
    const uint2 packed{ptx::pack2<T>(o.x, o.y), ptx::pack2<T>(o.z, o.w)};
    *reinterpret_cast<uint2*>(static_cast<T*>(p.o) + out_row * kHeadDim + col) = packed;
    if (col == 0) p.lse[(int64_t(batch) * p.heads + rows.head(row)) * p.seqlen_q + rows.query(row)] = row_lse[row];
  }
}

}  // namespace jax_flash::decode
