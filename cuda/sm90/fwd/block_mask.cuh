// The band mask of the Hopper forward's key blocks. Only blocks that straddle the band, the end of
// the keys or a segment's edge are masked (BlockMask::whole false). The masked variant
// (FwdWork::kOneSegmentKeys) tests a block against its tile's one-segment keys (arithmetic) and
// compares no ids in a block of one segment (H25); the others read the block's chunks
// (Band::all_visible). The kernel classifies each block (its block_mask).
#pragma once

#include <type_traits>

#include "common/accumulator.cuh"
#include "common/mask.cuh"

namespace jax_flash::sm90 {

struct BlockMask {
  bool whole;        // every logit of the block visible: no mask
  bool one_segment;  // its keys hold only the tile's rows' one segment id: no id compared
};

// The band mask of an S accumulator (rows q[r] of this thread, the block's keys from k_first):
// `fill` where a row does not see a key (-inf before the exp2, 0 after it).
template <int kSRegs>
__device__ __forceinline__ void mask_band(float (&s)[kSRegs], const Band& band, const int (&q)[2], int k_first,
                                          int lane, BlockMask bm, float fill) {
  const Range seen[2] = {band.keys_seen_by(q[0]), band.keys_seen_by(q[1])};
  const AccumulatorLayout accum{lane};
  auto mask = [&](auto segments) {
    constexpr bool kSegments = decltype(segments)::value;
    const int q_segment[2] = {kSegments ? band.q_segment(q[0]) : 0, kSegments ? band.q_segment(q[1]) : 0};
#pragma unroll
    for (int i = 0; i < kSRegs; ++i) {
      const int r = (i % 4) / 2, k = k_first + accum.col(i);
      // The id loads issue with the range test, not after it: unswitched, they cost less.
      const bool other_segment = kSegments && band.kv_segment(k) != q_segment[r];
      hide_outside(s[i], fill, seen[r], k, [&] { return other_segment; });
    }
  };
  if (bm.one_segment) {
    mask(std::false_type{});
  } else {
    band.with_segments(mask);
  }
}

}  // namespace jax_flash::sm90
