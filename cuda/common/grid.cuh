// Grids of (blocks along one sequence) x (batch * heads): the block in x, batch * heads in y and
// z. gridDim.y allows 65,535 CTAs, which large-batch training on short sequences passes (4,375 x
// 16 heads): there batch * heads is split as y * z exactly, so that no CTA falls past its end
// (an early return made ptxas spill in the sm80 kernels, which run at 255 registers). The launch
// order is that of a (block, batch * heads) grid.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace jax_flash {

inline constexpr int64_t kMaxGridYZ = 65535;  // CUDA's limit on gridDim.y and gridDim.z

// y: the largest divisor of batch_heads up to 65,535, z = batch_heads / y. An error where z would
// pass 65,535 too (batch_heads with a prime factor above 65,535, say) or batch_heads a 32-bit int,
// which cuda_impl.py's `grid_fits` refuses before any launch.
inline cudaError_t batch_head_grid(int blocks, int64_t batch_heads, dim3* grid) {
  if (batch_heads > INT32_MAX) return cudaErrorInvalidConfiguration;
  for (int64_t y = std::min(batch_heads, kMaxGridYZ); y >= 1 && y * kMaxGridYZ >= batch_heads; --y) {
    if (batch_heads % y == 0) {
      *grid = dim3(unsigned(blocks), unsigned(y), unsigned(batch_heads / y));
      return cudaSuccess;
    }
  }
  return cudaErrorInvalidConfiguration;
}

__device__ __forceinline__ int batch_head_index() { return int(blockIdx.z * gridDim.y + blockIdx.y); }

}  // namespace jax_flash
