// Launchers of the Turing family (sm_75): the mma.sync kernels with Turing's tiles and
// instructions (sm80/config.cuh with Isa::kSm75), fp16 at head dims 64, 96 and 128, no bias.
#pragma once

#include <cuda_runtime.h>

#include "common/bwd_preprocess.cuh"
#include "common/params.h"
#include "launch/run_sm80.cuh"
#include "sm80/config.cuh"

namespace jax_flash {

template <typename T, int kHeadDim, Variant kVariant>
cudaError_t run_fwd_sm75(const FwdParams& p, cudaStream_t stream) {
  return launch_fwd_mma<sm80::FwdConfig<T, kHeadDim, kVariant, Isa::kSm75>, kVariant>(p, stream);
}

template <typename T, int kHeadDim, Variant kVariant>
cudaError_t run_bwd_sm75(const BwdParams& p, cudaStream_t stream) {
  if (cudaError_t e = launch_bwd_preprocess<T, kHeadDim, 75>(p, stream); e != cudaSuccess) return e;
  return launch_bwd_mma<sm80::BwdConfig<T, kHeadDim, false, Isa::kSm75>, kVariant>(p, stream);
}

}  // namespace jax_flash
