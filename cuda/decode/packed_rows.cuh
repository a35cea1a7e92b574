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
};

}  // namespace jax_flash::decode
