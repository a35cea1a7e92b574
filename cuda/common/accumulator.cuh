// Where element i of a thread's accumulator fragment lies. An mma.sync m16n8 tile and each warp's
// 16 rows of a wgmma m64nN tile share the layout: n8 tile i / 4, row ((i % 4) / 2) * 8 + lane / 4
// of the warp's 16, two adjacent columns a thread ((lane % 4) * 2 + i % 2).
#pragma once

namespace jax_flash {

struct AccumulatorLayout {
  int lane;
  // Row of element i within the warp's 16 rows.
  __device__ __forceinline__ int row(int i) const { return ((i % 4) / 2) * 8 + lane / 4; }
  // Column of element i.
  __device__ __forceinline__ int col(int i) const { return (i / 4) * 8 + (lane % 4) * 2 + i % 2; }
};

}  // namespace jax_flash
