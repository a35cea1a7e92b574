// The float32 dQ accumulator of the sm90 backward (bwd_kernel.cuh), and the kernel that turns it
// into dQ.
//
// The accumulator is a sequence of kRows x 64 tiles, [batch, head, row block, 64-column block], each
// in the order a consumer warp group holds it in registers (an m64 wgmma accumulator): element i
// of consumer thread t is float (i / 4 * 128 + t) * 4 + i % 4 of its tile. A consumer then writes its
// dQ part to shared memory with four-float stores that no two threads of a quarter warp send to the
// same bank, at offsets that are constants from one register, and the whole part is added to
// global memory by one contiguous bulk reduce (FlashAttention-3's dQ path). Rows are padded to
// BwdParams::stats_stride, so that a step's rows past seqlen_q land in the scratch too.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/params.h"
#include "common/ptx.cuh"
#include "generated/contract.h"

namespace jax_flash::sm90 {

// A dQ ticket (BwdParams::dq_tickets) counts the CTAs that arrived at its query block in its low
// bits; this bit says that the first one's part has landed, so that the others may add theirs.
constexpr int kDqStored = 1 << 30;

// The ticket of query block m_block (of block_m rows) of (batch * heads + head): one per
// kDqCounterRows rows of BwdParams::dq_tickets. In 32 bits: far below 2^31 (B N T / 32 tickets), and
// 64-bit math spilled in the backward's 24-register dQ thread.
__host__ __device__ inline int* dq_ticket(const BwdParams& p, int batch_head, int m_block, int block_m) {
  constexpr int kRows = contract::kDqCounterRows;
  return p.dq_tickets + (batch_head * (p.stats_stride / kRows) + m_block * (block_m / kRows));
}

// kRows x 64 tiles. kTransposed: the consumers hold dQ^T (FlashAttention-3's 80-query steps at
// H = 128, bwd_kernel.cuh), so in an m64n(kRows) accumulator the 64 rows are columns of dQ and
// the kRows columns are its rows; the tile keeps that register order all the same.
template <int kRows_, bool kTransposed_ = false>
struct DqTiles {
  static constexpr int kRows = kRows_, kCols = 64;
  static constexpr bool kTransposed = kTransposed_;
  static_assert(kTransposed || kRows == 64, "an m64 accumulator has 64 rows");
  static constexpr int kFloats = kRows * kCols;
  static constexpr int kChunks = kFloats / 4 / 128;  // float4s a consumer thread
  // The first float of tile (row block, column block) of one batch row and head.
  __host__ __device__ static int64_t tile(const BwdParams& p, int batch, int head, int row_block, int col_block) {
    const int64_t row_blocks = p.stats_stride / kRows, col_blocks = p.head_dim / kCols;
    return (((int64_t(batch) * p.heads + head) * row_blocks + row_block) * col_blocks + col_block) * kFloats;
  }
  // Where thread t's accumulator elements 4 c .. 4 c + 3 go: a float4, chunk c * 128 + t of the tile.
  __host__ __device__ static constexpr int chunk(int c, int thread) { return c * 128 + thread; }
};

// dQ [B, T, N, H] in T from the tiles: a CTA of 128 threads per tile. Each thread reads the float4
// chunks that consumer thread t wrote: accumulator rows warp * 16 + lane / 4 and + 8, two adjacent
// accumulator columns of each n8 tile (dQ rows and columns, or with kTransposed the other way
// round). The tile goes out through shared memory as 16-byte row chunks. With dQ tickets, a tile
// of a query block (kStepRows rows) that no CTA visited was never written: its dQ is 0.
template <typename T, typename Tiles, int kStepRows>
__global__ void __launch_bounds__(128) dq_from_tiles(const BwdParams p) {
  constexpr int kRows = Tiles::kRows, kCols = Tiles::kCols;
  constexpr int kRowBytes = kCols * 2 + 16;  // padded: the writes of a warp spread over the banks
  __shared__ __align__(16) char staging[kRows * kRowBytes];
  const int col_blocks = p.head_dim / kCols, row_blocks = p.stats_stride / kRows;
  const int col_block = blockIdx.x % col_blocks, row_block = (blockIdx.x / col_blocks) % row_blocks;
  const int batch_head = blockIdx.x / (col_blocks * row_blocks);
  const int head = batch_head % p.heads, batch = batch_head / p.heads;
  const int row0 = row_block * kRows;
  if (row0 >= p.seqlen_q) return;
  const int t = threadIdx.x, warp = t / 32, lane = t % 32;
  const float4* tile = reinterpret_cast<const float4*>(p.dq_accum + Tiles::tile(p, batch, head, row_block, col_block));
  const bool unvisited = p.dq_tickets != nullptr && *dq_ticket(p, batch_head, row0 / kStepRows, kStepRows) == 0;
  const uint32_t staged = ptx::smem_addr(staging);
#pragma unroll
  for (int c = 0; c < Tiles::kChunks; ++c) {
    float4 v = unvisited ? make_float4(0.f, 0.f, 0.f, 0.f) : tile[Tiles::chunk(c, t)];
    v = {v.x * p.scale, v.y * p.scale, v.z * p.scale, v.w * p.scale};  // bwd_kernel's dS leaves it out
    const int acc_row = warp * 16 + lane / 4, acc_col = c * 8 + (lane % 4) * 2;
    if constexpr (Tiles::kTransposed) {
      // Elements (acc_row, acc_col), (acc_row, acc_col + 1), then the same 8 rows down.
      const float values[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = acc_col + e % 2, col = acc_row + (e / 2) * 8;
        ptx::st_shared_b16(staged + row * kRowBytes + col * 2, uint16_t(ptx::pack2<T>(values[e], 0.f)));
      }
    } else {
      ptx::st_shared_b32(staged + acc_row * kRowBytes + acc_col * 2, ptx::pack2<T>(v.x, v.y));
      ptx::st_shared_b32(staged + (acc_row + 8) * kRowBytes + acc_col * 2, ptx::pack2<T>(v.z, v.w));
    }
  }
  __syncthreads();
  const int64_t row_stride = int64_t(p.heads) * p.head_dim;
  T* dq = static_cast<T*>(p.dq) + (int64_t(batch) * p.seqlen_q + row0) * row_stride + head * p.head_dim +
          col_block * kCols;
#pragma unroll
  for (int i = t; i < kRows * 8; i += 128) {
    const int row = i / 8, chunk = i % 8;
    if (row0 + row < p.seqlen_q) {
      *reinterpret_cast<uint4*>(dq + row * row_stride + chunk * 8) =
          ptx::ld_shared_v4(staged + row * kRowBytes + chunk * 16);
    }
  }
}

template <typename T, typename Tiles, int kStepRows>
cudaError_t launch_dq_from_tiles(const BwdParams& p, cudaStream_t stream) {
  const int64_t tiles = int64_t(p.batch) * p.heads * (p.stats_stride / Tiles::kRows) * (p.head_dim / Tiles::kCols);
  dq_from_tiles<T, Tiles, kStepRows><<<tiles, 128, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_flash::sm90
