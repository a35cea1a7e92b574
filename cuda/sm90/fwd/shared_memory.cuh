// Where the Hopper forward keeps its tiles and barriers in shared memory: Q, kStages K and V stages,
// the bias tiles' region (kBiasTiles), then the mbarriers and three slots of tile work, from a
// base aligned up to the 1024 bytes the 128-byte swizzle repeats over (FwdConfig::kSmemBytes).
#pragma once

#include <cstdint>

#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"

namespace jax_flash::sm90 {

template <typename Cfg>
struct FwdSharedMemory {
  static constexpr int kStages = Cfg::kStages;
  char* base;      // the dynamic shared memory, generic address
  uint32_t q;      // Q's tile (1024-byte aligned); K, V and the rest follow
  uint32_t bars;   // the first mbarrier

  __device__ __forceinline__ static FwdSharedMemory of(char* smem) {
    const uint32_t q = (ptx::smem_addr(smem) + 1023) & ~1023u;
    return {smem, q, q + Cfg::kQBytes + kStages * (Cfg::kKBytes + Cfg::kVBytes) + Cfg::kBiasRegionBytes};
  }
  __device__ __forceinline__ uint32_t k(int stage) const { return q + Cfg::kQBytes + stage * Cfg::kKBytes; }
  __device__ __forceinline__ uint32_t v(int stage) const {
    return q + Cfg::kQBytes + kStages * Cfg::kKBytes + stage * Cfg::kVBytes;
  }
  __device__ __forceinline__ uint32_t bias_region() const {
    return q + Cfg::kQBytes + kStages * (Cfg::kKBytes + Cfg::kVBytes);
  }

  // Q loaded (the producer's one arrival with its bytes) / free again (every consumer thread).
  __device__ __forceinline__ uint32_t q_full() const { return bars; }
  __device__ __forceinline__ uint32_t q_empty() const { return bars + 8; }
  // A K or V stage loaded / released by every consumer thread.
  __device__ __forceinline__ uint32_t k_full(int stage) const { return bars + 8 * (2 + stage); }
  __device__ __forceinline__ uint32_t v_full(int stage) const { return bars + 8 * (2 + kStages + stage); }
  __device__ __forceinline__ uint32_t k_empty(int stage) const { return bars + 8 * (2 + 2 * kStages + stage); }
  __device__ __forceinline__ uint32_t v_empty(int stage) const { return bars + 8 * (2 + 3 * kStages + stage); }
  // Every consumer's last S of a tile has landed (the staged O store may then reuse its K stage).
  __device__ __forceinline__ uint32_t last_s_landed() const { return bars + 8 * (2 + 4 * kStages); }
  // kBiasTiles: two "full" barriers, then two "empty" ones.
  __device__ __forceinline__ uint32_t bias_full() const { return bars + 8 * (3 + 4 * kStages); }
  __device__ __forceinline__ uint32_t bias_empty() const { return bias_full() + 16; }

  // The producer writes the work of the n-th tile whose Q it loads (or that no tile is left) into
  // tile_slot(n) before it arrives on q_full; the consumers read it there at the tile's start and
  // in its epilogue. Three slots: the producer writes tile n's as soon as it has derived it, once
  // the consumers have begun tile n - 2 (it waited for that before publishing tile n - 1), so
  // done with tile n - 3's slot; the work need not stay in its registers until Q's buffer frees.
  template <typename Work>
  __device__ __forceinline__ uint32_t tile_slot(int n) const {
    static_assert(Cfg::kSlotsOffset + 3 * Work::kSlotBytes <= Cfg::kBarrierBytes, "barrier space");
    return bars + Cfg::kSlotsOffset + Work::kSlotBytes * (n % 3);
  }
  // The same slot's generic address, for plain loads (FwdWork::load).
  template <typename Work>
  __device__ __forceinline__ const int* tile_slot_ptr(int n) const {
    return reinterpret_cast<const int*>(base + (tile_slot<Work>(n) - ptx::smem_addr(base)));
  }

  // By thread 0, before the CTA's first __syncthreads.
  __device__ __forceinline__ void init_barriers() const {
    constexpr int kConsumerThreads = 128 * Cfg::kConsumers;
    ptx::mbarrier_init(q_full(), 1);
    ptx::mbarrier_init(q_empty(), kConsumerThreads);
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(k_full(s), 1);
      ptx::mbarrier_init(v_full(s), 1);
      ptx::mbarrier_init(k_empty(s), kConsumerThreads);
      ptx::mbarrier_init(v_empty(s), kConsumerThreads);
    }
    ptx::mbarrier_init(last_s_landed(), kConsumerThreads);
    if constexpr (Cfg::kBiasRegionBytes > 0) {
      for (int stage = 0; stage < 2; ++stage) {
        ptx::mbarrier_init(bias_full() + 8 * stage, 1);
        ptx::mbarrier_init(bias_empty() + 8 * stage, kConsumerThreads);
      }
    }
    ptx::fence_barrier_init();
  }
};

}  // namespace jax_flash::sm90
