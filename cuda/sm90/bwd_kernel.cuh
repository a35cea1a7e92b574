// FlashAttention backward on Hopper (sm_90a): TMA, mbarriers, wgmma, warp specialisation.
//
// A CTA owns kBlockN = 128 keys of one kv head and walks every query block that can see them
// (common/bwd_walk.cuh), kBlockM query rows a step (BwdConfig), keeping dK and dV of its keys in
// registers. Warp group 0 is the producer: one thread copies K and V once, then each step's Q,
// dO, lse and delta into kStages stages by TMA, completing on "full" mbarriers; one thread of
// another warp adds the consumers' dQ parts to global memory. Warp groups 1 and 2 are consumers
// of 64 keys each. Per step a consumer computes, all by wgmma with fp32 accumulators:
//   S^T  = K Q^T    and  dP^T = V dO^T      (both operands in shared memory)
//   P^T  = exp2(S^T * scale * log2 e - lse_log2),  dS^T = P^T (dP^T - delta)
//   dV  += P^T dO   and  dK  += dS^T Q      (P^T, dS^T from registers)
//   dQ   = dS K, or dQ^T = K^T dS^T         (dS^T or dS through shared memory)
// The logits' scale is left out of dS^T (so the deltas need no scaling each step): dK takes it in
// the epilogue, dQ in its conversion (dq_from_tiles).
// Computing S and dP transposed (keys as rows) puts P^T and dS^T in registers in the layout of a
// wgmma A operand, so dV and dK need no trip through shared memory; only dQ, whose rows are
// queries, reads dS from there. dQ needs every key block's share: each consumer writes its fp32
// part to shared memory in the order of its accumulator registers, and the producer's dQ thread
// adds it to the fp32 accumulator in global memory, tiled in the same order (sm90/bwd/dq_tiles.cuh),
// with one bulk reduce-add, so the consumers never wait for the adds. The two consumers split dQ
// (kBlockM x H) into two parts, each over all 128 keys, so the dS of both must be in shared memory
// (a barrier across the two): 64 x 64 at H = 128 by columns, at H = 64 (128-query steps) by rows;
// with 80-query steps (dQ^T) 80 x 64 by columns. Each step then adds one kBlockM x H tile to
// global memory, not one a consumer (B6).
//
// Shared-memory tiles are the layout TMA writes with the 128-byte swizzle: 64-column panels of
// 128-byte rows (sm90/fwd_kernel.cuh); wgmma reads them K-major or MN-major through descriptors.
//
// The pieces, in sm90/bwd/: config.cuh (tile shapes and offsets), shared_memory.cuh (tiles and
// barriers), products.cuh (the wgmma products), band_mask.cuh (S^T's mask), bias_grad.cuh
// (dbias), dq_adder.cuh (the producer's dQ thread), epilogue.cuh (dK and dV out); the stage copies
// are sm90/bwd/stages.cuh.
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
#include "sm90/bwd/band_mask.cuh"
#include "sm90/bwd/bias_grad.cuh"
#include "sm90/bwd/capped_scores.cuh"
#include "sm90/bwd/config.cuh"
#include "sm90/bwd/dq_adder.cuh"
#include "sm90/bwd/dq_part.cuh"
#include "sm90/bwd/ds_lanes.cuh"
#include "sm90/bwd/ds_tiles.cuh"
#include "sm90/bwd/epilogue.cuh"
#include "sm90/bwd/probabilities.cuh"
#include "sm90/bwd/products.cuh"
#include "sm90/bwd/shared_memory.cuh"
#include "sm90/bwd/steps.cuh"
#include "sm90/bwd/step_stats.cuh"
#include "sm90/bwd/bias_tiles.cuh"
#include "sm90/bwd/stages.cuh"
#include "sm90/bwd/dq_tiles.cuh"
#include "sm90/common/ignored_rows.cuh"

namespace jax_flash::sm90 {

// kVariant (params.h): which of the masks (mask.cuh) and the soft cap (logits.cuh) are read.
// kBiasGrad (kBias only): dbias gets d logit; a kernel of its own, for the registers its adds take.
// kBiasCapped (kBias only): the call has a soft cap; a kernel of its own, for the registers its
// slopes take (with them, the uncapped bias kernels spilled; B31).
template <typename Cfg, Variant kVariant, bool kBiasGrad = false, bool kBiasCapped = false>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    bwd_kernel(const __grid_constant__ BwdTensorMaps maps, const BwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = typename Cfg::T;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  constexpr int kStages = Cfg::kStages;
  constexpr int kConsumerThreads = 128 * Cfg::kConsumers;
  // Named barriers: 1 + consumer and 3 (epilogue.cuh), 4 (dQ's dS reads), and this one.
  constexpr int kIgnoredRowsBarrier = 5;
  constexpr float kLog2e = 1.4426950408889634f;
  using Steps = BwdSteps<Cfg, kVariant, kBiasGrad, kBiasCapped>;  // what a step does, in which order
  constexpr bool kMasked = Steps::kMasked, kBias = Steps::kBias;
  constexpr bool kCappedStep = Steps::kCappedStep, kSlopesApart = Steps::kSlopesApart;
  constexpr bool kLongestFirst = Steps::kLongestFirst, kDvAfterDs = Steps::kDvAfterDs;
  constexpr bool kThreadIndexAhead = Steps::kThreadIndexAhead, kDqFirst = Steps::kDqFirst;

  extern __shared__ char smem[];
  const auto sm = BwdSharedMemory<Cfg>::of(smem);
  const BwdBarriers<kStages> barriers = sm.stages();
  if (threadIdx.x == 0) sm.template init_barriers<kBias>();
  __syncthreads();

  const bool dbias_shared = kBiasGrad && BiasGrad::shared_by_ctas(p);
  const auto [n_block, batch, kv_head] = BwdCta::of<kLongestFirst>(p.batch, p.kv_heads, dbias_shared);
  const int group = p.heads / p.kv_heads;
  const int k_first = n_block * kBlockN;
  const Band band = Band::from<kMasked>(p, batch);
  // Made in each warp group's branch, after its setmaxnreg: made once before the branches, its
  // bounds were live across the producer's 24-register section and ptxas spilled them.
  auto make_walk = [&] {
    return BwdWalk::make(p.dq_turns ? band.without_segments() : band, k_first, k_first + kBlockN - 1, kBlockM, group);
  };

  const int warp_group = threadIdx.x / 128;
  if (warp_group == 0) {
    // Producer: one thread copies the stages (bwd/stages.cuh), another adds the dQ parts, and with
    // a bias a third copies its tiles (bwd/bias_tiles.cuh).
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    const BwdWalk walk = make_walk();
    if (threadIdx.x == 0 && walk.steps > 0) {
      produce_bwd_stages<Cfg>(maps, p, walk, barriers, sm.base_addr, batch, kv_head, k_first);
    } else if (kBias && threadIdx.x == 64 && walk.steps > 0) {
      load_bias_tiles<T, typename Cfg::BiasTiles>(&maps.bias, &maps.mask, p, walk, sm.base_addr + Cfg::kBiasTiles,
                                                  sm.bias_full(), sm.bias_empty(), batch, kv_head, k_first);
    } else if (threadIdx.x == 32) {
      add_dq_parts<Cfg>(p, sm, walk, band, batch, kv_head, group, n_block);
    }
    return;
  }

  // Consumers: this one's keys are rows consumer * 64 .. + 63 of the K and V tiles.
  ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
  const BwdWalk walk = make_walk();
  const int consumer = warp_group - 1;
  // The same, broadcast from lane 0 so that the compiler knows it is uniform across the warp: the
  // wgmma descriptors built from it then stay in uniform registers (B8), and key0 needs no S2R of
  // the thread index each step (B20).
  const int consumer_uniform = __shfl_sync(0xffffffff, consumer, 0);
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int key0 = k_first + (kThreadIndexAhead ? consumer_uniform : consumer) * 64;
  // Accumulator element i of an m64nN tile of keys: row warp * 16 + accum.row(i), column
  // accum.col(i). (dQ's tile leaves in register order, sm90/bwd/dq_tiles.cuh.)
  const AccumulatorLayout accum{lane};
  // The byte offset of this thread's first statistics column, kept in a register (not with a cap,
  // where the register made H = 64 spill): rebuilt each step from the thread index, its S2R held
  // up the step's first product.
  uint32_t stats_offset = accum.col(0) * 4;
  if constexpr (!kCappedStep) asm volatile("" : "+r"(stats_offset));
  // Where this thread's lane addresses dS's 8 x 8 tiles for stmatrix (see the dS^T loop), in the
  // buffer: kept in registers like stats_offset, except at 80-query steps, where they spilled: there
  // they are rebuilt each step from the thread index, read when S^T lands so that the S2R's latency
  // passes under the softmax (B20).
  uint32_t ds_lane_offset, ds_chunk_bits = 0;
  auto ds_offsets = [&](int warp_index, int lane_index) {  // bwd/ds_lanes.cuh
    ds_lane_offsets<Cfg>(warp_index, lane_index, kThreadIndexAhead ? consumer_uniform : consumer, consumer,
                         ds_lane_offset, ds_chunk_bits);
  };
  ds_offsets(warp, lane);
  if constexpr (!kCappedStep && !Cfg::kDqTransposed) asm volatile("" : "+r"(ds_lane_offset), "+r"(ds_chunk_bits));
  const auto logits = Logits<kCappedStep ? Cap::kAlways : Cap::kNever>::from(p);
  const float scale_log2 = logits.unit * kLog2e;

  float dk[kHeadDim / 2], dv[kHeadDim / 2];  // m64 x H: keys x columns
#pragma unroll
  for (int i = 0; i < kHeadDim / 2; ++i) dk[i] = dv[i] = 0.f;

  constexpr int kSRegs = kBlockM / 2;  // S^T, dP^T: 64 keys x kBlockM queries

  if (walk.steps > 0) ptx::mbarrier_wait(barriers.kv_full(), 0);
  if constexpr (kMasked) {  // K and V past this row's key length zeroed (sm90/common/ignored_rows.cuh)
    const int first_ignored = first_ignored_row<kBlockN>(band.seqlen_k, p.seqlen_k, k_first);
    if (walk.steps > 0 && first_ignored < kBlockN) {
      zero_rows_from<Cfg::kPanels, kBlockN, kConsumerThreads>(sm.k(), first_ignored, threadIdx.x - 128);
      zero_rows_from<Cfg::kValuePanels, kBlockN, kConsumerThreads>(sm.v(), first_ignored, threadIdx.x - 128);
      ptx::named_barrier_sync(kIgnoredRowsBarrier, kConsumerThreads);
    }
  }
  BwdStep step = BwdStep::first(walk, kv_head * group);
  for (int s = 0; s < walk.steps; ++s, step.advance(walk)) {
    const int stage = s % kStages;
    const int q_first = step.m_block * kBlockM;
    const uint32_t ds_buffer = sm.ds(s);
    float st[kSRegs], dpt[kSRegs];
    // Taken before the products: taken after them, its bounds' registers made the lse spill.
    const bool whole = band.all_visible(q_first, q_first + kBlockM - 1, key0, key0 + 63);
    // This thread's columns of the step's lse and delta (bwd/step_stats.cuh).
    const StepStats<decltype(sm), kCappedStep, kBlockM / 8> stats{sm, stats_offset, accum};
    // lse is read into registers before S^T is issued, except with a cap or 128-query steps, which
    // have no registers for it: read behind the products, the loads queued behind their operand
    // reads in shared memory, and the exp2 waited for them (B16).
    constexpr bool kEarlyLse = !kCappedStep && kBlockM <= 80;
    float2 lse[kBlockM / 8];
    if constexpr (kEarlyLse) {
      ptx::mbarrier_wait(barriers.q_full(stage), (s / kStages) & 1);
      stats.load(sm.lse(stage), lse);
    }
    // Not waited for again: behind the loads, the barrier's test waited its turn in the same queue
    // (B16).
    issue_transposed<Cfg>(st, sm.k(), sm.q(stage), kEarlyLse ? 0u : barriers.q_full(stage), s, consumer_uniform);
    issue_transposed<Cfg>(dpt, sm.v(), sm.d_o(stage), barriers.do_full(stage), s, consumer_uniform);

    // P^T, masked outside the band and past seqlen_k (rows past seqlen_q have lse_log2 = +inf).
    ptx::wgmma_wait<kCappedStep ? 0 : 1>();
    ptx::fence_registers(st);
    const uint32_t tid_early = kThreadIndexAhead && Cfg::kDqTransposed ? ptx::thread_index() % 128 : 0;
    // kSlopesApart: the tanh's slopes, packed pairs of elements 2 i, 2 i + 1.
    [[maybe_unused]] uint32_t slopes[kSlopesApart ? kSRegs / 2 : 1];
    if constexpr (kCappedStep) {
      ptx::fence_registers(dpt);
      cap_scores<T, kSlopesApart>(st, dpt, slopes, logits, sm, stage, accum);  // bwd/capped_scores.cuh
    }
    if constexpr (kBias) {
      add_step_bias<Cfg>(st, p, sm, s, key0 - k_first + warp * 16 + lane / 4, accum.col(0), 1.f / logits.unit);
    }
    if (!whole) mask_transposed_scores<kVariant>(st, band, q_first, key0, warp, lane);
    uint32_t pa[kBlockM / 16][4];  // P^T (bwd/probabilities.cuh)
    const uint32_t lse_stats = sm.lse(stage);
    probabilities<T, kEarlyLse>(st, pa, scale_log2, lse, stats, lse_stats);

    // delta, read before dV is issued (so ahead of its operand reads), except with a cap (folded
    // into dpt above), so that the FMULs scaling it do not wait for it (B16).
    float2 delta[kBlockM / 8];  // unused with a cap
    if constexpr (!kCappedStep) stats.load(sm.delta(stage), delta);

    // dV += P^T dO, here or after dS^T (kDvAfterDs).
    auto issue_dv = [&] {
      ptx::wgmma_fence();
      issue_over_queries<Cfg>(dv, pa, sm.d_o(stage));
    };
    if constexpr (!kDvAfterDs) issue_dv();

    // dS^T = P^T (dP^T - delta) (with a cap, dpt holds (dP^T - delta) * slope already), from
    // the 16-bit P (the precision dV used).
    ptx::wgmma_wait<kDvAfterDs ? 0 : 1>();
    ptx::fence_registers(dpt);
    if constexpr (kThreadIndexAhead && Cfg::kDqTransposed) ds_offsets(tid_early / 32, tid_early % 32);
    // With kBiasGrad, d logit = P^T (dP^T - delta) goes into dbias (add_bias_grad).
    const BiasGrad dbias = kBiasGrad ? BiasGrad::from(p, batch, step.head) : BiasGrad{};
    const int dbias_key = key0 + warp * 16 + lane / 4, dbias_query = q_first + (lane % 4) * 2;
    uint32_t dsa[kBlockM / 16][4];  // bwd/ds_tiles.cuh
    const uint32_t ds_lane_addr = ds_buffer + ds_lane_offset;
    if constexpr (Cfg::kDsBuffers == 1) {
      if (s > 0) ptx::named_barrier_sync(4, kConsumerThreads);  // the other's dQ read the last dS
    }
    make_ds_tiles<Cfg, kCappedStep, kSlopesApart, kBiasGrad>(dsa, dpt, delta, pa, slopes, ds_lane_addr, ds_chunk_bits,
                                                          dbias, p, lane, dbias_query, dbias_key);

    if constexpr (kDvAfterDs && !kDqFirst) issue_dv();

    // This consumer's dQ part over all the CTA's keys.
    ptx::fence_proxy_async_shared();  // the dS stores, before wgmma reads them
    ptx::named_barrier_sync(3, kConsumerThreads);
    float dq[Cfg::Dq::kChunks * 4];
    issue_dq<Cfg>(dq, sm.k(), ds_buffer, consumer_uniform);
    if constexpr (kDqFirst) issue_dv();

    // dK += dS^T Q.
    issue_over_queries<Cfg>(dk, dsa, sm.q(stage));
    // The thread index for the dQ stores, read again each step rather than kept from the top of the
    // kernel (kept, it held a register across the step and ptxas spilled 16 bytes at H = 64), and
    // read before the wait, so that its S2R's latency passes under it (B20).
    int t = kThreadIndexAhead ? ptx::thread_index() % 128 : 0;
    // dQ goes out while dK (and with kDqFirst dV) runs.
    if constexpr (kDqFirst) {
      ptx::wgmma_wait<2>();  // in flight: dQ, dV, dK
    } else {
      ptx::wgmma_wait<1>();  // in flight: dV, dQ, dK
      ptx::fence_registers(dv);
      ptx::fence_registers(pa);
    }
    ptx::fence_registers(dq);

    // dQ to shared memory for the producer's dQ thread (bwd/dq_part.cuh).
    const int dq_buffer = s % Cfg::kDqBuffers, dq_use = s / Cfg::kDqBuffers;
    store_dq_part<Cfg, kThreadIndexAhead>(sm, dq, dq_buffer, dq_use, consumer, consumer_uniform, t);

    ptx::wgmma_wait<0>();
    ptx::fence_registers(dk);
    ptx::fence_registers(dsa);
    if constexpr (kDqFirst) {
      ptx::fence_registers(dv);
      ptx::fence_registers(pa);
    }
    ptx::mbarrier_arrive(barriers.q_empty(stage));
    ptx::mbarrier_arrive(barriers.do_empty(stage));
  }

  store_dk_dv<Cfg, kLongestFirst, kBiasGrad>(maps, p, sm, dk, dv, consumer, tid);
#endif
}

}  // namespace jax_flash::sm90
