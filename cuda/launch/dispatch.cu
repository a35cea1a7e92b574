// Dispatch from runtime (dtype, head dim) to the compiled instantiations.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <type_traits>

#include "common/bias.cuh"
#include "launch/device.h"
#include "launch/dispatch.h"
#include "sm80/config.cuh"
#include "sm80/wide_fwd/config.cuh"
#include "sm90/bwd/bias_tiles.cuh"

namespace jax_flash {
namespace {

// fn(std::integral_constant<int, d>{}) for the head dim d of `dims` equal to head_dim.
template <int... kDims, typename Fn>
cudaError_t for_head_dim(std::integer_sequence<int, kDims...>, int head_dim, Fn&& fn) {
  cudaError_t status = cudaErrorInvalidValue;
  ((head_dim == kDims && (status = fn(std::integral_constant<int, kDims>{}), true)) || ...);
  return status;
}

// fn(integral_constant h, integral_constant v) for the pair (h, v) of `pairs` (flattened: h0, v0,
// h1, v1, ...) equal to (head_dim, value_dim).
template <int kH, int kV, int... kRest, typename Fn>
cudaError_t for_head_dim_pair(std::integer_sequence<int, kH, kV, kRest...>, int head_dim, int value_dim, Fn&& fn) {
  if (head_dim == kH && value_dim == kV) return fn(std::integral_constant<int, kH>{}, std::integral_constant<int, kV>{});
  if constexpr (sizeof...(kRest) > 0) {
    return for_head_dim_pair(std::integer_sequence<int, kRest...>{}, head_dim, value_dim, fn);
  } else {
    return cudaErrorInvalidValue;
  }
}

// Every forward head dim; the backward's and the Hopper kernels' are subsets (contract.h).
template <typename Fn>
cudaError_t by_head_dim(int head_dim, Fn&& fn) {
  return for_head_dim(contract::FwdHeadDims{}, head_dim, fn);
}

bool use_sm90(KernelFamily family) { return family == KernelFamily::kHopper; }
bool use_sm75(KernelFamily family) { return family == KernelFamily::kTuring; }

// The Turing family: fp16 without a bias or mask, equal head dims of fwd_sm75 / bwd_sm75 (the Python
// layer sends it nothing else: bf16 and the rest take the xla path there).
template <typename T, Variant kVariant, typename Params, typename Run>
cudaError_t turing_for(const Params& p, Run&& run) {
  if constexpr (!std::is_same_v<T, __half> || kVariant == Variant::kEverything) {
    return cudaErrorInvalidValue;
  } else {
    if (p.value_dim != p.head_dim) return cudaErrorInvalidValue;
    return for_head_dim(contract::FwdSm75HeadDims{}, p.head_dim, [&](auto d) { return run(d); });
  }
}

// The variant that reads what the call has (params.h).
template <typename Fn>
cudaError_t by_variant(const FwdParams& p, Fn&& fn) {
  if (p.bias != nullptr || p.mask != nullptr) return fn(std::integral_constant<Variant, Variant::kEverything>{});
  if (p.softcap > 0.f) return fn(std::integral_constant<Variant, Variant::kSoftcap>{});
  if (p.seqlens != nullptr || p.q_segments != nullptr) return fn(std::integral_constant<Variant, Variant::kMasked>{});
  return fn(std::integral_constant<Variant, Variant::kPlain>{});
}

// The forwards without a bias or mask: head dims above 256 (Hopper's, or the mma.sync ones), and
// unequal query/key and value head dims (Hopper only).
template <typename T, Variant kVariant>
cudaError_t bias_free_fwd_for(const FwdParams& p, KernelFamily family, cudaStream_t stream) {
  if constexpr (kVariant == Variant::kEverything) {
    return cudaErrorInvalidValue;
  } else {
    if (p.value_dim != p.head_dim) {
      if (!use_sm90(family)) return cudaErrorInvalidValue;
      return for_head_dim_pair(contract::FwdSm90UnequalHeadDims{}, p.head_dim, p.value_dim, [&](auto h, auto v) {
        return run_unequal_fwd_sm90<T, decltype(h)::value, decltype(v)::value, kVariant>(p, stream);
      });
    }
    if (use_sm90(family)) {
      return for_head_dim(contract::FwdSm90WideHeadDims{}, p.head_dim, [&](auto d) {
        return run_wide_fwd_sm90<T, decltype(d)::value, kVariant>(p, stream);
      });
    }
    return for_head_dim(contract::FwdSm80WideHeadDims{}, p.head_dim, [&](auto d) {
      return run_wide_fwd_sm80<T, decltype(d)::value, kVariant>(p, stream);
    });
  }
}

template <typename T, Variant kVariant>
cudaError_t fwd_for(const FwdParams& p, KernelFamily family, Tiles tiles, cudaStream_t stream) {
  // The kernels with one tile shape: the Turing ones, above 256, unequal dims, the mma.sync forward.
  const bool usual = tiles == Tiles::kUsual;
  if (use_sm75(family)) {
    if (!usual) return cudaErrorInvalidValue;
    return turing_for<T, kVariant>(p, [&](auto d) { return run_fwd_sm75<T, decltype(d)::value, kVariant>(p, stream); });
  }
  if (p.value_dim != p.head_dim || fwd_sm90_wide_supports_head_dim(p.head_dim)) {
    return usual ? bias_free_fwd_for<T, kVariant>(p, family, stream) : cudaErrorInvalidValue;
  }
  const bool sm90 = use_sm90(family) && fwd_sm90_supports_head_dim(p.head_dim);
  return by_head_dim(p.head_dim, [&](auto d) -> cudaError_t {
    constexpr int kHeadDim = decltype(d)::value;
    if constexpr (fwd_sm90_supports_head_dim(kHeadDim)) {
      // A bias or mask in another layout than pairs (odd S, strided keys) runs the sm80 kernel.
      const bool layout_ok = kVariant != Variant::kEverything || bias_in_pairs(p);
      if (sm90 && layout_ok) return run_fwd_sm90<T, kHeadDim, kVariant>(p, tiles, stream);
    }
    return usual ? run_fwd_sm80<T, kHeadDim, kVariant>(p, stream) : cudaErrorInvalidValue;
  });
}

template <typename T>
cudaError_t fwd_for(const FwdParams& p, KernelFamily family, Tiles tiles, cudaStream_t stream) {
  return by_variant(p, [&](auto v) { return fwd_for<T, decltype(v)::value>(p, family, tiles, stream); });
}

// The backwards that run only on Hopper, without a bias or mask: head dim 192 (with one, the Python
// layer pads it to 256), and unequal query/key and value head dims.
template <typename T, Variant kVariant>
cudaError_t hopper_only_bwd_for(const BwdParams& p, KernelFamily family, Tiles tiles, cudaStream_t stream) {
  if constexpr (kVariant == Variant::kEverything) {
    return cudaErrorInvalidValue;
  } else {
    if (!use_sm90(family)) return cudaErrorInvalidValue;
    if (p.value_dim != p.head_dim) {
      if (tiles != Tiles::kUsual) return cudaErrorInvalidValue;
      return for_head_dim_pair(contract::BwdSm90UnequalHeadDims{}, p.head_dim, p.value_dim, [&](auto h, auto v) {
        return run_unequal_bwd_sm90<T, decltype(h)::value, decltype(v)::value, kVariant>(p, stream);
      });
    }
    return for_head_dim(contract::BwdSm90NoBiasHeadDims{}, p.head_dim, [&](auto d) {
      return run_bwd_sm90<T, decltype(d)::value, kVariant>(p, tiles, stream);
    });
  }
}

template <typename T, Variant kVariant>
cudaError_t bwd_for(const BwdParams& p, KernelFamily family, Tiles tiles, cudaStream_t stream) {
  static_assert(std::is_same_v<contract::FwdSm75HeadDims, contract::BwdSm75HeadDims>);
  if (use_sm75(family)) {
    if (tiles != Tiles::kUsual) return cudaErrorInvalidValue;
    return turing_for<T, kVariant>(p, [&](auto d) { return run_bwd_sm75<T, decltype(d)::value, kVariant>(p, stream); });
  }
  if (p.value_dim != p.head_dim || bwd_sm90_no_bias_supports_head_dim(p.head_dim)) {
    return hopper_only_bwd_for<T, kVariant>(p, family, tiles, stream);
  }
  if (!bwd_supports_head_dim(p.head_dim)) return cudaErrorInvalidValue;
  const bool sm90 = use_sm90(family);
  return by_head_dim(p.head_dim, [&](auto d) -> cudaError_t {
    constexpr int kHeadDim = decltype(d)::value;
    if constexpr (bwd_sm90_supports_head_dim(kHeadDim)) {
      // The sm90 backward stages the bias by TMA (BwdBiasTiles), or at d = 256 reads it in pairs
      // of keys (bias.cuh).
      bool bias_ok = kVariant != Variant::kEverything;
      if constexpr (kVariant == Variant::kEverything) {
        if constexpr (kHeadDim == 256) {
          bias_ok = bias_in_pairs(p);
        } else {
          bias_ok = sm90::BwdBiasTiles<kHeadDim>::of(p, sizeof(T)).stages > 0;
        }
      }
      if (sm90 && bias_ok) return run_bwd_sm90<T, kHeadDim, kVariant>(p, tiles, stream);
    }
    if constexpr (bwd_supports_head_dim(kHeadDim)) {
      return run_bwd_sm80<T, kHeadDim, kVariant>(p, tiles, stream);
    } else {
      return cudaErrorInvalidValue;
    }
  });
}

template <typename T>
cudaError_t bwd_for(const BwdParams& p, KernelFamily family, Tiles tiles, cudaStream_t stream) {
  return by_variant(p, [&](auto v) { return bwd_for<T, decltype(v)::value>(p, family, tiles, stream); });
}

// The decode kernels over a cache of KvT at one of `dims`, over a ragged batch's work list where
// p has one.
template <typename T, typename KvT, typename HeadDims>
cudaError_t decode_for(HeadDims dims, const DecodeParams& p, cudaStream_t stream) {
  return for_head_dim(dims, p.head_dim, [&](auto d) -> cudaError_t {
    constexpr int kHeadDim = decltype(d)::value;
    if (p.work != nullptr) {
      if (p.softcap > 0.f) return run_ragged<T, KvT, kHeadDim, Variant::kSoftcap>(p, stream);
      return run_ragged<T, KvT, kHeadDim, Variant::kMasked>(p, stream);
    }
    if (p.softcap > 0.f) return run_decode<T, KvT, kHeadDim, Variant::kSoftcap>(p, stream);
    return run_decode<T, KvT, kHeadDim, Variant::kMasked>(p, stream);
  });
}

}  // namespace

const char* family_unavailable(KernelFamily family) {
  switch (family) {
    case KernelFamily::kTuring:
    case KernelFamily::kMmaSync:
      return nullptr;  // compiled for every target listed, or for them all (CMakeLists.txt)
    case KernelFamily::kHopper: {
#if defined(JAX_FLASH_HAS_SM90A)
      int major = 0, minor = 0;
      const bool hopper = current_device_capability(&major, &minor) && major == 9 && minor == 0;
      return hopper ? nullptr : "the plan names the Hopper kernels, which run on a 9.0 GPU alone";
#else
      return "the plan names the Hopper kernels, and this module has no sm_90a code";
#endif
    }
  }
  return "the plan names an unknown kernel family";
}

cudaError_t run_fwd(DType dtype, const FwdParams& p, KernelFamily family, Tiles tiles, cudaStream_t stream) {
  return dtype == DType::kFloat16 ? fwd_for<__half>(p, family, tiles, stream)
                                  : fwd_for<__nv_bfloat16>(p, family, tiles, stream);
}

cudaError_t run_bwd(DType dtype, const BwdParams& p, KernelFamily family, Tiles tiles, cudaStream_t stream) {
  return dtype == DType::kFloat16 ? bwd_for<__half>(p, family, tiles, stream)
                                  : bwd_for<__nv_bfloat16>(p, family, tiles, stream);
}

template <typename T>
cudaError_t decode_for(DType kv_dtype, const DecodeParams& p, cudaStream_t stream) {
  switch (kv_dtype) {
    case DType::kFp8E4m3: return decode_for<T, __nv_fp8_e4m3>(contract::DecodeFp8HeadDims{}, p, stream);
    case DType::kFp8E5m2: return decode_for<T, __nv_fp8_e5m2>(contract::DecodeFp8HeadDims{}, p, stream);
    default: return decode_for<T, T>(contract::DecodeHeadDims{}, p, stream);
  }
}

cudaError_t run_decode(DType dtype, DType kv_dtype, const DecodeParams& p, cudaStream_t stream) {
  const bool fp8 = kv_dtype == DType::kFp8E4m3 || kv_dtype == DType::kFp8E5m2;
  if (kv_dtype != dtype && !fp8) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat16: return decode_for<__half>(kv_dtype, p, stream);
    case DType::kBFloat16: return decode_for<__nv_bfloat16>(kv_dtype, p, stream);
    default: return cudaErrorInvalidValue;  // fp8 queries
  }
}

int sm80_forward_smem_bytes(int head_dim) {
  int bytes = 0;
  for_head_dim(contract::FwdHeadDims{}, head_dim, [&](auto d) {
    constexpr int kHeadDim = decltype(d)::value;
    using T = __nv_bfloat16;  // the same for fp16
    bytes = std::max({sm80::FwdConfig<T, kHeadDim, Variant::kPlain>::kSmemBytes,
                      sm80::FwdConfig<T, kHeadDim, Variant::kMasked>::kSmemBytes,
                      sm80::FwdConfig<T, kHeadDim, Variant::kSoftcap>::kSmemBytes,
                      sm80::FwdConfig<T, kHeadDim, Variant::kEverything>::kSmemBytes});
    return cudaSuccess;
  });
  return bytes;
}

int sm80_wide_forward_smem_bytes(int head_dim) {
  int bytes = 0;
  for_head_dim(contract::FwdSm80WideHeadDims{}, head_dim, [&](auto d) {
    bytes = sm80::WideFwdConfig<__nv_bfloat16, decltype(d)::value>::kSmemBytes;  // the same for fp16
    return cudaSuccess;
  });
  return bytes;
}

int sm75_forward_smem_bytes(int head_dim) {
  int bytes = 0;
  for_head_dim(contract::FwdSm75HeadDims{}, head_dim, [&](auto d) {
    constexpr int kHeadDim = decltype(d)::value;
    constexpr Isa kTuring = Isa::kSm75;
    bytes = std::max({sm80::FwdConfig<__half, kHeadDim, Variant::kPlain, kTuring>::kSmemBytes,
                      sm80::FwdConfig<__half, kHeadDim, Variant::kMasked, kTuring>::kSmemBytes,
                      sm80::FwdConfig<__half, kHeadDim, Variant::kSoftcap, kTuring>::kSmemBytes});
    return cudaSuccess;
  });
  return bytes;
}

int sm75_backward_smem_bytes(int head_dim) {
  int bytes = 0;
  for_head_dim(contract::BwdSm75HeadDims{}, head_dim, [&](auto d) {
    bytes = sm80::BwdConfig<__half, decltype(d)::value, false, Isa::kSm75>::kSmemBytes;
    return cudaSuccess;
  });
  return bytes;
}

int sm80_backward_usual_smem_bytes(int head_dim) {
  int bytes = 0;
  for_head_dim(contract::BwdHeadDims{}, head_dim, [&](auto d) {
    bytes = sm80::BwdConfig<__nv_bfloat16, decltype(d)::value>::kSmemBytes;  // the same for fp16
    return cudaSuccess;
  });
  return bytes;
}

int sm80_backward_smem_bytes(int head_dim) {
  int bytes = 0;
  for_head_dim(contract::BwdHeadDims{}, head_dim, [&](auto d) {
    constexpr int kHeadDim = decltype(d)::value;
    bytes = sm80::BwdConfig<__nv_bfloat16, kHeadDim, true>::kSmemBytes;  // the compact tiles; the same for fp16
    return cudaSuccess;
  });
  return bytes;
}

}  // namespace jax_flash
