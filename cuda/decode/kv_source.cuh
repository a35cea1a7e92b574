// Where a block of kDecodeBlockKeys keys of one (batch row, kv head) lies in memory: a dense
// cache [B, S, K, H], or a paged pool [P, page_size, K, H] through the page table. Either way the
// block's rows are kv_heads * H elements apart.
#pragma once

#include <cstdint>

#include "decode/params.h"

namespace jax_flash::decode {

template <typename T>
struct KvSource {
  const T* k;  // this kv head's column of key 0 (dense) or of the pool's first page (paged)
  const T* v;
  const int* pages;  // this batch row's page table, nullptr when dense
  int page_size, last_page;
  int64_t row_stride;  // elements between consecutive keys

  __device__ static KvSource of(const DecodeParams& p, int batch, int kv_head, int head_dim) {
    const int64_t row_stride = int64_t(p.kv_heads) * head_dim;
    const int64_t column = int64_t(kv_head) * head_dim;
    const int64_t first = p.page_table ? column : int64_t(batch) * p.seqlen_k * row_stride + column;
    return {static_cast<const T*>(p.k) + first, static_cast<const T*>(p.v) + first,
            p.page_table ? p.page_table + int64_t(batch) * p.max_pages : nullptr, p.page_size, p.pool_pages - 1,
            row_stride};
  }

  // Element offset of key `key` (from a multiple of kDecodeBlockKeys, a block stays in one page).
  // Page indices outside the pool are clamped into it: a bad index reads a wrong page, never
  // memory outside the pool.
  __device__ __forceinline__ int64_t offset(int key) const {
    if (pages == nullptr) return key * row_stride;
    const int page = min(max(__ldg(pages + key / page_size), 0), last_page);
    return (int64_t(page) * page_size + key % page_size) * row_stride;
  }
};

}  // namespace jax_flash::decode
