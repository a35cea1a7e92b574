// What a Hopper forward consumer does to a key block's logits between S landing and the softmax:
// the soft cap, the bias and boolean mask (staged tiles, fwd_bias_tiles.cuh, or pairs read from
// global memory, bias.cuh), and the band mask (block_mask.cuh); and, while S is computed, the
// bias's and mask's lines of the block prefetched into L1 (H22).
#pragma once

#include <cmath>
#include <cstdint>

#include "common/bias.cuh"
#include "common/logits.cuh"
#include "common/mask.cuh"
#include "common/params.h"
#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"
#include "sm90/fwd/block_mask.cuh"
#include "sm90/fwd/shared_memory.cuh"
#include "sm90/fwd/bias_tiles.cuh"

namespace jax_flash::sm90 {

// One tile's blocks, seen by one consumer thread: its rows are row_in_tile(0) and (1) of the
// tile (the accumulator layout); block j of the tile is block it + j of the CTA's ring.
template <typename Cfg, Variant kVariant, typename Work>
struct FwdBlockLogits {
  using T = typename Cfg::T;
  using Capped = Logits<cap_of(kVariant)>;
  using TileWork = Work;
  static constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kSRegs = kBlockN / 2;
  static constexpr bool kBias = kVariant == Variant::kEverything, kSoftcap = kVariant == Variant::kSoftcap;
  static constexpr bool kBiasTiles = Cfg::kBiasRegionBytes > 0;

  const FwdParams& p;
  const Work& w;
  const Capped& logits;
  const FwdSharedMemory<Cfg>& shared;
  char* smem;
  int it, consumer, warp, lane;

  __device__ __forceinline__ int row_in_tile(int r) const { return consumer * 64 + warp * 16 + r * 8 + lane / 4; }

  // Which mask block j needs: none (whole), or the band's, with or without segment ids.
  __device__ __forceinline__ BlockMask block_mask(int j) const {
    const int k_first = w.key_first(j), q_first = w.q_first;
    const bool one_segment = Work::kOneSegmentKeys && k_first >= w.one_segment_keys.begin &&
                             k_first + kBlockN <= w.one_segment_keys.end;
    const bool whole =
        Work::kOneSegmentKeys
            ? one_segment && w.band.inside_band(q_first, q_first + kBlockM - 1, k_first, k_first + kBlockN - 1)
            : w.band.all_visible(q_first, q_first + kBlockM - 1, k_first, k_first + kBlockN - 1);
    return BlockMask{whole, one_segment};
  }
  __device__ __forceinline__ void mask_band(float (&s)[kSRegs], int j, BlockMask bm, float fill) const {
    const int q[2] = {w.q_first + row_in_tile(0), w.q_first + row_in_tile(1)};
    sm90::mask_band(s, w.band, q, w.key_first(j), lane, bm, fill);
  }
  // Soft cap (the kEverything variant: where the call has one), bias and boolean mask, then the
  // band mask.
  __device__ __forceinline__ void cap_and_mask(float (&s)[kSRegs], int j, BlockMask bm) const {
    const int k_first = w.key_first(j);
    if constexpr (kSoftcap || kBias) {
#pragma unroll
      for (int i = 0; i < kSRegs; ++i) s[i] = logits.value(s[i]);
    }
    if constexpr (kBiasTiles) {
      const auto tiles = Cfg::BiasTiles::of(p, sizeof(T));
      const uint32_t stage = tiles.stage_of(it + j);
      ptx::mbarrier_wait(shared.bias_full() + 8 * stage, tiles.use_of(it + j) & 1);
      const char* bias_tile = smem + (shared.bias_region() - ptx::smem_addr(smem)) + stage * tiles.tile_bytes();
      add_tile_bias_rows<T, typename Cfg::BiasTiles>(s, bias_tile, tiles.bias_bytes, p.bias_fp32,
                                                     tiles.mask_bytes != 0, row_in_tile(0), lane, 1.f / logits.unit);
      ptx::mbarrier_arrive(shared.bias_empty() + 8 * stage);
    } else if constexpr (kBias) {
      // Made each block from the parameters (constant memory) rather than kept across the tile:
      // its pointers and strides would hold a dozen registers.
      const int q[2] = {w.q_first + row_in_tile(0), w.q_first + row_in_tile(1)};
      add_bias_pairs<T, kBlockN / 8>(LogitBias<T>::from(p, w.batch, w.head, logits.unit), s, q,
                                     k_first + (lane % 4) * 2);
    }
    if (!bm.whole) mask_band(s, j, bm, -INFINITY);
  }
  // The bias's and mask's lines of block j into L1 while S_j is computed (cap_and_mask reads them
  // when it has landed): a quad's four threads take its two rows' two 64-key halves.
  __device__ __forceinline__ void prefetch_bias(int j) const {
    if constexpr (kBias && !kBiasTiles) {
      const LogitBias<T> b = LogitBias<T>::from(p, w.batch, w.head, logits.unit);
      const int64_t row = min(w.q_first + row_in_tile((lane % 4) / 2), b.last_q);
      const int k = min(w.key_first(j) + (lane % 2) * 64, b.last_k);
      if (b.bias != nullptr) {
        ptx::prefetch_l1(b.bias + (row * b.bias_row + k) * (b.bias_fp32 ? 4 : int(sizeof(T))));
      }
      if (b.mask != nullptr) ptx::prefetch_l1(b.mask + row * b.mask_row + k);
    }
  }
};

}  // namespace jax_flash::sm90
