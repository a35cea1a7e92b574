// The scores' exchange of a split-head-dim pair (sm90/wide_fwd/config.cuh, kSplit = 2): the two
// CTAs of a cluster hold the same query rows and keys, each half of the head dim's columns, so each
// computes S over its half only. Each consumer thread sends its fragment of that partial S to the
// same thread of the same consumer in the peer (the same accumulator layout: no reshuffle) and adds
// the peer's to its own. a + b == b + a in IEEE arithmetic, so both CTAs hold the same S, and their
// softmax statistics agree bit for bit without further exchange.
//
// One inbox a consumer, 128 threads x kValues floats, written by the peer with st.async, whose
// bytes complete this CTA's `full` barrier; the reader's warps then arrive on the peer's `empty`
// barrier, which the peer waits on before it sends the next block's scores.
#pragma once

#include <cstdint>

#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"

namespace jax_flash::sm90 {

template <int kValues>
struct ScoreExchange {
  static_assert(kValues % 4 == 0, "16-byte pieces");
  static constexpr int kThreads = 128;                      // one consumer warp group
  static constexpr int kInboxBytes = kThreads * kValues * 4;  // one consumer's inbox
  static constexpr int kPieceStride = kThreads * 16;        // piece c of every thread, contiguous

  uint32_t inbox;       // this thread's first piece in this CTA's inbox
  uint32_t peer_inbox;  // the same place in the peer's (shared::cluster)
  uint32_t full, peer_full;    // the peer's scores landed here / ours there
  uint32_t empty, peer_empty;  // the peer has read ours / we have read the peer's
  bool announces;       // the one thread that tells `full` how many bytes each block brings

  // inbox_base, full, empty: this consumer's inbox and barriers in this CTA; tid in 0..127.
  __device__ __forceinline__ static ScoreExchange make(uint32_t inbox_base, uint32_t full, uint32_t empty, int tid) {
    const uint32_t peer = ptx::cluster_ctarank() ^ 1;
    const uint32_t inbox = inbox_base + tid * 16;
    return {inbox, ptx::mapa_shared(inbox, peer), full, ptx::mapa_shared(full, peer),
            empty, ptx::mapa_shared(empty, peer), tid == 0};
  }

  // Barrier arrival counts, set once before the cluster's first barrier.
  static constexpr int kFullArrivals = 1;   // `announces`, plus the bytes
  static constexpr int kEmptyArrivals = 4;  // one a warp of the peer's consumer

  // s: this CTA's partial scores of key block `step` (0, 1, ...); on return, the whole scores.
  __device__ __forceinline__ void add_peer(float (&s)[kValues], int step) const {
    if (step > 0) ptx::mbarrier_wait(empty, (step - 1) & 1);  // our last scores were read
#pragma unroll
    for (int c = 0; c < kValues / 4; ++c) {
      ptx::st_async_v4(peer_inbox + c * kPieceStride, s[4 * c], s[4 * c + 1], s[4 * c + 2], s[4 * c + 3], peer_full);
    }
    if (announces) ptx::mbarrier_arrive_expect_tx(full, kInboxBytes);
    ptx::mbarrier_wait(full, step & 1);
#pragma unroll
    for (int c = 0; c < kValues / 4; ++c) {
      const uint4 piece = ptx::ld_shared_v4(inbox + c * kPieceStride);
      s[4 * c] += __uint_as_float(piece.x);
      s[4 * c + 1] += __uint_as_float(piece.y);
      s[4 * c + 2] += __uint_as_float(piece.z);
      s[4 * c + 3] += __uint_as_float(piece.w);
    }
    __syncwarp();
    if (threadIdx.x % 32 == 0) ptx::mbarrier_arrive_remote(peer_empty);
  }

  // Before the CTA exits: the peer's last arrivals on this CTA's `empty` have landed (no access to
  // a CTA's shared memory may follow its exit). `steps`: the blocks exchanged.
  __device__ __forceinline__ void drain(int steps) const {
    if (steps > 0) ptx::mbarrier_wait(empty, (steps - 1) & 1);
  }
};

}  // namespace jax_flash::sm90
