// The Hopper forward's online softmax of a consumer thread's two rows over one tile's key blocks:
// each block's S (capped and masked by the kernel) becomes P in place, and O's rescale factors
// come out. Two forms: exact (the rows' maxima first, then exp2 against them) and speculative
// (exp2 against the rows' running maxima at once, settled afterwards; H15).
#pragma once

#include <cmath>

#include "common/ptx.cuh"
#include "common/softmax_rows.cuh"

namespace jax_flash::sm90 {

template <int kSRegs, int kExp2OnFmaQuarters, typename Logits>
struct FwdSoftmax {
  // Lazy rescale (FlashAttention-4's): a row keeps its old max, and O its scale, unless a block
  // exceeds it by more than this (exp2 units), so exp2 gives at most 2^8.
  static constexpr float kLazyRescaleLog2 = 8.f;
  static constexpr float kMaxP = 1 << int(kLazyRescaleLog2);
  // An element past 2^120 is lost (past 2^128 it is inf, and 1 / it flushes to 0 from 2^126).
  static constexpr float kLostP = 0x1p120f;

  const Logits& logits;
  const float scale_log2;
  // The rows' state, kept by the kernel (-inf and 0 at a tile's start).
  float (&row_max)[2];
  float (&row_sum)[2];  // this thread's columns

  // A row that has seen nothing visible keeps max -inf: shift by 0 so exp2 gives 0, not NaN.
  __device__ __forceinline__ float shift_of(int r) const {
    return row_max[r] == -INFINITY ? 0.f : row_max[r] * scale_log2;
  }
  __device__ __forceinline__ float exponentiate(float (&s)[kSRegs], int r, float shift, bool capped) const {
    return sm90::exponentiate<kExp2OnFmaQuarters>(s, r, shift, capped, logits, scale_log2);
  }

  // Exact: S (masked) becomes exp2(S - max) in place, against the maxima with this block's.
  __device__ __forceinline__ void exact(float (&s)[kSRegs], float (&rescale)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float block_max = fmaxf(row_max[r], block_row_max(s, r));
      // The comparison is false (inf or NaN) while the row has seen nothing visible.
      const bool keep = (block_max - row_max[r]) * scale_log2 <= kLazyRescaleLog2;
      const float old_max = row_max[r];
      if (!keep) row_max[r] = block_max;
      const float shift = shift_of(r);
      rescale[r] = keep ? 1.f : ptx::exp2(old_max * scale_log2 - shift);
      row_sum[r] = row_sum[r] * rescale[r] + exponentiate(s, r, shift, false);
    }
  }

  // Whether the speculative form may run: every row of the warp has a max (against a shift of 0,
  // a block's logits could all flush to 0).
  __device__ __forceinline__ bool warp_has_maxima() const {
    return __all_sync(0xffffffff, row_max[0] != -INFINITY && row_max[1] != -INFINITY);
  }
  // Speculative, first half: row r of S becomes exp2 against the running max; capped: S holds raw
  // scores, whose tanh is taken in the same pass. Returns this thread's sum of the row.
  __device__ __forceinline__ float speculate(float (&s)[kSRegs], int r, bool capped) const {
    return exponentiate(s, r, row_max[r] * scale_log2, capped);
  }
  // Speculative, second half, given the rows' sums. Where no thread's sum of a row exceeds 2^8 (so
  // no element does: the bound the exact form keeps), the block is done: accept() adds the sums.
  __device__ __forceinline__ bool within_bound(const float (&sum)[2]) const {
    return __all_sync(0xffffffff, sum[0] <= kMaxP && sum[1] <= kMaxP);
  }
  __device__ __forceinline__ void accept(const float (&sum)[2], float (&rescale)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      rescale[r] = 1.f;
      row_sum[r] += sum[r];
    }
  }
  // Otherwise the warp takes the maxima of what it computed and scales each row past 2^8 down.
  // Returns whether an element of the warp's was lost (past 2^120): the tile must be computed
  // again exactly.
  __device__ __forceinline__ bool scale_down(float (&s)[kSRegs], float (&sum)[2], float (&rescale)[2]) {
    bool lost = false;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m = block_row_max(s, r);  // in units of 2^shift
      lost |= !(m < kLostP);
      rescale[r] = 1.f;
      if (m > kMaxP && m < kLostP) {
        rescale[r] = 1.f / m;
        row_max[r] += __log2f(m) / scale_log2;
        sum[r] *= rescale[r];
#pragma unroll
        for (int n8 = 0; n8 < kSRegs / 4; ++n8)
#pragma unroll
          for (int c = 0; c < 2; ++c) s[4 * n8 + 2 * r + c] *= rescale[r];
      }
      row_sum[r] = row_sum[r] * rescale[r] + sum[r];
    }
    return __any_sync(0xffffffff, lost);
  }
};

}  // namespace jax_flash::sm90
