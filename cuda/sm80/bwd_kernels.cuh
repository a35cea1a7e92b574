// FlashAttention-2 backward on mma.sync (sm_80 and newer): bwd_preprocess (common/), then
// bwd_dkdv_kernel: one CTA per (key block, batch, kv head) keeps its 128 keys' dK and dV (64
//    keys' at H = 256) in registers while it walks every query block (64 rows, 128 where
//    H <= 64) of every query head of the GQA group, so dK/dV of a group are summed without
//    atomics and written once.
//    Per step: S and dP, then P and dS go to shared memory, where dV += P^T dO, dK += dS^T Q
//    and dQ = dS K each read them with their own warp grid (config.cuh). The next step's Q and
//    dO load during this one's products (or, with one stage, during dQ's). dQ needs the
//    contributions of every key block, so each CTA adds its share into the fp32 accumulator
//    with atomics: the separate-kernel alternative would compute S and dP a second time (7
//    products instead of 5).
//
// The pieces, in sm80/bwd/: products.cuh (S and dP), dq_adds.cuh (dQ into its accumulator) and
// epilogue.cuh (dK and dV out).
#pragma once

#include <cmath>

#include "common/bwd_walk.cuh"
#include "common/bias.cuh"
#include "common/grid.cuh"
#include "common/logits.cuh"
#include "common/mask.cuh"
#include "common/params.h"
#include "common/ptx.cuh"
#include "common/tile.cuh"
#include "sm80/bwd/dq_adds.cuh"
#include "sm80/bwd/ds.cuh"
#include "sm80/bwd/epilogue.cuh"
#include "sm80/bwd/probabilities.cuh"
#include "sm80/bwd/products.cuh"
#include "sm80/bwd/step_loads.cuh"
#include "sm80/config.cuh"

namespace jax_flash::sm80 {

constexpr float kLog2e = 1.4426950408889634f;

// kVariant (params.h): which of the masks (mask.cuh, bias.cuh) and the soft cap (logits.cuh) are read.
template <typename Cfg, Variant kVariant>
__global__ void __launch_bounds__(Cfg::kThreads, 1) bwd_dkdv_kernel(const BwdParams p) {
  using T = typename Cfg::T;
  using KTile = typename Cfg::KTile;
  using QTile = typename Cfg::QTile;
  using PTile = typename Cfg::PTile;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  constexpr int kKSteps = kHeadDim / 16;          // k16 steps of S and dP
  constexpr int kDkvTiles = kHeadDim / Cfg::kDkvWarpsD / 8;  // n8 tiles of a warp's dK and dV rows
  constexpr int kSdpMTiles = Cfg::kSdpRowsPerWarp / 16;  // m16 tiles of a warp's S and dP
  constexpr int kDqMTiles = Cfg::kDqRowsPerWarp / 16;
  constexpr int kDqNTiles = Cfg::kDqColsPerWarp / 8;
  constexpr bool kMasked = kVariant != Variant::kPlain, kBias = kVariant == Variant::kEverything;

  extern __shared__ __align__(128) char smem[];
  // Layout: K, V, kStages x (Q, dO, lse, delta), P, dS.
  const uint32_t sK = ptx::smem_addr(smem), sV = sK + KTile::kBytes, sStages = sV + KTile::kBytes;
  const uint32_t sP = sStages + Cfg::kStages * Cfg::kStageBytes, sDs = sP + PTile::kBytes;
  // Per stage: Q tile, dO tile, then the lse and delta of its rows (float32). dO and dS sit at
  // fixed distances from Q and P, so the fragment addresses of one serve the other.
  constexpr int kDoFromQ = QTile::kBytes, kVFromK = KTile::kBytes, kDsFromP = PTile::kBytes;
  auto stage_q = [&](int s) { return sStages + s * Cfg::kStageBytes; };
  auto stage_do = [&](int s) { return stage_q(s) + kDoFromQ; };
  auto stage_stats = [&](int s) { return stage_do(s) + QTile::kBytes; };

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int n_block = blockIdx.x;
  const int batch = batch_head_index() / p.kv_heads, kv_head = batch_head_index() % p.kv_heads;
  const int group = p.heads / p.kv_heads;
  const int k_first = n_block * kBlockN;
  const int keys_valid = min(kBlockN, p.seqlen_k - k_first);  // dK and dV rows stored
  // With the row test even without lengths: rows past T see nothing either way, and so ptxas
  // allocates this kernel without spills (it spilled 16 bytes at d = 128 without).
  const Band band = Band::from<kMasked>(p, batch).masking_rows();
  // K and V past this row's key length are zero-filled, not read: they are ignored, and a NaN
  // there would reach dQ and dS through a zero probability.
  const int keys_loaded = kMasked ? min(kBlockN, band.seqlen_k - k_first) : keys_valid;
  using LogitsT = Logits<cap_of(kVariant)>;
  const LogitsT logits = LogitsT::from(p);
  const float scale_log2 = logits.unit * kLog2e;

  const int64_t q_row_stride = int64_t(p.heads) * kHeadDim;
  const int64_t kv_row_stride = int64_t(p.kv_heads) * kHeadDim;
  const int64_t kv_offset = (int64_t(batch) * p.seqlen_k + k_first) * kv_row_stride + kv_head * kHeadDim;

  const BwdWalk walk = BwdWalk::make(p.dq_turns ? band.without_segments() : band, k_first, k_first + kBlockN - 1,
                                     kBlockM, group);
  const int steps = walk.steps;

  // A step's Q, dO and statistics into a stage (bwd/step_loads.cuh).
  auto prefetch = [&](BwdStep c, int stage) {
    load_step<Cfg>(p, c, batch, q_row_stride, stage_q(stage), stage_do(stage), stage_stats(stage), tid);
  };

  load_tile<KTile, Cfg::kThreads, false, false, Cfg::kIsa>(sK, static_cast<const T*>(p.k) + kv_offset, kv_row_stride,
                                               keys_loaded, tid);
  load_tile<KTile, Cfg::kThreads, false, false, Cfg::kIsa>(sV, static_cast<const T*>(p.v) + kv_offset, kv_row_stride,
                                               keys_loaded, tid);
  BwdStep cur = BwdStep::first(walk, kv_head * group), next = cur;
  next.advance(walk);
  if (steps > 0) prefetch(cur, 0);
  ptx::cp_async_commit();

  // This warp's tiles in the three warp grids (config.cuh).
  const int sdp_m = warp / Cfg::kSdpWarpsN * Cfg::kSdpRowsPerWarp, sdp_n = warp % Cfg::kSdpWarpsN * 32;
  const int dkv_n = warp / Cfg::kDkvWarpsD * 32, dkv_d = warp % Cfg::kDkvWarpsD * (kHeadDim / Cfg::kDkvWarpsD);
  const int dq_m = warp / Cfg::kDqWarpsD * Cfg::kDqRowsPerWarp;
  const int dq_d = warp % Cfg::kDqWarpsD * Cfg::kDqColsPerWarp;

  // Every fragment address of the main loop, as a few registers per walk (tile.cuh). ldmatrix.x4
  // lanes give the row addresses of matrix lane / 8; the Q-stage walks are for stage 0.
  // S = Q K^T, dP = dO V^T: A = rows of Q (dO), matrices (rows +0/+8, dims 2ks / 2ks+1);
  // B = rows of K (V), matrices (keys n*8 / +8) x (dims 2ks, 2ks+1).
  const ChunkWalk<QTile, kKSteps> a_q(stage_q(0), sdp_m + lane % 16, lane / 16);
  const ChunkWalk<KTile, kKSteps> b_k(sK, sdp_n + lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
  // P and dS stores: this thread's two 16-bit values of n8 tile n in its accumulator rows.
  const ChunkWalk<PTile, 4, 1> st_p(sP + (lane % 4) * 4, sdp_m + lane / 4, sdp_n / 8);
  // dV += P^T dO, dK += dS^T Q: A = ldmatrix.trans of P (dS), matrix i holding keys +8*(i%2) x
  // queries +8*(i/2); B = ldmatrix.trans of dO (Q): queries +0/+8 x dims of n8 tiles d, d+1.
  const ChunkWalk<PTile, 2> at_p(sP, (lane / 16) * 8 + lane % 8, dkv_n / 8 + (lane / 8) % 2);
  const ChunkWalk<QTile, (kDkvTiles + 1) / 2> bt_q(stage_q(0), lane % 8 + ((lane / 8) % 2) * 8, dkv_d / 8 + lane / 16);
  // dQ = dS K: A = rows of dS, B = ldmatrix.trans of K.
  const ChunkWalk<PTile, kBlockN / 16> a_ds(sDs, dq_m + lane % 16, lane / 16);
  const ChunkWalk<KTile, kDqNTiles / 2> bt_k(sK, lane % 8 + ((lane / 8) % 2) * 8, dq_d / 8 + lane / 16);

  float acc_dk[2][kDkvTiles][4], acc_dv[2][kDkvTiles][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int d = 0; d < kDkvTiles; ++d)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_dk[mt][d][i] = acc_dv[mt][d][i] = 0.f;

  for (int s = 0; s < steps; ++s) {
    const int stage = s % Cfg::kStages;
    const uint32_t stage_offset = stage * Cfg::kStageBytes;
    ptx::cp_async_wait<0>();
    // One barrier for two things: this step's tiles have landed, and every warp is done with the
    // previous step, whose stage buffer the prefetch below refills and whose P and dS get rewritten.
    __syncthreads();
    if (Cfg::kStages > 1 && s + 1 < steps) prefetch(next, (s + 1) % Cfg::kStages);
    ptx::cp_async_commit();
    const float* stats = reinterpret_cast<const float*>(smem + (stage_stats(stage) - sK));
    const int head = cur.head;
    const int q_first = cur.m_block * kBlockM;
    cur = next;
    next.advance(walk);

    // S = Q K^T, then P, then dP = dO V^T: kSdpRowsPerWarp queries x 32 keys per warp. S and dP take turns in
    // the same registers; P waits for dP packed to 16 bits (the precision it is stored in).
    const bool masked = !band.all_visible(q_first, q_first + kBlockM - 1, k_first, k_first + kBlockN - 1);
    const LogitBias<T> bias = kBias ? LogitBias<T>::from(p, batch, head, logits.unit) : LogitBias<T>{};
    float acc[kSdpMTiles][4][4];
    // P for dS, packed to 16 bits; with a cap, P times the tanh's slope (logits.cuh), so that the
    // slopes need no registers of their own while dP is computed.
    uint32_t p_for_ds[kSdpMTiles][4][2];
    // acc = A B^T with A = Q (or dO, a_shift bytes on) and B = K (or V, b_shift bytes on).
    auto product = [&](uint32_t a_shift, uint32_t b_shift) { sdp_product<Cfg>(acc, a_q, b_k, a_shift, b_shift); };
    // This thread's element (mt, n, i): query row(mt, i / 2), key k_first + col(n, i % 2).
    auto row = [&](int mt, int r) { return sdp_m + mt * 16 + r * 8 + lane / 4; };
    auto col = [&](int n, int j) { return sdp_n + n * 8 + (lane % 4) * 2 + j; };

    // P (bwd/probabilities.cuh). `pairs`: the bias's layout (kBias only, bias.cuh).
    auto probabilities = [&](auto pairs) {
      sm80::probabilities<T, kBias>(pairs, acc, p_for_ds, stats, band, bias, logits, scale_log2, q_first, k_first,
                                    masked, row, col, st_p);
    };
    product(stage_offset, 0);
    if constexpr (kBias) {
      bias.with_layout(probabilities);
    } else {
      probabilities(std::true_type{});
    }

    // dS = P (dP - delta) * scale (* slope with a cap, inside p_for_ds): bwd/ds.cuh.
    product(stage_offset + kDoFromQ, kVFromK);
    const BiasGrad dbias = kBias ? BiasGrad::from(p, batch, head) : BiasGrad{};
    store_ds<T, kBias, kBlockM, kDsFromP>(acc, p_for_ds, stats, dbias, p, q_first, k_first, row, col, st_p);
    __syncthreads();  // P and dS of every warp are in shared memory

    // dV += P^T dO and dK += dS^T Q: 32 keys x H/kDkvWarpsD per warp.
#pragma unroll
    for (int ks = 0; ks < kBlockM / 16; ++ks) {
      uint32_t a_p[2][4], a_ds[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        ptx::ldmatrix_x4_trans(a_p[mt], at_p(mt, ks * 16));
        ptx::ldmatrix_x4_trans(a_ds[mt], at_p(mt, ks * 16) + kDsFromP);
      }
      // B fragments of n8 tiles d and d + 1, or of d alone where it is an odd last one (H = 96
      // with 64 keys: 3 a warp).
      auto load_b = [&](uint32_t (&b)[4], uint32_t addr, int d) {
        if (d + 1 < kDkvTiles) {
          ptx::ldmatrix_x4_trans(b, addr);
        } else {
          ptx::ldmatrix_x2_trans(b[0], b[1], addr);
        }
      };
#pragma unroll
      for (int d = 0; d < kDkvTiles; d += 2) {
        uint32_t b[4];
        load_b(b, bt_q(d / 2, ks * 16) + stage_offset + kDoFromQ, d);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          ptx::mma_16816<T, Cfg::kIsa>(acc_dv[mt][d], a_p[mt], b[0], b[1]);
          if (d + 1 < kDkvTiles) ptx::mma_16816<T, Cfg::kIsa>(acc_dv[mt][d + 1], a_p[mt], b[2], b[3]);
        }
        load_b(b, bt_q(d / 2, ks * 16) + stage_offset, d);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          ptx::mma_16816<T, Cfg::kIsa>(acc_dk[mt][d], a_ds[mt], b[0], b[1]);
          if (d + 1 < kDkvTiles) ptx::mma_16816<T, Cfg::kIsa>(acc_dk[mt][d + 1], a_ds[mt], b[2], b[3]);
        }
      }
    }

    if constexpr (Cfg::kStages == 1) {
      // One stage (compact tiles): once every warp is done with this step's Q, dO and statistics,
      // the next step's load into the same buffers, under dQ's products.
      __syncthreads();
      if (s + 1 < steps) prefetch(cur, 0);
      ptx::cp_async_commit();
    }

    // dQ[q_first .. +kBlockM) += dS K: this warp's rows x columns, added with atomics.
    {
      float acc_dq[kDqMTiles][kDqNTiles][4];
#pragma unroll
      for (int mt = 0; mt < kDqMTiles; ++mt)
#pragma unroll
        for (int d = 0; d < kDqNTiles; ++d)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc_dq[mt][d][i] = 0.f;
#pragma unroll
      for (int ks = 0; ks < kBlockN / 16; ++ks) {
        uint32_t a[kDqMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kDqMTiles; ++mt) ptx::ldmatrix_x4(a[mt], a_ds(ks, mt * 16));
#pragma unroll
        for (int d = 0; d < kDqNTiles; d += 2) {
          uint32_t b[4];
          ptx::ldmatrix_x4_trans(b, bt_k(d / 2, ks * 16));
#pragma unroll
          for (int mt = 0; mt < kDqMTiles; ++mt) {
            ptx::mma_16816<T, Cfg::kIsa>(acc_dq[mt][d], a[mt], b[0], b[1]);
            ptx::mma_16816<T, Cfg::kIsa>(acc_dq[mt][d + 1], a[mt], b[2], b[3]);
          }
        }
      }
      add_dq<Cfg>(acc_dq, p, band, batch, head, q_first, n_block, dq_m, dq_d, q_row_stride, tid);
    }
  }
  ptx::cp_async_wait<0>();
  __syncthreads();  // every warp is done with K and V, whose buffers stage dK and dV

  store_dk_dv<Cfg>(acc_dk, acc_dv, sK, sV, p, kv_offset, kv_row_stride, keys_valid, dkv_n, dkv_d, tid);
}

}  // namespace jax_flash::sm80
