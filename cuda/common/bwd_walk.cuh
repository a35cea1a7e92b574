// The query blocks a backward CTA visits for its block of keys: the blocks that can see any of its
// keys, [m_begin, m_end), for each query head of its GQA group in turn (so that dK and dV of the
// group are summed in registers). The sm80 and sm90 backward kernels walk it the same way.
#pragma once

#include "common/mask.cuh"

namespace jax_flash {

struct BwdWalk {
  int m_begin, m_end, steps;

  __device__ static BwdWalk make(const Band& band, int k_first, int keys_valid, int seqlen_q, int block_m,
                                 int group) {
    const int m_begin = band.query_begin(k_first, seqlen_q) / block_m;
    const int m_end = (band.query_end(k_first + keys_valid - 1, seqlen_q) + block_m - 1) / block_m;
    return {m_begin, m_end, group * max(0, m_end - m_begin)};
  }
};

// A step of the walk; counted rather than divided out of the step index (an integer division per
// step showed in profiles).
struct BwdStep {
  int head, m_block;

  __device__ void advance(const BwdWalk& walk) {
    if (++m_block == walk.m_end) m_block = walk.m_begin, ++head;
  }
};

}  // namespace jax_flash
