// The Hopper backward's dQ thread (one thread of the producer warp group): adds each step's dQ
// parts, which the consumers leave in shared memory, to the fp32 accumulator in global memory, in
// the consumers' order; rows past seqlen_q go to the accumulator's padding.
//
// In deterministic mode each waits for the turn of this key block (common/bwd_walk.cuh) and
// is complete before the turn passes on. Otherwise, with dQ tickets (params.h), the first
// CTA at a query block stores its part and marks it stored once complete; the others add
// theirs after that mark. Each step's ticket is taken a step ahead, so that its round trip
// runs under the wait for the consumers. A CTA waits only at a block another CTA stores
// first, which does not wait there; any wait that CTA meets before is at a block earlier in
// the order that every walk over the head's blocks shares (last block first, head by head),
// so no chain of waits can go round in a circle.
#pragma once

#include <cstdint>

#include "common/bwd_walk.cuh"
#include "common/mask.cuh"
#include "common/params.h"
#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"
#include "sm90/bwd/shared_memory.cuh"

namespace jax_flash::sm90 {

template <typename Cfg>
__device__ __forceinline__ void add_dq_parts(const BwdParams& p, const BwdSharedMemory<Cfg>& sm, const BwdWalk& walk,
                                             const Band& band, int batch, int kv_head, int group, int n_block) {
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN;
    BwdStep step = BwdStep::first(walk, kv_head * group);
    // Made where used (the producer has 24 registers): a pointer kept across the step spilled.
    auto ticket_of = [&](const BwdStep& at) {
      return dq_ticket(p, batch * p.heads + at.head, at.m_block, kBlockM);
    };
    int arrivals_before = p.dq_tickets != nullptr && walk.steps > 0 ? atomicAdd(ticket_of(step), 1) : 0;
    for (int s = 0; s < walk.steps; ++s, step.advance(walk)) {
      const int buffer = s % Cfg::kDqBuffers, use = s / Cfg::kDqBuffers;
      int* turn = nullptr;
      if (Cfg::kRunsDeterministic && p.dq_turns != nullptr) {
        turn = wait_dq_turn(p.dq_turns + (int64_t(batch) * p.heads + step.head) * (p.stats_stride / contract::kDqCounterRows),
                            band.without_segments(), step.m_block, n_block, kBlockM, kBlockN);
        ptx::fence_proxy_async_global();
      }
      const bool stores = p.dq_tickets != nullptr && arrivals_before == 0;
      if (p.dq_tickets != nullptr) {
        if (!stores) {
          while ((ptx::ld_acquire(ticket_of(step)) & kDqStored) == 0) {
          }
          ptx::fence_proxy_async_global();
        }
        if (s + 1 < walk.steps) {
          BwdStep next = step;
          next.advance(walk);
          arrivals_before = atomicAdd(ticket_of(next), 1);
        }
      }
      for (int c = 0; c < Cfg::kConsumers; ++c) {
        ptx::mbarrier_wait(sm.dq_full(c, buffer), use & 1);
        const int row_block = (step.m_block * kBlockM + Cfg::dq_row0(c)) / Cfg::Dq::kRows;
        float* const dst = p.dq_accum + Cfg::Dq::tile(p, batch, step.head, row_block, Cfg::dq_column0(c) / 64);
        if (stores) {
          ptx::bulk_store(dst, sm.dq(c, buffer), Cfg::kDqBytes);
        } else {
          ptx::bulk_reduce_add_f32(dst, sm.dq(c, buffer), Cfg::kDqBytes);
        }
      }
      ptx::tma_store_commit();
      if (turn != nullptr || stores) {
        ptx::tma_store_wait_all();
        ptx::fence_proxy_async_global();
        if (stores) {
          ptx::red_release_add(ticket_of(step), kDqStored);
        } else {
          ptx::red_release_add(turn, 1);
        }
      } else {
        ptx::tma_store_wait_read();
      }
      for (int c = 0; c < Cfg::kConsumers; ++c) ptx::mbarrier_arrive(sm.dq_empty(c, buffer));
    }
}

}  // namespace jax_flash::sm90
