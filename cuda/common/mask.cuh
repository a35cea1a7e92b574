// The band mask shared by every kernel: causal attention and local windows, bottom-right aligned.
#pragma once

#include "common/params.h"

namespace jax_flash {

// Key j is visible to query i when j < seqlen_k and
//   -left <= j - (i + offset) <= right   (offset = seqlen_k - seqlen_q; -1 = unbounded side).
struct Band {
  int offset, left, right, seqlen_k;

  __device__ static Band from(const FwdParams& p) {
    return {p.seqlen_k - p.seqlen_q, p.window_left, p.window_right, p.seqlen_k};
  }
  __device__ __forceinline__ bool visible(int q, int k) const {
    const int rel = k - q - offset;
    return k < seqlen_k && (right < 0 || rel <= right) && (left < 0 || rel >= -left);
  }
  // Keys [key_begin(q_first), key_end(q_last)) hold everything rows q_first..q_last can see.
  __device__ __forceinline__ int key_begin(int q_first) const {
    return left < 0 ? 0 : max(0, q_first + offset - left);
  }
  __device__ __forceinline__ int key_end(int q_last) const {
    return right < 0 ? seqlen_k : max(0, min(seqlen_k, q_last + offset + right + 1));
  }
  // Queries [query_begin(k_first), query_end(k_last)) hold every row that keys k_first..k_last
  // are visible to (for the backward, which walks query blocks per key block).
  __device__ __forceinline__ int query_begin(int k_first, int seqlen_q) const {
    return right < 0 ? 0 : min(seqlen_q, max(0, k_first - offset - right));
  }
  __device__ __forceinline__ int query_end(int k_last, int seqlen_q) const {
    return left < 0 ? seqlen_q : max(0, min(seqlen_q, k_last - offset + left + 1));
  }
  // True when every pair of rows [q0, q1] x keys [k0, k1] is visible: no masking needed.
  __device__ __forceinline__ bool all_visible(int q0, int q1, int k0, int k1) const {
    return k1 < seqlen_k && (right < 0 || k1 - q0 - offset <= right) &&
           (left < 0 || k0 - q1 - offset >= -left);
  }
};

}  // namespace jax_flash
