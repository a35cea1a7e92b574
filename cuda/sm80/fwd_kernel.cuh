// FlashAttention-2 forward on mma.sync (sm_80 and newer).
//
// One CTA computes kBlockM query rows of one head; each warp owns kWarpRows of them (one or two
// m16 tiles: two halve the shared-memory reads of K and V per FLOP), so the softmax statistics of
// a row live in the 4 threads of one quad and need no shared memory. K and V tiles stream
// through two shared-memory stages with cp.async: block j-1 loads while block j is computed,
// with one barrier per key block. Key blocks are visited from the last one down, so the (few)
// blocks that need the band mask come first and the rest run unmasked.
//
// The pieces, in sm80/fwd/: products.cuh (S = Q K^T, O += P V), block_logits.cuh (cap and bias)
// and epilogue.cuh (O and the log-sum-exp out); from common/: the band mask (fragment_mask.cuh)
// and the online softmax (online_softmax.cuh, shared with the decode kernel); fwd/query_block.cuh
// says which rows a CTA takes.
//
// With kRagged, the CTAs take the prefill items of a ragged batch (decode/params.h's
// DecodeParams::prefill_work) and read K and V through its page table: a sequence's queries are
// the last of its keys (the band's diagonal from its lengths), its sinks and lengths a row per
// sequence, q and o [Q, N, H], lse [N, Q].
#pragma once

#include <cmath>
#include <type_traits>

#include "common/bias.cuh"
#include "common/fragment_mask.cuh"
#include "common/grid.cuh"
#include "common/logits.cuh"
#include "common/mask.cuh"
#include "common/online_softmax.cuh"
#include "common/params.h"
#include "common/ptx.cuh"
#include "common/tile.cuh"
#include "decode/kv_source.cuh"
#include "decode/params.h"
#include "sm80/fwd/block_logits.cuh"
#include "sm80/fwd/epilogue.cuh"
#include "sm80/fwd/products.cuh"
#include "sm80/fwd/query_block.cuh"
#include "sm80/config.cuh"

namespace jax_flash::sm80 {

// kVariant (params.h): which of the masks (mask.cuh, bias.cuh) and the soft cap (logits.cuh) are read.
template <typename Cfg, Variant kVariant, bool kRagged = false>
__global__ void __launch_bounds__(Cfg::kThreads)
    fwd_kernel(const std::conditional_t<kRagged, DecodeParams, FwdParams> p) {
  using T = typename Cfg::T;
  using QTile = typename Cfg::QTile;
  using KTile = typename Cfg::KTile;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  constexpr int kMTiles = Cfg::kWarpRows / 16;  // m16 tiles per warp
  constexpr int kNTiles = kBlockN / 8;    // n8 tiles of S per warp
  constexpr int kDTiles = kHeadDim / 8;   // n8 tiles of O per warp
  constexpr int kKSteps = kHeadDim / 16;  // k16 steps of Q K^T
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr bool kMasked = kVariant != Variant::kPlain, kBias = kVariant == Variant::kEverything;
  static_assert(!kRagged || (kMasked && !kBias), "a ragged batch's band is its lengths'; no bias");

  extern __shared__ __align__(128) char smem[];
  const uint32_t sQ = ptx::smem_addr(smem);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  QueryBlock block;
  if constexpr (kRagged) {
    block = QueryBlock::ragged<kBlockM>(p);
    if (block.batch < 0 || block.q_first >= block.queries) return;  // past the step's prefill work
  } else {
    block = QueryBlock::dense<kBlockM>(p);
  }
  const int batch = block.batch, head = block.head;
  const int kv_head = head / (p.heads / p.kv_heads);
  const int q_first = block.q_first;
  const int rows_valid = min(kBlockM, block.queries - q_first);
  const Band band = [&] {
    if constexpr (kRagged) {
      const int kv_length = min(max(__ldg(p.kv_lengths + batch), 0), p.seqlen_k);
      return Band::with_lengths<true>(p, batch, block.queries, kv_length).without_segments();
    } else {
      return Band::from<kMasked>(p, batch);
    }
  }();
  const auto logits = Logits<cap_of(kVariant)>::from(p);
  const LogitBias<T> bias = kBias ? LogitBias<T>::from(p, batch, head, logits.unit) : LogitBias<T>{};

  const int64_t q_row_stride = int64_t(p.heads) * kHeadDim;
  const int64_t kv_row_stride = int64_t(p.kv_heads) * kHeadDim;
  // Ragged: q and o rows from the sequence's first, K and V a pool's column (source: the pages).
  const T* gQ = static_cast<const T*>(p.q) +
                ((kRagged ? int64_t(block.row0) : int64_t(batch) * p.seqlen_q) + q_first) * q_row_stride +
                head * kHeadDim;
  const T* gK = static_cast<const T*>(p.k) + (kRagged ? 0 : int64_t(batch) * p.seqlen_k * kv_row_stride) +
                kv_head * kHeadDim;
  const T* gV = static_cast<const T*>(p.v) + (kRagged ? 0 : int64_t(batch) * p.seqlen_k * kv_row_stride) +
                kv_head * kHeadDim;
  T* gO = static_cast<T*>(p.o) +
          ((kRagged ? int64_t(block.row0) : int64_t(batch) * p.seqlen_q) + q_first) * q_row_stride +
          head * kHeadDim;
  float* gLse = p.lse +
                (kRagged ? int64_t(head) * p.seqlen_q + block.row0 : (int64_t(batch) * p.heads + head) * p.seqlen_q) +
                q_first;
  const auto source = [&] {
    if constexpr (kRagged) {
      return decode::KvSource<T>::of(p, batch, kv_head, kHeadDim);
    } else {
      return 0;
    }
  }();

  const Range keys = band.keys_of(q_first, q_first + rows_valid - 1);
  const int n_begin = keys.begin / kBlockN;
  const int n_end = (keys.end + kBlockN - 1) / kBlockN;

  // This thread's rows (the mma accumulator layout): warp_row0 + mt*16 + lane/4 + {0, 8}.
  const int warp_row0 = warp * Cfg::kWarpRows;
  auto thread_row = [&](int mt, int r) { return warp_row0 + mt * 16 + r * 8 + lane / 4; };
  float row_max[kMTiles][2], row_sum[kMTiles][2];  // row_sum: this thread's columns only
  float acc_o[kMTiles][kDTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) row_max[mt][r] = -INFINITY, row_sum[mt][r] = 0.f;
#pragma unroll
    for (int d = 0; d < kDTiles; ++d)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_o[mt][d][i] = 0.f;
  }

  if (n_begin < n_end) {
    // Key blocks are visited in order j = 0, 1, ... as n_block = n_end - 1 - j. K_j and V_j live
    // in stage j % 2. With Cfg::kKLead, iteration j computes S of block j + 1 before the softmax
    // and P V of block j, so that the tensor cores work while the softmax runs; K then loads one
    // block ahead of V.
    constexpr int kLead = Cfg::kKLead ? 1 : 0;
    const int blocks = n_end - n_begin;
    const uint32_t sK0 = sQ + QTile::kBytes;  // K of stage 0; V follows K in each stage
    auto load_block = [&](const T* g, int j, uint32_t extra) {
      const int k_first = (n_end - 1 - j) * kBlockN;
      if constexpr (kRagged) {
        load_tile_rows<KTile, Cfg::kThreads>(sK0 + (j % 2) * Cfg::kStageBytes + extra, g,
                                             [&](int row) { return source.offset(k_first + row); },
                                             band.seqlen_k - k_first, tid);
      } else {
        load_tile<KTile, Cfg::kThreads, Cfg::kUnrollLoads, true, Cfg::kIsa>(
            sK0 + (j % 2) * Cfg::kStageBytes + extra, g + int64_t(k_first) * kv_row_stride, kv_row_stride,
            (kMasked ? band.seqlen_k : p.seqlen_k) - k_first, tid);  // zero past the length: ignored keys
      }
    };
    auto load_k = [&](int j) { load_block(gK, j, 0); };
    auto load_v = [&](int j) { load_block(gV, j, KTile::kBytes); };

    // Fragment addresses as a few registers per walk (tile.cuh); the K/V ones are for stage 0.
    // Q (A operand): lanes 0-15 give rows, lanes 16-31 the second 8 columns.
    const ChunkWalk<QTile, kKSteps> a_q(sQ, warp_row0 + lane % 16, lane / 16);
    // K (B operand): matrices keys n*8..+7 / +8..+15 x columns 2ks / 2ks+1.
    const ChunkWalk<KTile, kKSteps> b_k(sK0, lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
    // V (B operand, transposed): keys ks*16..+7 / +8..+15 x columns of n8 tiles d, d+1.
    const ChunkWalk<KTile, kDTiles / 2> bt_v(sK0 + KTile::kBytes, lane % 8 + ((lane / 8) % 2) * 8, lane / 16);
    uint32_t q_frag[kMTiles][Cfg::kQInRegs ? kKSteps : 1][4];
    auto load_q_frags = [&] {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int ks = 0; ks < kKSteps; ++ks)
          ptx::ldmatrix_x4(q_frag[mt][Cfg::kQInRegs ? ks : 0], a_q(ks, mt * 16));
    };

    auto compute_s = [&](float (&acc_s)[kMTiles][kNTiles][4], int j) {
      qk_product<Cfg>(acc_s, q_frag, a_q, b_k, (j % 2) * Cfg::kStageBytes);
    };

    // Soft cap and bias (fwd/block_logits.cuh), band mask, then the online softmax of block j;
    // leaves P in acc_s.
    auto softmax = [&](float (&acc_s)[kMTiles][kNTiles][4], int j) {
      const int k_first = (n_end - 1 - j) * kBlockN;
      cap_and_bias<kBias>(acc_s, logits, bias, q_first, k_first, thread_row, lane);
      // Only blocks that straddle the band or the end of the keys need the mask.
      if (!band.all_visible(q_first, q_first + kBlockM - 1, k_first, k_first + kBlockN - 1)) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int q = q_first + thread_row(mt, r);
            mask_query_row<kNTiles>(band, q, k_first, lane, -INFINITY,
                                    [&](int n, int c) -> float& { return acc_s[mt][n][2 * r + c]; });
          }
      }
      // Base 2 with the scale folded in (one FFMA per element).
      const float scale_log2 = logits.unit * kLog2e;
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        online_softmax_step(acc_s[mt], acc_o[mt], row_max[mt], row_sum[mt], scale_log2);
      }
    };

    auto accumulate_pv = [&](const float (&acc_s)[kMTiles][kNTiles][4], int j) {
      pv_product<Cfg>(acc_o, acc_s, bt_v, (j % 2) * Cfg::kStageBytes);
    };

    float s_cur[kMTiles][kNTiles][4], s_next[kMTiles][kNTiles][4];
    load_tile<QTile, Cfg::kThreads, Cfg::kUnrollLoads, false, Cfg::kIsa>(sQ, gQ, q_row_stride, rows_valid, tid);
    load_k(0);
    if (kLead && blocks > 1) load_k(1);
    load_v(0);
    ptx::cp_async_commit();
    if constexpr (kLead) {
      ptx::cp_async_wait<0>();
      __syncthreads();
      if constexpr (Cfg::kQInRegs) load_q_frags();
      compute_s(s_cur, 0);
    }
    // One key block: s_this holds S of block j (with kLead; otherwise it is computed here),
    // s_following receives S of block j + 1.
    auto iteration = [&](float (&s_this)[kMTiles][kNTiles][4], float (&s_following)[kMTiles][kNTiles][4],
                         int j) {
      ptx::cp_async_wait<0>();  // K_{j+lead} and V_j (and Q) have landed
      // The one barrier per key block: the tiles are visible to every warp, and every warp is
      // done with the stage buffers that the loads below refill.
      __syncthreads();
      if (!kLead && Cfg::kQInRegs && j == 0) load_q_frags();
      if (j + kLead + 1 < blocks) load_k(j + kLead + 1);
      if (j + 1 < blocks) load_v(j + 1);
      ptx::cp_async_commit();
      if constexpr (kLead) {
        // Unconditional, so that these mma.sync and the softmax below form one basic block the
        // compiler can interleave; past the last block the result is never used.
        compute_s(s_following, j + 1);
      } else {
        compute_s(s_this, j);
      }
      softmax(s_this, j);
      accumulate_pv(s_this, j);
    };
    if constexpr (kLead) {
      // Two blocks per trip, the S buffers swapping roles, so that no register moves copy S.
      for (int j = 0; j < blocks; j += 2) {
        iteration(s_cur, s_next, j);
        if (j + 1 == blocks) break;
        iteration(s_next, s_cur, j + 1);
      }
    } else {
      for (int j = 0; j < blocks; ++j) iteration(s_cur, s_cur, j);
    }
  }

  store_output<Cfg>(acc_o, row_max, row_sum, logits.unit, p, batch, head, sQ, gO, gLse, q_row_stride, rows_valid, warp_row0,
                    lane);
}

}  // namespace jax_flash::sm80
