// Launcher of the mma.sync forward at head dims 320-512 (sm80/wide_fwd_kernel.cuh). No
// synchronisation and no allocation.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/grid.cuh"
#include "common/params.h"
#include "launch/allow_smem.h"
#include "sm80/wide_fwd_kernel.cuh"

namespace jax_flash {

// One CTA a 64-row query tile of each (batch, head).
template <typename T, int kHeadDim, Variant kVariant>
cudaError_t run_wide_fwd_sm80(const FwdParams& p, cudaStream_t stream) {
  using Cfg = sm80::WideFwdConfig<T, kHeadDim>;
  const int m_blocks = (p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM;
  if (m_blocks == 0 || p.batch == 0 || p.heads == 0) return cudaSuccess;
  auto kernel = sm80::wide_fwd_kernel<Cfg, kVariant>;
  if (cudaError_t e = allow_smem(kernel, Cfg::kSmemBytes); e != cudaSuccess) return e;
  dim3 grid;
  if (cudaError_t e = batch_head_grid(m_blocks, int64_t(p.batch) * p.heads, &grid); e != cudaSuccess) return e;
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_flash
