// dK and dV of the head-dim-256 backward on Hopper (sm_90a): TMA, mbarriers, wgmma. dQ is
// bwd_dq_kernel.cuh's, which walks the keys per query block instead: added here per step, it took
// 64 KB of fp32 atomics per 64 x 64 step, 40% of the backward (docs/PERF.md).
//
// bwd_kernel.cuh keeps dK and dV of its keys as m64 x H accumulators (keys as rows); at H = 256
// they would take 256 registers a thread. Here the head dim is the row side of those products:
//   dV^T += dO^T P    and    dK^T += Q^T dS      (H x keys: the consumers split the 256 rows)
// so each of the two consumer warp groups keeps 128 rows (two m64 tiles) of dV^T and of dK^T over
// the CTA's 64 keys: 64 + 64 registers. A CTA owns kBlockN = 64 keys of one kv head and walks the
// query blocks that see them (common/bwd_walk.cuh), 64 queries a step, as bwd_kernel.cuh does.
// Per step:
//   consumer 0:  S  = Q K^T,  P = exp2(S * scale * log2 e - lse_log2)  ->  shared memory
//   consumer 1:  dP = dO V^T, dS = P (dP - delta) * scale              ->  shared memory
//   both:        their rows of dV^T and dK^T (dO^T, Q^T read transposed; P, dS as B operands)
// Named barriers order the hand-offs: kPReady (P stored), kDsReady (dS stored); each consumer
// issues the next step's S or dP behind its products of the step, and P has two buffers, so no
// barrier ends a step.
// No atomics: deterministic. The soft cap and the bias run the sm80 kernel at this head dim
// (dispatch.cu).
#pragma once

#include <cuda.h>

#include <cmath>
#include <type_traits>

#include "common/bwd_walk.cuh"
#include "common/mask.cuh"
#include "common/params.h"
#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"
#include "sm90/bwd_stages.cuh"

namespace jax_flash::sm90 {

template <typename T_>
struct BwdWideConfig {
  using T = T_;
  static constexpr int kHeadDim = 256;
  static constexpr int kConsumers = 2;  // warp groups of 128 head-dim rows
  static constexpr int kBlockN = 64;    // keys a CTA
  static constexpr int kBlockM = 64;    // queries a step
  static_assert(kStatsRowMultiple % kBlockM == 0, "statistics rows are padded to whole query blocks");
  static constexpr int kStages = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kPanels = kHeadDim / 64;            // 64-column panels of 128-byte rows
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;  // K or V
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;   // one stage of Q or dO
  static constexpr int kTileBytes = kBlockM * kBlockN * 2;  // P or dS: [query][key], one panel
  static constexpr int kStatBytes = kBlockM * 4;
  static constexpr int kK = 0, kV = kKVBytes, kQ = 2 * kKVBytes, kDo = kQ + kStages * kQBytes;
  // P has two buffers (a step's P is stored while the other consumer's products of the step
  // before may still read the last one); dS one.
  static constexpr int kP = kDo + kStages * kQBytes, kDs = kP + 2 * kTileBytes;
  static constexpr int kLse = kDs + kTileBytes, kDelta = kLse + kStages * kStatBytes;
  static constexpr int kBarriers = kDelta + kStages * kStatBytes;
  static constexpr int kSmemBytes = kBarriers + 8 * (1 + 4 * kStages) + 1024;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static_assert(128 * kProducerRegs + 128 * kConsumers * kConsumerRegs <= 65536, "register file");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA");
};

template <typename Cfg, Variant kVariant>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    bwd_wide_kernel(const __grid_constant__ BwdTensorMaps maps, const BwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = typename Cfg::T;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  constexpr int kStages = Cfg::kStages;
  constexpr int kConsumerThreads = 128 * Cfg::kConsumers;
  constexpr float kLog2e = 1.4426950408889634f;
  static_assert(kVariant == Variant::kPlain || kVariant == Variant::kMasked, "no cap or bias at d = 256");
  constexpr bool kMasked = kVariant == Variant::kMasked;
  enum : int { kPReady = 1, kDsReady = 2, kEpilogue = 3 };  // named barriers (+ consumer)

  extern __shared__ char smem[];
  const uint32_t align = (1024 - (ptx::smem_addr(smem) & 1023)) & 1023;
  char* const base = smem + align;
  const uint32_t base_addr = ptx::smem_addr(smem) + align;
  const uint32_t sK = base_addr + Cfg::kK, sV = base_addr + Cfg::kV;
  const uint32_t sDs = base_addr + Cfg::kDs;
  auto sP = [&](int step) { return base_addr + Cfg::kP + (step % 2) * Cfg::kTileBytes; };
  auto sQ = [&](int stage) { return base_addr + Cfg::kQ + stage * Cfg::kQBytes; };
  auto sDo = [&](int stage) { return base_addr + Cfg::kDo + stage * Cfg::kQBytes; };
  auto stat = [&](int offset, int stage, int row) {
    return reinterpret_cast<const float*>(base + offset + stage * Cfg::kStatBytes)[row];
  };
  const BwdBarriers<kStages> barriers{base_addr + Cfg::kBarriers};

  const int n_block = blockIdx.x;
  const int batch = blockIdx.y / p.kv_heads, kv_head = blockIdx.y % p.kv_heads;
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
      produce_bwd_stages<Cfg>(maps, p, walk, barriers, base_addr, batch, kv_head, k_first);
    }
    return;
  }

  ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int consumer = warp_group - 1;
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  // Accumulator element i of an m64nN tile: row warp * 16 + accum_row(i), column accum_col(i).
  auto accum_row = [&](int i) { return warp * 16 + ((i % 4) / 2) * 8 + lane / 4; };
  auto accum_col = [&](int i) { return (i / 4) * 8 + (lane % 4) * 2 + i % 2; };
  // Elements i, i + 1 (one row, two adjacent keys) of P or dS in its [query][key] tile.
  auto tile_offset = [&](int i) {
    return ptx::sw128_offset(accum_row(i), accum_col(i) / 8) + (accum_col(i) % 8) * 2;
  };
  const float scale_log2 = p.scale * kLog2e;
  const int row0 = consumer * 128;  // this consumer's rows of dV^T and dK^T (head-dim columns)

  float dvt[2][32], dkt[2][32];  // two m64 tiles of head-dim rows x 64 keys
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int i = 0; i < 32; ++i) dvt[mt][i] = dkt[mt][i] = 0.f;

  // acc[mt] += X^T B over the step's queries: X (Q or dO, [query][column] panels) read MN-major as
  // A, B (P or dS, [query][key]) MN-major: queries are the k16 steps.
  auto issue_transposed_products = [&](float (&acc)[2][32], uint32_t x, uint32_t b) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int ks = 0; ks < kBlockM / 16; ++ks) {
        const uint32_t panel = x + ((row0 + mt * 64) / 64) * kBlockM * 128;
        ptx::wgmma_ss<1, 1>(acc[mt], ptx::smem_desc_sw128(panel + ks * 2048, 0),
                            ptx::smem_desc_sw128(b + ks * 2048, 0), true, T{});
      }
    ptx::wgmma_commit();
  };

  // S = Q K^T (consumer 0) or dP = dO V^T (consumer 1) of step s issued: queries x keys, k16 steps
  // along the head dim, both operands K-major.
  auto issue_scores = [&](float (&acc)[32], int s) {
    const int stage = s % kStages, phase = (s / kStages) & 1;
    const uint32_t rows = consumer == 0 ? sQ(stage) : sDo(stage), keys = consumer == 0 ? sK : sV;
    ptx::mbarrier_wait(consumer == 0 ? barriers.q_full(stage) : barriers.do_full(stage), phase);
    ptx::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      const uint32_t off_q = (ks / 4) * kBlockM * 128 + (ks % 4) * 32, off_k = (ks / 4) * kBlockN * 128 + (ks % 4) * 32;
      ptx::wgmma_ss(acc, ptx::smem_desc_sw128(rows + off_q, 0), ptx::smem_desc_sw128(keys + off_k, 0), ks > 0, T{});
    }
    ptx::wgmma_commit();
  };

  // Pipelined across steps: each consumer issues the next step's S or dP right behind this step's
  // dV^T and dK^T, so the tensor cores have it queued while the other consumer computes P or dS.
  // Every product is waited for inside the step that issues it: a wgmma in flight across the
  // loop's back edge made ptxas serialise them all (C7514, C7515).
  float acc[32];  // S or dP of the step
  if (walk.steps > 0) {
    ptx::mbarrier_wait(barriers.kv_full(), 0);
    issue_scores(acc, 0);
    ptx::wgmma_wait<0>();
    ptx::fence_registers(acc);
  }
  // Step s (q_first its first query); issue_next: the next step's S or dP goes out behind its
  // products. The last step is a separate copy: issued conditionally, the accumulators took
  // register moves at the branch's join while the products were in flight (C7515).
  auto do_step = [&](int s, int q_first, auto issue_next) {
    const int stage = s % kStages, phase = (s / kStages) & 1;
    if (consumer == 0) {
      // P, masked outside the band and past seqlen_k (rows past seqlen_q have lse_log2 = +inf).
      if (!band.all_visible(q_first, q_first + kBlockM - 1, k_first, k_first + kBlockN - 1)) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int q = q_first + accum_row(2 * h);
          const Range seen = band.keys_seen_by(q);
#pragma unroll
          for (int i = 0; i < 32; ++i) {
            if ((i % 4) / 2 != h) continue;
            const int k = k_first + accum_col(i);
            if (k < seen.begin || k >= seen.end || !band.same_segment(q, k)) acc[i] = -INFINITY;
          }
        }
      }
      const float lse[2] = {stat(Cfg::kLse, stage, accum_row(0)), stat(Cfg::kLse, stage, accum_row(2))};
#pragma unroll
      for (int i = 0; i < 32; i += 2) {
        const float l = lse[(i % 4) / 2];
        ptx::st_shared_b32(sP(s) + tile_offset(i), ptx::pack2<T>(ptx::exp2(acc[i] * scale_log2 - l),
                                                              ptx::exp2(acc[i + 1] * scale_log2 - l)));
      }
      ptx::fence_proxy_async_shared();  // the P stores, before wgmma reads them
      ptx::named_barrier_sync(kPReady, kConsumerThreads);
      ptx::mbarrier_wait(barriers.do_full(stage), phase);
    } else {
      ptx::named_barrier_sync(kPReady, kConsumerThreads);
      // dS = P (dP - delta) * scale, from the 16-bit P (the precision dV uses).
      const float delta[2] = {stat(Cfg::kDelta, stage, accum_row(0)), stat(Cfg::kDelta, stage, accum_row(2))};
#pragma unroll
      for (int i = 0; i < 32; i += 2) {
        const float d = delta[(i % 4) / 2];
        const float2 prob = ptx::unpack2<T>(ptx::ld_shared_b32(sP(s) + tile_offset(i)));
        ptx::st_shared_b32(sDs + tile_offset(i), ptx::pack2<T>(prob.x * (acc[i] - d) * p.scale,
                                                               prob.y * (acc[i + 1] - d) * p.scale));
      }
      ptx::fence_proxy_async_shared();
      ptx::mbarrier_wait(barriers.q_full(stage), phase);
    }
    // dV^T += dO^T P, then (once dS is in) dK^T += Q^T dS.
    ptx::wgmma_fence();
    issue_transposed_products(dvt, sDo(stage), sP(s));
    ptx::named_barrier_sync(kDsReady, kConsumerThreads);
    issue_transposed_products(dkt, sQ(stage), sDs);
    if constexpr (decltype(issue_next)::value) issue_scores(acc, s + 1);
    // This step's products have landed (and the next step's S or dP): its Q and dO stage is free.
    // Each consumer passes the next kPReady only after this wait, so once past it the other's
    // products of this step are complete too: dS (one buffer) and the P buffer of step s + 2
    // may be overwritten.
    ptx::wgmma_wait<0>();
    ptx::fence_registers(acc);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) ptx::fence_registers(dvt[mt]), ptx::fence_registers(dkt[mt]);
    ptx::mbarrier_arrive(barriers.q_empty(stage));
    ptx::mbarrier_arrive(barriers.do_empty(stage));
  };
  BwdStep step = BwdStep::first(walk, kv_head * group);
  for (int s = 0; s < walk.steps - 1; ++s, step.advance(walk)) do_step(s, step.m_block * kBlockM, std::true_type{});
  if (walk.steps > 0) do_step(walk.steps - 1, step.m_block * kBlockM, std::false_type{});

  // Epilogue: dK^T and dV^T transposed into this consumer's column panels of the K and V tiles
  // ([key][column], as the dk and dv tensor maps expect; every S and dP has landed before its
  // step's kPReady, which both consumers passed, so K and V are unread), then TMA stores, which
  // clip rows past seqlen_k.
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int column = row0 + mt * 64 + accum_row(i), key = accum_col(i);
      const uint32_t off = (column / 64) * kBlockN * 128 + ptx::sw128_offset(key, (column % 64) / 8) + (column % 8) * 2;
      ptx::st_shared_b16(sK + off, ptx::pack2<T>(dkt[mt][i], 0.f) & 0xffff);
      ptx::st_shared_b16(sV + off, ptx::pack2<T>(dvt[mt][i], 0.f) & 0xffff);
    }
  ptx::fence_proxy_async_shared();
  ptx::named_barrier_sync(kEpilogue + consumer, 128);
  if (tid == 0) {
    for (int panel = row0 / 64; panel < (row0 + 128) / 64; ++panel) {
      const uint32_t off = panel * kBlockN * 128;
      ptx::tma_store_4d(&maps.dk, sK + off, panel * 64, kv_head, k_first, batch);
      ptx::tma_store_4d(&maps.dv, sV + off, panel * 64, kv_head, k_first, batch);
    }
    ptx::tma_store_commit();
    ptx::tma_store_wait_read();
  }
#endif
}

}  // namespace jax_flash::sm90
