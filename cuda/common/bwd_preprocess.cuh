// The first kernel of every backward: the per-row statistics the main kernels read, a zeroed dQ
// accumulator and zeroed dQ turn or ticket counters (XLA hands us uninitialised output buffers).
// The accumulator has B * N * stats_stride * H floats (params.h), which each kernel family lays
// out its own way, so it is zeroed whole, H floats per statistics row; dq_accum = nullptr skips it
// (the d = 192 and 256 wgmma backward writes dq without one), and so do dQ tickets (params.h: the first
// part of each block is stored, not added).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "common/params.h"
#include "common/ptx.cuh"
#include "generated/contract.h"

namespace jax_flash {

// Lanes of a warp per statistics row [batch, head, q] (q < stats_stride), each reading one 16-byte
// chunk of the row's dO and O: delta = rowsum(dO * O) - dlse (dlse: the cotangent of the returned
// log-sum-exp, whose derivative is P; none when the lse was not used) and lse in base 2; rows past
// T get the values that make P = 0 and dS = 0 there. The rows go in the order of dO and O in memory,
// [batch, q, head], so that a warp reads whole runs of them: kRowsPerPass rows at once (all its
// lanes busy at H = 64 and 128), kPasses passes, whose loads it issues before any sum (B32).
template <int kHeadDim>
struct BwdPreprocessShape {
  static constexpr int kChunks = kHeadDim / 8;
  static_assert(kChunks <= 32, "one 16-byte chunk per lane");
  static constexpr int kLanesPerRow = kChunks <= 4 ? 4 : kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;
  static constexpr int kRowsPerPass = 32 / kLanesPerRow;
  static constexpr int kPasses = 2;
  static constexpr int kWarps = 8;
  static constexpr int kRowsPerBlock = kWarps * kRowsPerPass * kPasses;
};

// kFamily (75, 80 or 90): the kernel family that launches it. Each family's files compile for
// their own targets (CMakeLists.txt), so each needs its own copy of this kernel, a symbol of its own:
// copies of one symbol compiled for different targets would leave which one runs to the linker.
template <typename T, int kHeadDim, int kFamily>
__global__ void __launch_bounds__(32 * BwdPreprocessShape<kHeadDim>::kWarps) bwd_preprocess(const BwdParams p) {
  using Shape = BwdPreprocessShape<kHeadDim>;
  constexpr int kChunks = Shape::kChunks, kLanesPerRow = Shape::kLanesPerRow, kPasses = Shape::kPasses;
  constexpr float kLog2e = 1.4426950408889634f;
  const int lane = threadIdx.x % 32, chunk = lane % kLanesPerRow;
  // Each batch row's rows take whole blocks (one division a thread, 32-bit).
  const int rows = p.stats_stride * p.heads;  // of a batch row
  const int blocks_per_batch = (rows + Shape::kRowsPerBlock - 1) / Shape::kRowsPerBlock;
  const int batch = blockIdx.x / blocks_per_batch, block = blockIdx.x - batch * blocks_per_batch;
  // Pass i's row, in memory order: consecutive within a pass, passes kRowsPerPass apart. Its q and
  // head are stepped from the first pass's, not divided out each time (the 64-bit divisions by
  // row counts made this pass bound by its instructions).
  struct Row {
    int index, q, head;  // index: in memory order, q * heads + head
  };
  Row r0;
  r0.index = (block * Shape::kWarps + threadIdx.x / 32) * Shape::kRowsPerPass * kPasses + lane / kLanesPerRow;
  r0.q = r0.index / p.heads, r0.head = r0.index - r0.q * p.heads;
  auto row_of = [&](int pass) {
    Row r = r0;
    r.index += pass * Shape::kRowsPerPass;
    r.head += pass * Shape::kRowsPerPass;
    while (r.head >= p.heads) r.head -= p.heads, ++r.q;
    return r;
  };
  // Its index in the statistics, [batch, head, q].
  auto stats_of = [&](const Row& r) { return (int64_t(batch) * p.heads + r.head) * p.stats_stride + r.q; };

  uint4 o[kPasses], d[kPasses];
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const Row r = row_of(pass);
    o[pass] = d[pass] = make_uint4(0, 0, 0, 0);
    if (r.index < rows && r.q < p.seqlen_q && chunk < kChunks) {
      const int64_t offset = ((int64_t(batch) * p.seqlen_q + r.q) * p.heads + r.head) * kHeadDim + chunk * 8;
      o[pass] = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.o) + offset);
      d[pass] = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.dout) + offset);
    }
  }
  int* const counters = p.dq_turns != nullptr ? p.dq_turns : p.dq_tickets;
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const Row r = row_of(pass);
    if (r.index >= rows) break;
    constexpr int kCounterRows = contract::kDqCounterRows;
    if (counters != nullptr && r.q % kCounterRows == 0 && chunk == 0) counters[stats_of(r) / kCounterRows] = 0;
    // The accumulator is zeroed whole, so in memory order too.
    if (p.dq_accum != nullptr && p.dq_tickets == nullptr && chunk < kChunks) {
      float4* acc = reinterpret_cast<float4*>(p.dq_accum + (int64_t(batch) * rows + r.index) * kHeadDim + chunk * 8);
      acc[0] = make_float4(0.f, 0.f, 0.f, 0.f);
      acc[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const uint32_t os[4] = {o[pass].x, o[pass].y, o[pass].z, o[pass].w};
    const uint32_t ds[4] = {d[pass].x, d[pass].y, d[pass].z, d[pass].w};
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 a = ptx::unpack2<T>(os[i]), b = ptx::unpack2<T>(ds[i]);
      sum += a.x * b.x + a.y * b.y;
    }
#pragma unroll
    for (int mask = kLanesPerRow / 2; mask > 0; mask /= 2) sum += __shfl_xor_sync(0xffffffff, sum, mask);
    const Row r = row_of(pass);
    if (chunk != 0 || r.index >= rows) continue;
    const int64_t stats = stats_of(r);
    if (r.q >= p.seqlen_q) {
      p.delta[stats] = 0.f, p.lse_log2[stats] = INFINITY;
      continue;
    }
    const int64_t index = (int64_t(batch) * p.heads + r.head) * p.seqlen_q + r.q;  // into lse and dlse [B, N, T]
    const float lse = p.lse[index];
    p.delta[stats] = p.dlse == nullptr ? sum : sum - p.dlse[index];
    // A row that sees no key has lse = -inf; +inf makes its P = exp2(s - lse) = 0, not NaN.
    p.lse_log2[stats] = lse == -INFINITY ? INFINITY : lse * kLog2e;
  }
}

template <typename T, int kHeadDim, int kFamily>
cudaError_t launch_bwd_preprocess(const BwdParams& p, cudaStream_t stream) {
  using Shape = BwdPreprocessShape<kHeadDim>;
  const int64_t rows = int64_t(p.stats_stride) * p.heads;  // a batch row's
  const int64_t blocks = (rows + Shape::kRowsPerBlock - 1) / Shape::kRowsPerBlock * p.batch;
  if (rows > INT32_MAX || blocks > INT32_MAX) return cudaErrorInvalidValue;
  bwd_preprocess<T, kHeadDim, kFamily><<<blocks, 32 * Shape::kWarps, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_flash
