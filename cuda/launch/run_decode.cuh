// Launcher of the decode kernels for one (element type, head dim, variant): the split kernel over
// (splits, kv heads x row tiles, batch) and, with several splits, the combine kernel after it.
#pragma once

#include <cuda_runtime.h>

#include "common/grid.cuh"
#include "decode/combine_kernel.cuh"
#include "decode/config.cuh"
#include "decode/params.h"
#include "decode/split_kernel.cuh"
#include "launch/allow_smem.h"
#include "launch/device.h"

namespace jax_flash {

// The combine kernel, as a programmatic dependent launch where the GPU has them: its launch
// overlaps the split kernel, which is most of its cost at decode sizes (decode D6). Programmatic
// dependent launches exist from sm_90 on.
template <typename T, int kHeadDim>
cudaError_t launch_combine(const DecodeParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.batch) * p.seqlen_q * p.heads;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(unsigned((rows + decode::kCombineWarps - 1) / decode::kCombineWarps));
  config.blockDim = dim3(decode::kCombineWarps * 32);
  config.stream = stream;
  cudaLaunchAttribute dependent{};
  dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent.val.programmaticStreamSerializationAllowed = 1;
  int major = 0, minor = 0;
  if (current_device_capability(&major, &minor) && major >= 9) {
    config.attrs = &dependent;
    config.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&config, decode::combine_kernel<T, kHeadDim>, p);
}

template <typename T, int kHeadDim, Variant kVariant>
cudaError_t run_decode(const DecodeParams& p, cudaStream_t stream) {
  using Cfg = decode::Config<T, kHeadDim>;
  const int64_t tiles = int64_t(p.kv_heads) * decode_row_tiles(p.seqlen_q, p.heads, p.kv_heads);
  const int64_t rows = int64_t(p.batch) * p.seqlen_q * p.heads;
  if (tiles > kMaxGridYZ || p.batch > kMaxGridYZ || p.splits < 1 || p.splits > kMaxDecodeSplits ||
      (p.splits > 1 && (rows + decode::kCombineWarps - 1) / decode::kCombineWarps > INT32_MAX)) {
    return cudaErrorInvalidConfiguration;  // cuda_impl.py's decode rule keeps calls inside these
  }
  auto kernel = decode::split_kernel<Cfg, kVariant>;
  if (cudaError_t e = allow_smem(kernel, Cfg::kSmemBytes); e != cudaSuccess) return e;
  kernel<<<dim3(p.splits, unsigned(tiles), p.batch), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess || p.splits == 1) return e;
  return launch_combine<T, kHeadDim>(p, stream);
}

}  // namespace jax_flash
