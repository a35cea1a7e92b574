// Launchers of the sm80 kernels for one (element type, head dim): grid, shared memory, stream.
// No synchronisation and no allocation: they run inside XLA's stream (and CUDA graphs).
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"
#include "sm80/bwd_kernels.cuh"
#include "sm80/fwd_kernel.cuh"
#include "sm80/traits.cuh"

namespace jax_flash {

// Raise a kernel's dynamic shared-memory limit above the 48 KB default. Set at every launch
// (a host-side attribute, no synchronisation): the setting belongs to the current device's
// context, so caching it once per process would miss the other GPUs.
template <typename Kernel>
cudaError_t allow_smem(Kernel kernel, int bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

template <typename T, int kHeadDim>
cudaError_t run_fwd_sm80(const FwdParams& p, cudaStream_t stream) {
  using Cfg = sm80::FwdConfig<T, kHeadDim>;
  auto kernel = sm80::fwd_kernel<Cfg>;
  if (cudaError_t e = allow_smem(kernel, Cfg::kSmemBytes); e != cudaSuccess) return e;
  const dim3 grid((p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM, p.batch * p.heads);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int kHeadDim>
cudaError_t run_bwd_sm80(const BwdParams& p, cudaStream_t stream) {
  using Cfg = sm80::BwdConfig<T, kHeadDim>;
  const int64_t rows = int64_t(p.batch) * p.seqlen_q * p.heads;
  sm80::bwd_preprocess<T, kHeadDim><<<(rows + 3) / 4, 128, 0, stream>>>(p);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  auto kernel = sm80::bwd_dkdv_kernel<Cfg>;
  if (cudaError_t e = allow_smem(kernel, Cfg::kSmemBytes); e != cudaSuccess) return e;
  const dim3 grid((p.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN, p.batch * p.kv_heads);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_flash
