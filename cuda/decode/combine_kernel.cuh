// The combine step of split-KV decode: for each output row ([B, T, N] order), the splits' parts
// (each normalised over its own keys) weighed by exp(lse_split - lse), with
// lse = log(sum exp(lse_split)). One warp a row, four columns a lane.
#pragma once

#include <cmath>

#include "common/ptx.cuh"
#include "decode/params.h"

namespace jax_flash::decode {

constexpr int kCombineWarps = 4;

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kCombineWarps * 32) combine_kernel(const DecodeParams p) {
  __shared__ float weights[kCombineWarps][kMaxDecodeSplits];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t rows = int64_t(p.batch) * p.seqlen_q * p.heads;
  const int64_t row = int64_t(blockIdx.x) * kCombineWarps + warp;
  if (row >= rows) return;  // the whole warp: no barrier follows

  float max = -INFINITY;
  for (int s = lane; s < p.splits; s += 32) max = fmaxf(max, p.lse_partial[s * rows + row]);
#pragma unroll
  for (int mask = 16; mask >= 1; mask /= 2) max = fmaxf(max, __shfl_xor_sync(0xffffffff, max, mask));
  float sum = 0.f;
  for (int s = lane; s < p.splits; s += 32) {
    const float weight = max == -INFINITY ? 0.f : __expf(p.lse_partial[s * rows + row] - max);
    weights[warp][s] = weight;
    sum += weight;
  }
#pragma unroll
  for (int mask = 16; mask >= 1; mask /= 2) sum += __shfl_xor_sync(0xffffffff, sum, mask);
  __syncwarp();

  const float inv = sum > 0.f ? 1.f / sum : 0.f;  // a row that saw no key: output 0
  // The splits' loads issued eight at a time (no branch in the loop, so that they unroll): the
  // combine is a chain of L2 round trips, not bandwidth. An empty split's part is 0 (weight 0).
  for (int col = lane * 4; col < kHeadDim; col += 128) {
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    const float* part = p.o_partial + row * kHeadDim + col;
#pragma unroll 8
    for (int s = 0; s < p.splits; ++s) {
      const float weight = weights[warp][s] * inv;
      const float4 x = *reinterpret_cast<const float4*>(part + s * rows * kHeadDim);
      o.x += weight * x.x, o.y += weight * x.y, o.z += weight * x.z, o.w += weight * x.w;
    }
    const uint2 packed{ptx::pack2<T>(o.x, o.y), ptx::pack2<T>(o.z, o.w)};
    *reinterpret_cast<uint2*>(static_cast<T*>(p.o) + row * kHeadDim + col) = packed;
  }
  if (lane == 0) {
    const int64_t tokens = int64_t(p.seqlen_q) * p.heads;
    const int64_t batch = row / tokens, query = (row / p.heads) % p.seqlen_q, head = row % p.heads;
    p.lse[(batch * p.heads + head) * p.seqlen_q + query] = sum > 0.f ? max + logf(sum) : -INFINITY;
  }
}

}  // namespace jax_flash::decode
