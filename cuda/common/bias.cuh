// The additive bias and boolean mask of the kEverything variant (params.h), and the bias's gradient,
// for one (batch row, query head). Arrays broadcast to [B, N, T, S] through zero strides.
#pragma once

#include <cmath>
#include <type_traits>

#include "common/params.h"
#include "common/ptx.cuh"

namespace jax_flash {

// Keys k, k + 1 (k even) adjacent and aligned in both arrays: unit key strides, even row strides
// and an even S. Then a thread's two keys load as one (and the sm90 forward takes the call).
__host__ __device__ inline bool bias_in_pairs(const FwdParams& p) {
  const bool bias_pairs = !p.bias || (p.bias_strides.col == 1 && p.bias_strides.row % 2 == 0);
  const bool mask_pairs = !p.mask || (p.mask_strides.col == 1 && p.mask_strides.row % 2 == 0);
  return bias_pairs && mask_pairs && p.seqlen_k % 2 == 0;
}

template <typename T>
struct LogitBias {
  const char* bias;  // at (batch, head); nullptr: none
  const unsigned char* mask;
  int64_t bias_row, bias_col, mask_row, mask_col;
  int last_q, last_k;  // indices clamp to these, so that every load is in bounds
  bool bias_fp32;
  bool pairs;  // bias_in_pairs
  float inv_unit;  // the kernels keep logit = unit * x (logits.cuh), so x gets bias / unit

  __device__ static LogitBias from(const FwdParams& p, int batch, int head, float unit) {
    const Strides4& b = p.bias_strides;
    const Strides4& m = p.mask_strides;
    const int64_t bias_offset = (batch * b.batch + head * b.head) * (p.bias_fp32 ? 4 : sizeof(T));
    return {p.bias ? static_cast<const char*>(p.bias) + bias_offset : nullptr,
            p.mask ? reinterpret_cast<const unsigned char*>(p.mask) + batch * m.batch + head * m.head : nullptr,
            b.row, b.col, m.row, m.col, p.seqlen_q - 1, p.seqlen_k - 1, p.bias_fp32,
            bias_in_pairs(p), 1.f / unit};
  }

  // A mask loop, unswitched on `pairs`: fn(std::true_type{}) or fn(std::false_type{}).
  template <typename Fn>
  __device__ __forceinline__ void with_layout(Fn&& fn) const {
    if (pairs) {
      fn(std::true_type{});
    } else {
      fn(std::false_type{});
    }
  }

  // What x of query q and keys k, k + 1 (k even) gets added: bias / unit, or -inf where the mask
  // hides the key. Indices past the tensors read the last element: the loads need no branch, and
  // the kernels mask those elements anyway.
  template <bool kPairs>
  __device__ __forceinline__ float2 pair(int q, int k) const {
    q = min(q, last_q);
    const int k1 = kPairs ? k : min(k + 1, last_k);
    k = min(k, kPairs ? last_k - 1 : last_k);
    float2 add{0.f, 0.f};
    if (bias != nullptr) {
      const int64_t i = q * bias_row + k * bias_col;
      if constexpr (kPairs) {
        if (bias_fp32) {
          add = __ldg(reinterpret_cast<const float2*>(bias) + i / 2);
        } else {
          add = ptx::unpack2<T>(__ldg(reinterpret_cast<const unsigned*>(bias) + i / 2));
        }
      } else {
        const int64_t i1 = q * bias_row + k1 * bias_col;
        add = bias_fp32 ? float2{__ldg(reinterpret_cast<const float*>(bias) + i),
                                 __ldg(reinterpret_cast<const float*>(bias) + i1)}
                        : float2{static_cast<float>(__ldg(reinterpret_cast<const T*>(bias) + i)),
                                 static_cast<float>(__ldg(reinterpret_cast<const T*>(bias) + i1))};
      }
      add.x *= inv_unit, add.y *= inv_unit;
    }
    if (mask != nullptr) {
      const int64_t i = q * mask_row + k * mask_col;
      bool keep0, keep1;
      if constexpr (kPairs) {
        const unsigned short both = __ldg(reinterpret_cast<const unsigned short*>(mask) + i / 2);
        keep0 = (both & 0xff) != 0, keep1 = (both >> 8) != 0;
      } else {
        keep0 = __ldg(mask + i) != 0, keep1 = __ldg(mask + q * mask_row + k1 * mask_col) != 0;
      }
      if (!keep0) add.x = -INFINITY;
      if (!keep1) add.y = -INFINITY;
    }
    return add;
  }
};

// The sm90 forward's bias and mask for one key block of a thread's two rows (the wgmma accumulator
// layout: element 4 n8 + 2 r + c of s is row q[r], key k0 + 8 n8 + c, k0 even). The pairs layout
// only (the dispatch sends the others to the sm80 kernels): each row's loads are then a base
// address and constant offsets, not a 64-bit index per element; keys past the last read the last
// pair (the band masks them).
template <typename T, int kN8>
__device__ __forceinline__ void add_bias_pairs(const LogitBias<T>& b, float (&s)[4 * kN8], const int (&q)[2], int k0) {
  // The pair (keys last_k - 1, last_k: S is even) as an offset from this thread's first, k0.
  const int last_pair = (b.last_k - 1 - k0) / 2;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = min(q[r], b.last_q);
    if (b.bias != nullptr) {
      const int64_t first = (row * b.bias_row + k0) / 2;  // in pairs: unit key stride, even row stride
      if (b.bias_fp32) {
        const float2* at = reinterpret_cast<const float2*>(b.bias) + first;
#pragma unroll
        for (int n8 = 0; n8 < kN8; ++n8) {
          const float2 add = __ldg(at + min(4 * n8, last_pair));
          s[4 * n8 + 2 * r] += add.x * b.inv_unit;
          s[4 * n8 + 2 * r + 1] += add.y * b.inv_unit;
        }
      } else {
        const unsigned* at = reinterpret_cast<const unsigned*>(b.bias) + first;
#pragma unroll
        for (int n8 = 0; n8 < kN8; ++n8) {
          const float2 add = ptx::unpack2<T>(__ldg(at + min(4 * n8, last_pair)));
          s[4 * n8 + 2 * r] += add.x * b.inv_unit;
          s[4 * n8 + 2 * r + 1] += add.y * b.inv_unit;
        }
      }
    }
    if (b.mask != nullptr) {
      const unsigned short* at = reinterpret_cast<const unsigned short*>(b.mask) + (row * b.mask_row + k0) / 2;
#pragma unroll
      for (int n8 = 0; n8 < kN8; ++n8) {
        const unsigned short both = __ldg(at + min(4 * n8, last_pair));
        if ((both & 0xff) == 0) s[4 * n8 + 2 * r] = -INFINITY;
        if ((both >> 8) == 0) s[4 * n8 + 2 * r + 1] = -INFINITY;
      }
    }
  }
}

struct BiasGrad {
  float* dbias;  // at (batch, head); nullptr: not wanted
  int64_t row, col;

  __device__ static BiasGrad from(const BwdParams& p, int batch, int head) {
    const Strides4& s = p.dbias_strides;
    return {p.dbias ? p.dbias + batch * s.batch + head * s.head : nullptr, s.row, s.col};
  }
  __device__ __forceinline__ bool wanted() const { return dbias != nullptr; }
  // Whether backward CTAs of different (batch, kv head) add into the same elements.
  __device__ static bool shared_by_ctas(const BwdParams& p) {
    return (p.dbias_strides.batch == 0 && p.batch > 1) || (p.dbias_strides.head == 0 && p.kv_heads > 1);
  }
  // Keys in aligned fours of one row: unit key strides, rows and the base in 16-byte units, and an
  // S of whole fours (so a four is all in or all out).
  __device__ __forceinline__ bool in_fours(int seqlen_k) const {
    return col == 1 && row % 4 == 0 && reinterpret_cast<uintptr_t>(dbias) % 16 == 0 && seqlen_k % 4 == 0;
  }
  // d loss / d logit of (q, k), added: broadcast axes sum over the elements that share them.
  __device__ __forceinline__ void add(int q, int k, float value) const {
    atomicAdd(dbias + q * row + k * col, value);
  }
  // Those of keys k, k + 1 (k even) of query q, nothing where both are 0 (masked); one request
  // where dbias's keys are adjacent (its other strides are then multiples of its even rows, so
  // the pair is 8-byte aligned).
  __device__ __forceinline__ void add_pair(int q, int k, float value0, float value1) const {
    if (value0 == 0.f && value1 == 0.f) return;
    if (col == 1 && row % 2 == 0) {
      ptx::red_add_f32x2(dbias + q * row + k, value0, value1);
    } else {
      add(q, k, value0);
      add(q, k + 1, value1);
    }
  }
};

}  // namespace jax_flash
