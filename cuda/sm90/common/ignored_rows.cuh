// Keys at or past a batch row's length are ignored, yet a TMA copy of a key block brings them
// into shared memory (it zero-fills only past the tensor's end). Their probabilities are 0, but a
// NaN or inf there (a stale cache slot) would still reach P V, dP and dQ: 0 * NaN is NaN. So the
// Hopper kernels zero those rows of the block that holds the length, once it has landed.
#pragma once

#include <cstdint>

#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"

namespace jax_flash::sm90 {

// Rows `first` .. kRows - 1 of a tile of kPanels 64-column panels (kRows rows of 128 bytes each:
// whole rows, so the swizzle does not matter) set to 0 by kThreads threads, `tid` among them, and
// fenced for the tensor cores. The caller syncs those threads before the tile is read.
template <int kPanels, int kRows, int kThreads>
__device__ __forceinline__ void zero_rows_from(uint32_t tile, int first, int tid) {
  constexpr int kChunks = kPanels * kRows * 8;  // 16-byte chunks
  for (int c = tid; c < kChunks; c += kThreads) {
    if ((c / 8) % kRows >= first) ptx::st_shared_v4(tile + c * 16, 0u, 0u, 0u, 0u);
  }
  ptx::fence_proxy_async_shared();
}

// The first ignored row of the key block from `key_first`, or kRows where none needs zeroing.
template <int kRows>
__device__ __forceinline__ int first_ignored_row(int seqlen_k, int tensor_keys, int key_first) {
  const int first = seqlen_k - key_first;
  return first < kRows && seqlen_k < tensor_keys ? first : kRows;
}

}  // namespace jax_flash::sm90
