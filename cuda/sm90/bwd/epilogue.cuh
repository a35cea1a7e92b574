// The Hopper backward's epilogue: a consumer's dK (times the logits' scale, left out of dS^T) and
// dV as T into its rows of the K and V tiles (once both consumers are done reading them), then
// TMA stores, which clip rows past seqlen_k.
#pragma once

#include "common/accumulator.cuh"
#include "common/bias.cuh"
#include "common/bwd_walk.cuh"
#include "common/params.h"
#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"
#include "sm90/bwd/shared_memory.cuh"

namespace jax_flash::sm90 {

template <typename Cfg, bool kLongestFirst, bool kBiasGrad>
__device__ __forceinline__ void store_dk_dv(const BwdTensorMaps& maps, const BwdParams& p,
                                            const BwdSharedMemory<Cfg>& sm, const float (&dk)[Cfg::kHeadDim / 2],
                                            const float (&dv)[Cfg::kHeadDim / 2], int consumer, int tid) {
  using T = typename Cfg::T;
  constexpr int kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim, kConsumerThreads = 128 * Cfg::kConsumers;
  const int warp = tid / 32, lane = tid % 32;
  const AccumulatorLayout accum{lane};  // element i: row warp * 16 + accum.row(i), column accum.col(i)
  ptx::named_barrier_sync(3, kConsumerThreads);
#pragma unroll
  for (int i = 0; i < kHeadDim / 2; i += 2) {
    const int row = consumer * 64 + warp * 16 + accum.row(i), col = accum.col(i);
    const uint32_t off = (col / 64) * kBlockN * 128 + ptx::sw128_offset(row, (col % 64) / 8) + (lane % 4) * 4;
    ptx::st_shared_b32(sm.k() + off, ptx::pack2<T>(dk[i] * p.scale, dk[i + 1] * p.scale));
    ptx::st_shared_b32(sm.v() + off, ptx::pack2<T>(dv[i], dv[i + 1]));
  }
  ptx::fence_proxy_async_shared();
  ptx::named_barrier_sync(1 + consumer, 128);
  if (tid == 0) {
    // The coordinates derived again: kept from the top, they held registers across the loop.
    const BwdCta cta = BwdCta::of<kLongestFirst>(p.batch, p.kv_heads, kBiasGrad && BiasGrad::shared_by_ctas(p));
    const int batch = cta.batch, kv_head = cta.kv_head, key0 = cta.n_block * kBlockN + consumer * 64;
    for (int panel = 0; panel < Cfg::kPanels; ++panel) {
      const uint32_t off = panel * kBlockN * 128 + consumer * 64 * 128;
      ptx::tma_store_4d(&maps.dk, sm.k() + off, panel * 64, kv_head, key0, batch);
      ptx::tma_store_4d(&maps.dv, sm.v() + off, panel * 64, kv_head, key0, batch);
    }
    ptx::tma_store_commit();
    ptx::tma_store_wait_read();
  }
}

}  // namespace jax_flash::sm90
