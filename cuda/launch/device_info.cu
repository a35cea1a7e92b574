// Device queries shared by the launchers (cached per device: launches must not sync or query much).
#include "launch/device_info.h"

#include <cuda_runtime.h>

namespace jax_flash {

int current_sm_version() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  return major * 10 + minor;
}

}  // namespace jax_flash
