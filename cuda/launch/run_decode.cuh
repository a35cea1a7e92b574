// Launcher of the decode kernel for one (element type, head dim, variant): the split kernel over
// (splits, kv heads x row tiles, batch), which also combines the splits.
#pragma once

#include <cuda_runtime.h>

#include "common/grid.cuh"
#include "decode/config.cuh"
#include "decode/params.h"
#include "decode/split_kernel.cuh"
#include "launch/allow_smem.h"

namespace jax_flash {

template <typename T, int kHeadDim, Variant kVariant>
cudaError_t run_decode(const DecodeParams& p, cudaStream_t stream) {
  using Cfg = decode::Config<T, kHeadDim>;
  const int64_t tiles = int64_t(p.kv_heads) * decode_row_tiles(p.seqlen_q, p.heads, p.kv_heads);
  if (tiles > kMaxGridYZ || p.batch > kMaxGridYZ || p.splits < 1 || p.splits > kMaxDecodeSplits) {
    return cudaErrorInvalidConfiguration;  // cuda_impl.py's decode rule keeps calls inside these
  }
  auto kernel = decode::split_kernel<Cfg, kVariant>;
  if (cudaError_t e = allow_smem(kernel, Cfg::kSmemBytes); e != cudaSuccess) return e;
  if (p.splits > 1) {  // the tickets of the combine step
    const size_t bytes = sizeof(int) * size_t(p.batch) * size_t(tiles);
    if (cudaError_t e = cudaMemsetAsync(p.split_tickets, 0, bytes, stream); e != cudaSuccess) return e;
  }
  kernel<<<dim3(p.splits, unsigned(tiles), p.batch), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_flash
