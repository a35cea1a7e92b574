// fp8 caches in the decode kernels: two fp8 values of a 32-bit register widened to the queries'
// 16-bit type, as the B operand of an mma.sync takes them.
//
// ldmatrix moves 16-bit elements; on 8-bit data each one carries two neighbours along the row, so
// the fragments land permuted (split_kernel.cuh says how each product absorbs it). Widening is
// bit arithmetic, the same on every GPU from sm_80 on (sm_80 has no fp8 conversion
// instruction): the fp8 byte moved into the 16-bit type's exponent and mantissa fields, then one
// multiply by 2^(bias difference), exact (subnormal fp8 values become normal ones). e5m2 is
// float16 with 8 fewer mantissa bits, so for float16 queries it needs no multiply. An fp8 NaN
// (e4m3fn's 0x7f, e5m2's exponent 31) widens to a large finite value, except e5m2 into float16
// (exact, infinities too): a quantized cache holds none (jax_flash.quantize_kv clips).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

namespace jax_flash::decode {

template <typename KvT>
inline constexpr bool kIsFp8 = std::is_same_v<KvT, __nv_fp8_e4m3> || std::is_same_v<KvT, __nv_fp8_e5m2>;

// Bytes i and j of x as the high bytes of two 16-bit lanes: [0, x.i, 0, x.j] (low to high).
template <int kI, int kJ>
__device__ __forceinline__ uint32_t high_bytes(uint32_t x) {
  uint32_t y;
  constexpr uint32_t kSelect = 4u | (kI << 4) | (4u << 8) | (kJ << 12);  // selector 4: a zero byte
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(y) : "r"(x), "n"(kSelect));
  return y;
}

// Two fp8 values of KvT, as high_bytes placed them, widened to a T pair (low lane first).
template <typename T, typename KvT>
__device__ __forceinline__ uint32_t widen(uint32_t y) {
  static_assert(kIsFp8<KvT>, "an fp8 cache");
  constexpr bool kE4m3 = std::is_same_v<KvT, __nv_fp8_e4m3>;
  constexpr bool kHalf = std::is_same_v<T, __half>;
  if constexpr (kHalf && !kE4m3) {
    return y;  // e5m2's bits are float16's top byte
  } else {
    // The 7 exponent and mantissa bits under the sign, shifted into T's fields, then the bias
    // difference: e4m3 (bias 7) into float16 (15): >> 1, 2^8; into bfloat16 (127): >> 4, 2^120;
    // e5m2 (15) into bfloat16: >> 3, 2^112.
    constexpr int kShift = kE4m3 ? (kHalf ? 1 : 4) : 3;
    constexpr uint32_t kField = (0x7f00u >> kShift) * 0x10001u;
    constexpr uint32_t kBias = kHalf ? 0x5c005c00u : kE4m3 ? 0x7b807b80u : 0x77807780u;
    const uint32_t bits = ((y >> kShift) & kField) | (y & 0x80008000u);
    uint32_t out;
    if constexpr (kHalf) {
      asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(bits), "r"(kBias), "r"(0x80008000u));
    } else {
      asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(bits), "r"(kBias), "r"(0x80008000u));
    }
    return out;
  }
}

// Bytes i and j of x, widened to a T pair.
template <typename T, typename KvT, int kI, int kJ>
__device__ __forceinline__ uint32_t widen_bytes(uint32_t x) {
  return widen<T, KvT>(high_bytes<kI, kJ>(x));
}

}  // namespace jax_flash::decode
