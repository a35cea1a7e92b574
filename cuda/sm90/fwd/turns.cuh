// Ping-pong between the Hopper forward's consumers (FlashAttention-3's inter-warpgroup overlap):
// they take turns issuing their wgmma, in rotation, so that one's softmax runs while the others'
// products occupy the tensor cores. Named barrier kFirst + c opens consumer c's turn: c syncs on
// it (128 threads) and the consumer before it in the rotation arrives (128). Every consumer takes
// blocks + 1 turns a tile, and the rotation runs on from tile to tile: consumer 0 issues the next
// tile's first S as soon as the last consumer has issued its last P V, while the others finish
// their epilogues (H8).
#pragma once

#include "common/ptx_sm90.cuh"

namespace jax_flash::sm90 {

template <int kConsumers>
struct ConsumerTurns {
  static constexpr int kFirst = 1;  // named barriers kFirst .. kFirst + kConsumers - 1
  static constexpr int kEnd = kFirst + kConsumers;  // the next free named barrier
  int consumer;

  __device__ __forceinline__ void wait() const { ptx::named_barrier_sync(kFirst + consumer, 256); }
  __device__ __forceinline__ void pass() const { ptx::named_barrier_arrive(kFirst + (consumer + 1) % kConsumers, 256); }
};

}  // namespace jax_flash::sm90
