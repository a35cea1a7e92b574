// The parameters of one attention call, filled by the FFI handlers and read by every kernel.
// Tensors are contiguous in the JAX layout: q/o/do [B, T, N, H], k/v [B, S, K, H];
// lse and delta [B, N, T] float32.
#pragma once

#include <cstdint>

#include "generated/contract.h"

namespace jax_flash {

// Segment ids come with a summary per kMaskChunk rows (queries) or keys, computed on the host
// side (jax_flash/_masks.py): the chunk's smallest and largest segment id, the range of the other
// side (keys of a query chunk, queries of a key chunk) whose chunks share a segment with it, and
// the range whose chunks hold only this chunk's one segment id (empty if it holds several). The
// sizes and fields come from the kernel contract (scripts/generate_instantiations.py).
constexpr int kMaskChunk = contract::kMaskChunk;
using contract::kMaskChunkFields;
using contract::MaskChunk;

// The compiled variants of every kernel. kPlain reads no masks (the dispatch checked there are
// none), kMasked reads sequence lengths and segment ids, kSoftcap is kMasked plus the soft cap.
// kEverything reads everything: kMasked's masks, the soft cap when one is set, and an additive
// bias and boolean mask over [B, N, T, S] (the sm90 forward in the pairs layout only, bias.cuh; the sm90
// backward at d = 64 and 128 in layouts TMA copies, sm90/bwd/bias_tiles.cuh, at d = 256 in the
// pairs layout, its soft cap in kernels of their own; the sm80 kernels always).
// Separate instantiations keep the common calls' kernels free of the others' registers.
enum class Variant { kPlain, kMasked, kSoftcap, kEverything };

// Element strides of an array broadcast to [B, N, T, S]: 0 along its axes of size 1.
struct Strides4 {
  int64_t batch, head, row, col;
};

struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;  // natural-log log-sum-exp of the (scaled, capped) logits; -inf for empty rows

  int batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim;
  float scale;          // logit scale (applied before the soft cap)
  float softcap;        // > 0 exactly in the kSoftcap variant
  int window_left;      // -1: unbounded. Key j is visible to query i when
  int window_right;     //   -window_left <= j - (i + offset) <= window_right (mask.cuh's Band)
  // Optional masks (nullptr: none; mask.cuh says how they combine):
  const int* seqlens;          // [B, 2]: valid query and key lengths of each batch row (clamped)
  const int* q_segments;       // [B, T] segment ids, with kv_segments [B, S]
  const int* kv_segments;
  const MaskChunk* q_chunks;   // [B, ceil(T / kMaskChunk)], with the segment ids
  const MaskChunk* kv_chunks;  // [B, ceil(S / kMaskChunk)]
  // kEverything only (nullptr: none): an additive bias, float32 or the dtype of q, and a boolean mask
  // (true: attend), each broadcastable to [B, N, T, S].
  const void* bias;
  bool bias_fp32;
  Strides4 bias_strides;
  const bool* mask;
  Strides4 mask_strides;
  // The sm90 forward's scratch (FwdScratch), owned by XLA.
  int* tile_scratch;
  int64_t tile_scratch_size;  // elements
  int value_dim;  // V's and O's head dim: head_dim, except in the unequal-dims forward
  // The diagonal's offset: seqlen_k - seqlen_q, or with seqlens and this flag each batch row's key
  // length minus its query length (the last valid query sees the last valid key). Python decides
  // (AttentionConfig.diagonal_by_lengths): jax.nn's alignment where T == S, lengths elsewhere.
  // Last, in the struct's tail padding: the kernels that never read it keep their layout.
  bool diagonal_by_lengths;
  // Attention sinks: [B, N] float32, one natural-log logit per batch row and query head that joins
  // each row's softmax in its finish (common/row_total.cuh's RowTotal::finish); nullptr: none. Read by
  // the forwards alone (the backward takes it through the lse).
  const float* sinks;
};

// The layout of the sm90 forward's int32 scratch, for a kernel of `tiles` tiles: the persistent
// CTAs take their tiles from a counter, and the first pass lists the tiles that the redo pass
// must compute again (fwd_kernel.cuh). The launcher zeroes [0, kFlags + tiles).
struct FwdScratch {
  static constexpr int kCounter = 0;      // the first pass's tile counter
  static constexpr int kRedoCounter = 1;  // the redo pass's
  static constexpr int kRedoCount = 2;    // tiles listed
  static constexpr int kFlags = contract::kFwdScratchCounters;  // [tiles]: 1 where a tile is listed
  static constexpr int redo_list(int tiles) { return kFlags + tiles; }  // [tiles]
  static constexpr int64_t size(int64_t tiles) { return kFlags + 2 * tiles; }
  // The size the caller allocates: enough for the smallest tiles.
  static constexpr int64_t size_for(int64_t batch, int64_t seqlen_q, int64_t heads) {
    constexpr int kRows = contract::kFwdScratchTileRows;
    return size(batch * heads * ((seqlen_q + kRows - 1) / kRows));
  }
};

// A multiple of every backward kernel's query block (64, 80, 128): the statistics rows are padded
// to a multiple of it.
constexpr int kStatsRowMultiple = contract::kStatsRowMultiple;

struct BwdParams : FwdParams {
  const void* dout;
  const float* dlse;  // [B, N, T]: cotangent of the returned lse (enters delta as -dlse); nullptr: 0
  void* dq;
  void* dk;
  void* dv;
  // float32 scratch of B * stats_stride * N * H elements owned by XLA (an extra output of the
  // call), zeroed by bwd_preprocess: [B, T, N, H] for the atomics of the sm80 kernels,
  // 64 x 64 tiles for sm90/bwd_kernel.cuh (sm90/bwd/dq_tiles.cuh). A last kernel turns it into dq.
  // Unused (and not zeroed) at d = 192 and 256 on sm90, whose dQ kernel writes dq itself; not zeroed
  // either with dq_tickets.
  float* dq_accum;
  // Per-row statistics, [B, N, stats_stride] float32 scratch with stats_stride >= T a multiple of
  // kStatsRowMultiple, so that every query block's rows are whole and aligned (the sm90 kernel
  // copies them in bulk).
  float* delta;     // rowsum(dO * O) - dlse, the softmax backward's per-row term; 0 past T
  float* lse_log2;  // lse * log2(e), +inf for empty rows and past T (so that P = 0 there)
  int stats_stride;
  // Deterministic dQ: [B, N, stats_stride / kDqCounterRows] int32 scratch, one counter per 32
  // query rows (contract.h), zeroed by bwd_preprocess; the key blocks add their dQ parts of a query
  // block in key-block order (bwd_walk.cuh). nullptr: in any order (faster, not bit-reproducible).
  int* dq_turns;
  // sm90/bwd_kernel.cuh outside deterministic mode, without segment ids (run_sm90.cuh): the same
  // scratch as dQ turns, one ticket a query block (sm90/bwd/dq_tiles.cuh), zeroed by bwd_preprocess in
  // place of the accumulator. The first CTA to take a block's ticket stores its
  // dQ part, the others add theirs once it has landed (sm90/bwd/dq_tiles.cuh). `dq_counters` is that
  // scratch, for the launcher to choose.
  int* dq_tickets;
  int* dq_counters;
  // kEverything only: the bias's gradient, d loss / d logit, float32, zeroed by the handler and added to
  // with atomics (so broadcast axes sum up); nullptr: not wanted.
  float* dbias;
  Strides4 dbias_strides;
  // Bytes of shared memory a block of the mma.sync backward may take: the limit the Python
  // plan assumed (the GPU's, or JAX_FLASH_SMEM_LIMIT), against which it chose the usual or the
  // compact tiles (Tiles::kCompact); the launcher refuses tiles beyond it. 0: the device's.
  int smem_limit;
};

}  // namespace jax_flash
