// The Hopper forward at head dims 320-512, and 640-1024 as pairs of CTAs that split the head dim
// (sm90/wide_fwd/config.cuh). One CTA (or pair) a 64-row query tile: a producer thread copies Q
// once, then each key block's K and V (one buffer each: K of block j + 1 loads under P V of block
// j, V of j + 1 under S of j + 1). Each key block:
//   1. consumer w computes S for its 32 keys over the whole head dim (wgmma m64n32); in a pair,
//      over its CTA's half, then adds the peer's half (score_exchange.cuh);
//   2. cap and band mask; the rows' maxima meet in shared memory (named barrier 1), so that both
//      consumers rescale with the same maximum;
//   3. P of its keys to shared memory (the A operand of P V), O rescaled (named barrier 2);
//   4. O[:, its panels] += P (all 64 keys) V[:, its panels] (the first half of the 64-column
//      panels, rounded up, consumer 0's; the rest consumer 1's).
// At the end the rows' sums meet the same way, each consumer stores its panels of O and consumer 0
// (of the pair's first CTA) the log-sum-exp.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/accumulator.cuh"
#include "common/fragment_mask.cuh"
#include "common/grid.cuh"
#include "common/logits.cuh"
#include "common/mask.cuh"
#include "common/params.h"
#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"
#include "common/row_total.cuh"
#include "common/split_rows.cuh"
#include "common/softmax_rows.cuh"
#include "sm90/common/head_dim_product.cuh"
#include "sm90/common/ignored_rows.cuh"
#include "sm90/wide_fwd/config.cuh"

namespace jax_flash::sm90 {

// One consumer warpgroup's part of a tile (the kernel below): S of its 32 keys of each block, and
// O's kOChunks 64-column panels from first_panel (of the CTA's columns, which start at column
// rank * kCtaHeadDim); row_stats: the consumers' row statistics in shared memory (Cfg::kRowStats,
// common/split_rows.cuh). Every argument by reference or a constant.
template <typename Cfg, Variant kVariant, int kOChunks>
__device__ __forceinline__ void consume(const FwdParams& p, const Band& band, const uint32_t& base,
                                        float* const& row_stats, const int& n_first, const int& blocks,
                                        const int& q_first, const int& batch, const int& head, const int& consumer,
                                        const int& first_panel, const int& rank) {
  using T = typename Cfg::T;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHalfKeys = Cfg::kKeysPerConsumer;
  constexpr float kLog2e = 1.4426950408889634f;
  enum : int { kMaxima = 1, kPReady = 2, kSums = 3 };  // named barriers of the two consumers
  constexpr int kIgnoredRows = 4;                        // + consumer: its V rows zeroed
  auto barrier = [&](int b) { return base + Cfg::kBarriers + 8 * b; };
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const AccumulatorLayout accum{lane};
  const int rows[2] = {warp * 16 + accum.row(0), warp * 16 + accum.row(2)};  // this thread's, of the tile
  const SplitRows split{row_stats, consumer, {rows[0], rows[1]}, lane % 4 == 0};
  using LogitsT = Logits<cap_of(kVariant)>;
  const LogitsT logits = LogitsT::from(p);
  const float scale_log2 = logits.unit * kLog2e;
  using Exchange = typename Cfg::Exchange;
  Exchange exchange{};
  if constexpr (Cfg::kSplit == 2) {
    exchange = Exchange::make(base + Cfg::kInboxes + consumer * Exchange::kInboxBytes,
                              barrier(Cfg::kScoresFull + consumer), barrier(Cfg::kScoresEmpty + consumer), tid);
  }

  float o[kOChunks][32];
#pragma unroll
  for (int c = 0; c < kOChunks; ++c)
#pragma unroll
    for (int i = 0; i < 32; ++i) o[c][i] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};

  const uint64_t q_desc = ptx::smem_desc_sw128(base + Cfg::kQ, 0);
  const uint64_t k_desc = ptx::smem_desc_sw128(base + Cfg::kK + consumer * kHalfKeys * 128, 0);
  const uint64_t p_desc = ptx::smem_desc_sw128(base + Cfg::kP, 0);
  const uint64_t v_desc = ptx::smem_desc_sw128(base + Cfg::kV + first_panel * Cfg::kPanelBytes, Cfg::kPanelBytes);
  if (blocks > 0) ptx::mbarrier_wait(barrier(Cfg::kQFull), 0);
  for (int j = 0; j < blocks; ++j) {
    const int phase = j & 1;
    const int key_first = (n_first + j) * kBlockN + consumer * kHalfKeys;  // this consumer's keys
    // 1. S = Q K^T over this consumer's keys; its K rows are free once it has landed.
    float s[kHalfKeys / 2];
    ptx::mbarrier_wait(barrier(Cfg::kKFull), phase);
    ptx::wgmma_fence();
    wgmma_over_head_dim<T, Cfg::kCtaHeadDim, kBlockM, kBlockN>(s, q_desc, k_desc);
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    ptx::fence_registers(s);
    ptx::mbarrier_arrive(barrier(Cfg::kKEmpty));
    if constexpr (Cfg::kSplit == 2) exchange.add_peer(s, j);  // the other half of the head dim's columns

    // 2. Cap, band mask, and the rows' maxima over both consumers' keys.
    if constexpr (LogitsT::kMayCap) {
#pragma unroll
      for (int i = 0; i < kHalfKeys / 2; ++i) s[i] = logits.value(s[i]);
    }
    if (!band.all_visible(q_first, q_first + kBlockM - 1, key_first, key_first + kHalfKeys - 1)) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mask_query_row<kHalfKeys / 8>(band, q_first + rows[r], key_first, lane, -INFINITY,
                                      [&](int n8, int c) -> float& { return s[4 * n8 + 2 * r + c]; });
      }
    }
    const float block_max[2] = {block_row_max(s, 0), block_row_max(s, 1)};
    split.put_max(block_max);
    ptx::named_barrier_sync(kMaxima, 256);
    float shift[2], rescale[2];
    split.merge_max(block_max, row_max, scale_log2, shift, rescale);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_sum[r] = row_sum[r] * rescale[r] + exponentiate<0>(s, r, shift[r], false, logits, scale_log2);
    }

    // 3. P of this consumer's keys into the tile's P (bf16 pairs, the 128-byte swizzle), O rescaled.
#pragma unroll
    for (int i = 0; i < kHalfKeys / 2; i += 2) {
      const int col = consumer * kHalfKeys + accum.col(i);
      ptx::st_shared_b32(base + Cfg::kP + ptx::sw128_offset(rows[(i % 4) / 2], col / 8) + (col % 8) * 2,
                         ptx::pack2<T>(s[i], s[i + 1]));
    }
#pragma unroll
    for (int c = 0; c < kOChunks; ++c)
#pragma unroll
      for (int i = 0; i < 32; ++i) o[c][i] *= rescale[(i % 4) / 2];
    ptx::fence_proxy_async_shared();  // the stores, before wgmma reads them
    ptx::named_barrier_sync(kPReady, 256);

    // 4. O[:, its panels] += P V[:, its panels]: P K-major (16 keys a step, 32 bytes of its rows),
    // V MN-major (16 keys a step, 2048 bytes of a panel).
    ptx::mbarrier_wait(barrier(Cfg::kVFull), phase);
    if constexpr (kVariant != Variant::kPlain) {  // V past this row's key length zeroed (ignored_rows.cuh)
      const int first_ignored = first_ignored_row<kBlockN>(band.seqlen_k, p.seqlen_k, (n_first + j) * kBlockN);
      if (first_ignored < kBlockN) {
        zero_rows_from<Cfg::kPanels, kBlockN, 128>(base + Cfg::kV, first_ignored, tid);
        ptx::named_barrier_sync(kIgnoredRows + consumer, 128);
      }
    }
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
#pragma unroll
      for (int c = 0; c < kOChunks; ++c) {
        ptx::wgmma_ss<0, 1>(o[c], ptx::desc_advance(p_desc, kk * 32),
                            ptx::desc_advance(v_desc, c * Cfg::kPanelBytes + kk * 2048), true, T{});
      }
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
#pragma unroll
    for (int c = 0; c < kOChunks; ++c) ptx::fence_registers(o[c]);
    ptx::mbarrier_arrive(barrier(Cfg::kVEmpty));
  }

  // The rows' sums over both consumers' keys, then O's panels and (consumer 0) the lse out.
  const RowTotal own[2] = {RowTotal(row_sum[0]), RowTotal(row_sum[1])};
  split.put_sums(own);
  ptx::named_barrier_sync(kSums, 256);
  const int rows_valid = min(kBlockM, p.seqlen_q - q_first);
  const int64_t row_stride = int64_t(p.heads) * Cfg::kHeadDim;
  T* const out = static_cast<T*>(p.o) + (int64_t(batch) * p.seqlen_q + q_first) * row_stride +
                 int64_t(head) * Cfg::kHeadDim + rank * Cfg::kCtaHeadDim + first_panel * 64;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const RowTotal total = split.total(own[r], r);
    float inv, lse;
    total.finish(row_max[r], logits.unit, p, batch, head, inv, lse);
    if (rows[r] < rows_valid) {
#pragma unroll
      for (int c = 0; c < kOChunks; ++c)
#pragma unroll
        for (int n8 = 0; n8 < 8; ++n8) {
          const int i = 4 * n8 + 2 * r;
          *reinterpret_cast<uint32_t*>(out + rows[r] * row_stride + c * 64 + accum.col(i)) =
              ptx::pack2<T>(o[c][i] * inv, o[c][i + 1] * inv);
        }
      if (consumer == 0 && rank == 0 && lane % 4 == 0) {
        p.lse[(int64_t(batch) * p.heads + head) * p.seqlen_q + q_first + rows[r]] = lse;
      }
    }
  }
  if constexpr (Cfg::kSplit == 2) exchange.drain(blocks);
}

// kVariant: kPlain, kMasked (lengths, segment ids) or kSoftcap; bias and mask run elsewhere.
template <typename Cfg, Variant kVariant>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    wide_fwd_kernel(const __grid_constant__ WideFwdTensorMaps maps, const FwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kPanels = Cfg::kPanels;
  constexpr bool kMasked = kVariant == Variant::kMasked;
  static_assert(kVariant != Variant::kEverything, "bias and mask take the other kernels");

  extern __shared__ char smem_raw[];
  const uint32_t base = (ptx::smem_addr(smem_raw) + 1023) & ~1023u;
  float* const row_stats = reinterpret_cast<float*>(smem_raw + (base - ptx::smem_addr(smem_raw)) + Cfg::kRowStats);
  auto barrier = [&](int b) { return base + Cfg::kBarriers + 8 * b; };

  // A pair's CTAs (kSplit = 2: a cluster of blockIdx.x 2i and 2i + 1) share the query tile.
  const int rank = Cfg::kSplit == 2 ? int(ptx::cluster_ctarank()) : 0;
  const int q_first = blockIdx.x / Cfg::kSplit * kBlockM;
  const int batch = batch_head_index() / p.heads, head = batch_head_index() % p.heads;
  const int kv_head = head / (p.heads / p.kv_heads);
  const Band band = Band::from<kMasked>(p, batch);
  const Range keys = band.keys_of(q_first, q_first + kBlockM - 1);
  const int n_first = keys.begin / kBlockN;
  const int blocks = keys.end > keys.begin ? (keys.end + kBlockN - 1) / kBlockN - n_first : 0;

  if (threadIdx.x == 0) {
    ptx::mbarrier_init(barrier(Cfg::kQFull), 1);
    ptx::mbarrier_init(barrier(Cfg::kKFull), 1);
    ptx::mbarrier_init(barrier(Cfg::kVFull), 1);
    ptx::mbarrier_init(barrier(Cfg::kKEmpty), 256);
    ptx::mbarrier_init(barrier(Cfg::kVEmpty), 256);
    for (int c = 0; c < 2; ++c) {
      ptx::mbarrier_init(barrier(Cfg::kScoresFull + c), Cfg::Exchange::kFullArrivals);
      ptx::mbarrier_init(barrier(Cfg::kScoresEmpty + c), Cfg::Exchange::kEmptyArrivals);
    }
    ptx::fence_barrier_init();
  }
  if constexpr (Cfg::kSplit == 2) {
    ptx::cluster_sync();  // the peer's barriers are initialised before anything arrives on them
  } else {
    __syncthreads();
  }

  if (threadIdx.x < 128) {  // the producer
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    if (threadIdx.x != 0 || blocks == 0) return;
    auto load = [&](const CUtensorMap* map, uint32_t dst, uint32_t full, int row, int head_) {
      ptx::mbarrier_arrive_expect_tx(full, Cfg::kTileBytes);
      for (int panel = 0; panel < kPanels; ++panel) {
        ptx::tma_load_4d(dst + panel * Cfg::kPanelBytes, map, full, rank * Cfg::kCtaHeadDim + panel * 64, head_, row,
                         batch);
      }
    };
    load(&maps.q, base + Cfg::kQ, barrier(Cfg::kQFull), q_first, head);
    for (int j = 0; j < blocks; ++j) {
      const int key_first = (n_first + j) * kBlockN;
      if (j > 0) ptx::mbarrier_wait(barrier(Cfg::kKEmpty), (j - 1) & 1);
      load(&maps.k, base + Cfg::kK, barrier(Cfg::kKFull), key_first, kv_head);
      if (j > 0) ptx::mbarrier_wait(barrier(Cfg::kVEmpty), (j - 1) & 1);
      load(&maps.v, base + Cfg::kV, barrier(Cfg::kVFull), key_first, kv_head);
    }
    return;
  }

  ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int consumer = threadIdx.x / 128 - 1;
  // O's panels of each consumer are a constant of its code: consumer 1 has one fewer at 320, 448.
  if (consumer == 0) {
    consume<Cfg, kVariant, Cfg::kOChunks0>(p, band, base, row_stats, n_first, blocks, q_first, batch, head, 0, 0,
                                           rank);
  } else {
    const int first_panel = Cfg::kOChunks0;
    consume<Cfg, kVariant, Cfg::kOChunks1>(p, band, base, row_stats, n_first, blocks, q_first, batch, head, 1,
                                           first_panel, rank);
  }
#endif
}

}  // namespace jax_flash::sm90
