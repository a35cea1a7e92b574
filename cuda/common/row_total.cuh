// The end of a row's online softmax, shared by every forward epilogue: the row's sum of
// exponentials (a quad's four threads each hold a part, in the accumulator layout), the factor
// that normalises its O (0 for a row that saw nothing visible) and its log-sum-exp (-inf then).
#pragma once

#include <cmath>

namespace jax_flash {

struct RowTotal {
  float sum;
  bool empty;  // nothing visible: output 0, lse -inf

  __device__ __forceinline__ explicit RowTotal(const float& thread_sum) : sum(thread_sum) {
    sum += __shfl_xor_sync(0xffffffff, sum, 1);
    sum += __shfl_xor_sync(0xffffffff, sum, 2);
    empty = sum == 0.f;
  }
  // The whole row from this part and another's sum (the wide forward's consumers each sum half
  // of a block's keys).
  __device__ __forceinline__ RowTotal plus(const float& other_sum) const {
    RowTotal whole = *this;
    whole.sum += other_sum;
    whole.empty = whole.sum == 0.f;
    return whole;
  }
  __device__ __forceinline__ float inv() const { return empty ? 0.f : 1.f / sum; }
  // max: the row's maximum in units of `unit` (the logits' scale, or the soft cap).
  __device__ __forceinline__ float lse(const float& max, const float& unit) const {
    return empty ? -INFINITY : max * unit + logf(sum);
  }
};

}  // namespace jax_flash
