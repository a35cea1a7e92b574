// The query rows of one mma.sync forward CTA: kBlockM queries of one head of a batch row (the
// dense grid: blocks x batch * heads), or of one sequence of a ragged batch's prefill list
// (DecodeParams::prefill_work; the grid: its items x kPrefillBlockRows / kBlockM CTAs, heads).
#pragma once

#include "common/grid.cuh"
#include "common/params.h"
#include "decode/params.h"

namespace jax_flash::sm80 {

struct QueryBlock {
  int batch;    // the batch row, or the sequence (-1: no work): the row of lengths, sinks, pages
  int head;
  int q_first;  // the block's first query within its batch row or sequence
  int row0;     // ragged: the sequence's first row of q [Q, N, H]
  int queries;  // queries of the batch row or sequence

  // The dense grid's block; longest rows first: with a causal band the last blocks have the most keys.
  template <int kBlockM>
  __device__ static QueryBlock dense(const FwdParams& p) {
    const int m_block = gridDim.x - 1 - blockIdx.x;
    return {batch_head_index() / p.heads, batch_head_index() % p.heads, m_block * kBlockM, 0, p.seqlen_q};
  }
  template <int kBlockM>
  __device__ static QueryBlock ragged(const DecodeParams& p) {
    static_assert(kPrefillBlockRows % kBlockM == 0, "whole CTAs an item");
    constexpr int kCtas = kPrefillBlockRows / kBlockM;
    const int4 item = __ldg(reinterpret_cast<const int4*>(p.prefill_work) + blockIdx.x / kCtas);
    return {item.x, int(blockIdx.y), item.y + int(blockIdx.x % kCtas) * kBlockM, item.z, item.w};
  }
};

}  // namespace jax_flash::sm80
