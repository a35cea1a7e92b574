// Row operations on an S accumulator of the Hopper forward (wgmma m64nN, fp32): a thread holds
// two rows r = 0, 1 of its warp's 16, as pairs of adjacent columns s[4 n8 + 2 r], + 1 of each n8
// tile; a row's four threads are a quad (lanes 4i .. 4i + 3).
#pragma once

#include <cmath>
#include <cstdint>

#include "common/ptx.cuh"

namespace jax_flash::sm90 {

// The maximum of row r over the block (its quad's columns).
template <int kSRegs>
__device__ __forceinline__ float block_row_max(const float (&s)[kSRegs], int r) {
  float m = -INFINITY;
#pragma unroll
  for (int n8 = 0; n8 < kSRegs / 4; ++n8) m = fmaxf(m, fmaxf(s[4 * n8 + 2 * r], s[4 * n8 + 2 * r + 1]));
  m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, 1));
  return fmaxf(m, __shfl_xor_sync(0xffffffff, m, 2));
}

// This thread's sum of row r.
template <int kSRegs>
__device__ __forceinline__ float thread_row_sum(const float (&s)[kSRegs], int r) {
  float sum = 0.f;
#pragma unroll
  for (int n8 = 0; n8 < kSRegs / 4; ++n8) sum += s[4 * n8 + 2 * r] + s[4 * n8 + 2 * r + 1];
  return sum;
}

// P as the A fragments of the k16 steps over the block's keys (n8 tiles 2kk and 2kk + 1: the
// accumulator and A layouts agree thread for thread).
template <typename T, int kSRegs>
__device__ __forceinline__ void to_operand(const float (&s)[kSRegs], uint32_t (&pa)[kSRegs / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < kSRegs / 8; ++kk)
#pragma unroll
    for (int i = 0; i < 4; ++i) pa[kk][i] = ptx::pack2<T>(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
}

}  // namespace jax_flash::sm90
