// The end of a row's online softmax, the one piece every forward epilogue, decode's tile output
// and decode's combine finish with: from the row's maximum (in units of `unit`, the logits' scale
// or the soft cap) and its sum of exponentials (relative to that maximum), the factor that
// normalises its O (0 for a row that saw nothing visible) and its log-sum-exp (-inf then).
//
// A per-head logit that enters each row's softmax once, beside its keys' (attention sinks), is
// the `extra` argument: a type with kPresent and logit() (in the same natural-log units as
// max * unit). It adds exp(extra - max * unit) to the sum, so it lowers O's factor and raises
// the lse, and a row with no visible key gets output 0 and lse = extra. NoExtraLogit is none
// (the code is then what it was without the argument). Every finish takes it from
// extra_logit(p, head), the one place that reads it from the call's parameters; where rows are
// merged from parts (split-KV decode's splits), only the final merge passes it.
#pragma once

#include <cmath>

namespace jax_flash {

struct NoExtraLogit {
  static constexpr bool kPresent = false;
  __device__ __forceinline__ float logit() const { return -INFINITY; }
};

// The extra logit of a head of the call, for every finish: none yet.
template <typename Params>
__device__ __forceinline__ NoExtraLogit extra_logit(const Params& p, int head) {
  (void)p, (void)head;
  return {};
}

// The extra logit where `take` (a merge's last step), none where not (a part that a later merge
// finishes): one type either way, so that the finish is computed once.
template <typename Params>
__device__ __forceinline__ auto extra_logit_if(bool take, const Params& p, int head) {
  (void)take;
  return extra_logit(p, head);
}

struct RowTotal {
  float sum;
  bool empty;  // nothing visible: output 0, lse -inf (or the extra logit)

  // From a quad's four parts (the accumulator layout: each of a quad's threads holds a part).
  __device__ __forceinline__ explicit RowTotal(const float& thread_sum) : sum(thread_sum) {
    sum += __shfl_xor_sync(0xffffffff, sum, 1);
    sum += __shfl_xor_sync(0xffffffff, sum, 2);
    empty = sum == 0.f;
  }
  // From a row's whole sum (decode's merges, which sum each row in one thread).
  __device__ __forceinline__ static RowTotal whole(const float& row_sum) { return RowTotal(row_sum, !(row_sum > 0.f)); }
  // The whole row from this part and another's sum (the wide forward's consumers each sum half
  // of a block's keys).
  __device__ __forceinline__ RowTotal plus(const float& other_sum) const {
    RowTotal whole = *this;
    whole.sum += other_sum;
    whole.empty = whole.sum == 0.f;
    return whole;
  }
  // The factor that normalises O. `max` and `unit` as for lse (unused without an extra logit).
  template <typename Extra = NoExtraLogit>
  __device__ __forceinline__ float inv(const float& max, const float& unit, const Extra& extra = {}) const {
    if constexpr (Extra::kPresent) {
      return empty ? 0.f : 1.f / (sum + expf(extra.logit() - max * unit));
    } else {
      (void)max, (void)unit;
      return empty ? 0.f : 1.f / sum;
    }
  }
  template <typename Extra = NoExtraLogit>
  __device__ __forceinline__ float lse(const float& max, const float& unit, const Extra& extra = {}) const {
    if constexpr (Extra::kPresent) {
      const float e = extra.logit(), m = max * unit, top = fmaxf(m, e);
      return empty ? e : top + logf(sum * expf(m - top) + expf(e - top));
    } else {
      return empty ? -INFINITY : max * unit + logf(sum);
    }
  }

 private:
  __device__ __forceinline__ RowTotal(const float& row_sum, bool is_empty) : sum(row_sum), empty(is_empty) {}
};

}  // namespace jax_flash
