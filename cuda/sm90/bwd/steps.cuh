// The Hopper backward's per-variant choices (sm90/bwd_kernel.cuh): which features a step reads and
// the order of its products, each with the step of the perf log that chose it.
#pragma once

#include "common/params.h"

namespace jax_flash::sm90 {

template <typename Cfg, Variant kVariant, bool kBiasGrad, bool kBiasCapped>
struct BwdSteps {
  static constexpr int kBlockM = Cfg::kBlockM, kHeadDim = Cfg::kHeadDim;
  static constexpr bool kMasked = kVariant != Variant::kPlain, kSoftcap = kVariant == Variant::kSoftcap;
  static constexpr bool kBias = kVariant == Variant::kEverything;
  static_assert(kBias || (!kBiasGrad && !kBiasCapped), "dbias and kBiasCapped need a bias");
  // A capped step (kCappedStep) waits for dP^T as well as S^T before its softmax, and takes
  // dP^T - delta there, times the tanh's slopes, except where dbias wants d logit without them
  // (kSlopesApart): there the slopes wait for dS^T in registers, as packed pairs.
  static constexpr bool kCappedStep = kSoftcap || kBiasCapped, kSlopesApart = kBiasCapped && kBiasGrad;
  // Key blocks with the longest walks start first (BwdCta; B19).
  // Not where the remap's registers spill: at 80-query steps (which run no band, so that every
  // order does as well) and in the capped H = 64 kernel.
  static constexpr bool kLongestFirst = kBlockM != 80 && !(kCappedStep && kHeadDim == 64);
  // dV is issued once dS^T is in shared memory (FlashAttention-3's order), so that dS^T follows
  // dP^T's landing at once, and the thread index is read ahead of where it is needed (B20).
  // Not with a cap, whose step waits for dP^T before the softmax: there the two were slower.
  static constexpr bool kDvAfterDs = !kCappedStep, kThreadIndexAhead = !kCappedStep;
  // At H = 64 (128-query steps) dV goes out after dQ, not before: dQ's part then reaches shared
  // memory while dV and dK run (B21). Slower at H = 128; at 80-query steps P^T, live until dV
  // lands, spilled. (Measured in the plain kernels only.)
  static constexpr bool kDqFirst = kHeadDim == 64 && kVariant == Variant::kPlain;
  static_assert(kDvAfterDs || !kDqFirst, "dV is issued at one place of the step");
};

}  // namespace jax_flash::sm90
