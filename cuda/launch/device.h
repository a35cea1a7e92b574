// The current GPU, as the launchers ask about it.
#pragma once

#include <cuda_runtime.h>

namespace jax_flash {

// The current device's compute capability; false where the runtime cannot say.
inline bool current_device_capability(int* major, int* minor) {
  int device = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
         cudaDeviceGetAttribute(minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess;
}

}  // namespace jax_flash
