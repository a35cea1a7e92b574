// Which (query, key) pairs take part, shared by every kernel: the band (causal attention and local
// windows, bottom-right aligned), per-batch sequence lengths and segment ids (packed documents).
#pragma once

#include <type_traits>

#include "common/params.h"

namespace jax_flash {

struct Range {
  int begin, end;
};

// The mask of one batch row. Key j is visible to query i when i < seqlen_q, j < seqlen_k,
//   -left <= j - (i + offset) <= right   (-1 = unbounded side; offset: the tensors' S - T, or this
// row's seqlen_k - seqlen_q with FwdParams::diagonal_by_lengths, the one place that rule is read),
// and, with segment ids, q_seg[i] == kv_seg[j]. Segments also bound the blocks a kernel visits:
// MaskChunk ranges (params.h) computed on the host side say which keys a 64-row chunk of queries
// can see and the reverse, so that blocks of other documents are skipped, not just masked.
struct Band {
  int offset, seqlen_q, seqlen_k, left, right;
  // This batch row's segment ids and chunks; nullptr: none.
  const int* q_seg;
  const int* kv_seg;
  const MaskChunk* q_chunks;
  const MaskChunk* kv_chunks;
  // Rows past seqlen_q must be masked: only with lengths, where they may lie inside the tensor
  // (rows past T are never written; the backward gives rows past the length lse = -inf).
  bool mask_rows;

  // kMasked = false: p has no lengths or segment ids (the dispatch checked), so none are read and
  // the constant nullptrs compile the segment code out.
  template <bool kMasked>
  __device__ static Band from(const FwdParams& p, int batch) {
    if (!kMasked) return with_lengths<false>(p, batch, p.seqlen_q, p.seqlen_k);
    return with_lengths<true>(p, batch, p.seqlens ? p.seqlens[2 * batch] : p.seqlen_q,
                              p.seqlens ? p.seqlens[2 * batch + 1] : p.seqlen_k);
  }
  // The same, with this batch row's lengths already read (the forward's producer passes them on).
  template <bool kMasked>
  __device__ static Band with_lengths(const FwdParams& p, int batch, int seqlen_q, int seqlen_k) {
    if (!kMasked) {
      return {p.seqlen_k - p.seqlen_q, p.seqlen_q, p.seqlen_k, p.window_left, p.window_right,
              nullptr, nullptr, nullptr, nullptr, false};
    }
    const bool segments = p.q_segments != nullptr;
    const int q_chunks = (p.seqlen_q + kMaskChunk - 1) / kMaskChunk;
    const int kv_chunks = (p.seqlen_k + kMaskChunk - 1) / kMaskChunk;
    return {p.diagonal_by_lengths ? seqlen_k - seqlen_q : p.seqlen_k - p.seqlen_q,
            seqlen_q,
            seqlen_k,
            p.window_left,
            p.window_right,
            segments ? p.q_segments + int64_t(batch) * p.seqlen_q : nullptr,
            segments ? p.kv_segments + int64_t(batch) * p.seqlen_k : nullptr,
            segments ? p.q_chunks + int64_t(batch) * q_chunks : nullptr,
            segments ? p.kv_chunks + int64_t(batch) * kv_chunks : nullptr,
            true};
  }
  __device__ __forceinline__ bool segments() const { return q_seg != nullptr; }
  __device__ __forceinline__ Band masking_rows() const {
    Band band = *this;
    band.mask_rows = true;
    return band;
  }
  __device__ __forceinline__ Band without_segments() const {
    return {offset, seqlen_q, seqlen_k, left, right, nullptr, nullptr, nullptr, nullptr, mask_rows};
  }

  // The kernels mask a tile row by row: query q sees keys [keys_seen_by(q)) (and key k is seen by
  // queries [queries_seeing(k))), then, with segment ids, only those of its segment. Two compares
  // an element instead of the whole band test keeps the mask's registers low.
  __device__ __forceinline__ Range keys_seen_by(int q) const {
    if (mask_rows && q >= seqlen_q) return {0, 0};
    return {left < 0 ? 0 : q + offset - left, right < 0 ? seqlen_k : min(seqlen_k, q + offset + right + 1)};
  }
  __device__ __forceinline__ Range queries_seeing(int k) const {
    if (k >= seqlen_k) return {0, 0};
    return {right < 0 ? 0 : k - offset - right, left < 0 ? seqlen_q : min(seqlen_q, k - offset + left + 1)};
  }
  // A kernel's mask loop, unswitched: fn(std::true_type{}) with segment ids, fn(std::false_type{})
  // without, so that neither copy branches per element (and the id loads issue together).
  template <typename Fn>
  __device__ __forceinline__ void with_segments(Fn&& fn) const {
    if (segments()) {
      fn(std::true_type{});
    } else {
      fn(std::false_type{});
    }
  }
  // Per element, in one copy of a mask loop: the sm80 kernels and the sm90 backward, which spill
  // with two (with_segments).
  __device__ __forceinline__ bool same_segment(int q, int k) const {
    return !segments() || __ldg(q_seg + q) == __ldg(kv_seg + k);
  }
  // Segment ids (with segments only). Rows and keys past the lengths, outside every range anyway
  // and maybe past the tensors' ends, read the last valid one: a clamp, not a branch.
  __device__ __forceinline__ int q_segment(int q) const { return __ldg(q_seg + max(0, min(q, seqlen_q - 1))); }
  __device__ __forceinline__ int kv_segment(int k) const { return __ldg(kv_seg + max(0, min(k, seqlen_k - 1))); }

  // Keys that rows [q_first, q_last] can see lie in the returned range (empty: none).
  __device__ __forceinline__ Range keys_of(int q_first, int q_last) const {
    q_last = min(q_last, seqlen_q - 1);
    if (q_first > q_last) return {0, 0};
    Range r{max(0, keys_seen_by(q_first).begin), max(0, keys_seen_by(q_last).end)};
    if (segments()) r = narrow(r, q_chunks, q_first, q_last);
    return r;
  }
  // Queries that keys [k_first, k_last] are visible to lie in the returned range (the backward
  // walks these per key block). Narrowed by the segment chunks when there are any; the
  // deterministic dQ order needs ranges that only grow with the keys and so walks
  // `without_segments()` (bwd_walk.cuh).
  __device__ __forceinline__ Range queries_of(int k_first, int k_last) const {
    k_last = min(k_last, seqlen_k - 1);
    if (k_first > k_last) return {0, 0};
    Range r{min(seqlen_q, max(0, queries_seeing(k_first).begin)), max(0, queries_seeing(k_last).end)};
    if (segments()) r = narrow(r, kv_chunks, k_first, k_last);
    return r;
  }

  // True when every pair of rows [q0, q1] x keys [k0, k1] is visible: no masking needed.
  __device__ __forceinline__ bool all_visible(int q0, int q1, int k0, int k1) const {
    if (!inside_band(q0, q1, k0, k1)) return false;
    if (!segments()) return true;
    // One segment for every row and key: each chunk's min == max == the first chunk's.
    const int segment = q_chunks[q0 / kMaskChunk].segment_min;
    for (int c = q0 / kMaskChunk; c <= q1 / kMaskChunk; ++c) {
      if (q_chunks[c].segment_min != segment || q_chunks[c].segment_max != segment) return false;
    }
    for (int c = k0 / kMaskChunk; c <= k1 / kMaskChunk; ++c) {
      if (kv_chunks[c].segment_min != segment || kv_chunks[c].segment_max != segment) return false;
    }
    return true;
  }
  // The band and the lengths' part of all_visible: arithmetic only.
  __device__ __forceinline__ bool inside_band(int q0, int q1, int k0, int k1) const {
    return q1 < seqlen_q && k1 < seqlen_k && (right < 0 || k1 - q0 - offset <= right) &&
           (left < 0 || k0 - q1 - offset >= -left);
  }
  // Keys [begin, end) that with every row of [q0, q1] lie in one segment, so that a block inside
  // them, and inside the band, needs no mask (no ids compared); all keys without segment ids. Read
  // once a tile (the chunks' one-segment ranges, _masks.py), then tested by arithmetic per block,
  // instead of all_visible's chunk loads each block (H25).
  // Rows past the length get none (nor is a chunk past the tensor's end read).
  __device__ __forceinline__ Range keys_of_one_segment(int q0, int q1) const {
    if (!segments()) return {0, 1 << 30};
    return q0 < seqlen_q ? one_segment_range(q_chunks, q0, min(q1, seqlen_q - 1)) : Range{0, 0};
  }
  // Queries [begin, end) that with every key of [k0, k1] lie in one segment (the same per key
  // block; the backward's last block may hold a consumer's 64 keys all past the end).
  __device__ __forceinline__ Range queries_of_one_segment(int k0, int k1) const {
    if (!segments()) return {0, 1 << 30};
    return k0 < seqlen_k ? one_segment_range(kv_chunks, k0, min(k1, seqlen_k - 1)) : Range{0, 0};
  }

 private:
  // `r` cut to the union of the other side's ranges of chunks first / 64 .. last / 64.
  __device__ static Range narrow(Range r, const MaskChunk* chunks, int first, int last) {
    int begin = 1 << 30, end = 0;
    for (int c = first / kMaskChunk; c <= last / kMaskChunk; ++c) {
      begin = min(begin, chunks[c].other_begin);
      end = max(end, chunks[c].other_end);
    }
    begin = max(r.begin, begin), end = min(r.end, end);
    return begin < end ? Range{begin, end} : Range{0, 0};
  }
  // The intersection of chunks first / 64 .. last / 64's one-segment ranges.
  __device__ static Range one_segment_range(const MaskChunk* chunks, int first, int last) {
    int begin = 0, end = 1 << 30;
    for (int c = first / kMaskChunk; c <= last / kMaskChunk; ++c) {
      begin = max(begin, chunks[c].one_begin);
      end = min(end, chunks[c].one_end);
    }
    return begin < end ? Range{begin, end} : Range{0, 0};
  }
};

// The per-element rule of the mask loops: `element` becomes `fill` where x lies outside the range
// its row sees (a key of query row q in keys_seen_by(q), or a query of key row k in
// queries_seeing(k)) or other_segment() (q's and k's segment ids differ; a callable, so that the
// ids load only past the range test). Two loops write the same test out, as through a function
// they compiled to slower or spilling code (perf log, session 49): mask_query_row
// (fragment_mask.cuh) and the Hopper backward's S^T mask (sm90/bwd/band_mask.cuh).
template <typename OtherSegment>
__device__ __forceinline__ void hide_outside(float& element, float fill, const Range& seen, const int& x,
                                             const OtherSegment& other_segment) {
  if (x < seen.begin || x >= seen.end || other_segment()) element = fill;
}

}  // namespace jax_flash
