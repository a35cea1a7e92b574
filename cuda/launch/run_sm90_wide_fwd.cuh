// Launcher of the Hopper forward at head dims 320-1024 (sm90/wide_fwd_kernel.cuh): one CTA a
// 64-row query tile of each (batch, head), above 512 a cluster of two that split the head dim. No
// synchronisation and no allocation.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/grid.cuh"
#include "common/params.h"
#include "launch/allow_smem.h"
#include "launch/tensor_map.h"
#include "sm90/wide_fwd_kernel.cuh"

namespace jax_flash {

template <typename T, int kHeadDim, Variant kVariant>
cudaError_t run_wide_fwd_sm90(const FwdParams& p, cudaStream_t stream) {
  using Cfg = sm90::WideFwdConfig<T, kHeadDim>;
  const int blocks = (p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM;
  if (blocks == 0 || p.batch == 0 || p.heads == 0) return cudaSuccess;
  sm90::WideFwdTensorMaps maps;
  if (cudaError_t e = make_qkv_tensor_maps(p, kHeadDim, kHeadDim, Cfg::kBlockM, Cfg::kBlockN, &maps.q, &maps.k, &maps.v);
      e != cudaSuccess) {
    return e;
  }
  auto kernel = sm90::wide_fwd_kernel<Cfg, kVariant>;
  if (cudaError_t e = allow_smem(kernel, Cfg::kSmemBytes); e != cudaSuccess) return e;
  dim3 grid;
  if (cudaError_t e = batch_head_grid(blocks, int64_t(p.batch) * p.heads, &grid); e != cudaSuccess) return e;
  grid.x *= Cfg::kSplit;
  if constexpr (Cfg::kSplit == 1) {
    kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(maps, p);
    return cudaGetLastError();
  } else {
    cudaLaunchConfig_t config{grid, dim3(Cfg::kThreads), size_t(Cfg::kSmemBytes), stream, nullptr, 0};
    cudaLaunchAttribute pair{};
    pair.id = cudaLaunchAttributeClusterDimension;
    pair.val.clusterDim = {Cfg::kSplit, 1, 1};
    config.attrs = &pair;
    config.numAttrs = 1;
    return cudaLaunchKernelEx(&config, kernel, maps, p);
  }
}

}  // namespace jax_flash
