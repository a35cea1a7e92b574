// One warp's load pipeline: a ring of Cfg::kStages shared-memory stages, each holding K and V of
// kDecodeBlockKeys keys, filled by cp.async. Step i of the warp lives in stage i % kStages; a
// step's loads form one commit group, so waiting for all but the newest kStages - 1 groups
// leaves step i's block in place. Only this warp reads its ring: __syncwarp orders it, no CTA
// barrier.
#pragma once

#include <cstdint>

#include "common/ptx.cuh"
#include "common/tile.cuh"

namespace jax_flash::decode {

template <typename Cfg>
struct WarpRing {
  using KvTile = typename Cfg::KvTile;
  uint32_t base;  // this warp's first stage

  __device__ static WarpRing of_warp(uint32_t smem, int warp) {
    return {smem + uint32_t(warp * Cfg::kStages * Cfg::kStageBytes)};
  }
  __device__ __forceinline__ uint32_t k_stage(int step) const { return base + (step % Cfg::kStages) * Cfg::kStageBytes; }
  __device__ __forceinline__ uint32_t v_stage(int step) const { return k_stage(step) + KvTile::kBytes; }

  // Start copying a block (its first key at k and v, keys row_stride elements apart) into step
  // `step`'s stage; keys from `keys_valid` on are zero-filled, never read. No commit.
  template <typename T>
  __device__ __forceinline__ void load(int step, const T* k, const T* v, int64_t row_stride, int keys_valid,
                                       int lane) const {
    load_tile<KvTile, 32, true>(k_stage(step), k, row_stride, keys_valid, lane);
    load_tile<KvTile, 32, true>(v_stage(step), v, row_stride, keys_valid, lane);
  }
  // Wait until step `step`'s block has landed, given that kStages - 1 later groups were committed.
  __device__ __forceinline__ void wait() const {
    ptx::cp_async_wait<Cfg::kStages - 1>();
    __syncwarp();
  }
};

}  // namespace jax_flash::decode
