// The Hopper forward's tiles: the order in which the persistent CTAs take them (FwdTile) and what
// one tile reads (FwdWork), which the producer publishes to the consumers in shared memory.
#pragma once

#include "common/mask.cuh"
#include "common/params.h"
#include "common/ptx.cuh"

namespace jax_flash::sm90 {

// The order of the tiles: the query blocks of one (batch, head) consecutive, the last first (the
// longest rows under a causal band), so that the CTAs at work share the K/V of a few heads in L2
// and the short tiles of a head come last, filling in behind the long ones.
// With a bias or mask that all heads share (kBias), the heads of one query block come
// consecutively instead, so that the CTAs at work share that block's rows of it in L2 (H21).
struct FwdTile {
  int m_block, batch, head;
  __device__ static FwdTile from(int tile, int m_blocks, int heads, bool heads_inner) {
    if (heads_inner) {
      const int bm = tile / heads;
      return {m_blocks - 1 - bm % m_blocks, bm / m_blocks, tile - bm * heads};
    }
    const int bh = tile / m_blocks;
    return {m_blocks - 1 - (tile - bh * m_blocks), bh / heads, bh % heads};
  }
};

// What one tile reads: its rows, its batch row's mask, and the key blocks n_begin up to
// n_begin + blocks - 1. The producer derives it from the tile index and publishes it in a slot of
// shared memory with the tile's Q (store / load), so that the consumers' integer divisions do not
// sit between a tile's Q and its first product (H19).
// In the redo pass (kRedo) the tiles are those the first pass listed (FwdScratch).
template <typename Cfg, Variant kVariant, bool kRedo>
struct FwdWork {
  static constexpr bool kMasked = kVariant != Variant::kPlain;
  // Only the masked variant's first pass tests blocks against one_segment_keys (the kernel's
  // cap_and_mask); in the others that range's registers made the kernels spill.
  static constexpr bool kOneSegmentKeys = kVariant == Variant::kMasked && !kRedo;
  int q_first, n_begin, blocks;
  int rotation = 0;  // 1: block 0 visited last (Cfg::kWindowEdgeLast)
  int batch, head;
  Band band;
  Range one_segment_keys{0, 1 << 30};  // Band::keys_of_one_segment of the tile's rows
  static constexpr int kSlotBytes = 48;  // 11 ints (Slot), 16-byte aligned
  __device__ static int m_blocks(const FwdParams& p) { return (p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM; }
  __device__ static int all_tiles(const FwdParams& p) { return m_blocks(p) * p.batch * p.heads; }
  __device__ static int tile_count(const FwdParams& p) {
    return kRedo ? p.tile_scratch[FwdScratch::kRedoCount] : all_tiles(p);
  }
  __device__ static FwdTile tile_of(int tile, const FwdParams& p) {
    if constexpr (kRedo) tile = p.tile_scratch[FwdScratch::redo_list(all_tiles(p)) + tile];
    const bool shared_bias = (!p.bias || p.bias_strides.head == 0) && (!p.mask || p.mask_strides.head == 0);
    return FwdTile::from(tile, m_blocks(p), p.heads, kVariant == Variant::kEverything && shared_bias);
  }
  __device__ static FwdWork of(int tile, const FwdParams& p) {
    const FwdTile t = tile_of(tile, p);
    FwdWork w;
    w.q_first = t.m_block * Cfg::kBlockM;
    w.batch = t.batch;
    w.head = t.head;
    w.band = Band::from<kMasked>(p, t.batch);
    const int q_last = min(w.q_first + Cfg::kBlockM, p.seqlen_q) - 1;
    const Range keys = w.band.keys_of(w.q_first, q_last);
    w.n_begin = keys.begin / Cfg::kBlockN;
    w.blocks = max(0, (keys.end + Cfg::kBlockN - 1) / Cfg::kBlockN - w.n_begin);
    if constexpr (kOneSegmentKeys) w.one_segment_keys = w.band.keys_of_one_segment(w.q_first, q_last);
    if constexpr (Cfg::kWindowEdgeLast) {
      w.rotation = w.band.left >= 0 && w.blocks > 1 &&
                   !w.band.all_visible(w.q_first, q_last, w.n_begin * Cfg::kBlockN, (w.n_begin + 1) * Cfg::kBlockN - 1);
    }
    return w;
  }
  // Into / from a slot of kSlotBytes (16-byte aligned), these ints in this order; tile < 0: no
  // tile left.
  enum Slot { kTile, kQFirst, kNBegin, kBlocks, kRotation, kBatch, kHead, kSeqlenQ, kSeqlenK, kOneBegin, kOneEnd };
  __device__ void store(uint32_t slot, int tile) const {
    ptx::st_shared_v4(slot, uint32_t(tile), uint32_t(q_first), uint32_t(n_begin), uint32_t(blocks));
    ptx::st_shared_v4(slot + 4 * kRotation, uint32_t(rotation), uint32_t(batch), uint32_t(head),
                      uint32_t(band.seqlen_q));
    ptx::st_shared_v4(slot + 4 * kSeqlenK, uint32_t(band.seqlen_k), uint32_t(one_segment_keys.begin),
                      uint32_t(one_segment_keys.end), 0u);
  }
  __device__ static void store_end(uint32_t slot) { ptx::st_shared_b32(slot + 4 * kTile, uint32_t(-1)); }
  // Read by plain loads (the slot's generic address), which the compiler may repeat where it
  // would otherwise keep the values in registers (with asm loads the redo kernels spilled).
  __device__ static int load_tile(const int* slot) { return slot[kTile]; }
  __device__ static FwdTile load_tile_coordinates(const int* slot) { return {0, slot[kBatch], slot[kHead]}; }
  __device__ static FwdWork load(const int* slot, const FwdParams& p) {
    FwdWork w;
    w.q_first = slot[kQFirst], w.n_begin = slot[kNBegin], w.blocks = slot[kBlocks];
    w.rotation = slot[kRotation], w.batch = slot[kBatch], w.head = slot[kHead];
    w.band = Band::with_lengths<kMasked>(p, w.batch, slot[kSeqlenQ], slot[kSeqlenK]);
    if constexpr (kOneSegmentKeys) w.one_segment_keys = {slot[kOneBegin], slot[kOneEnd]};
    return w;
  }
  // The keys of the j-th block visited.
  __device__ __forceinline__ int key_first(int j) const {
    int block = j + rotation;
    if (block >= blocks) block -= blocks;
    return (n_begin + block) * Cfg::kBlockN;
  }
};

}  // namespace jax_flash::sm90
