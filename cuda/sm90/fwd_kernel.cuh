// FlashAttention forward on Hopper (sm_90a): TMA, mbarriers, wgmma, warp specialisation.
//
// A persistent kernel: one CTA per SM walks tiles of kBlockM = 128 query rows of one head (192 at
// H = 64), claiming the next from a global counter as it nears the end of one (FwdTile says in
// which order).
// Three warp groups (four). Warp group 0 is the producer: one thread issues bulk tensor copies
// (TMA) of each tile's Q and of K and V per key block into kStages shared-memory stages, each
// completing on a "full" mbarrier; it gives most of its registers to the consumers (setmaxnreg).
// With each tile's Q it publishes the tile's work (rows, key blocks: FwdWork) in shared memory, so
// that the consumers need not derive it again.
// The stages form one ring across tiles, so the next tile's Q and first K/V blocks load while the
// consumers finish this one, instead of after a new CTA has started.
// The others are consumers of 64 rows each:
// S = Q K^T by wgmma with both operands in shared memory, the online softmax on the accumulators in
// registers (the same per-thread layout as mma.sync, so rows stay inside a quad), then O += P V by
// wgmma with P from registers; each releases a stage through its "empty" mbarriers, and Q's
// buffer once its last S has landed. Two overlaps after FlashAttention-3: inside a consumer, the
// softmax of key block j runs while S_j's successor products are in flight (see the pipeline
// below), and the consumers take turns issuing their wgmma (ping-pong), so that one's softmax runs
// under the others' products. Key blocks are visited first to last: a causal tile then starts on
// a whole block, whose row maxima the speculative softmax keeps for the rest of the row, and its
// masked diagonal blocks come last (H17). The epilogue stores O from registers (Q's buffer
// already holds the next tile's Q), or stages it in the last key block's K stage for a TMA store
// (FwdConfig::kStagedStore).
//
// Shared-memory tiles are the layout TMA writes with the 128-byte swizzle: 64-column panels of
// 128-byte rows, which wgmma reads through descriptors (ptx_sm90.cuh).
#pragma once

#include <cuda.h>

#include <cmath>

#include "common/bias.cuh"
#include "common/logits.cuh"
#include "common/mask.cuh"
#include "common/params.h"
#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"
#include "sm90/fwd/block_logits.cuh"
#include "sm90/fwd/block_mask.cuh"
#include "sm90/fwd/block_softmax.cuh"
#include "sm90/fwd/config.cuh"
#include "sm90/fwd/epilogue.cuh"
#include "sm90/fwd/key_ring.cuh"
#include "sm90/fwd/online_softmax.cuh"
#include "sm90/fwd/producer.cuh"
#include "sm90/fwd/products.cuh"
#include "sm90/fwd/shared_memory.cuh"
#include "common/softmax_rows.cuh"
#include "sm90/fwd/tiles.cuh"
#include "sm90/fwd/turns.cuh"
#include "sm90/fwd/bias_tiles.cuh"

namespace jax_flash::sm90 {

// kVariant (params.h): which of the masks (mask.cuh), the soft cap (logits.cuh) and the bias and
// boolean mask (bias.cuh; the pairs layout only, launch/dispatch.cu; staged tiles with
// Cfg::kBiasRegionBytes, fwd/bias_tiles.cuh) are read.
// p.tile_scratch (FwdScratch): zeroed before the first pass; CTA c starts with tile c, and claims
// each next one as gridDim.x + (an increment of its pass's counter) once it has issued the
// current tile's last copies.
// kRedo: the second pass, over the tiles the first listed (the softmax below says when), with the
// exact softmax on every block.
template <typename Cfg, Variant kVariant, bool kRedo>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    fwd_kernel(const __grid_constant__ FwdTensorMaps maps, const FwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = typename Cfg::T;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr bool kSoftcap = kVariant == Variant::kSoftcap;
  using Work = FwdWork<Cfg, kVariant, kRedo>;
  // The consumers read each tile's work where the producer published it (FwdWork), except in the
  // redo pass and the capped H = 256 kernel, whose consumers then spilled (56-152 and 24 bytes);
  // there they derive it again.
  constexpr bool kReadsWork = !kRedo && !(kSoftcap && kHeadDim == 256);
  constexpr bool kStagedStore = Cfg::kStagedStore;

  extern __shared__ char smem[];
  const auto shared = FwdSharedMemory<Cfg>::of(smem);

  if (threadIdx.x == 0) shared.init_barriers();
  __syncthreads();

  const int warp_group = threadIdx.x / 128;
  if (warp_group == 0) {
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    if (threadIdx.x == 0) FwdProducer<Cfg, kVariant, kRedo>{maps, p, shared}.run();
    return;
  }

  // Consumers.
  ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int consumer = warp_group - 1;
  // The same, broadcast from lane 0 so that the compiler knows it is uniform across the warp: the
  // wgmma descriptors of this consumer's Q rows then stay in uniform registers (built from
  // `consumer`, every wgmma rebuilt its descriptor in vector registers; H13).
  const int consumer_uniform = __shfl_sync(0xffffffff, consumer, 0);
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  // This thread's rows of the tile (the accumulator layout): row_in_tile(r), r = 0, 1.
  auto row_in_tile = [&](int r) { return consumer * 64 + warp * 16 + r * 8 + lane / 4; };
  constexpr int kSRegs = kBlockN / 2;  // S accumulators: [n8 tile][4]
  constexpr int kORegs = Cfg::kOChunkCols / 2;
  const auto logits = Logits<cap_of(kVariant)>::from(p);
  const float scale_log2 = logits.unit * kLog2e;
  // With a cap at H = 64, whose softmax the MUFU bounds (a tanh and an exp2 a logit, twice the
  // tensor cores' time), one element in four takes its exp2 on the FMA pipe (H27).
  constexpr int kExp2OnFmaQuarters = kSoftcap && kHeadDim == 64 ? 1 : 0;
  using Softmax = FwdSoftmax<kSRegs, kExp2OnFmaQuarters, Logits<cap_of(kVariant)>>;

  // The consumers take turns issuing their wgmma (fwd/turns.cuh).
  const ConsumerTurns<Cfg::kConsumers> turns{consumer};
  constexpr int kLastConsumer = Cfg::kConsumers - 1;

  bool started = false;  // this consumer has taken a turn
  // kStagedStore: the K stage holding this consumer's staged O (-1: none), freed once the store
  // has read it, after the next tile's first S is issued (or before the CTA exits); and the
  // number of tiles staged so far (the phase of shared.last_s_landed()).
  int staged_stage = -1, staged_tiles = 0;
  auto release_staging = [&] { release_staged_o<Cfg>(shared, staged_stage, tid); };
  constexpr int kStoreBarrier = ConsumerTurns<Cfg::kConsumers>::kEnd;  // + consumer: its O staged
  constexpr int kClearBarrier = kStoreBarrier + Cfg::kConsumers;       // + consumer: V rows cleared
  for (int n = 0, it = 0;; ++n) {
    ptx::mbarrier_wait(shared.q_full(), n & 1);
    const int tile = Work::load_tile(shared.template tile_slot_ptr<Work>(n));
    if (tile < 0) {
      // The last consumer passed its last turn on to consumer 0: take it, so that no arrival is
      // left on a named barrier when the CTA exits.
      if (consumer == 0 && started) turns.wait();
      release_staging();
      if (kStagedStore && tid == 0) ptx::tma_store_wait_all();
      break;
    }
    const Work w = kReadsWork ? Work::load(shared.template tile_slot_ptr<Work>(n), p) : Work::of(tile, p);
    const int q_first = w.q_first, blocks = w.blocks;

    float o[Cfg::kOChunks][kORegs];
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
    Softmax softmax{logits, scale_log2, row_max, row_sum};
#pragma unroll
    for (int c = 0; c < Cfg::kOChunks; ++c)
#pragma unroll
      for (int i = 0; i < kORegs; ++i) o[c][i] = 0.f;

    // This tile's key blocks in the ring: products issued, stages released (fwd/key_ring.cuh).
    const FwdKeyRing<Cfg> ring{shared, it, blocks, consumer_uniform};
    // The cap, bias and masks of each block's logits (fwd/block_logits.cuh).
    const FwdBlockLogits<Cfg, kVariant, Work> block_logits{p, w, logits, shared, smem, it, consumer, warp, lane};
    // Each block's logits capped and masked, then exponentiated (fwd/block_softmax.cuh).
    const FwdBlockSoftmax<Softmax, decltype(block_logits)> block_softmax{softmax, block_logits};
    // Before P V_j: V_j's rows past this row's key length zeroed where the tensor goes on
    // (key_ring.cuh); only with lengths, in the one block that holds the length.
    auto clear_ignored_v = [&](int j) {
      if constexpr (kVariant != Variant::kPlain) {
        const int first_ignored = first_ignored_row<kBlockN>(w.band.seqlen_k, p.seqlen_k, w.key_first(j));
        if (first_ignored < kBlockN) ring.clear_v_rows(j, first_ignored, kClearBarrier + consumer_uniform, tid);
      }
    };
    auto fence_o = [&] {
#pragma unroll
      for (int c = 0; c < Cfg::kOChunks; ++c) ptx::fence_registers(o[c]);
    };

    // Software pipeline inside the warp group (FlashAttention-3's intra-warpgroup overlap): while
    // the tensor cores compute S_j and then P_{j-1} V_{j-1}, this warp group runs the softmax of
    // block j. O is scaled for block j (where a row's max moved) only after P_{j-1} V_{j-1} has
    // landed in it.
    if (blocks > 0) {
      float s[kSRegs], rescale[2];
      uint32_t pa[kBlockN / 16][4];
      if (consumer == kLastConsumer && !started) turns.pass();  // opens consumer 0's first turn
      started = true;
      turns.wait();
      ring.issue_s(s, 0);
      block_logits.prefetch_bias(0);
      turns.pass();
      release_staging();
      ptx::wgmma_wait<0>();
      ptx::fence_registers(s);
      ring.release_k(0);
      block_softmax.exact(s, 0, rescale);
      to_operand<T>(s, pa);
      for (int j = 1; j < blocks; ++j) {
        clear_ignored_v(j - 1);
        turns.wait();
        ring.issue_s(s, j);
        block_logits.prefetch_bias(j);
        ring.issue_pv(o, pa, j - 1);
        turns.pass();
        ptx::wgmma_wait<1>();  // S_j is in; P_{j-1} V_{j-1} may still run
        ptx::fence_registers(s);
        ring.release_k(j);
        if constexpr (kRedo) {
          block_softmax.exact(s, j, rescale);
        } else {
          block_softmax.template speculative<kSoftcap && kHeadDim >= 128>(s, j, rescale, tile);
        }
        ptx::wgmma_wait<0>();
        fence_o();
        ptx::fence_registers(pa);  // read by that wgmma until now
        ring.release_v(j - 1);
        rescale_o(o, rescale);
        to_operand<T>(s, pa);
      }
      clear_ignored_v(blocks - 1);
      turns.wait();
      ring.issue_pv(o, pa, blocks - 1);
      turns.pass();
      ptx::wgmma_wait<0>();
      fence_o();
      ptx::fence_registers(pa);
      ring.release_v(blocks - 1);
    } else {
      ptx::mbarrier_arrive(shared.q_empty());  // no Q was loaded
      release_staging();
    }

    // Epilogue: the lse, then O normalised, staged for a TMA store (kStagedStore) or stored
    // straight from registers (fwd/epilogue.cuh). The lse goes first: an instruction after the O
    // stores that reuses their registers waits until they have drained.
    // Read again: not kept in registers.
    const FwdTile t = Work::load_tile_coordinates(shared.template tile_slot_ptr<Work>(n));
    const int rows_valid = min(kBlockM, p.seqlen_q - q_first);
    float inv[2];
    write_lse(p, t.batch, t.head, q_first, rows_valid, row_max, row_sum, logits.unit, row_in_tile, lane, inv);
    if (kStagedStore && blocks > 0) {
      // Into the last block's K stage (fwd/epilogue.cuh).
      const int stage = ring.stage_of(blocks - 1), barrier = kStoreBarrier + consumer_uniform;
      store_o_staged_tile<Cfg>(shared, &maps.o, t.head, q_first, t.batch, o, inv, stage, consumer_uniform, barrier,
                               staged_tiles, staged_stage, tid, warp, lane);
    } else {
      const int64_t row_stride = int64_t(p.heads) * Cfg::kValueDim;
      T* gO = static_cast<T*>(p.o) + (int64_t(t.batch) * p.seqlen_q + q_first) * row_stride + t.head * Cfg::kValueDim;
      const int rows[2] = {row_in_tile(0), row_in_tile(1)};
      store_o<Cfg>(gO, row_stride, rows_valid, o, inv, rows, lane);
    }
    it += blocks;
  }
#endif
}

}  // namespace jax_flash::sm90
