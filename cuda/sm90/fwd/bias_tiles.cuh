// The bias and boolean mask of the sm90 forward (kBias), a key block's tile at a time
// (bias_tiles.cuh): copied by the producer thread with the block's K and V, added to S by the
// consumers in place of loads from global memory (bias.cuh's add_bias_pairs, which the kernels
// without tiles keep).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/ptx.cuh"
#include "sm90/common/bias_tiles.cuh"

namespace jax_flash::sm90 {

// The forward's tiles: 128 query rows (two consumers) x a key block (FwdConfig's narrow blocks:
// 128 keys, 64 at H > 128). The region: 64 KB (two bf16 tiles, or one float32) except at H = 256,
// whose Q and two K/V stages leave 32 KB; at H = 128 it takes the third K/V stage's place.
template <int kHeadDim>
using FwdBiasTiles = BiasTiles<128, kHeadDim <= 128 ? 128 : 64, kHeadDim == 256 ? 32 * 1024 : 64 * 1024>;

// s[i] of S (row `row0` + 8 ((i % 4) / 2) of the tile, key 8 (i / 4) + 2 (lane % 4) + i % 2 of the
// block) plus its bias / unit, or -inf where the mask hides it; `tile` at the stage. row0 % 8 =
// lane / 4, as for the accumulator. A thread's two adjacent keys are one load, and rows 8 apart
// share their swizzle: every load is a register offset per n8 tile (the swizzle's XOR) plus
// constants.
template <typename T, typename Tiles, int kRegs>
__device__ __forceinline__ void add_tile_bias_rows(float (&s)[kRegs], const char* tile, int bias_bytes,
                                                   bool bias_fp32, bool has_mask, int row0, int lane,
                                                   float inv_unit) {
  const uint32_t swizzle = (lane / 4) << 4;  // row % 8, in 16-byte chunks
  auto add = [&](auto bias_type, auto masked) {
    using B = decltype(bias_type);
    constexpr bool kBias = !std::is_same_v<B, void*>, kMasked = decltype(masked)::value;
#pragma unroll
    for (int t = 0; t < kRegs / 4; ++t)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float& x0 = s[4 * t + 2 * r];
        float& x1 = s[4 * t + 2 * r + 1];
        const int row = (row0 + 8 * r) * 128;
        if constexpr (kBias && sizeof(B) == 2) {
          // Keys 16 t + 4 (lane % 4) bytes in: box t / 8, chunk t % 8.
          const uint32_t at = (t / 8) * Tiles::kBoxBytes + row + (((t % 8) << 4) ^ swizzle) + 4 * (lane % 4);
          const float2 b = ptx::unpack2<T>(*reinterpret_cast<const uint32_t*>(tile + at));
          x0 += b.x * inv_unit, x1 += b.y * inv_unit;
        } else if constexpr (kBias) {
          // 32 t + 8 (lane % 4) bytes in: box t / 4, chunk 2 (t % 4) + (lane % 4) / 2.
          const uint32_t chunk = ((2 * (t % 4)) << 4) ^ (swizzle ^ (((lane % 4) / 2) << 4));
          const uint32_t at = (t / 4) * Tiles::kBoxBytes + row + chunk + 8 * (lane % 2);
          const float2 b = *reinterpret_cast<const float2*>(tile + at);
          x0 += b.x * inv_unit, x1 += b.y * inv_unit;
        }
        if constexpr (kMasked) {
          // 8 t + 2 (lane % 4) bytes in: chunk t / 2, 8 (t % 2) bytes into it.
          const uint32_t at = bias_bytes + row + (((t / 2) << 4) ^ swizzle) + 8 * (t % 2) + 2 * (lane % 4);
          const uint32_t keep = *reinterpret_cast<const uint16_t*>(tile + at);
          if (!(keep & 0xff)) x0 = -INFINITY;
          if (!(keep >> 8)) x1 = -INFINITY;
        }
      }
  };
  with_tile_layout<T>(bias_bytes, bias_fp32, has_mask, add);
}

}  // namespace jax_flash::sm90
