// What the two sm90 backward kernels (bwd_kernel.cuh, bwd_wide_kernel.cuh) share: their first
// mbarriers and the producer thread that fills the shared-memory stages through them. K and V of
// the CTA's keys are copied once; each step's Q with its lse_log2 rows and dO with its delta rows
// go into one of Cfg::kStages stages.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "common/bwd_walk.cuh"
#include "common/grid.cuh"
#include "common/params.h"
#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"

namespace jax_flash::sm90 {

// [batch, row, head, column] views (tensor_map.h): q and dO in boxes of kBlockM rows, k and v of
// kBlockN, dk and dv of 64 (a consumer's).
struct BwdTensorMaps {
  CUtensorMap q, dout, k, v, dk, dv;
  CUtensorMap bias, mask;  // kBias (sm90/bwd/bias_tiles.cuh)
};

// The key block and (batch, kv head) of a backward CTA. The hardware starts CTAs in launch order
// (blockIdx.x fastest). In the grid's order, (key block, batch * kv_heads), the last CTAs to start
// include the last heads' longest walks (key block 0 of a causal head), which then run on with
// most SMs idle. With kLongestFirst, groups of about 256 CTAs (whole heads, which share their Q
// and dO in L2) start key block by key block: every head's block 0, then every head's block 1,
// and so on, so that the grid ends on the shortest walks (FlashAttention-3 orders its causal
// backward longest first too). Deterministic mode's turns, which pass from each key block of a
// head to the next, still find the earlier blocks started. `all_heads_together`: one group of
// every (batch, kv head), for a bias's gradient that several of them add into (a bias broadcast
// over heads or batch): each key block's column of dbias is then added to by all of them while it
// is in L2, rather than once a group, each group reading and writing it from DRAM again.
struct BwdCta {
  int n_block, batch, kv_head;
  template <bool kLongestFirst>
  __device__ static BwdCta of(int batch, int kv_heads, bool all_heads_together = false) {
    int n_block = blockIdx.x, batch_head = batch_head_index();
    if constexpr (kLongestFirst) {
      const int blocks = gridDim.x, heads = batch * kv_heads;
      const int linear = batch_head * blocks + n_block;
      const int group_heads = all_heads_together ? heads : max(1, 256 / blocks);
      const int first_head = linear / (group_heads * blocks) * group_heads;
      const int heads_here = min(group_heads, heads - first_head);
      const int i = linear - first_head * blocks;
      n_block = i / heads_here, batch_head = first_head + i % heads_here;
    }
    return {n_block, batch_head / kv_heads, batch_head % kv_heads};
  }
};

// 8-byte mbarriers from `first`: K and V loaded, then per stage Q (+ lse) and dO (+ delta)
// loaded ("full", one arrival and the bytes) and released by every consumer thread ("empty").
template <int kStages>
struct BwdBarriers {
  static constexpr int kCount = 1 + 4 * kStages;
  uint32_t first;
  __device__ uint32_t kv_full() const { return first; }
  __device__ uint32_t q_full(int stage) const { return first + 8 * (1 + stage); }
  __device__ uint32_t do_full(int stage) const { return first + 8 * (1 + kStages + stage); }
  __device__ uint32_t q_empty(int stage) const { return first + 8 * (1 + 2 * kStages + stage); }
  __device__ uint32_t do_empty(int stage) const { return first + 8 * (1 + 3 * kStages + stage); }
  // By one thread, before the CTA's first barrier.
  __device__ void init(int consumer_threads) const {
    ptx::mbarrier_init(kv_full(), 1);
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(q_full(s), 1);
      ptx::mbarrier_init(do_full(s), 1);
      ptx::mbarrier_init(q_empty(s), consumer_threads);
      ptx::mbarrier_init(do_empty(s), consumer_threads);
    }
  }
};

// The producer thread's copies for the whole walk; `base` is the 1024-byte aligned shared-memory
// base of Cfg's offsets (kK, kV, kQ, kDo, kLse, kDelta). The n-th use of a stage waits for the
// consumers' release of use n - 1.
template <typename Cfg>
__device__ __forceinline__ void produce_bwd_stages(const BwdTensorMaps& maps, const BwdParams& p,
                                                   const BwdWalk& walk, BwdBarriers<Cfg::kStages> bars,
                                                   uint32_t base, int batch, int kv_head, int k_first) {
  constexpr int kStages = Cfg::kStages, kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN;
  const int group = p.heads / p.kv_heads;
  ptx::mbarrier_arrive_expect_tx(bars.kv_full(), Cfg::kKBytes + Cfg::kVBytes);
  for (int panel = 0; panel < Cfg::kPanels; ++panel) {
    ptx::tma_load_4d(base + Cfg::kK + panel * kBlockN * 128, &maps.k, bars.kv_full(), panel * 64, kv_head, k_first,
                     batch);
  }
  for (int panel = 0; panel < Cfg::kValuePanels; ++panel) {
    ptx::tma_load_4d(base + Cfg::kV + panel * kBlockN * 128, &maps.v, bars.kv_full(), panel * 64, kv_head, k_first,
                     batch);
  }
  BwdStep step = BwdStep::first(walk, kv_head * group);
  for (int s = 0; s < walk.steps; ++s, step.advance(walk)) {
    const int stage = s % kStages, use = s / kStages;
    const int q_first = step.m_block * kBlockM;
    const int64_t stats = (int64_t(batch) * p.heads + step.head) * p.stats_stride + q_first;
    const uint32_t q_tile = base + Cfg::kQ + stage * Cfg::kQBytes, do_tile = base + Cfg::kDo + stage * Cfg::kDoBytes;
    if (use > 0) ptx::mbarrier_wait(bars.q_empty(stage), (use - 1) & 1);
    ptx::mbarrier_arrive_expect_tx(bars.q_full(stage), Cfg::kQBytes + Cfg::kStatBytes);
    for (int panel = 0; panel < Cfg::kPanels; ++panel) {
      ptx::tma_load_4d(q_tile + panel * kBlockM * 128, &maps.q, bars.q_full(stage), panel * 64, step.head, q_first,
                       batch);
    }
    ptx::bulk_load(base + Cfg::kLse + stage * Cfg::kStatBytes, p.lse_log2 + stats, Cfg::kStatBytes,
                   bars.q_full(stage));
    if (use > 0) ptx::mbarrier_wait(bars.do_empty(stage), (use - 1) & 1);
    ptx::mbarrier_arrive_expect_tx(bars.do_full(stage), Cfg::kDoBytes + Cfg::kStatBytes);
    for (int panel = 0; panel < Cfg::kValuePanels; ++panel) {
      ptx::tma_load_4d(do_tile + panel * kBlockM * 128, &maps.dout, bars.do_full(stage), panel * 64, step.head,
                       q_first, batch);
    }
    ptx::bulk_load(base + Cfg::kDelta + stage * Cfg::kStatBytes, p.delta + stats, Cfg::kStatBytes,
                   bars.do_full(stage));
  }
}

}  // namespace jax_flash::sm90
