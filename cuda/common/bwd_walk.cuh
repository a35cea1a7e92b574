// The query blocks a backward CTA visits for its block of keys: the blocks that can see any of its
// keys, [m_begin, m_end), for each query head of its GQA group in turn (so that dK and dV of the
// group are summed in registers). The sm80 and sm90 backward kernels walk it the same way.
#pragma once

#include "common/mask.cuh"
#include "common/ptx.cuh"
#include "generated/contract.h"

namespace jax_flash {

struct BwdWalk {
  int m_begin, m_end, steps;

  // With segment ids in `band`, the query blocks of other documents are skipped; deterministic
  // mode passes `band.without_segments()`, since its turn order needs walks that only grow with
  // the key block.
  __device__ static BwdWalk make(const Band& band, int k_first, int k_last, int block_m, int group) {
    const Range rows = band.queries_of(k_first, k_last);
    const int m_begin = rows.begin / block_m;
    const int m_end = (rows.end + block_m - 1) / block_m;
    return {m_begin, m_end, group * max(0, m_end - m_begin)};
  }
};

// The first key block whose walk includes query block m. The key blocks that visit m are
// contiguous (m_begin and m_end never decrease with the key block), so the deterministic dQ order
// gives key block n the turn n - first_key_block(m).
__device__ inline int first_key_block(const Band& band, int m, int block_m, int block_n) {
  int lo = 0, hi = (band.seqlen_k + block_n - 1) / block_n - 1;  // the answer is in [lo, hi]
  while (lo < hi) {
    const int n = (lo + hi) / 2;
    const int m_end = (band.queries_of(n * block_n, (n + 1) * block_n - 1).end + block_m - 1) / block_m;
    if (m_end > m) hi = n; else lo = n + 1;
  }
  return lo;
}

// Deterministic dQ (BwdParams::dq_turns): the counter of query block m of one (batch, head) row of
// counters, and the wait for key block n's turn there. Not inlined: it runs only in deterministic
// mode and should not cost the main loop registers. `band` without segments (the walks of
// deterministic mode ignore them).
__device__ __noinline__ inline int* wait_dq_turn(int* turns_row, Band band, int m, int n, int block_m,
                                                 int block_n) {
  int* turn = turns_row + m * (block_m / contract::kDqCounterRows);
  const int mine = n - first_key_block(band, m, block_m, block_n);
  while (ptx::ld_acquire(turn) != mine) {
  }
  return turn;
}

// A step of the walk: query blocks from the last down, head after head. Counted rather than
// divided out of the step index (an integer division per step showed in profiles). From the last
// block down, every key block reaches a query block after the same number of steps (their walks
// all end at m_end - 1 unless a window bounds them), so in deterministic mode a key block's turn
// comes without waiting for a longer walk to catch up (walking up, key block n of a causal mask
// would wait about 2n steps for key block 0).
struct BwdStep {
  int head, m_block;

  __device__ static BwdStep first(const BwdWalk& walk, int head) { return {head, walk.m_end - 1}; }
  __device__ void advance(const BwdWalk& walk) {
    if (--m_block < walk.m_begin) m_block = walk.m_end - 1, ++head;
  }
};

}  // namespace jax_flash
