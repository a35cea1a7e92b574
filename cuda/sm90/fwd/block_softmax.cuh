// The online softmax of one key block of a Hopper forward tile: its logits capped and masked
// (block_logits.cuh), then exponentiated by the rows' softmax (online_softmax.cuh), exactly or
// speculatively (H15: exp2 against the rows' current maxima straight away, without taking the
// block's). A tile with an element lost that way (a logit above every earlier one of its row by
// 83 scaled units) is listed for the redo pass, which computes it again exactly.
#pragma once

#include <cmath>

#include "common/params.h"
#include "sm90/fwd/block_logits.cuh"
#include "sm90/fwd/block_mask.cuh"
#include "common/softmax_rows.cuh"

namespace jax_flash::sm90 {

template <typename Softmax, typename BlockLogits>
struct FwdBlockSoftmax {
  static constexpr int kSRegs = BlockLogits::kSRegs;
  Softmax& softmax;
  const BlockLogits& block_logits;

  __device__ __forceinline__ void exact(float (&s)[kSRegs], int j, float (&rescale)[2]) const {
    block_logits.cap_and_mask(s, j, block_logits.block_mask(j));
    softmax.exact(s, rescale);
  }

  // kCapInOnePass (a cap at H >= 128): each element's tanh and exp2 in one pass, masked after it
  // (to 0, the row's sum taken again): the MUFU bounds the capped softmax, and with no mask between
  // a tanh pass and an exp2 pass the compiler fills the MUFU's gaps with the FMULs and FFMAs that
  // otherwise ran before each pass, the MUFU idle (H26; slower at H = 64). A masked logit's exp2
  // against the row's max may overflow to inf (e^2c), never NaN: the max is finite here.
  template <bool kCapInOnePass>
  __device__ __forceinline__ void speculative(float (&s)[kSRegs], int j, float (&rescale)[2], int tile) const {
    if (!softmax.warp_has_maxima()) {
      exact(s, j, rescale);
      return;
    }
    float sum[2];
    const BlockMask bm = block_logits.block_mask(j);
    if constexpr (kCapInOnePass) {
#pragma unroll
      for (int r = 0; r < 2; ++r) sum[r] = softmax.speculate(s, r, true);
      if (!bm.whole) {
        block_logits.mask_band(s, j, bm, 0.f);
#pragma unroll
        for (int r = 0; r < 2; ++r) sum[r] = thread_row_sum(s, r);
      }
    } else {
      block_logits.cap_and_mask(s, j, bm);
#pragma unroll
      for (int r = 0; r < 2; ++r) sum[r] = softmax.speculate(s, r, false);
    }
    if (softmax.within_bound(sum)) {
      softmax.accept(sum, rescale);
      return;
    }
    if (softmax.scale_down(s, sum, rescale) && block_logits.lane == 0) {
      const FwdParams& p = block_logits.p;
      int* scratch = p.tile_scratch;
      if (atomicExch(scratch + FwdScratch::kFlags + tile, 1) == 0) {
        const int all_tiles = BlockLogits::TileWork::all_tiles(p);
        scratch[FwdScratch::redo_list(all_tiles) + atomicAdd(scratch + FwdScratch::kRedoCount, 1)] = tile;
      }
    }
  }
};

}  // namespace jax_flash::sm90
