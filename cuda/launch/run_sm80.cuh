// Launchers of the sm80 kernels for one (element type, head dim): grid, shared memory, stream.
// (The Turing family's launchers, run_sm75.cuh, take these with their own tiles.)
// No synchronisation and no allocation: they run inside XLA's stream (and CUDA graphs).
#pragma once

#include <cuda_runtime.h>

#include "common/bwd_preprocess.cuh"
#include "common/dq_rows.cuh"
#include "common/grid.cuh"
#include "common/params.h"
#include "launch/allow_smem.h"
#include "launch/device.h"
#include "sm80/bwd_kernels.cuh"
#include "sm80/fwd_kernel.cuh"
#include "sm80/config.cuh"

namespace jax_flash {

// The mma.sync forward with the given tiles (config.cuh: the sm80 or the Turing family's).
template <typename Cfg, Variant kVariant>
cudaError_t launch_fwd_mma(const FwdParams& p, cudaStream_t stream) {
  auto kernel = sm80::fwd_kernel<Cfg, kVariant>;
  if (cudaError_t e = allow_smem(kernel, Cfg::kSmemBytes); e != cudaSuccess) return e;
  dim3 grid;
  const int m_blocks = (p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM;
  if (cudaError_t e = batch_head_grid(m_blocks, int64_t(p.batch) * p.heads, &grid); e != cudaSuccess) return e;
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int kHeadDim, Variant kVariant>
cudaError_t run_fwd_sm80(const FwdParams& p, cudaStream_t stream) {
  return launch_fwd_mma<sm80::FwdConfig<T, kHeadDim, kVariant>, kVariant>(p, stream);
}

// The mma.sync backward with the given tiles (config.cuh), then dQ out of its accumulator.
template <typename Cfg, Variant kVariant>
cudaError_t launch_bwd_mma(const BwdParams& p, cudaStream_t stream) {
  auto kernel = sm80::bwd_dkdv_kernel<Cfg, kVariant>;
  if (cudaError_t e = allow_smem(kernel, Cfg::kSmemBytes); e != cudaSuccess) return e;
  dim3 grid;
  const int n_blocks = (p.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN;
  if (cudaError_t e = batch_head_grid(n_blocks, int64_t(p.batch) * p.kv_heads, &grid); e != cudaSuccess) return e;
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  return launch_dq_from_rows<typename Cfg::T, Cfg::kTuring ? 75 : 80>(p, stream);
}

// The mma.sync backward with tiles Cfg, which must fit `limit` bytes a block (0: unknown).
template <typename Cfg, Variant kVariant>
cudaError_t launch_bwd_mma_within(const BwdParams& p, int limit, cudaStream_t stream) {
  if (limit > 0 && Cfg::kSmemBytes > limit) return cudaErrorInvalidConfiguration;
  if (cudaError_t e = launch_bwd_preprocess<typename Cfg::T, Cfg::kHeadDim, 80>(p, stream); e != cudaSuccess) {
    return e;
  }
  return launch_bwd_mma<Cfg, kVariant>(p, stream);
}

// The plan's tiles: the usual ones or the compact ones (jax_flash/_plan.py picks the compact ones
// where the usual exceed the shared memory a block may take). cudaErrorInvalidConfiguration
// where they exceed this GPU's limit (or BwdParams::smem_limit): the plan and the GPU disagree.
template <typename T, int kHeadDim, Variant kVariant>
cudaError_t run_bwd_sm80(const BwdParams& p, contract::Tiles tiles, cudaStream_t stream) {
  int limit = current_device_limits().smem_optin;  // 0 where the runtime cannot say
  if (p.smem_limit > 0 && (limit <= 0 || p.smem_limit < limit)) limit = p.smem_limit;
  switch (tiles) {
    case contract::Tiles::kUsual: return launch_bwd_mma_within<sm80::BwdConfig<T, kHeadDim>, kVariant>(p, limit, stream);
    case contract::Tiles::kCompact:
      return launch_bwd_mma_within<sm80::BwdConfig<T, kHeadDim, true>, kVariant>(p, limit, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace jax_flash
