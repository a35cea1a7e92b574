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

// What the launchers size grids and shared memory by: the current device's SM count, the shared
// memory a block may opt in to and an SM's (zeros where the runtime cannot say).
struct DeviceLimits {
  int sms = 0, smem_optin = 0, smem_per_sm = 0;
};
inline DeviceLimits current_device_limits() {
  DeviceLimits limits;
  int device = 0;
  if (cudaGetDevice(&device) == cudaSuccess) {
    cudaDeviceGetAttribute(&limits.sms, cudaDevAttrMultiProcessorCount, device);
    cudaDeviceGetAttribute(&limits.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    cudaDeviceGetAttribute(&limits.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
  }
  return limits;
}

}  // namespace jax_flash
