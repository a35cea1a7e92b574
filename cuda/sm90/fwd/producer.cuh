// The producer of the Hopper forward: one thread of warp group 0. It walks the CTA's tiles,
// publishes each tile's work in a slot (FwdWork), and issues the TMA copies of the tile's Q and of
// K and V (and with kBiasTiles the bias and mask) per key block into the stages. Key blocks are
// numbered across tiles (`it`), so the stages form one ring and the next tile's first copies go
// out while the consumers finish this one: the n-th use of a stage waits for the consumers'
// release of use n - 1.
#pragma once

#include <cuda.h>

#include "common/params.h"
#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"
#include "sm90/fwd/config.cuh"
#include "sm90/fwd/shared_memory.cuh"
#include "sm90/fwd/tiles.cuh"

namespace jax_flash::sm90 {

template <typename Cfg, Variant kVariant, bool kRedo>
struct FwdProducer {
  using T = typename Cfg::T;
  using Work = FwdWork<Cfg, kVariant, kRedo>;
  static constexpr int kStages = Cfg::kStages;
  const FwdTensorMaps& maps;
  const FwdParams& p;
  const FwdSharedMemory<Cfg>& shared;

  // The copies of one key block (keys from key_first of kv head `kv_head`, kPanels 64-column
  // panels) into stage use `it`.
  template <int kPanels>
  __device__ __forceinline__ void load_kv(uint32_t full, uint32_t empty, uint32_t dst, const CUtensorMap* map, int it,
                                          int kv_head, int key_first, int batch) const {
    if (it >= kStages) ptx::mbarrier_wait(empty, (it / kStages - 1) & 1);
    ptx::mbarrier_arrive_expect_tx(full, kPanels * Cfg::kBlockN * 128);
    for (int panel = 0; panel < kPanels; ++panel) {
      ptx::tma_load_4d(dst + panel * Cfg::kBlockN * 128, map, full, panel * 64, kv_head, key_first, batch);
    }
  }
  __device__ __forceinline__ void load_k(int it, int kv_head, int key_first, int batch) const {
    const int stage = it % kStages;
    load_kv<Cfg::kPanels>(shared.k_full(stage), shared.k_empty(stage), shared.k(stage), &maps.k, it, kv_head, key_first,
                          batch);
  }
  __device__ __forceinline__ void load_v(int it, int kv_head, int key_first, int batch) const {
    const int stage = it % kStages;
    load_kv<Cfg::kVPanels>(shared.v_full(stage), shared.v_empty(stage), shared.v(stage), &maps.v, it, kv_head,
                           key_first, batch);
  }
  // With kBiasTiles, key block `it`'s tiles of the bias and mask, after its V.
  __device__ __forceinline__ void load_bias(int it, const Work& w, int key_first) const {
    if constexpr (Cfg::kBiasRegionBytes > 0) {
      Cfg::BiasTiles::of(p, sizeof(T)).load(&maps.bias, &maps.mask, p, it, shared.bias_region(), shared.bias_full(),
                                            shared.bias_empty(), w.batch, w.head, w.q_first, key_first);
    }
  }
  __device__ __forceinline__ void load_q(const Work& w) const {
    ptx::mbarrier_arrive_expect_tx(shared.q_full(), Cfg::kQBytes);
    for (int panel = 0; panel < Cfg::kPanels; ++panel) {
      ptx::tma_load_4d(shared.q + panel * Cfg::kBlockM * 128, &maps.q, shared.q_full(), panel * 64, w.head, w.q_first,
                       w.batch);
    }
  }

  __device__ __forceinline__ void run() const {
    const int tiles = Work::tile_count(p);
    int tile = blockIdx.x;
    for (int n = 0, it = 0;; ++n) {
      // Q's buffer is free once every consumer's last S of the previous tile has landed.
      auto wait_q_empty = [&] {
        if (n > 0) ptx::mbarrier_wait(shared.q_empty(), (n - 1) & 1);
      };
      if (tile >= tiles) {  // no tile left: the consumers are told so, and all stop
        Work::store_end(shared.template tile_slot<Work>(n));
        wait_q_empty();
        ptx::mbarrier_arrive(shared.q_full());
        break;
      }
      const Work w = Work::of(tile, p);
      w.store(shared.template tile_slot<Work>(n), tile);
      const int kv_head = w.head / (p.heads / p.kv_heads);
      if (w.blocks == 0) {
        wait_q_empty();
        ptx::mbarrier_arrive(shared.q_full());
      } else {
        // The first K block goes out before Q: its stage frees earlier than Q's buffer.
        load_k(it, kv_head, w.key_first(0), w.batch);
        wait_q_empty();
        load_q(w);
        load_v(it, kv_head, w.key_first(0), w.batch);
        load_bias(it, w, w.key_first(0));
        for (int j = 1; j < w.blocks; ++j) {
          load_k(it + j, kv_head, w.key_first(j), w.batch);
          load_v(it + j, kv_head, w.key_first(j), w.batch);
          load_bias(it + j, w, w.key_first(j));
        }
      }
      it += w.blocks;
      // The next tile is claimed only now, a few blocks before the consumers finish this one:
      // claimed at the start, a long causal tile would stay reserved behind another long one
      // while CTAs that finished sit idle (H7).
      tile = int(gridDim.x) + atomicAdd(p.tile_scratch + (kRedo ? FwdScratch::kRedoCounter : FwdScratch::kCounter), 1);
    }
  }
};

}  // namespace jax_flash::sm90
