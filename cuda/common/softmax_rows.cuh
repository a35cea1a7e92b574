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

// Row r of S becomes exp2(S * scale_log2 - shift) in place; returns this thread's sum of the row.
// capped (a constant at each call): S holds raw scores, whose tanh (`logits`, logits.cuh) is taken
// in the same pass. kExp2OnFmaQuarters of each four elements take their exp2 on the FMA pipe
// (ptx::exp2_on_fma) instead of the MUFU (H27).
template <int kExp2OnFmaQuarters, typename Logits, int kSRegs>
__device__ __forceinline__ float exponentiate(float (&s)[kSRegs], int r, float shift, bool capped, const Logits& logits,
                                              float scale_log2) {
  float sum = 0.f;
#pragma unroll
  for (int n8 = 0; n8 < kSRegs / 4; ++n8)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float& x = s[4 * n8 + 2 * r + c];
      const float arg = (capped ? logits.value(x) : x) * scale_log2 - shift;
      x = (2 * n8 + c) % 4 < kExp2OnFmaQuarters ? ptx::exp2_on_fma(arg) : ptx::exp2(arg);
      sum += x;
    }
  return sum;
}

// O's rows scaled by rescale[r] (the accumulator layout of S, in chunks); skipped by a warp whose
// rows all kept their max (the usual case once a row has seen a few blocks).
template <int kChunks, int kORegs>
__device__ __forceinline__ void rescale_o(float (&o)[kChunks][kORegs], const float (&rescale)[2]) {
  if (!__any_sync(0xffffffff, rescale[0] != 1.f || rescale[1] != 1.f)) return;
#pragma unroll
  for (int c = 0; c < kChunks; ++c)
#pragma unroll
    for (int i = 0; i < kORegs; ++i) o[c][i] *= rescale[(i % 4) / 2];
}

}  // namespace jax_flash::sm90
