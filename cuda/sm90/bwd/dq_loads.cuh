// The producer of the Hopper backward's dQ kernel (one thread): Q and dO of the CTA's query block
// once, then K and V of each key block into kStages stages by TMA, from the last block down.
// The n-th use of a stage waits for the consumers' release of use n - 1.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "common/params.h"
#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"
#include "sm90/bwd/dq_shared_memory.cuh"
#include "sm90/bwd/stages.cuh"

namespace jax_flash::sm90 {

template <typename Cfg>
__device__ __forceinline__ void load_dq_kernel_tiles(const BwdTensorMaps& maps, const DqKernelSharedMemory<Cfg>& sm,
                                                     int batch, int head, int kv_head, int q_first, int n_end,
                                                     int blocks) {
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kStages = Cfg::kStages;
  auto key_block_first = [&](int j) { return (n_end - 1 - j) * kBlockN; };
  ptx::mbarrier_arrive_expect_tx(sm.qdo_full(), Cfg::kQBytes + Cfg::kDoBytes);
  for (int panel = 0; panel < Cfg::kPanels; ++panel) {
    ptx::tma_load_4d(sm.q() + panel * kBlockM * 128, &maps.q, sm.qdo_full(), panel * 64, head, q_first, batch);
  }
  for (int panel = 0; panel < Cfg::kValuePanels; ++panel) {
    ptx::tma_load_4d(sm.d_o() + panel * kBlockM * 128, &maps.dout, sm.qdo_full(), panel * 64, head, q_first, batch);
  }
  // kPanels of K or kValuePanels of V.
  auto load = [&](uint32_t full, uint32_t empty, uint32_t dst, const CUtensorMap* map, int panels, int j) {
    if (j >= kStages) ptx::mbarrier_wait(empty, (j / kStages - 1) & 1);
    ptx::mbarrier_arrive_expect_tx(full, panels * kBlockN * 128);
    for (int panel = 0; panel < panels; ++panel) {
      ptx::tma_load_4d(dst + panel * kBlockN * 128, map, full, panel * 64, kv_head, key_block_first(j), batch);
    }
  };
  for (int j = 0; j < blocks; ++j) {
    const int stage = j % kStages;
    load(sm.k_full(stage), sm.k_empty(stage), sm.k(stage), &maps.k, Cfg::kPanels, j);
    load(sm.v_full(stage), sm.v_empty(stage), sm.v(stage), &maps.v, Cfg::kValuePanels, j);
  }
}

}  // namespace jax_flash::sm90
