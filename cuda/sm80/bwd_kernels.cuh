// FlashAttention-2 backward on mma.sync (sm_80 and newer): two kernels.
//
// 1. bwd_preprocess: delta = rowsum(dO * O) - dlse per query row (dlse: the cotangent of the
//    returned log-sum-exp, whose derivative is P), and zeroes the fp32 dQ accumulator
//    (XLA hands us uninitialised output buffers).
// 2. bwd_dkdv_kernel: one CTA per (key block, batch, kv head). Each warp owns 16 keys and keeps
//    their dK and dV in registers while the CTA walks every query block of every query head of
//    the GQA group, so dK/dV of a group are summed without atomics and written once. The
//    products run transposed (S^T = K Q^T, dP^T = V dO^T) so that P^T and dS^T come out of the
//    accumulators already in the A-operand layout of dV += P^T dO and dK += dS^T Q.
//    dQ += dS K needs every key of the block: dS^T goes through shared memory and each warp adds
//    a [16 x H/k] share of dQ into the fp32 accumulator with atomics (the separate-kernel
//    alternative would recompute S and dP a second time).
#pragma once

#include <cmath>

#include "common/mask.cuh"
#include "common/params.h"
#include "common/ptx.cuh"
#include "common/tile.cuh"
#include "sm80/traits.cuh"

namespace jax_flash::sm80 {

constexpr float kLog2e = 1.4426950408889634f;

// One warp per (batch, query, head) row: delta = sum_h dO * O - dlse, and dq_accum row = 0.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(128) bwd_preprocess(const BwdParams p) {
  constexpr int kChunks = kHeadDim / 8;
  static_assert(kChunks <= 32, "one 16-byte chunk per lane");
  const int64_t row = int64_t(blockIdx.x) * 4 + threadIdx.x / 32;  // index into [B, T, N]
  const int lane = threadIdx.x % 32;
  if (row >= int64_t(p.batch) * p.seqlen_q * p.heads) return;
  float sum = 0.f;
  if (lane < kChunks) {
    const int64_t offset = row * kHeadDim + lane * 8;
    const uint4 o = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.o) + offset);
    const uint4 d = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.dout) + offset);
    const uint32_t os[4] = {o.x, o.y, o.z, o.w}, ds[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 a = ptx::unpack2<T>(os[i]), b = ptx::unpack2<T>(ds[i]);
      sum += a.x * b.x + a.y * b.y;
    }
    float4* acc = reinterpret_cast<float4*>(p.dq_accum + offset);
    acc[0] = make_float4(0.f, 0.f, 0.f, 0.f);
    acc[1] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
#pragma unroll
  for (int mask = 16; mask > 0; mask /= 2) sum += __shfl_xor_sync(0xffffffff, sum, mask);
  if (lane == 0) {
    const int head = row % p.heads;
    const int64_t bt = row / p.heads;
    const int batch = bt / p.seqlen_q, q = bt % p.seqlen_q;
    const int64_t index = (int64_t(batch) * p.heads + head) * p.seqlen_q + q;
    p.delta[index] = sum - p.dlse[index];
  }
}

template <typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1) bwd_dkdv_kernel(const BwdParams p) {
  using T = typename Cfg::T;
  using KTile = typename Cfg::KTile;
  using QTile = typename Cfg::QTile;
  using DsTile = typename Cfg::DsTile;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  constexpr int kMTiles = kBlockM / 8;    // n8 tiles of S^T (over queries) per warp
  constexpr int kDTiles = kHeadDim / 8;   // n8 tiles of dK, dV per warp
  constexpr int kKSteps = kHeadDim / 16;  // k16 steps over the head dim

  extern __shared__ __align__(128) char smem[];
  const uint32_t smem_base = ptx::smem_addr(smem);
  // Layout: K, V, kStages x (Q, dO, lse, delta), dS^T. Re-derived from an opaque base in the main
  // loop (see ptx::opaque) so that fragment addresses are not all hoisted into registers.
  uint32_t sK = smem_base, sV = sK + KTile::kBytes, sStages = sV + KTile::kBytes;
  uint32_t sDs = sStages + Cfg::kStages * Cfg::kStageBytes;
  // Per stage: Q tile, dO tile, then the lse and delta of its rows (float32).
  auto stage_q = [&](int s) { return sStages + s * Cfg::kStageBytes; };
  auto stage_do = [&](int s) { return stage_q(s) + QTile::kBytes; };
  auto stage_stats = [&](int s) { return stage_do(s) + QTile::kBytes; };

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int n_block = blockIdx.x;
  const int batch = blockIdx.y / p.kv_heads, kv_head = blockIdx.y % p.kv_heads;
  const int group = p.heads / p.kv_heads;
  const int k_first = n_block * kBlockN;
  const int keys_valid = min(kBlockN, p.seqlen_k - k_first);
  const Band band = Band::from(p);
  const float scale_log2 = p.scale * kLog2e;

  const int64_t q_row_stride = int64_t(p.heads) * kHeadDim;
  const int64_t kv_row_stride = int64_t(p.kv_heads) * kHeadDim;
  const int64_t kv_offset = (int64_t(batch) * p.seqlen_k + k_first) * kv_row_stride + kv_head * kHeadDim;

  const int m_begin = band.query_begin(k_first, p.seqlen_q) / kBlockM;
  const int m_end = (band.query_end(k_first + keys_valid - 1, p.seqlen_q) + kBlockM - 1) / kBlockM;
  const int steps = group * max(0, m_end - m_begin);

  // The steps walk query blocks m_begin..m_end of each query head of the group in turn; counted
  // rather than divided out of the step index (an integer division per step showed in profiles).
  struct Cursor {
    int head, m_block;
    __device__ void advance(int first, int end) {
      if (++m_block == end) m_block = first, ++head;
    }
  };

  // Rows past seqlen_q are zero-filled in every tile (Q, dO, lse, delta), so they give dS = 0
  // and add nothing to dK or dV (their P^T is multiplied by a zero dO row).
  auto prefetch = [&](Cursor c, int stage) {
    const int q_first = c.m_block * kBlockM;
    const int64_t offset = (int64_t(batch) * p.seqlen_q + q_first) * q_row_stride + c.head * kHeadDim;
    const int rows = p.seqlen_q - q_first;
    load_tile_async<QTile, Cfg::kThreads, false>(stage_q(stage), static_cast<const T*>(p.q) + offset,
                                                 q_row_stride, rows, tid);
    load_tile_async<QTile, Cfg::kThreads, false>(stage_do(stage), static_cast<const T*>(p.dout) + offset,
                                                 q_row_stride, rows, tid);
    const int64_t row_offset = (int64_t(batch) * p.heads + c.head) * p.seqlen_q + q_first;
    const int r = tid % kBlockM;
    if (tid < 2 * kBlockM) {
      const float* src = (tid < kBlockM ? p.lse : p.delta) + row_offset + (r < rows ? r : 0);
      ptx::cp_async_4(stage_stats(stage) + tid * 4, src, r < rows);
    }
  };

  load_tile_async<KTile, Cfg::kThreads, false>(sK, static_cast<const T*>(p.k) + kv_offset, kv_row_stride,
                                               keys_valid, tid);
  load_tile_async<KTile, Cfg::kThreads, false>(sV, static_cast<const T*>(p.v) + kv_offset, kv_row_stride,
                                               keys_valid, tid);
  Cursor cur{kv_head * group, m_begin}, next = cur;
  next.advance(m_begin, m_end);
  if (steps > 0) prefetch(cur, 0);
  ptx::cp_async_commit();

  float acc_dk[kDTiles][4], acc_dv[kDTiles][4];
#pragma unroll
  for (int d = 0; d < kDTiles; ++d)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc_dk[d][i] = acc_dv[d][i] = 0.f;

  const int key_row = warp * 16 + lane / 4;  // this thread's key rows: key_row and key_row + 8
  for (int s = 0; s < steps; ++s) {
    sK = ptx::opaque(smem_base);
    sV = sK + KTile::kBytes;
    sStages = sV + KTile::kBytes;
    sDs = sStages + Cfg::kStages * Cfg::kStageBytes;
    const int stage = s % Cfg::kStages;
    ptx::cp_async_wait<0>();
    // One barrier for two things: this step's tiles have landed, and every warp is done with the
    // previous step, whose stage buffer the prefetch below refills and whose dS^T gets rewritten.
    __syncthreads();
    if (s + 1 < steps) prefetch(next, (s + 1) % Cfg::kStages);
    ptx::cp_async_commit();
    const uint32_t sQ = stage_q(stage), sDo = stage_do(stage);
    const float* stats = reinterpret_cast<const float*>(smem + (stage_stats(stage) - smem_base));
    const int head = cur.head;
    const int q_first = cur.m_block * kBlockM;
    cur = next;
    next.advance(m_begin, m_end);

    // S^T = K Q^T and dP^T = V dO^T: 16 keys x kBlockM queries per warp.
    float acc_s[kMTiles][4], acc_dp[kMTiles][4];
#pragma unroll
    for (int n = 0; n < kMTiles; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_s[n][i] = acc_dp[n][i] = 0.f;
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      uint32_t a_k[4], a_v[4];
      ptx::ldmatrix_x4(a_k, sK + KTile::offset(warp * 16 + lane % 16, ks * 2 + lane / 16));
      ptx::ldmatrix_x4(a_v, sV + KTile::offset(warp * 16 + lane % 16, ks * 2 + lane / 16));
#pragma unroll
      for (int n = 0; n < kMTiles; n += 2) {
        uint32_t b[4];
        const int row = n * 8 + lane % 8 + (lane / 16) * 8, chunk = ks * 2 + (lane / 8) % 2;
        ptx::ldmatrix_x4(b, sQ + QTile::offset(row, chunk));
        ptx::mma_16816<T>(acc_s[n], a_k, b[0], b[1]);
        ptx::mma_16816<T>(acc_s[n + 1], a_k, b[2], b[3]);
        ptx::ldmatrix_x4(b, sDo + QTile::offset(row, chunk));
        ptx::mma_16816<T>(acc_dp[n], a_v, b[0], b[1]);
        ptx::mma_16816<T>(acc_dp[n + 1], a_v, b[2], b[3]);
      }
    }

    // P^T = exp(scale * S^T - lse) and dS^T = scale * P^T (dP^T - delta). A row that sees no key
    // has lse = -inf and must give P = 0; keys outside the band or past seqlen_k are masked here.
    const bool masked = !band.all_visible(q_first, q_first + kBlockM - 1, k_first, k_first + kBlockN - 1);
#pragma unroll
    for (int n = 0; n < kMTiles; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int col = n * 8 + (lane % 4) * 2 + i % 2;
        const int key = k_first + key_row + (i / 2) * 8;
        const float lse = stats[col];
        float prob = lse == -INFINITY ? 0.f : ptx::exp2(acc_s[n][i] * scale_log2 - lse * kLog2e);
        if (masked && !band.visible(q_first + col, key)) prob = 0.f;
        acc_s[n][i] = prob;
        acc_dp[n][i] = prob * (acc_dp[n][i] - stats[kBlockM + col]) * p.scale;
      }

    // dV += P^T dO and dK += dS^T Q; dS^T also goes to shared memory for dQ.
#pragma unroll
    for (int ks = 0; ks < kBlockM / 16; ++ks) {
      uint32_t a_p[4], a_ds[4];
      ptx::accumulators_to_a<T>(a_p, acc_s[2 * ks], acc_s[2 * ks + 1]);
      ptx::accumulators_to_a<T>(a_ds, acc_dp[2 * ks], acc_dp[2 * ks + 1]);
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // the two n8 tiles (query columns) of this k16 step
        const int byte = (lane % 4) * 4;
        ptx::st_shared_b32(sDs + DsTile::offset(key_row, 2 * ks + half) + byte, a_ds[2 * half]);
        ptx::st_shared_b32(sDs + DsTile::offset(key_row + 8, 2 * ks + half) + byte, a_ds[2 * half + 1]);
      }
#pragma unroll
      for (int d = 0; d < kDTiles; d += 2) {
        uint32_t b[4];
        const int row = ks * 16 + lane % 8 + ((lane / 8) % 2) * 8, chunk = d + lane / 16;
        ptx::ldmatrix_x4_trans(b, sDo + QTile::offset(row, chunk));
        ptx::mma_16816<T>(acc_dv[d], a_p, b[0], b[1]);
        ptx::mma_16816<T>(acc_dv[d + 1], a_p, b[2], b[3]);
        ptx::ldmatrix_x4_trans(b, sQ + QTile::offset(row, chunk));
        ptx::mma_16816<T>(acc_dk[d], a_ds, b[0], b[1]);
        ptx::mma_16816<T>(acc_dk[d + 1], a_ds, b[2], b[3]);
      }
    }
    __syncthreads();  // dS^T of every warp is in shared memory

    // dQ[q_first .. +kBlockM) += dS K: this warp's 16 query rows x kDqTilesPerWarp n8 tiles.
    {
      const int row_tile = warp / Cfg::kDqWarpsPerRowTile;
      const int d_first = (warp % Cfg::kDqWarpsPerRowTile) * Cfg::kDqTilesPerWarp;
      float acc_dq[Cfg::kDqTilesPerWarp][4];
#pragma unroll
      for (int d = 0; d < Cfg::kDqTilesPerWarp; ++d)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc_dq[d][i] = 0.f;
#pragma unroll
      for (int ks = 0; ks < kBlockN / 16; ++ks) {
        uint32_t a[4];  // dS rows (queries) from dS^T, transposed by ldmatrix
        ptx::ldmatrix_x4_trans(a, sDs + DsTile::offset(ks * 16 + lane % 8 + (lane / 16) * 8,
                                                       row_tile * 2 + (lane / 8) % 2));
#pragma unroll
        for (int d = 0; d < Cfg::kDqTilesPerWarp; d += 2) {
          uint32_t b[4];
          ptx::ldmatrix_x4_trans(b, sK + KTile::offset(ks * 16 + lane % 8 + ((lane / 8) % 2) * 8,
                                                       d_first + d + lane / 16));
          ptx::mma_16816<T>(acc_dq[d], a, b[0], b[1]);
          ptx::mma_16816<T>(acc_dq[d + 1], a, b[2], b[3]);
        }
      }
      float* dq = p.dq_accum + (int64_t(batch) * p.seqlen_q + q_first) * q_row_stride + head * kHeadDim;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int q = row_tile * 16 + lane / 4 + r * 8;
        if (q_first + q < p.seqlen_q) {
#pragma unroll
          for (int d = 0; d < Cfg::kDqTilesPerWarp; ++d)
            ptx::red_add_f32x2(dq + q * q_row_stride + (d_first + d) * 8 + (lane % 4) * 2,
                               acc_dq[d][2 * r], acc_dq[d][2 * r + 1]);
        }
      }
    }
  }
  ptx::cp_async_wait<0>();
  __syncthreads();

  // Epilogue: dK, dV to T, staged in this warp's own rows of sK / sV, stored as 16-byte chunks.
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int d = 0; d < kDTiles; ++d) {
      const int off = KTile::offset(key_row + r * 8, d) + (lane % 4) * 4;
      ptx::st_shared_b32(sK + off, ptx::pack2<T>(acc_dk[d][2 * r], acc_dk[d][2 * r + 1]));
      ptx::st_shared_b32(sV + off, ptx::pack2<T>(acc_dv[d][2 * r], acc_dv[d][2 * r + 1]));
    }
  __syncwarp();
  T* gdk = static_cast<T*>(p.dk) + kv_offset;
  T* gdv = static_cast<T*>(p.dv) + kv_offset;
  constexpr int kChunks = KTile::kChunks;
#pragma unroll
  for (int i = lane; i < 16 * kChunks; i += 32) {
    const int row = warp * 16 + i / kChunks, chunk = i % kChunks;
    if (row < keys_valid) {
      *reinterpret_cast<uint4*>(gdk + row * kv_row_stride + chunk * 8) =
          ptx::ld_shared_v4(sK + KTile::offset(row, chunk));
      *reinterpret_cast<uint4*>(gdv + row * kv_row_stride + chunk * 8) =
          ptx::ld_shared_v4(sV + KTile::offset(row, chunk));
    }
  }
}

}  // namespace jax_flash::sm80
