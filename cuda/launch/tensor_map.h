// Tensor maps (the descriptors of TMA copies) for the [B, T, N, H] tensors of an attention call.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include "common/params.h"

namespace jax_flash {

// A 4-d view [batch, rows, heads, head_dim] of a contiguous tensor, copied in boxes of `box_rows`
// rows x 128 bytes of one head's columns (64 16-bit elements), with the 128-byte
// shared-memory swizzle. Rows past the end read as zeros and are not written.
// cudaErrorInvalidValue when the driver refuses it.
cudaError_t make_tensor_map_bthd(CUtensorMap* map, const void* data, int batch, int rows, int heads,
                                 int head_dim, int box_rows);  // 16-bit elements

// A 4-d view [batch, heads, rows, keys] of a contiguous bias or mask [B or 1, N or 1, T, S]
// (`batch` and `heads` as stored: 1 where broadcast), copied in boxes of `box_rows` rows x 128
// bytes of keys with the 128-byte shared-memory swizzle. Past the end reads as zeros.
cudaError_t make_tensor_map_bnts(CUtensorMap* map, const void* data, int elem_bytes, int batch, int heads, int rows,
                                 int keys, int box_rows);

// The maps of a forward call's Q (boxes of q_rows rows), K and V (kv_rows rows); V of value_dim
// columns, Q and K of head_dim.
inline cudaError_t make_qkv_tensor_maps(const FwdParams& p, int head_dim, int value_dim, int q_rows, int kv_rows,
                                        CUtensorMap* q, CUtensorMap* k, CUtensorMap* v) {
  if (cudaError_t e = make_tensor_map_bthd(q, p.q, p.batch, p.seqlen_q, p.heads, head_dim, q_rows); e != cudaSuccess) {
    return e;
  }
  if (cudaError_t e = make_tensor_map_bthd(k, p.k, p.batch, p.seqlen_k, p.kv_heads, head_dim, kv_rows);
      e != cudaSuccess) {
    return e;
  }
  return make_tensor_map_bthd(v, p.v, p.batch, p.seqlen_k, p.kv_heads, value_dim, kv_rows);
}

}  // namespace jax_flash
