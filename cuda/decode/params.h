// The parameters of a decode call: the forward's (params.h) plus the key lengths, the split-KV
// scratch and, for a paged cache, the page table. The decode kernels read the band and the soft
// cap; never query lengths, segment ids, a bias or a mask (the Python dispatch sends those calls
// to the forward kernels).
#pragma once

#include <cuda_runtime.h>  // __host__ __device__

#include "common/params.h"

namespace jax_flash {

// Splits of one row tile's keys over CTAs, at most: the combine kernel keeps a weight per split
// (kMaxDecodeSplits / 32 a lane).
constexpr int kMaxDecodeSplits = contract::kMaxDecodeSplits;
// Query rows of one decode CTA (one m16 tile): the (query, head of the group) pairs of a kv head.
constexpr int kDecodeTileRows = contract::kDecodeTileRows;
// Keys a warp reads per step; pages are whole multiples of it, so that no step spans two pages.
constexpr int kDecodeBlockKeys = contract::kDecodeBlockKeys;
// Queries of one prefill item of a ragged batch (DecodeParams::prefill_work).
constexpr int kPrefillBlockRows = contract::kPrefillBlockRows;

// 16-row tiles of one kv head's packed rows (its queries x query heads); the grid's y runs over
// kv heads x these.
__host__ __device__ inline int decode_row_tiles(int seqlen_q, int heads, int kv_heads) {
  return (seqlen_q * (heads / kv_heads) + kDecodeTileRows - 1) / kDecodeTileRows;
}

struct DecodeParams : FwdParams {
  // [B] keys of each batch row, clamped into [0, seqlen_k] (nullptr: seqlen_k). Read directly, so
  // that a step passes its lengths as they are: no kernel builds FwdParams::seqlens for it.
  const int* kv_lengths;
  // With splits > 1, each split's output (normalised over its keys) and log-sum-exp, float32:
  // o_partial [splits, B, T, N, H], lse_partial [splits, B, T, N], which the combine kernel
  // merges (combine_kernel.cuh).
  float* o_partial;
  float* lse_partial;
  int splits;
  // A paged cache (nullptr: dense). k and v are then pools [pool_pages, page_size, K, H], and
  // key s of batch row b is in page page_table[b * max_pages + s / page_size] (clamped into the
  // pool) at slot s % page_size; seqlen_k is max_pages * page_size.
  const int* page_table;
  int page_size, max_pages, pool_pages;
  // An fp8 cache's scales, float32 [B, K] (batch row b's values are k * key_scale[b, kv head]);
  // nullptr with a 16-bit cache.
  const float* key_scale;
  const float* value_scale;
  // A ragged batch (ragged_paged_attention; nullptr: every batch row has seqlen_q queries): the
  // work list, int32 [work_items, 4], one row tile of one sequence each: (sequence, or -1 for no
  // work; the tile's first packed row; the sequence's first row of q [Q, N, H]; its query count).
  // The Python layer makes it on the device from the query starts (jax_flash/_ragged_work.py).
  // q, o are then [1, Q, N, H] (batch 1, seqlen_q Q) and lse [1, N, Q]; the page table, key
  // lengths, scales and sinks have a row per sequence. Last: the dense kernels keep their layout.
  const int* work;
  int work_items;
  // A ragged batch's prefill list (nullptr: none): int32 [prefill_items, 4], kPrefillBlockRows
  // queries of one sequence each, which the forward kernels' tiles take instead of the split
  // kernels (sm80::fwd_kernel with kRagged): (sequence, or -1 for no work; the item's first query
  // within the sequence; the sequence's first row of q; its query count). Its sequences have no
  // item in `work`.
  const int* prefill_work;
  int prefill_items;
};

}  // namespace jax_flash
