// The mma.sync forward at head dims 320, 384, 448 and 512 (sm_80 and newer; DESIGN.md, "Head dims
// above 256"): the Hopper kernel's split (sm90/wide_fwd_kernel.cuh) with warps for warpgroups.
//
// One CTA a 64-row query tile, 8 warps: warp w takes rows 16 (w % 4) .. + 15 and half h = w / 4,
// which is both its 16 of each block's 32 keys (for S) and its half of O's columns (for P V):
// O of 16 rows x 512 columns would take 256 registers a thread. Q stays in shared memory; each
// key block's K and V (one buffer each, by cp.async) load behind the products that last read
// them: K of block j + 1 under the softmax and P V of block j, V of j + 1 under S of j + 1. Per
// key block:
//   1. S = Q K^T over the warp's 16 keys; cap and band mask; the rows' maxima of both halves meet
//      in shared memory (barrier), so that both rescale with the same maximum;
//   2. P of its keys into a shared [64 x 32] tile, O rescaled (barrier);
//   3. O[:, its columns] += P (all 32 keys) V[:, its columns].
// At the end the rows' sums meet the same way; each warp stores its columns of O, half 0 the
// log-sum-exp. The plain, masked and capped variants; a bias takes the xla path.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/fragment_mask.cuh"
#include "common/grid.cuh"
#include "common/logits.cuh"
#include "common/mask.cuh"
#include "common/params.h"
#include "common/ptx.cuh"
#include "common/row_total.cuh"
#include "common/split_rows.cuh"
#include "common/tile.cuh"
#include "sm80/wide_fwd/config.cuh"
#include "common/softmax_rows.cuh"  // row operations on the accumulator layout, which mma.sync shares

namespace jax_flash::sm80 {

// kVariant: kPlain, kMasked (lengths, segment ids) or kSoftcap.
template <typename Cfg, Variant kVariant>
__global__ void __launch_bounds__(Cfg::kThreads, 1) wide_fwd_kernel(const FwdParams p) {
  using T = typename Cfg::T;
  using QTile = typename Cfg::QTile;
  using KTile = typename Cfg::KTile;
  using PTile = typename Cfg::PTile;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  constexpr int kHalfKeys = Cfg::kHalfKeys, kHalfCols = Cfg::kHalfCols;
  constexpr int kKSteps = kHeadDim / 16;      // k16 steps of Q K^T
  constexpr int kOTiles = kHalfCols / 8;      // n8 tiles of the warp's O
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr bool kMasked = kVariant == Variant::kMasked;
  static_assert(kVariant != Variant::kEverything, "a bias or mask takes the xla path");

  extern __shared__ __align__(128) char smem[];
  const uint32_t sQ = ptx::smem_addr(smem), sK = sQ + Cfg::kK, sV = sQ + Cfg::kV, sP = sQ + Cfg::kP;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int half = warp / 4, warp_row0 = (warp % 4) * 16;
  const int rows[2] = {warp_row0 + lane / 4, warp_row0 + 8 + lane / 4};  // this thread's, of the tile
  const SplitRows split{reinterpret_cast<float*>(smem + Cfg::kRowStats), half, {rows[0], rows[1]}, lane % 4 == 0};

  // Longest rows first: with a causal band the last query blocks have the most keys.
  const int q_first = (gridDim.x - 1 - blockIdx.x) * kBlockM;
  const int batch = batch_head_index() / p.heads, head = batch_head_index() % p.heads;
  const int kv_head = head / (p.heads / p.kv_heads);
  const int rows_valid = min(kBlockM, p.seqlen_q - q_first);
  const Band band = Band::from<kMasked>(p, batch);
  using LogitsT = Logits<cap_of(kVariant)>;
  const LogitsT logits = LogitsT::from(p);
  const float scale_log2 = logits.unit * kLog2e;

  const int64_t q_row_stride = int64_t(p.heads) * kHeadDim, kv_row_stride = int64_t(p.kv_heads) * kHeadDim;
  const T* const gQ = static_cast<const T*>(p.q) + (int64_t(batch) * p.seqlen_q + q_first) * q_row_stride +
                      int64_t(head) * kHeadDim;
  const T* const gK = static_cast<const T*>(p.k) + int64_t(batch) * p.seqlen_k * kv_row_stride +
                      int64_t(kv_head) * kHeadDim;
  const T* const gV = static_cast<const T*>(p.v) + int64_t(batch) * p.seqlen_k * kv_row_stride +
                      int64_t(kv_head) * kHeadDim;
  const Range keys = band.keys_of(q_first, q_first + rows_valid - 1);
  const int n_first = keys.begin / kBlockN;
  const int blocks = keys.end > keys.begin ? (keys.end + kBlockN - 1) / kBlockN - n_first : 0;
  auto load_block = [&](uint32_t tile, const T* g, int j) {
    const int k_first = (n_first + j) * kBlockN;
    load_tile<KTile, Cfg::kThreads, false>(tile, g + int64_t(k_first) * kv_row_stride, kv_row_stride,
                                                 (kMasked ? band.seqlen_k : p.seqlen_k) - k_first, tid);  // zero past the length: ignored keys
    ptx::cp_async_commit();
  };

  float o[kOTiles * 4];
#pragma unroll
  for (int i = 0; i < kOTiles * 4; ++i) o[i] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};  // row_sum: this thread's columns

  // Fragment addresses (tile.cuh): Q as A (lanes 0-15 rows, 16-31 the second 8 columns); K as B
  // (keys n*8 .. + 15 of this half x columns 2 ks, 2 ks + 1).
  const ChunkWalk<QTile, kKSteps> a_q(sQ, warp_row0 + lane % 16, lane / 16);
  const ChunkWalk<KTile, kKSteps> b_k(sK, half * kHalfKeys + lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
  // V as B, transposed: keys ks * 16 + (0 .. 15) x this half's n8 tiles 2 dp, 2 dp + 1 (computed
  // per access: half a row's chunks need not start a swizzle panel).
  const int v_row = lane % 8 + ((lane / 8) % 2) * 8, v_chunk = half * (kHalfCols / 8) + lane / 16;

  if (blocks > 0) {
    load_tile<QTile, Cfg::kThreads, false>(sQ, gQ, q_row_stride, rows_valid, tid);
    load_block(sK, gK, 0);  // with Q: one group
    load_block(sV, gV, 0);
  }
  for (int j = 0; j < blocks; ++j) {
    const int key_first = (n_first + j) * kBlockN + half * kHalfKeys;  // this warp's keys
    ptx::cp_async_wait<1>();  // Q and K of block j (V of j may still be in flight)
    __syncthreads();

    // 1. S = Q K^T over this warp's 16 keys (two n8 tiles: s[0..3], s[4..7], the accumulator layout).
    float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      uint32_t a[4], b[4];
      ptx::ldmatrix_x4(a, a_q(ks));
      ptx::ldmatrix_x4(b, b_k(ks));
      ptx::mma_16816<T>(reinterpret_cast<float(&)[4]>(s[0]), a, b[0], b[1]);
      ptx::mma_16816<T>(reinterpret_cast<float(&)[4]>(s[4]), a, b[2], b[3]);
    }
    if constexpr (LogitsT::kMayCap) {
#pragma unroll
      for (int i = 0; i < 8; ++i) s[i] = logits.value(s[i]);
    }
    if (!band.all_visible(q_first, q_first + kBlockM - 1, key_first, key_first + kHalfKeys - 1)) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mask_query_row<kHalfKeys / 8>(band, q_first + rows[r], key_first, lane, -INFINITY,
                                      [&](int n8, int c) -> float& { return s[4 * n8 + 2 * r + c]; });
      }
    }
    const float block_max[2] = {sm90::block_row_max(s, 0), sm90::block_row_max(s, 1)};
    split.put_max(block_max);
    __syncthreads();  // both halves' maxima; every warp is done with K of block j
    if (j + 1 < blocks) load_block(sK, gK, j + 1);

    // 2. P of this warp's keys into the P tile, O rescaled.
    float shift[2], rescale[2];
    split.merge_max(block_max, row_max, scale_log2, shift, rescale);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_sum[r] = row_sum[r] * rescale[r] + sm90::exponentiate<0>(s, r, shift[r], false, logits, scale_log2);
    }
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
      const int col = half * kHalfKeys + (i / 4) * 8 + (lane % 4) * 2;
      ptx::st_shared_b32(sP + PTile::offset(rows[(i % 4) / 2], col / 8) + (col % 8) * 2, ptx::pack2<T>(s[i], s[i + 1]));
    }
#pragma unroll
    for (int i = 0; i < kOTiles * 4; ++i) o[i] *= rescale[(i % 4) / 2];
    if (j + 1 < blocks) {
      ptx::cp_async_wait<1>();  // V of block j (K of j + 1 may still be in flight)
    } else {
      ptx::cp_async_wait<0>();
    }
    __syncthreads();  // P whole; V of block j visible

    // 3. O[:, its columns] += P V[:, its columns], 16 keys a k16 step.
#pragma unroll
    for (int ks = 0; ks < kBlockN / 16; ++ks) {
      uint32_t a[4];
      ptx::ldmatrix_x4(a, sP + PTile::offset(warp_row0 + lane % 16, 2 * ks + lane / 16));
#pragma unroll
      for (int dp = 0; dp < kOTiles / 2; ++dp) {
        uint32_t b[4];
        ptx::ldmatrix_x4_trans(b, sV + KTile::offset(ks * 16 + v_row, v_chunk + 2 * dp));
        ptx::mma_16816<T>(reinterpret_cast<float(&)[4]>(o[8 * dp]), a, b[0], b[1]);
        ptx::mma_16816<T>(reinterpret_cast<float(&)[4]>(o[8 * dp + 4]), a, b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with V of block j and with the P tile
    if (j + 1 < blocks) load_block(sV, gV, j + 1);
  }

  // The rows' sums over both halves' keys, then this warp's columns of O and (half 0) the lse.
  const RowTotal own[2] = {RowTotal(row_sum[0]), RowTotal(row_sum[1])};
  split.put_sums(own);
  __syncthreads();
  T* const out = static_cast<T*>(p.o) + (int64_t(batch) * p.seqlen_q + q_first) * q_row_stride +
                 int64_t(head) * kHeadDim + half * kHalfCols + (lane % 4) * 2;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const RowTotal total = split.total(own[r], r);
    float inv, lse;
    total.finish(row_max[r], logits.unit, p, batch, head, inv, lse);
    if (rows[r] < rows_valid) {
#pragma unroll
      for (int n8 = 0; n8 < kOTiles; ++n8) {
        *reinterpret_cast<uint32_t*>(out + rows[r] * q_row_stride + n8 * 8) =
            ptx::pack2<T>(o[4 * n8 + 2 * r] * inv, o[4 * n8 + 2 * r + 1] * inv);
      }
      if (half == 0 && lane % 4 == 0) {
        p.lse[(int64_t(batch) * p.heads + head) * p.seqlen_q + q_first + rows[r]] = lse;
      }
    }
  }
}

}  // namespace jax_flash::sm80
