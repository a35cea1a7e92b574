// A Hopper backward consumer's dQ part of a step (its keys' share of dQ for the step's queries),
// from registers to shared memory in the accumulator's tile order (sm90/bwd/dq_tiles.cuh), for the
// producer's dQ thread to add (dq_adder.cuh), once that thread has read the buffer's previous use.
// Every argument by reference, as the kernel holds it (by value, the code changed).
#pragma once

#include <cstdint>

#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"

namespace jax_flash::sm90 {

// dq_buffer and dq_use: the step's buffer and its use of it. t: the thread index in the warp group,
// read ahead of the wait (kThreadIndexAhead) or here after it.
template <typename Cfg, bool kThreadIndexAhead, typename SharedMemory>
__device__ __forceinline__ void store_dq_part(const SharedMemory& sm, const float (&dq)[Cfg::Dq::kChunks * 4],
                                              const int& dq_buffer, const int& dq_use, const int& consumer,
                                              const int& consumer_uniform, int& t) {
  if (dq_use > 0) ptx::mbarrier_wait(sm.dq_empty(consumer, dq_buffer), (dq_use - 1) & 1);
  if constexpr (!kThreadIndexAhead) t = ptx::thread_index() % 128;
  const uint32_t part = sm.dq(consumer_uniform, dq_buffer);
#pragma unroll
  for (int c = 0; c < Cfg::Dq::kChunks; ++c) {
    ptx::st_shared_f32x4(part + Cfg::Dq::chunk(c, t) * 16, dq[4 * c], dq[4 * c + 1], dq[4 * c + 2], dq[4 * c + 3]);
  }
  ptx::fence_proxy_async_shared();
  ptx::mbarrier_arrive(sm.dq_full(consumer, dq_buffer));
}

}  // namespace jax_flash::sm90
