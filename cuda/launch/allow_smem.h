// Shared by the launchers: raising a kernel's dynamic shared-memory limit.
#pragma once

#include <cuda_runtime.h>

namespace jax_flash {

// Raise a kernel's dynamic shared-memory limit above the 48 KB default. Set at every launch
// (a host-side attribute, no synchronisation): the setting belongs to the current device's
// context, so caching it once per process would miss the other GPUs.
template <typename Kernel>
cudaError_t allow_smem(Kernel kernel, int bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

}  // namespace jax_flash
