// The query rows of one decode CTA. A kv head's rows are its (query, head of its group) pairs,
// packed: row i is query i / group of head kv_head * group + i % group, so that every query head
// that reads this kv head's cache shares one pass over it (GQA packing). A CTA takes one m16 tile
// of them: kDecodeTileRows rows from `first`.
#pragma once

#include "common/params.h"
#include "decode/params.h"

namespace jax_flash::decode {

struct PackedRows {
  int group;    // query heads per kv head
  int count;    // T * group rows of the kv head
  int first;    // this tile's first row
  int kv_head;

  // The grid's y runs over kv heads x tiles of each.
  __device__ static PackedRows of_cta(const FwdParams& p) {
    const int group = p.heads / p.kv_heads, count = p.seqlen_q * group;
    const int tiles = decode_row_tiles(p.seqlen_q, p.heads, p.kv_heads);
    return {group, count, int(blockIdx.y % tiles) * kDecodeTileRows, int(blockIdx.y / tiles)};
  }
  __device__ __forceinline__ bool valid(int row) const { return first + row < count; }
  __device__ __forceinline__ int query(int row) const { return (first + row) / group; }
  __device__ __forceinline__ int head(int row) const { return kv_head * group + (first + row) % group; }
  __device__ __forceinline__ int last_valid() const { return min(count - first, kDecodeTileRows) - 1; }
  // Index of the row in [B, T, N] order (the output's rows and the split scratch's).
  __device__ __forceinline__ int64_t output_row(const FwdParams& p, int batch, int row) const {
    return (int64_t(batch) * p.seqlen_q + query(row)) * p.heads + head(row);
  }
  // Index of the row's log-sum-exp in [B, N, T].
  __device__ __forceinline__ int64_t lse_index(const FwdParams& p, int batch, int row) const {
    return (int64_t(batch) * p.heads + head(row)) * p.seqlen_q + query(row);
  }
  // The queries of batch row `batch` (the band's query length).
  __device__ __forceinline__ int queries(const FwdParams& p) const { return p.seqlen_q; }
};

// The rows of one item of a ragged batch's work list (DecodeParams::work): one sequence's packed
// rows, its `queries` rows of q [Q, N, H] from `query_row0`. The grid's y runs over the list,
// its z over kv heads.
static_assert(contract::kRaggedWorkFields == 4, "a work item is one int4");
struct RaggedRows : PackedRows {
  int query_row0;
  int query_count;

  // The CTA's item, or sequence -1 for none.
  __device__ static RaggedRows of_cta(const DecodeParams& p, int& sequence) {
    const int4 item = __ldg(reinterpret_cast<const int4*>(p.work) + blockIdx.y);
    const int group = p.heads / p.kv_heads;
    sequence = item.x;
    return {{group, item.w * group, item.y, int(blockIdx.z)}, item.z, item.w};
  }
  __device__ __forceinline__ int64_t output_row(const FwdParams& p, int, int row) const {
    return int64_t(query_row0 + query(row)) * p.heads + head(row);
  }
  __device__ __forceinline__ int64_t lse_index(const FwdParams& p, int, int row) const {
    return int64_t(head(row)) * p.seqlen_q + query_row0 + query(row);
  }
  __device__ __forceinline__ int queries(const FwdParams&) const { return query_count; }
};

}  // namespace jax_flash::decode
