// Launchers of the decode kernels for one (query and K/V element types, head dim, variant): the split kernel over
// (splits, kv heads x row tiles, batch), or over a ragged batch's work list, and, with several splits, the combine
// kernel after it; a ragged batch's prefill items then on the mma.sync forward's tiles.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/grid.cuh"
#include "decode/combine_kernel.cuh"
#include "decode/config.cuh"
#include "decode/params.h"
#include "decode/split_kernel.cuh"
#include "launch/allow_smem.h"
#include "launch/device.h"
#include "sm80/config.cuh"
#include "sm80/fwd_kernel.cuh"

namespace jax_flash {

// The combine kernel, as a programmatic dependent launch where the GPU has them: its launch
// overlaps the split kernel, which is most of its cost at decode sizes (decode D6). Programmatic
// dependent launches exist from sm_90 on.
template <typename T, int kHeadDim>
cudaError_t launch_combine(const DecodeParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.batch) * p.seqlen_q * p.heads;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(unsigned((rows + decode::kCombineWarps - 1) / decode::kCombineWarps));
  config.blockDim = dim3(decode::kCombineWarps * 32);
  config.stream = stream;
  cudaLaunchAttribute dependent{};
  dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent.val.programmaticStreamSerializationAllowed = 1;
  int major = 0, minor = 0;
  if (current_device_capability(&major, &minor) && major >= 9) {
    config.attrs = &dependent;
    config.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&config, decode::combine_kernel<T, kHeadDim>, p);
}

// Whether a grid of `ctas` split CTAs runs as whole waves of one CTA an SM (Config's kOneAnSm):
// more than two an SM hold (waves either way), or nearly whole waves of one an SM (at least 7/8
// of the SMs busy in the last). A few CTAs past one wave would otherwise run alone at the end.
inline bool one_cta_an_sm(int64_t ctas, int sms) {
  if (sms <= 0 || ctas <= sms) return false;
  return ctas > 2 * int64_t(sms) || ctas % sms == 0 || 8 * (ctas % sms) >= 7 * int64_t(sms);
}

// The split kernel over (splits, tiles, batch), or with kRagged over (splits, work items, kv
// heads), with `smem` bytes of dynamic shared memory (at least the configuration's; more keeps
// other CTAs off its SM).
template <typename Cfg, Variant kVariant, bool kRagged>
cudaError_t launch_split(const DecodeParams& p, unsigned tiles, int smem, cudaStream_t stream) {
  auto kernel = decode::split_kernel<Cfg, kVariant, kRagged>;
  if (cudaError_t e = allow_smem(kernel, smem); e != cudaSuccess) return e;
  const dim3 grid = kRagged ? dim3(p.splits, unsigned(p.work_items), p.kv_heads) : dim3(p.splits, tiles, p.batch);
  kernel<<<grid, Cfg::kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

// The split kernel, then with several splits the combine kernel.
template <typename T, typename KvT, int kHeadDim, Variant kVariant, bool kRagged>
cudaError_t run_split_kv(const DecodeParams& p, cudaStream_t stream) {
  using Cfg = decode::Config<T, KvT, kHeadDim>;
  const int64_t tiles = int64_t(p.kv_heads) * decode_row_tiles(p.seqlen_q, p.heads, p.kv_heads);
  const int64_t ctas_a_split = kRagged ? int64_t(p.work_items) * p.kv_heads : tiles * p.batch;
  const int64_t rows = int64_t(p.batch) * p.seqlen_q * p.heads;
  const bool grid_fits = kRagged ? p.work_items <= kMaxGridYZ && p.kv_heads <= kMaxGridYZ && p.batch == 1
                                 : tiles <= kMaxGridYZ && p.batch <= kMaxGridYZ;
  if (!grid_fits || p.splits < 1 || p.splits > kMaxDecodeSplits ||
      (p.splits > 1 && (rows + decode::kCombineWarps - 1) / decode::kCombineWarps > INT32_MAX)) {
    return cudaErrorInvalidConfiguration;  // cuda_impl.py's decode rule keeps calls inside these
  }
  auto launch = [&] {
    if constexpr (kHeadDim <= 128) {
      using OneAnSmCfg = decode::Config<T, KvT, kHeadDim, true>;
      const DeviceLimits device = current_device_limits();
      // Over half an SM's shared memory: no second CTA fits beside it.
      const int smem = std::max(OneAnSmCfg::kSmemBytes, device.smem_per_sm / 2 + 1);
      if (one_cta_an_sm(ctas_a_split * p.splits, device.sms) && smem <= device.smem_optin) {
        return launch_split<OneAnSmCfg, kVariant, kRagged>(p, unsigned(tiles), smem, stream);
      }
    }
    return launch_split<Cfg, kVariant, kRagged>(p, unsigned(tiles), Cfg::kSmemBytes, stream);
  };
  if (cudaError_t e = launch(); e != cudaSuccess || p.splits == 1) return e;
  return launch_combine<T, kHeadDim>(p, stream);
}

template <typename T, typename KvT, int kHeadDim, Variant kVariant>
cudaError_t run_decode(const DecodeParams& p, cudaStream_t stream) {
  return run_split_kv<T, KvT, kHeadDim, kVariant, false>(p, stream);
}

// A ragged batch's prefill items (DecodeParams::prefill_work) on the mma.sync forward's tiles,
// K and V read through the page table: a chunk of many queries reads each visible key once per
// 64 queries of a head, where the split kernel's 16-row tiles read it once per 16 packed rows.
template <typename T, int kHeadDim, Variant kVariant>
cudaError_t launch_prefill(const DecodeParams& p, cudaStream_t stream) {
  using Cfg = sm80::FwdConfig<T, kHeadDim, kVariant, Isa::kSm80, true>;
  auto kernel = sm80::fwd_kernel<Cfg, kVariant, true>;
  if (cudaError_t e = allow_smem(kernel, Cfg::kSmemBytes); e != cudaSuccess) return e;
  const int64_t blocks = int64_t(p.prefill_items) * (kPrefillBlockRows / Cfg::kBlockM);
  if (blocks > INT32_MAX || p.heads > kMaxGridYZ) return cudaErrorInvalidConfiguration;
  kernel<<<dim3(unsigned(blocks), unsigned(p.heads)), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// A ragged batch (DecodeParams::work): the same kernels over its work list, then its prefill
// items, if any (16-bit caches; last, as the combine writes every row). The split grid counts the
// list's items, a bound on the step's tiles (the items past its work exit at once), so for a step
// emptier than its shapes the one-CTA-an-SM choice may take the two-stage configuration that a
// grid of the live tiles alone would not.
template <typename T, typename KvT, int kHeadDim, Variant kVariant>
cudaError_t run_ragged(const DecodeParams& p, cudaStream_t stream) {
  if (p.work == nullptr) return cudaErrorInvalidValue;
  if (cudaError_t e = run_split_kv<T, KvT, kHeadDim, kVariant, true>(p, stream); e != cudaSuccess) return e;
  if (p.prefill_work == nullptr || p.prefill_items == 0) return cudaSuccess;
  if constexpr (std::is_same_v<T, KvT>) {
    return launch_prefill<T, kHeadDim, kVariant>(p, stream);
  } else {
    return cudaErrorInvalidValue;  // the handler refuses prefill items over fp8 pages
  }
}

}  // namespace jax_flash
