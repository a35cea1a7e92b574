// From the raw scores s = q . k to the logits the softmax sees: scale * s, or with a soft cap c
// (Gemma 2) c * tanh(scale * s / c). Either way a kernel keeps one value x per element with
// logit = unit * x (x = s, unit = scale; or x = tanh(scale * s / c), unit = c), so the softmax
// folds `unit` into its exp2 exactly as without a cap: the cap costs one tanh per element.
#pragma once

#include "common/params.h"
#include "common/ptx.cuh"

namespace jax_flash {

// Whether a kernel variant (params.h) applies a cap: never, always (kSoftcap), or when the call
// has one (kEverything, which takes every feature in one instantiation).
enum class Cap { kNever, kAlways, kIfSet };
constexpr Cap cap_of(Variant v) {
  return v == Variant::kSoftcap ? Cap::kAlways : v == Variant::kEverything ? Cap::kIfSet : Cap::kNever;
}

template <Cap kCap>
struct Logits {
  static constexpr bool kMayCap = kCap != Cap::kNever;
  float tanh_scale;  // scale / c (with a cap)
  float unit;        // logit = unit * value
  bool has_cap;      // read with kIfSet only

  __device__ __forceinline__ static Logits from(const FwdParams& p) {
    const bool cap = kCap == Cap::kAlways || (kCap == Cap::kIfSet && p.softcap > 0.f);
    return cap ? Logits{p.scale / p.softcap, p.softcap, true} : Logits{0.f, p.scale, false};
  }
  // The logits of keys stored divided by `key_scale` (an fp8 cache): the same function of q.k
  // times it.
  __device__ __forceinline__ Logits with_key_scale(float key_scale) const {
    return capped() ? Logits{tanh_scale * key_scale, unit, has_cap} : Logits{tanh_scale, unit * key_scale, has_cap};
  }
  __device__ __forceinline__ bool capped() const { return kCap == Cap::kAlways || (kCap == Cap::kIfSet && has_cap); }
  __device__ __forceinline__ float value(float s) const { return capped() ? ptx::tanh(s * tanh_scale) : s; }

  // The backward's dS = P (dP - delta) * d logit / d s takes d logit / d s = scale * slope(x):
  // under a cap the tanh's slope 1 - x^2, without one 1. The kernels take it before masking
  // (x = -inf would give -inf, and P = 0 times that NaN).
  __device__ __forceinline__ float slope(float x) const { return capped() ? 1.f - x * x : 1.f; }
};

}  // namespace jax_flash
