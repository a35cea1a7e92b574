// The end of a row's online softmax, the one piece every forward epilogue, decode's tile output
// and decode's combine finish with: from the row's maximum (in units of `unit`, the logits' scale
// or the soft cap) and its sum of exponentials (relative to that maximum), the factor that
// normalises its O (0 for a row that saw nothing visible) and its log-sum-exp (-inf then).
//
// A per-head logit that enters each row's softmax once, beside its keys' (attention sinks:
// FwdParams::sinks, natural-log units) joins in `join_sink`, the one place that reads it: it
// lowers O's factor and raises the lse, and a row with no visible key gets output 0 and lse = the
// sink. Where rows are merged from parts (split-KV decode's splits), only the final merge takes it.
#pragma once

#include <cmath>
#include <cstdint>

namespace jax_flash {

// The sink of a (batch row, query head) of a call with sinks.
template <typename Params>
__device__ __forceinline__ float sink_of(const Params& p, int batch, int head) {
  return p.sinks[batch * p.heads + head];
}

struct RowTotal {
  float sum;
  bool empty;  // nothing visible: output 0, lse -inf (or the sink)

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
  // The factor that normalises O (`inv`: 0 for a row that saw nothing) and the lse (-inf then),
  // from the row's `max` in units of `unit`, without a sink: a part that a merge finishes later.
  __device__ __forceinline__ void finish_part(const float& max, const float& unit, float& inv, float& lse) const {
    inv = empty ? 0.f : 1.f / sum;
    lse = empty ? -INFINITY : max * unit + logf(sum);
  }
  // The same with a sink in the row's softmax (a row that saw nothing: inv 0, lse = the sink).
  // exp(sink - m) may overflow: inv is then 0, its limit; past e^80 the row's own sum (below 2^31)
  // no longer moves the lse in float, which is the sink.
  __device__ __forceinline__ void finish_with_sink(const float& max, const float& unit, const float& sink, float& inv,
                                                   float& lse) const {
    const float m = max * unit, whole = sum + expf(sink - m);
    inv = empty ? 0.f : 1.f / whole;
    lse = empty || sink - m > 80.f ? sink : m + logf(whole);
  }
  // A whole row of (batch, head): with its sink where the call has sinks. The branch depends on
  // the call alone (uniform), and a call without sinks runs the code it ran before they existed
  // (the same bits, no register held for the sink's math). ptxas is touchy here: a sink of -inf
  // in every thread's path cost decode's split kernel 20 registers, and so did its sink read
  // through sink_of rather than in place (decode/tile_output.cuh).
  template <typename Params>
  __device__ __forceinline__ void finish(const float& max, const float& unit, const Params& p, const int& batch,
                                         const int& head, float& inv, float& lse) const {
    if (p.sinks != nullptr) {
      finish_with_sink(max, unit, sink_of(p, batch, head), inv, lse);
    } else {
      finish_part(max, unit, inv, lse);
    }
  }

 private:
  __device__ __forceinline__ RowTotal(const float& row_sum, bool is_empty) : sum(row_sum), empty(is_empty) {}
};

}  // namespace jax_flash
