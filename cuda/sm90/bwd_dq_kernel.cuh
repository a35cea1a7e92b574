// dQ of the Hopper backward (sm_90a) at head dims 192 and 256 (also with a narrower V: 192 / 128),
// in a kernel of its own.
//
// bwd_wide_kernel.cuh walks query blocks per key block, so every one of its CTAs adds a part of
// dQ: 64 KB of fp32 atomics per 64 x 64 step (B12).
// Here a CTA owns kBlockM = 64 query rows of one head and walks the key blocks they see, keeping
// dQ in registers and writing it once, in the output dtype. It recomputes what it needs:
//   S = Q K^T,  P = exp2(S * scale * log2 e - lse_log2),  dP = dO V^T,
//   dS = P (dP - delta) * scale,  dQ += dS K
// (with a soft cap, S becomes the tanh values and dS takes their slope: logits.cuh; with a bias
// and boolean mask, kBias, S takes them after the cap, as bwd_wide_kernel.cuh's does)
// Warp group 0 is the producer (one thread: Q and dO once, K and V per key block into kStages
// stages, TMA completing on mbarriers). The two consumer warp groups split each key block: keys
// [32 c, 32 c + 32) go to consumer c, whose dQ (64 x H fp32, H / 2 registers a thread) sums over
// its halves; the two partial sums meet through shared memory at the end. No ping-pong: each
// consumer issues S and dP together and then its dQ product, so the tensor cores hold work of both
// while either computes P and dS.
// Deterministic (one writer per dQ element, a fixed order of adds), so deterministic mode takes it.
//
// Its pieces, in sm90/bwd/: dq_shared_memory.cuh (tiles and barriers), dq_loads.cuh (the
// producer) and dq_exchange.cuh (the consumers' halves meet and are stored).
#pragma once

#include <cuda.h>

#include <cmath>

#include "common/bias.cuh"
#include "common/grid.cuh"
#include "common/logits.cuh"
#include "common/mask.cuh"
#include "common/params.h"
#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"
#include "sm90/bwd/config.cuh"
#include "sm90/bwd/dq_exchange.cuh"
#include "sm90/bwd/dq_loads.cuh"
#include "sm90/bwd/dq_shared_memory.cuh"
#include "sm90/bwd/stages.cuh"
#include "sm90/common/head_dim_product.cuh"
#include "sm90/bwd/row_mask.cuh"
#include "sm90/common/ignored_rows.cuh"

namespace jax_flash::sm90 {

// The launcher builds these maps for bwd_wide_kernel (boxes of 64 rows for q, dO, k and v), which
// are the boxes this kernel loads: it takes the same BwdTensorMaps.
// kBiasCapped (kBias only): the call has a soft cap (a kernel of its own, as bwd_wide_kernel's).
template <typename Cfg, Variant kVariant, bool kBiasCapped = false>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    bwd_dq_kernel(const __grid_constant__ BwdTensorMaps maps, const BwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = typename Cfg::T;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHalfN = Cfg::kHalfN, kHeadDim = Cfg::kHeadDim;
  constexpr int kStages = Cfg::kStages;
  constexpr int kConsumerThreads = 128 * Cfg::kConsumers;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr bool kMasked = kVariant != Variant::kPlain, kSoftcap = kVariant == Variant::kSoftcap;
  constexpr bool kBias = kVariant == Variant::kEverything;
  constexpr bool kCapped = kSoftcap || kBiasCapped;
  static_assert(kBias || !kBiasCapped, "kBiasCapped needs a bias");
  constexpr int kExchangeBarrier = 1;
  constexpr int kIgnoredRowsBarrier = 2;  // + consumer: its stage's ignored rows zeroed

  extern __shared__ char smem[];
  const uint32_t align = (1024 - (ptx::smem_addr(smem) & 1023)) & 1023;
  float* const exchange = reinterpret_cast<float*>(smem + align + Cfg::kK);
  const DqKernelSharedMemory<Cfg> sm{ptx::smem_addr(smem) + align};

  // The last query blocks first: under a causal band they see the most keys, so the short ones
  // fill in behind them.
  const int q_first = (gridDim.x - 1 - blockIdx.x) * kBlockM;
  const int batch = batch_head_index() / p.heads, head = batch_head_index() % p.heads;
  const int kv_head = head / (p.heads / p.kv_heads);
  const Band band = Band::from<kMasked>(p, batch);
  // Key blocks n_end - 1 down to n_end - blocks (the band's edge first).
  const Range keys = band.keys_of(q_first, min(q_first + kBlockM, p.seqlen_q) - 1);
  const int n_end = (keys.end + kBlockN - 1) / kBlockN;
  const int blocks = max(0, n_end - keys.begin / kBlockN);
  auto key_block_first = [&](int j) { return (n_end - 1 - j) * kBlockN; };

  if (threadIdx.x == 0) {
    ptx::mbarrier_init(sm.qdo_full(), 1);
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(sm.k_full(s), 1);
      ptx::mbarrier_init(sm.v_full(s), 1);
      ptx::mbarrier_init(sm.k_empty(s), kConsumerThreads);
      ptx::mbarrier_init(sm.v_empty(s), kConsumerThreads);
    }
    ptx::fence_barrier_init();
  }
  __syncthreads();

  const int warp_group = threadIdx.x / 128;
  if (warp_group == 0) {
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    if (threadIdx.x != 0 || blocks == 0) return;
    load_dq_kernel_tiles<Cfg>(maps, sm, batch, head, kv_head, q_first, n_end, blocks);
    return;
  }

  ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int consumer = warp_group - 1;
  // Broadcast from lane 0, so that the descriptors built from it stay in uniform registers.
  const int consumer_uniform = __shfl_sync(0xffffffff, consumer, 0);
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  // This thread's rows of the block (accumulator layout), r = 0, 1.
  auto row_in_block = [&](int r) { return warp * 16 + r * 8 + lane / 4; };
  const auto logits = Logits<kCapped ? Cap::kAlways : Cap::kNever>::from(p);
  const float scale_log2 = logits.unit * kLog2e;

  // Rows past T hold lse_log2 = +inf and delta = 0 (bwd_preprocess), so their P and dS are 0.
  float lse_log2[2], delta[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = (int64_t(batch) * p.heads + head) * p.stats_stride + q_first + row_in_block(r);
    lse_log2[r] = p.lse_log2[row];
    delta[r] = p.delta[row];
  }

  float dq[kHeadDim / 2];  // one m64nH accumulator
#pragma unroll
  for (int i = 0; i < kHeadDim / 2; ++i) dq[i] = 0.f;

  const uint64_t q_desc = ptx::smem_desc_sw128(sm.q(), 0), do_desc = ptx::smem_desc_sw128(sm.d_o(), 0);
  uint32_t ds_a[kHalfN / 16][4];  // dS as the A fragments of dQ's k16 steps
  if (blocks > 0) ptx::mbarrier_wait(sm.qdo_full(), 0);
  for (int j = 0; j < blocks; ++j) {
    const int stage = j % kStages, phase = (j / kStages) & 1;
    const int k_first = key_block_first(j) + consumer * kHalfN;  // this consumer's keys
    // S = Q K^T and dP = dO V^T over this consumer's 32 keys (head_dim_product.cuh); its keys
    // start 32 rows (4 swizzle groups) into each panel.
    const uint64_t k_desc = ptx::smem_desc_sw128(sm.k(stage) + consumer_uniform * kHalfN * 128, 0);
    const uint64_t v_desc = ptx::smem_desc_sw128(sm.v(stage) + consumer_uniform * kHalfN * 128, 0);
    float s[kHalfN / 2], dp[kHalfN / 2];
    ptx::mbarrier_wait(sm.k_full(stage), phase);
    if constexpr (kMasked) {  // K and V past this row's key length zeroed (sm90/common/ignored_rows.cuh)
      const int first_ignored = first_ignored_row<kBlockN>(band.seqlen_k, p.seqlen_k, key_block_first(j));
      if (first_ignored < kBlockN) {
        ptx::mbarrier_wait(sm.v_full(stage), phase);
        zero_rows_from<Cfg::kPanels, kBlockN, 128>(sm.k(stage), first_ignored, tid);
        zero_rows_from<Cfg::kValuePanels, kBlockN, 128>(sm.v(stage), first_ignored, tid);
        ptx::named_barrier_sync(kIgnoredRowsBarrier + consumer_uniform, 128);
      }
    }
    ptx::wgmma_fence();
    wgmma_over_head_dim<T, kHeadDim, kBlockM, kBlockN>(s, q_desc, k_desc);
    ptx::wgmma_commit();
    ptx::mbarrier_wait(sm.v_full(stage), phase);
    ptx::wgmma_fence();  // after the wait's branch (else ptxas injects one, C7519)
    wgmma_over_head_dim<T, Cfg::kValueDim, kBlockM, kBlockN>(dp, do_desc, v_desc);
    ptx::wgmma_commit();
    // The previous block's dQ product and S have landed (dP may still run): that block's K stage
    // and dS fragments are free.
    ptx::wgmma_wait<1>();
    ptx::fence_registers(s);
    ptx::fence_registers(ds_a);
    ptx::fence_registers(dq);
    if (j > 0) ptx::mbarrier_arrive(sm.k_empty((j - 1) % kStages));

    // With a cap (before the bias), S becomes the tanh values, whose slopes dS takes (made before
    // the masks).
    float slope[kCapped ? kHalfN / 2 : 1];
    if constexpr (kCapped) {
#pragma unroll
      for (int i = 0; i < kHalfN / 2; ++i) {
        s[i] = logits.value(s[i]);
        slope[i] = logits.slope(s[i]);
      }
    }
    if constexpr (kBias) {
      const int rows[2] = {q_first + row_in_block(0), q_first + row_in_block(1)};
      add_bias_pairs<T, kHalfN / 8>(LogitBias<T>::from(p, batch, head, logits.unit), s, rows,
                                    k_first + (lane % 4) * 2);
    }
    // P, masked outside the band, past the keys and across segments.
    if (!band.all_visible(q_first, q_first + kBlockM - 1, k_first, k_first + kHalfN - 1)) {
      mask_rows(s, band, q_first, k_first, warp, lane);
    }
#pragma unroll
    for (int i = 0; i < kHalfN / 2; ++i) s[i] = ptx::exp2(s[i] * scale_log2 - lse_log2[(i % 4) / 2]);

    ptx::wgmma_wait<0>();
    ptx::fence_registers(dp);
    ptx::mbarrier_arrive(sm.v_empty(stage));
    // dS, packed as the A operand (the accumulator and A layouts agree thread for thread).
#pragma unroll
    for (int i = 0; i < kHalfN / 2; ++i) {
      s[i] = s[i] * (dp[i] - delta[(i % 4) / 2]) * p.scale;
      if constexpr (kCapped) s[i] *= slope[i];
    }
#pragma unroll
    for (int kk = 0; kk < kHalfN / 16; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) ds_a[kk][i] = ptx::pack2<T>(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);

    // dQ += dS K: K MN-major (keys are K, head-dim columns N: one wgmma nH), this consumer's 32
    // keys, 16 a step (2048 bytes of a panel), column panels kBlockN * 128 bytes apart.
    const uint64_t kt_desc = ptx::smem_desc_sw128(sm.k(stage) + consumer_uniform * kHalfN * 128, kBlockN * 128);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHalfN / 16; ++kk) ptx::wgmma_rs(dq, ds_a[kk], ptx::desc_advance(kt_desc, kk * 2048), T{});
    ptx::wgmma_commit();
  }
  ptx::wgmma_wait<0>();
  ptx::fence_registers(ds_a);
  ptx::fence_registers(dq);

  // The two partial sums meet (sm90/bwd/dq_exchange.cuh), once both consumers' last products have
  // landed and the stages are free.
  ptx::named_barrier_sync(kExchangeBarrier, kConsumerThreads);
  // Consumer c stores the c-th half of the columns (the accumulator's c-th half of registers).
  if (consumer == 0) {
    exchange_and_store_dq<T, kHeadDim, kExchangeBarrier, 0>(p, exchange, dq, batch, head, q_first, tid, warp, lane);
  } else {
    exchange_and_store_dq<T, kHeadDim, kExchangeBarrier, 1>(p, exchange, dq, batch, head, q_first, tid, warp, lane);
  }
#endif
}

}  // namespace jax_flash::sm90
