// The first kernel of every backward: the per-row statistics the main kernels read, a zeroed dQ
// accumulator and zeroed dQ turn or ticket counters (XLA hands us uninitialised output buffers).
// The accumulator has B * N * stats_stride * H floats (params.h), which each kernel family lays
// out its own way, so it is zeroed whole, H floats per statistics row; dq_accum = nullptr skips it
// (the d = 256 wgmma backward writes dq without one), and so do dQ tickets (params.h: the first
// part of each block is stored, not added).
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "common/params.h"
#include "common/ptx.cuh"

namespace jax_flash {

// One warp per statistics row [batch, head, q] (q < stats_stride): delta = rowsum(dO * O) - dlse
// (dlse: the cotangent of the returned log-sum-exp, whose derivative is P; none when the lse was
// not used) and lse in base 2; rows past T get the values that make P = 0 and dS = 0 there.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(128) bwd_preprocess(const BwdParams p) {
  constexpr int kChunks = kHeadDim / 8;
  static_assert(kChunks <= 32, "one 16-byte chunk per lane");
  constexpr float kLog2e = 1.4426950408889634f;
  const int64_t row = int64_t(blockIdx.x) * 4 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= int64_t(p.batch) * p.heads * p.stats_stride) return;
  const int q = row % p.stats_stride;
  const int64_t batch_head = row / p.stats_stride;
  int* const counters = p.dq_turns != nullptr ? p.dq_turns : p.dq_tickets;
  if (counters != nullptr && q % 64 == 0 && lane == 0) counters[row / 64] = 0;
  if (p.dq_accum != nullptr && p.dq_tickets == nullptr && lane < kChunks) {
    float4* acc = reinterpret_cast<float4*>(p.dq_accum + row * kHeadDim + lane * 8);
    acc[0] = make_float4(0.f, 0.f, 0.f, 0.f);
    acc[1] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  if (q >= p.seqlen_q) {
    if (lane == 0) p.delta[row] = 0.f, p.lse_log2[row] = INFINITY;
    return;
  }
  const int head = batch_head % p.heads, batch = batch_head / p.heads;
  float sum = 0.f;
  if (lane < kChunks) {
    const int64_t offset = ((int64_t(batch) * p.seqlen_q + q) * p.heads + head) * kHeadDim + lane * 8;
    const uint4 o = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.o) + offset);
    const uint4 d = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.dout) + offset);
    const uint32_t os[4] = {o.x, o.y, o.z, o.w}, ds[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 a = ptx::unpack2<T>(os[i]), b = ptx::unpack2<T>(ds[i]);
      sum += a.x * b.x + a.y * b.y;
    }
  }
#pragma unroll
  for (int mask = 16; mask > 0; mask /= 2) sum += __shfl_xor_sync(0xffffffff, sum, mask);
  if (lane == 0) {
    const int64_t index = batch_head * p.seqlen_q + q;  // into lse and dlse [B, N, T]
    const float lse = p.lse[index];
    p.delta[row] = p.dlse == nullptr ? sum : sum - p.dlse[index];
    // A row that sees no key has lse = -inf; +inf makes its P = exp2(s - lse) = 0, not NaN.
    p.lse_log2[row] = lse == -INFINITY ? INFINITY : lse * kLog2e;
  }
}

template <typename T, int kHeadDim>
cudaError_t launch_bwd_preprocess(const BwdParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.batch) * p.heads * p.stats_stride;
  bwd_preprocess<T, kHeadDim><<<(rows + 3) / 4, 128, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_flash
