// The last kernel of the mma.sync backward: dQ [B, T, N, H] in T from the
// float32 accumulator it adds into with atomics, the same layout. (The sm90 backward's
// accumulator is tiled: sm90/bwd/dq_tiles.cuh.)
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/params.h"
#include "common/ptx.cuh"

namespace jax_flash {

// Eight elements a thread (H is a multiple of 8): two float4 loads, one 16-byte store.
// kFamily (75, 80 or 90): the kernel family that launches it, a symbol of its own for each
// (bwd_preprocess.cuh says why).
template <typename T, int kFamily>
__global__ void __launch_bounds__(256) dq_from_rows(const BwdParams p) {
  const int64_t i = (int64_t(blockIdx.x) * 256 + threadIdx.x) * 8;
  if (i >= int64_t(p.batch) * p.seqlen_q * p.heads * p.head_dim) return;
  const float4 a = *reinterpret_cast<const float4*>(p.dq_accum + i);
  const float4 b = *reinterpret_cast<const float4*>(p.dq_accum + i + 4);
  *reinterpret_cast<uint4*>(static_cast<T*>(p.dq) + i) =
      uint4{ptx::pack2<T>(a.x, a.y), ptx::pack2<T>(a.z, a.w), ptx::pack2<T>(b.x, b.y), ptx::pack2<T>(b.z, b.w)};
}

template <typename T, int kFamily>
cudaError_t launch_dq_from_rows(const BwdParams& p, cudaStream_t stream) {
  const int64_t chunks = int64_t(p.batch) * p.seqlen_q * p.heads * p.head_dim / 8;
  dq_from_rows<T, kFamily><<<(chunks + 255) / 256, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_flash
