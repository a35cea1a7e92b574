// The combine step of split-KV decode, a kernel of its own launched right after the split kernel:
// one warp per output row (b, t, n) weighs every split's part (each normalised over its own keys)
// by exp(lse_split - lse), with lse = log(sum exp(lse_split)). On sm_90 it is a programmatic
// dependent launch: its CTAs start while the split kernel runs and wait for its memory there.
// Its cost is latency (two L2 round trips once the split kernel ends): the first splits' parts
// load together with the lse, and each further chunk of splits in one round trip.
#pragma once

#include <cmath>

#include "common/ptx.cuh"
#include "common/row_total.cuh"
#include "decode/params.h"

namespace jax_flash::decode {

constexpr int kCombineWarps = 4;

// x = p[0, kColumns), in 16- or 8-byte loads where the columns allow (p is then aligned: a row
// of kHeadDim floats, a lane's columns from lane * kColumns).
template <int kColumns>
__device__ __forceinline__ void load_columns(const float* p, float (&x)[kColumns]) {
  if constexpr (kColumns % 4 == 0) {
#pragma unroll
    for (int c = 0; c < kColumns; c += 4) {
      const float4 v = __ldcg(reinterpret_cast<const float4*>(p + c));
      x[c] = v.x, x[c + 1] = v.y, x[c + 2] = v.z, x[c + 3] = v.w;
    }
  } else if constexpr (kColumns % 2 == 0) {
#pragma unroll
    for (int c = 0; c < kColumns; c += 2) {
      const float2 v = __ldcg(reinterpret_cast<const float2*>(p + c));
      x[c] = v.x, x[c + 1] = v.y;
    }
  } else {
#pragma unroll
    for (int c = 0; c < kColumns; ++c) x[c] = __ldcg(p + c);
  }
}

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kCombineWarps * 32) combine_kernel(const DecodeParams p) {
  constexpr int kSplitsPerLane = kMaxDecodeSplits / 32;
  constexpr int kColumns = kHeadDim / 32;  // of each lane: [lane * kColumns, + kColumns)
  constexpr int kChunk = kColumns <= 4 ? 16 : 8;  // splits whose parts are in flight at once
  static_assert(kMaxDecodeSplits % 32 == 0 && kHeadDim % 32 == 0, "whole lanes of splits and columns");
  __shared__ float weights[kCombineWarps][kMaxDecodeSplits];
  ptx::wait_for_prior_grids();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t rows = int64_t(p.batch) * p.seqlen_q * p.heads;
  const int64_t row = int64_t(blockIdx.x) * kCombineWarps + warp;  // [B, T, N] order
  if (row >= rows) return;
  const float* part = p.o_partial + row * kHeadDim + lane * kColumns;
  const int64_t split_stride = rows * kHeadDim;
  float x[kChunk][kColumns];
  auto load_chunk = [&](int first) {
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      if (first + j < p.splits) load_columns(part + (first + j) * split_stride, x[j]);
    }
  };
  load_chunk(0);

  // Lane l weighs splits l, l + 32, ...; the weights go to shared memory for the whole warp.
  float lse[kSplitsPerLane], max = -INFINITY;
#pragma unroll
  for (int i = 0; i < kSplitsPerLane; ++i) {
    const int split = lane + 32 * i;
    lse[i] = split < p.splits ? __ldcg(p.lse_partial + split * rows + row) : -INFINITY;
    max = fmaxf(max, lse[i]);
  }
  max = ptx::warp_max(max);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kSplitsPerLane; ++i) {
    lse[i] = max == -INFINITY ? 0.f : __expf(lse[i] - max);  // an empty split (lse -inf) weighs 0
    sum += lse[i];
  }
  sum = ptx::warp_sum(sum);
  const RowTotal total = RowTotal::whole(sum);  // the splits' lse are natural logarithms: unit 1
  float inv, row_lse;
  total.finish(max, 1.f, p, int(row / (int64_t(p.heads) * p.seqlen_q)), int(row % p.heads), inv, row_lse);
#pragma unroll
  for (int i = 0; i < kSplitsPerLane; ++i) weights[warp][lane + 32 * i] = lse[i] * inv;
  __syncwarp();

  float o[kColumns] = {};
  for (int first = 0;; first += kChunk) {
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      if (first + j < p.splits) {
        const float w = weights[warp][first + j];
#pragma unroll
        for (int c = 0; c < kColumns; ++c) o[c] += w * x[j][c];
      }
    }
    if (first + kChunk >= p.splits) break;
    load_chunk(first + kChunk);
  }
  T* out = static_cast<T*>(p.o) + row * kHeadDim + lane * kColumns;
#pragma unroll
  for (int c = 0; c < kColumns; ++c) out[c] = T(o[c]);
  if (lane == 0) {
    const int64_t head = row % p.heads, query = (row / p.heads) % p.seqlen_q, batch = row / (int64_t(p.heads) * p.seqlen_q);
    p.lse[(batch * p.heads + head) * p.seqlen_q + query] = row_lse;
  }
}

}  // namespace jax_flash::decode
