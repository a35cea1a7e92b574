// Split-KV decode forward: one CTA per (split of the keys, m16 tile of packed query rows, kv head,
// batch row). Each warp streams every kWarps-th block of the split through its own cp.async ring
// (warp_ring.cuh), computes S = Q K^T and O += P V with mma.sync, and keeps an online softmax
// (common/online_softmax.cuh); the warps merge at the end (tile_output.cuh), and with several
// splits the combine kernel merges the splits' parts (combine_kernel.cuh). Work follows the
// lengths: a split covers a share of the keys its rows can see, not of the cache buffer.
#pragma once

#include <cmath>
#include <type_traits>

#include "common/logits.cuh"
#include "common/mask.cuh"
#include "common/online_softmax.cuh"
#include "common/ptx.cuh"
#include "common/tile.cuh"
#include "decode/config.cuh"
#include "decode/fp8.cuh"
#include "decode/kv_source.cuh"
#include "decode/packed_rows.cuh"
#include "decode/params.h"
#include "decode/query_tile.cuh"
#include "decode/tile_output.cuh"
#include "decode/warp_ring.cuh"

namespace jax_flash::decode {

// Blocks of kDecodeBlockKeys keys [begin, end): split `split`'s share of the blocks over `keys`.
struct BlockRange {
  int begin, end;
};
__device__ __forceinline__ BlockRange split_blocks(Range keys, int split, int splits) {
  if (keys.begin >= keys.end) return {0, 0};
  const int first = keys.begin / kDecodeBlockKeys, last = (keys.end + kDecodeBlockKeys - 1) / kDecodeBlockKeys;
  const int per_split = (last - first + splits - 1) / splits;
  const int begin = min(last, first + split * per_split);
  return {begin, min(last, begin + per_split)};
}

// The logits' scale, with an fp8 cache's key scale for this (batch row, kv head) folded in.
template <typename Cfg, Variant kVariant>
__device__ __forceinline__ Logits<cap_of(kVariant)> scaled_logits(const DecodeParams& p, int batch, int kv_head) {
  const auto logits = Logits<cap_of(kVariant)>::from(p);
  if constexpr (Cfg::kFp8) {
    return logits.with_key_scale(__ldg(p.key_scale + batch * p.kv_heads + kv_head));
  } else {
    return logits;
  }
}

// S += Q K^T from an fp8 stage. ldmatrix gives a thread 16-bit elements (2c, 2c + 1) of its key's
// row in a chunk, i.e. fp8 columns 4c .. 4c + 3: widened, columns 4c, 4c + 1 take b[0]'s place and
// 4c + 2, 4c + 3 b[1]'s, the permutation Q's fragments share (query_tile.cuh). Registers: [0]
// keys 0-7 and [1] keys 8-15 of step ks, [2] and [3] of step ks + 1.
template <typename Cfg, typename Query, typename Walk>
__device__ __forceinline__ void fp8_scores(float (&s)[2][4], const Query& query, uint32_t k_stage, const Walk& b_k) {
  using T = typename Cfg::T;
  using KvT = typename Cfg::KvT;
#pragma unroll
  for (int ks = 0; ks < Cfg::kHeadDim / 16; ks += 2) {
    uint32_t r[4];
    ptx::ldmatrix_x4(r, k_stage + b_k(ks / 2));
#pragma unroll
    for (int step = 0; step < 2; ++step) {
      query.with_fragment(ks + step, [&](const uint32_t(&a)[4]) {
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          const uint32_t x = r[2 * step + n];
          ptx::mma_16816<T>(s[n], a, widen_bytes<T, KvT, 0, 1>(x), widen_bytes<T, KvT, 2, 3>(x));
        }
      });
    }
  }
}

// O += P V from an fp8 stage. Transposed, ldmatrix gives a thread keys 2c, 2c + 1 of its 16-bit
// column g, i.e. fp8 columns 2g and 2g + 1: bytes (key 2c, column 2g), (2c, 2g + 1), (2c + 1, 2g),
// (2c + 1, 2g + 1). Bytes 0 and 2 are the B fragment of an n8 tile over the chunk's even columns,
// 1 and 3 of one over its odd columns; acc_o[2j] and [2j + 1] hold chunk j's even and odd
// columns, so a thread's C fragments hold columns 16j + 4c + 0..3 (tile_output.cuh stores them so).
template <typename Cfg, int kDTiles, typename Walk>
__device__ __forceinline__ void fp8_values(float (&acc_o)[kDTiles][4], const uint32_t (&a)[4], uint32_t v_stage,
                                           const Walk& bt_v) {
  using T = typename Cfg::T;
  using KvT = typename Cfg::KvT;
#pragma unroll
  for (int chunk = 0; chunk < kDTiles / 2; chunk += 2) {
    uint32_t r[4];  // [0] keys 0-7 and [1] keys 8-15 of this chunk, [2] and [3] of the next
    ptx::ldmatrix_x4_trans(r, v_stage + bt_v(chunk / 2));
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const uint32_t lo = r[2 * c], hi = r[2 * c + 1];
      float(&even)[4] = acc_o[2 * (chunk + c)];
      float(&odd)[4] = acc_o[2 * (chunk + c) + 1];
      ptx::mma_16816<T>(even, a, widen_bytes<T, KvT, 0, 2>(lo), widen_bytes<T, KvT, 0, 2>(hi));
      ptx::mma_16816<T>(odd, a, widen_bytes<T, KvT, 1, 3>(lo), widen_bytes<T, KvT, 1, 3>(hi));
    }
  }
}

// kVariant: kMasked (lengths and the band) or kSoftcap (the same with the soft cap). kRagged: the
// CTA's rows are an item of a ragged batch's work list (params.h; the batch row is its sequence),
// else a tile of blockIdx.z's seqlen_q queries.
template <typename Cfg, Variant kVariant, bool kRagged = false>
__global__ void __launch_bounds__(Cfg::kThreads) split_kernel(const DecodeParams p) {
  using T = typename Cfg::T;
  using KvT = typename Cfg::KvT;
  using Rows = std::conditional_t<kRagged, RaggedRows, PackedRows>;
  constexpr int kHeadDim = Cfg::kHeadDim, kWarps = Cfg::kWarps;
  constexpr int kKSteps = kHeadDim / 16, kDTiles = kHeadDim / 8;
  constexpr float kLog2e = 1.4426950408889634f;
  extern __shared__ __align__(128) char smem[];
  ptx::allow_dependent_grids();  // the combine kernel's CTAs may start now and wait for ours
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int batch = blockIdx.z;
  Rows rows;
  if constexpr (kRagged) {
    rows = RaggedRows::of_cta(p, batch);
    if (batch < 0) return;  // past the step's work
  } else {
    rows = PackedRows::of_cta(p);
  }
  const int kv_length = p.kv_lengths ? min(max(__ldg(p.kv_lengths + batch), 0), p.seqlen_k) : p.seqlen_k;
  const Band band = Band::with_lengths<true>(p, batch, rows.queries(p), kv_length);
  const auto logits = scaled_logits<Cfg, kVariant>(p, batch, rows.kv_head);
  const Range keys = band.keys_of(rows.query(0), rows.query(rows.last_valid()));
  const BlockRange blocks = split_blocks(keys, blockIdx.x, p.splits);
  const KvSource<KvT> source = KvSource<KvT>::of(p, batch, rows.kv_head, kHeadDim);
  const WarpRing<Cfg> ring = WarpRing<Cfg>::of_warp(ptx::smem_addr(smem), warp);

  // This warp's steps: blocks begin + warp, begin + warp + kWarps, ...
  const int steps = max(0, (blocks.end - blocks.begin - warp + kWarps - 1) / kWarps);
  auto first_key = [&](int step) { return (blocks.begin + warp + step * kWarps) * kDecodeBlockKeys; };
  auto load = [&](int step) {
    const int key = first_key(step);
    const int64_t offset = source.offset(key);
    ring.load(step, source.k + offset, source.v + offset, source.row_stride, keys.end - key, lane);
  };
  // Q first (in shared memory, it joins step 0's commit group), then the ring's first stages.
  QueryTile<Cfg> query;
  query.load(p, rows, batch, ptx::smem_addr(smem) + Cfg::kSmemBytes - Cfg::kQBytes + warp * Cfg::QTile::kBytes, lane);
#pragma unroll
  for (int step = 0; step < Cfg::kStages - 1; ++step) {
    if (step < steps) load(step);
    ptx::cp_async_commit();
  }

  // The keys each of this thread's two rows sees, and those all the tile's rows see (a block
  // inside them needs no mask).
  Range seen[2];
  int all_begin = 0, all_end = 1 << 30;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = lane / 4 + 8 * r;
    seen[r] = rows.valid(row) ? band.keys_seen_by(rows.query(row)) : Range{0, 1 << 30};
    all_begin = max(all_begin, seen[r].begin);
    all_end = min(all_end, seen[r].end);
  }
#pragma unroll
  for (int mask = 1; mask < 32; mask *= 2) {
    all_begin = max(all_begin, __shfl_xor_sync(0xffffffff, all_begin, mask));
    all_end = min(all_end, __shfl_xor_sync(0xffffffff, all_end, mask));
  }

  // Fragment offsets within a stage (tile.cuh), as in the sm80 forward: K as the B operand of
  // Q K^T (keys lane % 8 and + 8 x chunk pairs), V transposed as the B operand of P V.
  // With an fp8 cache a 16-byte chunk is a whole k16 step of K (16 columns) and two n8 tiles of
  // V: an x4 load covers both key halves of two chunks (fp8_products).
  const ChunkWalk<typename Cfg::KvTile, Cfg::kFp8 ? kKSteps / 2 : kKSteps> b_k(
      0, Cfg::kFp8 ? lane % 8 + ((lane / 8) % 2) * 8 : lane % 8 + (lane / 16) * 8, Cfg::kFp8 ? lane / 16 : (lane / 8) % 2);
  const ChunkWalk<typename Cfg::KvTile, Cfg::kFp8 ? kDTiles / 4 : kDTiles / 2> bt_v(
      0, lane % 8 + ((lane / 8) % 2) * 8, lane / 16);
  const float scale_log2 = logits.unit * kLog2e;
  OnlineSoftmax softmax;
  float acc_o[kDTiles][4];
#pragma unroll
  for (int d = 0; d < kDTiles; ++d)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc_o[d][i] = 0.f;

  for (int step = 0; step < steps; ++step) {
    __syncwarp();  // every lane is done with the stage that this load refills
    if (step + Cfg::kStages - 1 < steps) load(step + Cfg::kStages - 1);
    ptx::cp_async_commit();
    ring.wait();
    const uint32_t k_stage = ring.k_stage(step), v_stage = ring.v_stage(step);

    // S = Q K^T over the block's 16 keys: two n8 tiles.
    float s[2][4] = {};
    if constexpr (Cfg::kFp8) {
      fp8_scores<Cfg>(s, query, k_stage, b_k);
    } else {
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        uint32_t b[4];
        ptx::ldmatrix_x4(b, k_stage + b_k(ks));
        query.with_fragment(ks, [&](const uint32_t(&a)[4]) {
          ptx::mma_16816<T>(s[0], a, b[0], b[1]);
          ptx::mma_16816<T>(s[1], a, b[2], b[3]);
        });
      }
    }
    if (logits.capped()) {
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[n][i] = logits.value(s[n][i]);
    }
    const int key0 = first_key(step);
    if (key0 < all_begin || key0 + kDecodeBlockKeys > all_end) {
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int key = key0 + n * 8 + (lane % 4) * 2 + c;
            if (key < seen[r].begin || key >= seen[r].end) s[n][2 * r + c] = -INFINITY;
          }
    }
    softmax.update(s, acc_o, scale_log2);

    // O += P V: the two n8 tiles of P form the A fragment of one k16 step.
    uint32_t a[4];
    ptx::accumulators_to_a<T>(a, s[0], s[1]);
    if constexpr (Cfg::kFp8) {
      fp8_values<Cfg>(acc_o, a, v_stage, bt_v);
    } else {
#pragma unroll
      for (int d = 0; d < kDTiles; d += 2) {
        uint32_t b[4];
        ptx::ldmatrix_x4_trans(b, v_stage + bt_v(d / 2));
        ptx::mma_16816<T>(acc_o[d], a, b[0], b[1]);
        ptx::mma_16816<T>(acc_o[d + 1], a, b[2], b[3]);
      }
    }
  }
  ptx::cp_async_wait<0>();
  merge_and_store<Cfg>(p, rows, batch, blockIdx.x, softmax, acc_o, logits.unit, smem);
}

}  // namespace jax_flash::decode
