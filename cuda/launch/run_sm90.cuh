// Launchers of the sm90 kernels for one (element type, head dim): tensor maps, grid, stream.
// No synchronisation and no allocation: they run inside XLA's stream (and CUDA graphs).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/bwd_preprocess.cuh"
#include "common/grid.cuh"
#include "common/params.h"
#include "launch/allow_smem.h"
#include "launch/tensor_map.h"
#include "sm90/bwd_dq_kernel.cuh"
#include "sm90/bwd_kernel.cuh"
#include "sm90/bwd_wide_kernel.cuh"
#include "sm90/fwd_kernel.cuh"

namespace jax_flash {

// The tensor maps of the bias and mask tiles (sm90/common/bias_tiles.cuh), for the arrays the call has,
// in boxes of `box_rows` rows; the launchers took only whole [T, S] rows, stored [B or 1, N or 1,
// T, S].
inline cudaError_t make_bias_tensor_maps(const FwdParams& p, int elem_bytes, int box_rows, CUtensorMap* bias,
                                         CUtensorMap* mask) {
  auto stored = [&](int64_t stride, int full) { return stride == 0 ? 1 : full; };
  const Strides4 &b = p.bias_strides, &m = p.mask_strides;
  if (p.bias != nullptr) {
    if (cudaError_t e = make_tensor_map_bnts(bias, p.bias, p.bias_fp32 ? 4 : elem_bytes, stored(b.batch, p.batch),
                                             stored(b.head, p.heads), p.seqlen_q, p.seqlen_k, box_rows);
        e != cudaSuccess) {
      return e;
    }
  }
  if (p.mask != nullptr) {
    return make_tensor_map_bnts(mask, p.mask, 1, stored(m.batch, p.batch), stored(m.head, p.heads), p.seqlen_q,
                                p.seqlen_k, box_rows);
  }
  return cudaSuccess;
}

template <typename Cfg, Variant kVariant>
cudaError_t launch_fwd_sm90(const FwdParams& p, cudaStream_t stream) {
  constexpr int kHeadDim = Cfg::kHeadDim;
  const int64_t tiles = int64_t((p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM) * p.batch * p.heads;
  if (tiles == 0) return cudaSuccess;
  if (p.tile_scratch == nullptr || tiles > INT32_MAX || p.tile_scratch_size < FwdScratch::size(tiles)) {
    return cudaErrorInvalidValue;
  }
  sm90::FwdTensorMaps maps;
  if (cudaError_t e = make_qkv_tensor_maps(p, kHeadDim, Cfg::kValueDim, Cfg::kBlockM, Cfg::kBlockN, &maps.q, &maps.k, &maps.v);
      e != cudaSuccess) {
    return e;
  }
  if constexpr (Cfg::kStagedStore) {
    if (cudaError_t e = make_tensor_map_bthd(&maps.o, p.o, p.batch, p.seqlen_q, p.heads, Cfg::kValueDim, 64);
        e != cudaSuccess) {
      return e;
    }
  }
  if constexpr (Cfg::kBiasRegionBytes > 0) {
    if (cudaError_t e = make_bias_tensor_maps(p, sizeof(typename Cfg::T), Cfg::kBlockM, &maps.bias, &maps.mask);
        e != cudaSuccess) {
      return e;
    }
  }
  auto kernel = sm90::fwd_kernel<Cfg, kVariant, false>;
  auto redo_kernel = sm90::fwd_kernel<Cfg, kVariant, true>;
  for (auto k : {kernel, redo_kernel}) {
    if (cudaError_t e = allow_smem(k, Cfg::kSmemBytes); e != cudaSuccess) return e;
  }
  // Persistent: one CTA per SM (the shared memory allows no more), each walking tiles.
  int device = 0, sms = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device); e != cudaSuccess) {
    return e;
  }
  const size_t zeroed = sizeof(int) * (FwdScratch::kFlags + tiles);
  if (cudaError_t e = cudaMemsetAsync(p.tile_scratch, 0, zeroed, stream); e != cudaSuccess) return e;
  // The redo pass finds its tiles (usually none) in the scratch: its CTAs past their number
  // return at once.
  const int grid = int(tiles < sms ? tiles : sms);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(maps, p);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  redo_kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(maps, p);
  return cudaGetLastError();
}

// The plan's tiles (jax_flash/_plan.py, forward_tiles, says when each is chosen and why), or
// cudaErrorInvalidValue where this head dim and variant have no such tiles. kUsual with a bias
// or mask stages its tiles by TMA where they copy by rows and fit (FwdBiasTiles: the operands'
// strides and alignment, which the plan does not see), and reads them from global memory
// otherwise.
template <typename T, int kHeadDim, Variant kVariant>
cudaError_t run_fwd_sm90(const FwdParams& p, contract::Tiles tiles, cudaStream_t stream) {
  using contract::Tiles;
  switch (tiles) {
    case Tiles::kTall:  // 192-row tiles
      if constexpr (kHeadDim == 64 && (kVariant == Variant::kPlain || kVariant == Variant::kMasked)) {
        return launch_fwd_sm90<sm90::FwdConfig<T, kHeadDim, 3>, kVariant>(p, stream);
      }
      break;
    case Tiles::kWideKeys:  // wider key blocks (with a bias their loads' registers spilled)
      if constexpr ((kHeadDim == 128 || kHeadDim == 256) && kVariant != Variant::kEverything) {
        return launch_fwd_sm90<sm90::FwdConfig<T, kHeadDim, 2, true>, kVariant>(p, stream);
      }
      break;
    case Tiles::kUsual:
      if constexpr (kVariant == Variant::kEverything) {
        if (sm90::FwdBiasTiles<kHeadDim>::of(p, sizeof(T)).stages > 0) {
          return launch_fwd_sm90<sm90::FwdConfig<T, kHeadDim, 2, false, true>, kVariant>(p, stream);
        }
      }
      return launch_fwd_sm90<sm90::FwdConfig<T, kHeadDim>, kVariant>(p, stream);
    default:
      break;
  }
  return cudaErrorInvalidValue;
}

// Unequal head dims (query/key kHeadDim, value kValueDim < kHeadDim; DESIGN.md, "Unequal head
// dims"): the plain tiles of kHeadDim, with V's stages and O of kValueDim columns.
template <typename T, int kHeadDim, int kValueDim, Variant kVariant>
cudaError_t run_unequal_fwd_sm90(const FwdParams& p, cudaStream_t stream) {
  return launch_fwd_sm90<sm90::FwdConfig<T, kHeadDim, 2, false, false, kValueDim>, kVariant>(p, stream);
}

// The tensor maps of the backward kernels: q and dO in boxes of Cfg::kBlockM rows, k and v of
// Cfg::kBlockN, dk and dv of 64 (a consumer's columns); dO, v and dv of Cfg::kValueDim columns.
template <typename Cfg>
cudaError_t make_bwd_tensor_maps(const BwdParams& p, sm90::BwdTensorMaps* maps) {
  constexpr int kHeadDim = Cfg::kHeadDim, kValueDim = Cfg::kValueDim;
  for (cudaError_t e : {
           make_tensor_map_bthd(&maps->q, p.q, p.batch, p.seqlen_q, p.heads, kHeadDim, Cfg::kBlockM),
           make_tensor_map_bthd(&maps->dout, p.dout, p.batch, p.seqlen_q, p.heads, kValueDim, Cfg::kBlockM),
           make_tensor_map_bthd(&maps->k, p.k, p.batch, p.seqlen_k, p.kv_heads, kHeadDim, Cfg::kBlockN),
           make_tensor_map_bthd(&maps->v, p.v, p.batch, p.seqlen_k, p.kv_heads, kValueDim, Cfg::kBlockN),
           make_tensor_map_bthd(&maps->dk, p.dk, p.batch, p.seqlen_k, p.kv_heads, kHeadDim, 64),
           make_tensor_map_bthd(&maps->dv, p.dv, p.batch, p.seqlen_k, p.kv_heads, kValueDim, 64),
       }) {
    if (e != cudaSuccess) return e;
  }
  if constexpr (Cfg::kBiasRegionBytes > 0) {
    return make_bias_tensor_maps(p, sizeof(typename Cfg::T), Cfg::kBlockM, &maps->bias, &maps->mask);
  }
  return cudaSuccess;
}

// H <= 128: bwd_kernel with Cfg = BwdConfig, whose dQ accumulator is tiled as Cfg::Dq, converted
// to dq by a last kernel. Outside deterministic mode and without segment ids the accumulator is
// not zeroed: dQ tickets (params.h) say which CTA stores each block's first part. With segment
// ids (packed documents, padding masks) the zeroed accumulator is faster (B33).
template <typename Cfg, Variant kVariant>
cudaError_t launch_bwd_sm90(const BwdParams& params, cudaStream_t stream) {
  using T = typename Cfg::T;
  BwdParams p = params;
  p.dq_tickets = p.dq_turns == nullptr && p.q_segments == nullptr ? p.dq_counters : nullptr;
  if (cudaError_t e = launch_bwd_preprocess<T, Cfg::kHeadDim, 90>(p, stream); e != cudaSuccess) return e;
  sm90::BwdTensorMaps maps;
  if (cudaError_t e = make_bwd_tensor_maps<Cfg>(p, &maps); e != cudaSuccess) return e;
  auto kernel = sm90::bwd_kernel<Cfg, kVariant>;
  if constexpr (kVariant == Variant::kEverything) {  // with dbias or not, capped or not
    if (p.softcap > 0.f) {
      kernel = p.dbias != nullptr ? sm90::bwd_kernel<Cfg, kVariant, true, true>
                                  : sm90::bwd_kernel<Cfg, kVariant, false, true>;
    } else if (p.dbias != nullptr) {
      kernel = sm90::bwd_kernel<Cfg, kVariant, true>;
    }
  }
  if (cudaError_t e = allow_smem(kernel, Cfg::kSmemBytes); e != cudaSuccess) return e;
  dim3 grid;
  const int n_blocks = (p.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN;
  if (cudaError_t e = batch_head_grid(n_blocks, int64_t(p.batch) * p.kv_heads, &grid); e != cudaSuccess) return e;
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(maps, p);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  return sm90::launch_dq_from_tiles<T, typename Cfg::Dq, Cfg::kBlockM>(p, stream);
}

// H = 192 and 256 (V of kValueDim columns): dK and dV by bwd_wide_kernel (a CTA per 64 keys), dQ
// by bwd_dq_kernel (a CTA per 64 queries), which writes dq itself: no fp32 accumulator to zero or
// convert.
template <typename T, int kHeadDim, int kValueDim, Variant kVariant>
cudaError_t launch_bwd_sm90_wide(const BwdParams& p, cudaStream_t stream) {
  using Cfg = sm90::BwdWideConfig<T, kHeadDim, kValueDim>;
  using DqCfg = sm90::BwdDqConfig<T, kHeadDim, kValueDim>;
  static_assert(DqCfg::kBlockM == Cfg::kBlockM && DqCfg::kBlockN == Cfg::kBlockN, "one set of tensor maps");
  BwdParams stats_only = p;
  stats_only.dq_accum = nullptr;
  if (cudaError_t e = launch_bwd_preprocess<T, kValueDim, 90>(stats_only, stream); e != cudaSuccess) return e;
  sm90::BwdTensorMaps maps;
  if (cudaError_t e = make_bwd_tensor_maps<Cfg>(p, &maps); e != cudaSuccess) return e;
  auto dkdv_kernel = sm90::bwd_wide_kernel<Cfg, kVariant>;
  auto dq_kernel = sm90::bwd_dq_kernel<DqCfg, kVariant>;
  if constexpr (kVariant == Variant::kEverything) {  // with dbias or not, capped or not
    if (p.softcap > 0.f) {
      dkdv_kernel = p.dbias != nullptr ? sm90::bwd_wide_kernel<Cfg, kVariant, true, true>
                                       : sm90::bwd_wide_kernel<Cfg, kVariant, false, true>;
      dq_kernel = sm90::bwd_dq_kernel<DqCfg, kVariant, true>;
    } else if (p.dbias != nullptr) {
      dkdv_kernel = sm90::bwd_wide_kernel<Cfg, kVariant, true>;
    }
  }
  if (cudaError_t e = allow_smem(dkdv_kernel, Cfg::kSmemBytes); e != cudaSuccess) return e;
  if (cudaError_t e = allow_smem(dq_kernel, DqCfg::kSmemBytes); e != cudaSuccess) return e;
  dim3 dkdv_grid, dq_grid;
  const int n_blocks = (p.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN;
  const int m_blocks = (p.seqlen_q + DqCfg::kBlockM - 1) / DqCfg::kBlockM;
  for (cudaError_t e : {batch_head_grid(n_blocks, int64_t(p.batch) * p.kv_heads, &dkdv_grid),
                        batch_head_grid(m_blocks, int64_t(p.batch) * p.heads, &dq_grid)}) {
    if (e != cudaSuccess) return e;
  }
  dkdv_kernel<<<dkdv_grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(maps, p);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  dq_kernel<<<dq_grid, DqCfg::kThreads, DqCfg::kSmemBytes, stream>>>(maps, p);
  return cudaGetLastError();
}

// Unequal head dims (query/key kHeadDim, value kValueDim < kHeadDim): the kernels of H = 192 and 256,
// with V, dO and dV of kValueDim columns.
template <typename T, int kHeadDim, int kValueDim, Variant kVariant>
cudaError_t run_unequal_bwd_sm90(const BwdParams& p, cudaStream_t stream) {
  return launch_bwd_sm90_wide<T, kHeadDim, kValueDim, kVariant>(p, stream);
}

// The plan's tiles, or cudaErrorInvalidValue where this head dim and variant have no such tiles.
// H = 128's 80-query steps (FlashAttention-3's non-causal tile) take no masks, band or
// deterministic mode (whose turns count 64-row blocks).
template <typename T, int kHeadDim, Variant kVariant>
cudaError_t run_bwd_sm90(const BwdParams& p, contract::Tiles tiles, cudaStream_t stream) {
  using contract::Tiles;
  if constexpr (kHeadDim >= 192) {
    if (tiles != Tiles::kUsual) return cudaErrorInvalidValue;
    return launch_bwd_sm90_wide<T, kHeadDim, kHeadDim, kVariant>(p, stream);
  } else {
    if (tiles == Tiles::kStepsOf80) {
      if constexpr (kHeadDim == 128 && kVariant == Variant::kPlain) {
        if (p.window_left < 0 && p.window_right < 0 && p.dq_turns == nullptr) {
          return launch_bwd_sm90<sm90::BwdConfig<T, kHeadDim, 80>, kVariant>(p, stream);
        }
      }
      return cudaErrorInvalidValue;
    }
    if (tiles != Tiles::kUsual) return cudaErrorInvalidValue;
    constexpr bool kBias = kVariant == Variant::kEverything;
    using Cfg = sm90::BwdConfig<T, kHeadDim, kHeadDim == 64 ? 128 : 64, kBias>;
    return launch_bwd_sm90<Cfg, kVariant>(p, stream);
  }
}

}  // namespace jax_flash
