// Tensor maps (the descriptors of TMA copies) for the [B, T, N, H] tensors of an attention call.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

namespace jax_flash {

// A 4-d view [batch, rows, heads, head_dim] of a contiguous tensor, copied in boxes of `box_rows`
// rows x 128 bytes of one head's columns (64 16-bit elements), with the 128-byte
// shared-memory swizzle. Rows past the end read as zeros and are not written.
// cudaErrorInvalidValue when the driver refuses it.
cudaError_t make_tensor_map_bthd(CUtensorMap* map, const void* data, int batch, int rows, int heads,
                                 int head_dim, int box_rows);  // 16-bit elements

}  // namespace jax_flash
