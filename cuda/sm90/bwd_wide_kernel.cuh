// dK and dV of the Hopper backward (sm_90a) at head dims 192 and 256, also with a narrower V
// (192 / 128): TMA, mbarriers, wgmma. dQ is bwd_dq_kernel.cuh's, which walks the keys per query
// block instead: added here per step, it would take 64 KB of fp32 atomics per 64 x 64 step (B12).
//
// bwd_kernel.cuh keeps dK and dV of its keys as m64 x H accumulators (keys as rows); at H = 256
// they would take 256 registers a thread. Here the head dim is the row side of those products:
//   dV^T += dO^T P    and    dK^T += Q^T dS      (H x keys: the consumers split the m64 row tiles)
// The row tiles of both, (H + value dim) / 64 of them, are dealt to the two consumer warp groups
// (BwdWideConfig::tile_is_dk, tile_row0): at H = 256 four each (128 registers), at 192 three, at
// 192 / 128 three and two. A CTA owns kBlockN = 64 keys of one kv head and walks the query blocks
// that see them (common/bwd_walk.cuh), 64 queries a step, as bwd_kernel.cuh does.
// Per step, each consumer c over its 32 of the CTA's keys (32 c onwards):
//   S = Q K^T, dP = dO V^T (m64n32), P = exp2(S * scale * log2 e - lse_log2),
//   dS = P (dP - delta) * scale                          ->  shared memory, [query][key] tiles
// then, once both halves are in (named barrier kTilesReady), over all 64 keys:
//   its tiles of dV^T += dO^T P and dK^T += Q^T dS (dO^T, Q^T read transposed; P, dS as B operands)
// and the next step's S and dP right behind them. P and dS have two buffers each, so no barrier
// ends a step.
// With a soft cap (logits.cuh), S becomes the tanh values and dP - delta takes their slope
// before the masks. With a bias and boolean mask (kBias), each thread reads its elements' bias
// and mask from global memory (bias.cuh, pairs of keys), after the cap when the call has one, and
// with kBiasGrad adds P (dP - delta) into dbias with float32 atomics; otherwise no atomics:
// deterministic.
#pragma once

#include <cuda.h>

#include <cmath>
#include <type_traits>

#include "common/accumulator.cuh"
#include "common/bias.cuh"
#include "common/bwd_walk.cuh"
#include "common/logits.cuh"
#include "common/mask.cuh"
#include "common/params.h"
#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"
#include "sm90/bwd/config.cuh"
#include "sm90/bwd/wide_epilogue.cuh"
#include "sm90/bwd/wide_products.cuh"
#include "sm90/bwd/wide_shared_memory.cuh"
#include "sm90/bwd/row_mask.cuh"
#include "sm90/bwd/stages.cuh"
#include "sm90/common/ignored_rows.cuh"

namespace jax_flash::sm90 {

// kBiasGrad, kBiasCapped (kBias only): dbias wanted, a soft cap; kernels of their own
// (bwd_kernel.cuh says why).
template <typename Cfg, Variant kVariant, bool kBiasGrad = false, bool kBiasCapped = false>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    bwd_wide_kernel(const __grid_constant__ BwdTensorMaps maps, const BwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = typename Cfg::T;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  constexpr int kStages = Cfg::kStages;
  constexpr int kConsumerThreads = 128 * Cfg::kConsumers;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr bool kMasked = kVariant != Variant::kPlain, kSoftcap = kVariant == Variant::kSoftcap;
  constexpr bool kBias = kVariant == Variant::kEverything;
  static_assert(kBias || (!kBiasGrad && !kBiasCapped), "dbias and kBiasCapped need a bias");
  enum : int { kTilesReady = 1, kEpilogue = 2, kIgnoredRows = 5 };  // named barriers (kEpilogue + consumer)

  extern __shared__ char smem[];
  const auto sm = WideSharedMemory<Cfg>::of(smem);  // bwd/wide_shared_memory.cuh
  const uint32_t sK = sm.k(), sV = sm.v();
  const BwdBarriers<kStages> barriers{sm.barriers()};

  // Longest walks first (B19).
  const BwdCta cta = BwdCta::of<true>(p.batch, p.kv_heads);
  const int n_block = cta.n_block, batch = cta.batch, kv_head = cta.kv_head;  // (lambdas capture these)
  const int group = p.heads / p.kv_heads;
  const int k_first = n_block * kBlockN;
  const Band band = Band::from<kMasked>(p, batch);
  const BwdWalk walk = BwdWalk::make(band, k_first, k_first + kBlockN - 1, kBlockM, group);

  if (threadIdx.x == 0) {
    barriers.init(kConsumerThreads);
    ptx::fence_barrier_init();
  }
  __syncthreads();

  const int warp_group = threadIdx.x / 128;
  if (warp_group == 0) {
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    if (threadIdx.x == 0 && walk.steps > 0) {
      produce_bwd_stages<Cfg>(maps, p, walk, barriers, sm.base_addr, batch, kv_head, k_first);
    }
    return;
  }

  ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int consumer = warp_group - 1;
  // Broadcast from lane 0, so that the descriptors built from it stay in uniform registers.
  const int consumer_uniform = __shfl_sync(0xffffffff, consumer, 0);
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  // Accumulator element i of an m64nN tile: row accum_row(i), column accum.col(i).
  const AccumulatorLayout accum{lane};
  auto accum_row = [&](int i) { return warp * 16 + accum.row(i); };
  // Elements i, i + 1 (one row, two adjacent keys) of P or dS in its [query][key] tile, whose
  // columns start column_bytes into the row.
  auto tile_offset = [&](int i, uint32_t column_bytes) {
    const int col = accum.col(i) + column_bytes / 2;
    return ptx::sw128_offset(accum_row(i), col / 8) + (col % 8) * 2;
  };
  const auto logits = Logits<kSoftcap || kBiasCapped ? Cap::kAlways : Cap::kNever>::from(p);
  const float scale_log2 = logits.unit * kLog2e;

  // The consumer's work, for its kTiles m64 tiles of dV^T and dK^T (head-dim rows x 64 keys) from
  // tile first_tile (BwdWideConfig): the consumers hold equally many at d = 256 and 192, where one
  // copy of this code serves both; with a narrower V, consumer 0 one more.
  auto consume = [&](auto tiles, const int first_tile) {
    constexpr int kTiles = decltype(tiles)::value;
    float acc[kTiles][32];
#pragma unroll
    for (int t = 0; t < kTiles; ++t)
#pragma unroll
      for (int i = 0; i < 32; ++i) acc[t][i] = 0.f;

    // S = Q K^T and dP = dO V^T of step s over this consumer's 32 keys of the CTA's 64, issued:
    // queries x keys, k16 steps along the head dim, both operands K-major; the keys start 32 rows
    // (4 swizzle groups) into each panel.
    auto issue_scores = [&](float (&s_acc)[16], float (&dp_acc)[16], int s) {
      const int stage = s % kStages, phase = (s / kStages) & 1;
      const uint32_t key_rows = consumer_uniform * (kBlockN / 2) * 128;
      ptx::mbarrier_wait(barriers.q_full(stage), phase);
      issue_wide_scores<Cfg, kHeadDim>(s_acc, sm.q(stage), sK + key_rows);
      ptx::mbarrier_wait(barriers.do_full(stage), phase);
      issue_wide_scores<Cfg, Cfg::kValueDim>(dp_acc, sm.d_o(stage), sV + key_rows);
    };

    // Each step: both consumers compute P and dS of their 32 keys at once and store them; then each
    // issues its tiles of dV^T and dK^T over all 64 keys and, right behind them, the next step's S
    // and dP, so that the tensor cores have those queued. Every product is waited for inside the
    // step that issues it: with a wgmma in flight across the loop's back edge, or issued under a
    // branch, ptxas serialised them all (C7514, C7515), so the last step is a separate copy.
    float s_acc[16], dp_acc[16];
    if (walk.steps > 0) {
      ptx::mbarrier_wait(barriers.kv_full(), 0);
      if constexpr (kMasked) {  // K and V past this row's key length zeroed (sm90/common/ignored_rows.cuh)
        const int first_ignored = first_ignored_row<kBlockN>(band.seqlen_k, p.seqlen_k, k_first);
        if (first_ignored < kBlockN) {
          zero_rows_from<Cfg::kPanels, kBlockN, kConsumerThreads>(sm.k(), first_ignored, threadIdx.x - 128);
          zero_rows_from<Cfg::kValuePanels, kBlockN, kConsumerThreads>(sm.v(), first_ignored, threadIdx.x - 128);
          ptx::named_barrier_sync(kIgnoredRows, kConsumerThreads);
        }
      }
      issue_scores(s_acc, dp_acc, 0);
      ptx::wgmma_wait<0>();
      ptx::fence_registers(s_acc);
      ptx::fence_registers(dp_acc);
    }
    auto do_step = [&](int s, int q_first, int head, auto issue_next) {
      const int stage = s % kStages;
      const int key_first = k_first + consumer * (kBlockN / 2);  // this consumer's keys
      // With a cap, S becomes the tanh values and dP - delta takes their slope, before the masks.
      if constexpr (kSoftcap) {
        const float delta[2] = {sm.stat(Cfg::kDelta, stage, accum_row(0)), sm.stat(Cfg::kDelta, stage, accum_row(2))};
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          s_acc[i] = logits.value(s_acc[i]);
          dp_acc[i] = (dp_acc[i] - delta[(i % 4) / 2]) * logits.slope(s_acc[i]);
        }
      }
      // kBiasCapped: the cap comes before the bias, and its slopes are kept apart, as dbias takes
      // d logit = P (dP - delta) without them.
      [[maybe_unused]] float slope[kBiasCapped ? 16 : 1];
      if constexpr (kBiasCapped) {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          s_acc[i] = logits.value(s_acc[i]);
          slope[i] = logits.slope(s_acc[i]);
        }
      }
      if constexpr (kBias) {
        const int rows[2] = {q_first + accum_row(0), q_first + accum_row(2)};  // this thread's queries
        add_bias_pairs<T, 4>(LogitBias<T>::from(p, batch, head, logits.unit), s_acc, rows,
                             key_first + (lane % 4) * 2);
      }
      // P, masked outside the band and past seqlen_k (rows past seqlen_q have lse_log2 = +inf).
      if (!band.all_visible(q_first, q_first + kBlockM - 1, key_first, key_first + kBlockN / 2 - 1)) {
        mask_rows(s_acc, band, q_first, key_first, warp, lane);
      }
      const float lse[2] = {sm.stat(Cfg::kLse, stage, accum_row(0)), sm.stat(Cfg::kLse, stage, accum_row(2))};
      const float delta[2] = {sm.stat(Cfg::kDelta, stage, accum_row(0)), sm.stat(Cfg::kDelta, stage, accum_row(2))};
      // P and dS = P (dP - delta) * scale (* slope), into the [query][key] tiles at this consumer's
      // columns.
      const uint32_t column_bytes = consumer * (kBlockN / 2) * 2;
#pragma unroll
      for (int i = 0; i < 16; i += 2) {
        const int r = (i % 4) / 2;
        const float p0 = ptx::exp2(s_acc[i] * scale_log2 - lse[r]), p1 = ptx::exp2(s_acc[i + 1] * scale_log2 - lse[r]);
        const uint32_t off = tile_offset(i, column_bytes);
        ptx::st_shared_b32(sm.p(s) + off, ptx::pack2<T>(p0, p1));
        if constexpr (kSoftcap) {  // dp_acc holds (dP - delta) * slope
          ptx::st_shared_b32(sm.ds(s) + off, ptx::pack2<T>(p0 * dp_acc[i] * p.scale, p1 * dp_acc[i + 1] * p.scale));
        } else if constexpr (!kBias) {
          ptx::st_shared_b32(sm.ds(s) + off, ptx::pack2<T>(p0 * (dp_acc[i] - delta[r]) * p.scale,
                                                         p1 * (dp_acc[i + 1] - delta[r]) * p.scale));
        } else {
          // d loss / d logit; dS takes the cap's slopes and the scale.
          const float g0 = p0 * (dp_acc[i] - delta[r]), g1 = p1 * (dp_acc[i + 1] - delta[r]);
          if constexpr (kBiasCapped) {
            ptx::st_shared_b32(sm.ds(s) + off, ptx::pack2<T>(g0 * slope[i] * p.scale, g1 * slope[i + 1] * p.scale));
          } else {
            ptx::st_shared_b32(sm.ds(s) + off, ptx::pack2<T>(g0 * p.scale, g1 * p.scale));
          }
          if constexpr (kBiasGrad) {
            // keys k, k + 1 of row q (k even, S even: both in or both out)
            const int q = q_first + accum_row(i), k = key_first + accum.col(i);
            if (q < p.seqlen_q && k < p.seqlen_k) BiasGrad::from(p, batch, head).add_pair(q, k, g0, g1);
          }
        }
      }
      ptx::fence_proxy_async_shared();  // the stores, before wgmma reads them
      ptx::named_barrier_sync(kTilesReady, kConsumerThreads);
      // dV^T += dO^T P, dK^T += Q^T dS, then the next step's S and dP.
      ptx::wgmma_fence();
      issue_wide_transposed<Cfg, kTiles>(acc, first_tile, sm.q(stage), sm.d_o(stage), sm.p(s), sm.ds(s));
      if constexpr (decltype(issue_next)::value) issue_scores(s_acc, dp_acc, s + 1);
      // This step's products have landed (and the next step's S and dP): its Q and dO stage is
      // free. Each consumer passes the next kTilesReady only after this wait, so once past it the
      // other's products of this step are complete too: the P and dS buffers of step s + 2 may be
      // overwritten.
      ptx::wgmma_wait<0>();
      ptx::fence_registers(s_acc);
      ptx::fence_registers(dp_acc);
#pragma unroll
      for (int t = 0; t < kTiles; ++t) ptx::fence_registers(acc[t]);
      ptx::mbarrier_arrive(barriers.q_empty(stage));
      ptx::mbarrier_arrive(barriers.do_empty(stage));
    };
    BwdStep step = BwdStep::first(walk, kv_head * group);
    for (int s = 0; s < walk.steps - 1; ++s, step.advance(walk)) {
      do_step(s, step.m_block * kBlockM, step.head, std::true_type{});
    }
    if (walk.steps > 0) do_step(walk.steps - 1, step.m_block * kBlockM, step.head, std::false_type{});

    // dK^T and dV^T out (bwd/wide_epilogue.cuh).
    store_wide_dkdv<Cfg, kEpilogue>(&maps.dk, &maps.dv, acc, first_tile, sK, sV, accum_row, accum, consumer, tid,
                                    kv_head, k_first, batch);
  };
  if constexpr (Cfg::kTiles0 == Cfg::kTiles1) {
    consume(std::integral_constant<int, Cfg::kTiles0>{}, consumer_uniform * Cfg::kTiles0);
  } else if (consumer == 0) {
    consume(std::integral_constant<int, Cfg::kTiles0>{}, 0);
  } else {
    consume(std::integral_constant<int, Cfg::kTiles1>{}, Cfg::kTiles0);
  }
#endif
}

}  // namespace jax_flash::sm90
