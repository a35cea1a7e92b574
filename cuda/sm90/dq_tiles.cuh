// The float32 dQ accumulator of the sm90 backward (bwd_kernel.cuh), and the kernel that turns it
// into dQ.
//
// The accumulator is a sequence of 64 x 64 tiles, [batch, head, 64-row block, 64-column block], each
// in the order a consumer warp group holds it in registers (the m64n64 wgmma accumulator): element i
// of consumer thread t is float (i / 4 * 128 + t) * 4 + i % 4 of its tile. A consumer then writes its
// dQ part to shared memory with four-float stores that no two threads of a quarter warp send to the
// same bank, at offsets that are constants from one register, and the whole 16 KB part is added to
// global memory by one contiguous bulk reduce (FlashAttention-3's dQ path). Rows are padded to
// BwdParams::stats_stride, so that a step's rows past seqlen_q land in the scratch too.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/params.h"
#include "common/ptx.cuh"

namespace jax_flash::sm90 {

struct DqTiles {
  static constexpr int kRows = 64, kCols = 64;
  static constexpr int kFloats = kRows * kCols;
  // The first float of tile (row block, column block) of one batch row and head.
  __host__ __device__ static int64_t tile(const BwdParams& p, int batch, int head, int row_block, int col_block) {
    const int64_t row_blocks = p.stats_stride / kRows, col_blocks = p.head_dim / kCols;
    return (((int64_t(batch) * p.heads + head) * row_blocks + row_block) * col_blocks + col_block) * kFloats;
  }
  // Where thread t's accumulator elements 4 c .. 4 c + 3 go: a float4, chunk c * 128 + t of the tile.
  __host__ __device__ static constexpr int chunk(int c, int thread) { return c * 128 + thread; }
};

// dQ [B, T, N, H] in T from the tiles: a CTA of 128 threads per tile. Each thread reads the float4
// chunks that consumer thread t wrote (rows warp * 16 + lane / 4 and + 8, two adjacent columns of
// each n8 tile), and the tile goes out through shared memory as 16-byte row chunks.
template <typename T>
__global__ void __launch_bounds__(128) dq_from_tiles(const BwdParams p) {
  constexpr int kRowBytes = DqTiles::kCols * 2 + 16;  // padded: the 4-byte writes of a warp hit 32 banks
  __shared__ __align__(16) char staging[DqTiles::kRows * kRowBytes];
  const int col_blocks = p.head_dim / DqTiles::kCols, row_blocks = p.stats_stride / DqTiles::kRows;
  const int col_block = blockIdx.x % col_blocks, row_block = (blockIdx.x / col_blocks) % row_blocks;
  const int batch_head = blockIdx.x / (col_blocks * row_blocks);
  const int head = batch_head % p.heads, batch = batch_head / p.heads;
  const int row0 = row_block * DqTiles::kRows;
  if (row0 >= p.seqlen_q) return;
  const int t = threadIdx.x, warp = t / 32, lane = t % 32;
  const float4* tile =
      reinterpret_cast<const float4*>(p.dq_accum + DqTiles::tile(p, batch, head, row_block, col_block));
  const uint32_t staged = ptx::smem_addr(staging);
#pragma unroll
  for (int c = 0; c < DqTiles::kCols / 8; ++c) {
    const float4 v = tile[DqTiles::chunk(c, t)];
    const int row = warp * 16 + lane / 4, col = c * 8 + (lane % 4) * 2;
    ptx::st_shared_b32(staged + row * kRowBytes + col * 2, ptx::pack2<T>(v.x, v.y));
    ptx::st_shared_b32(staged + (row + 8) * kRowBytes + col * 2, ptx::pack2<T>(v.z, v.w));
  }
  __syncthreads();
  const int64_t row_stride = int64_t(p.heads) * p.head_dim;
  T* dq = static_cast<T*>(p.dq) + (int64_t(batch) * p.seqlen_q + row0) * row_stride + head * p.head_dim +
          col_block * DqTiles::kCols;
#pragma unroll
  for (int i = t; i < DqTiles::kRows * 8; i += 128) {
    const int row = i / 8, chunk = i % 8;
    if (row0 + row < p.seqlen_q) {
      *reinterpret_cast<uint4*>(dq + row * row_stride + chunk * 8) =
          ptx::ld_shared_v4(staged + row * kRowBytes + chunk * 16);
    }
  }
}

template <typename T>
cudaError_t launch_dq_from_tiles(const BwdParams& p, cudaStream_t stream) {
  const int64_t tiles = int64_t(p.batch) * p.heads * (p.stats_stride / DqTiles::kRows) * (p.head_dim / DqTiles::kCols);
  dq_from_tiles<T><<<tiles, 128, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_flash::sm90
