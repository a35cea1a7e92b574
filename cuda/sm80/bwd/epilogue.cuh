// The mma.sync backward's epilogue: dK and dV to T in the K and V tiles' buffers (sK, sV: every
// warp is done with them), then whole rows to global memory as 16-byte chunks.
#pragma once

#include <cstdint>

#include "common/params.h"
#include "common/ptx.cuh"

namespace jax_flash::sm80 {

// A warp's dK and dV: keys dkv_n + mt * 16 + r * 8 + lane / 4, columns from dkv_d; to p.dk, p.dv
// at kv_offset (the CTA's first key), rows kv_row_stride apart, keys_valid of them stored.
template <typename Cfg, int kDkvTiles>
__device__ __forceinline__ void store_dk_dv(const float (&acc_dk)[2][kDkvTiles][4],
                                            const float (&acc_dv)[2][kDkvTiles][4], uint32_t sK, uint32_t sV,
                                            const BwdParams& p, int64_t kv_offset, int64_t kv_row_stride,
                                            int keys_valid, int dkv_n, int dkv_d, int tid) {
  using T = typename Cfg::T;
  using KTile = typename Cfg::KTile;
  const int lane = tid % 32;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int d = 0; d < kDkvTiles; ++d) {
        const int off = KTile::offset(dkv_n + mt * 16 + r * 8 + lane / 4, dkv_d / 8 + d) + (lane % 4) * 4;
        ptx::st_shared_b32(sK + off, ptx::pack2<T>(acc_dk[mt][d][2 * r], acc_dk[mt][d][2 * r + 1]));
        ptx::st_shared_b32(sV + off, ptx::pack2<T>(acc_dv[mt][d][2 * r], acc_dv[mt][d][2 * r + 1]));
      }
  __syncthreads();  // a row's parts come from kDkvWarpsD warps
  T* gdk = static_cast<T*>(p.dk) + kv_offset;
  T* gdv = static_cast<T*>(p.dv) + kv_offset;
  constexpr int kChunks = KTile::kChunks;
  for (int i = tid; i < Cfg::kBlockN * kChunks; i += Cfg::kThreads) {
    const int row = i / kChunks, chunk = i % kChunks;
    if (row < keys_valid) {
      *reinterpret_cast<uint4*>(gdk + row * kv_row_stride + chunk * 8) = ptx::ld_shared_v4(sK + KTile::offset(row, chunk));
      *reinterpret_cast<uint4*>(gdv + row * kv_row_stride + chunk * 8) = ptx::ld_shared_v4(sV + KTile::offset(row, chunk));
    }
  }
}

}  // namespace jax_flash::sm80
