// Thin wrappers over the PTX instructions the mma.sync kernels use: cp.async, ldmatrix, mma.sync.
// Each names the instruction it emits; none does more than that instruction, but for the Turing
// lowering (Isa::kSm75) of the two that sm_75 lacks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <type_traits>

namespace jax_flash {

// The instructions a family of mma.sync kernels is written in: sm_80's (mma.sync m16n8k16,
// cp.async; fp16 and bf16), or Turing's (sm_75: m16n8k8, fp16 only, and plain loads and stores
// in place of cp.async). The Turing family also compiles for Hopper, where its tests run it with
// these same instructions.
enum class Isa { kSm80, kSm75 };

}  // namespace jax_flash

// Targets below sm_80 have no cp.async and no m16n8k16: the sm80 family compiled for one (only in
// a build with no sm_80+ target, CMakeLists.txt) never runs there, and its wrappers trap.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define JAX_FLASH_BELOW_SM80 1
#endif

namespace jax_flash::ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// cp.async.cg 16 bytes global -> shared; when !valid the 16 bytes are zero-filled (src-size 0).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
#if defined(JAX_FLASH_BELOW_SM80)
  __trap();
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
#endif
}
// cp.async.ca 4 bytes global -> shared, zero-filled when !valid (row statistics of a tile).
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
#if defined(JAX_FLASH_BELOW_SM80)
  __trap();
#else
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 4 : 0));
#endif
}
// The line holding p into this SM's L1, ahead of loads that would otherwise wait on L2.
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p)); }
// Below sm_80 no copy can be in flight (there is no cp.async): the commit and the wait are no-ops
// there, so that the Turing family's kernels keep the sm80 family's pipeline code.
__device__ __forceinline__ void cp_async_commit() {
#if !defined(JAX_FLASH_BELOW_SM80)
  asm volatile("cp.async.commit_group;\n");
#endif
}
// Wait until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if !defined(JAX_FLASH_BELOW_SM80)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// ldmatrix.x4: four 8x8 b16 matrices; lane l gives the row address of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// Two 8 x 8 matrices, transposed: lanes 0-15 give the row addresses.
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t& r0, uint32_t& r1, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// mma.sync m16n8k8 (sm_75), fp16 in, fp32 accumulate: c += a * b. A row-major (2 regs: rows g and
// g + 8 of k 2t, 2t + 1), B col-major (1 reg).
__device__ __forceinline__ void mma_1688_f16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t b) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(b));
}

// mma.sync m16n8k16, fp32 accumulate: c += a * b. A row-major (4 regs), B col-major (2 regs).
// Isa::kSm75: two m16n8k8, one per k half; their fragments are m16n8k16's halves (a[0..1] and b0
// hold k 0-7, a[2..3] and b1 k 8-15), so callers keep one layout for both.
template <typename T, Isa kIsa = Isa::kSm80>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kIsa == Isa::kSm75) {
    static_assert(std::is_same_v<T, __half>, "Turing's tensor cores take fp16, not bf16");
    mma_1688_f16(c, a[0], a[1], b0);
    mma_1688_f16(c, a[2], a[3], b1);
  } else {
#if defined(JAX_FLASH_BELOW_SM80)
    __trap();
#else
    if constexpr (std::is_same_v<T, __half>) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};\n"
          : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
          "{%8,%9}, {%0,%1,%2,%3};\n"
          : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
#endif
  }
}

// Two floats -> one register of two 16-bit values (low half = first).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t v);
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t v) {
  return __half22float2(*reinterpret_cast<__half2*>(&v));
}
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t v) {
  // A bf16 is the upper half of its float: one shift and one mask (the intrinsic took two byte
  // permutes and two multiplies a pair in the sm90 backward).
  return float2{__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u)};
}

// The accumulators of two adjacent n8 tiles (mma C layout) as the A fragment of one k16 step:
// the C and A layouts of m16n8k16 agree thread for thread, so nothing moves between lanes.
template <typename T>
__device__ __forceinline__ void accumulators_to_a(uint32_t (&a)[4], const float (&lo)[4],
                                                  const float (&hi)[4]) {
  a[0] = pack2<T>(lo[0], lo[1]);
  a[1] = pack2<T>(lo[2], lo[3]);
  a[2] = pack2<T>(hi[0], hi[1]);
  a[3] = pack2<T>(hi[2], hi[3]);
}

// One butterfly step between lanes `mask` apart: of each pair (lo, hi), the lane with `set`
// gives lo and takes its partner's hi in its place, the partner gives hi and takes lo. (Selects,
// not a computed index into an array, which would put the array in local memory.)
__device__ __forceinline__ void butterfly_swap(uint32_t& lo, uint32_t& hi, bool set, int mask) {
  const uint32_t got = __shfl_xor_sync(0xffffffff, set ? lo : hi, mask);
  lo = set ? got : lo;
  hi = set ? hi : got;
}

// Four lanes `stride` apart (the index-th of them: index = (lane / stride) % 4) each hold a row of a
// 4 x 4 matrix of 32-bit values in a; afterwards lane `index` holds its column (a[i] = what lane i
// held in a[index]): the off-diagonal 2 x 2 blocks swap (lane ^ 2 stride), then each 2 x 2 block
// is transposed (lane ^ stride). Every lane of the warp must take part.
__device__ __forceinline__ void transpose_4x4(uint32_t (&a)[4], int index, int stride) {
  const bool upper = index & 2, odd = index & 1;
  butterfly_swap(a[0], a[2], upper, 2 * stride);
  butterfly_swap(a[1], a[3], upper, 2 * stride);
  butterfly_swap(a[0], a[1], odd, stride);
  butterfly_swap(a[2], a[3], odd, stride);
}
// The four lanes of a quad (lanes 4i..4i+3), quad_lane = lane % 4.
__device__ __forceinline__ void quad_transpose(uint32_t (&a)[4], int quad_lane) { transpose_4x4(a, quad_lane, 1); }

// threadIdx.x, read where it is used: the compiler cannot keep it in a register from an earlier read.
__device__ __forceinline__ uint32_t thread_index() {
  uint32_t t;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
  return t;
}

__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t value) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(value));
}
__device__ __forceinline__ void st_shared_b16(uint32_t addr, uint16_t value) {
  asm volatile("st.shared.b16 [%0], %1;\n" ::"r"(addr), "h"(value));
}
__device__ __forceinline__ void st_shared_f32x4(uint32_t addr, float a, float b, float c, float d) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d));
}
__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d));
}
__device__ __forceinline__ uint32_t ld_shared_b32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
// 16 bytes through the read-only path, where the caller puts it (volatile: not moved across the
// mma.sync around it, so that the registers it fills are live only as long as the caller says).
__device__ __forceinline__ uint4 ld_global_nc_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}

// 16 bytes global -> shared, zero-filled when !valid: cp.async (the caller commits and waits),
// or with Isa::kSm75 a load into registers and a store, done when it returns.
template <Isa kIsa>
__device__ __forceinline__ void copy_16(uint32_t dst, const void* src, bool valid) {
  if constexpr (kIsa == Isa::kSm75) {
    uint4 v = make_uint4(0, 0, 0, 0);
    if (valid) v = __ldg(static_cast<const uint4*>(src));
    st_shared_v4(dst, v.x, v.y, v.z, v.w);
  } else {
    cp_async_16(dst, src, valid);
  }
}
// The same for 4 bytes.
template <Isa kIsa>
__device__ __forceinline__ void copy_4(uint32_t dst, const void* src, bool valid) {
  if constexpr (kIsa == Isa::kSm75) {
    const uint32_t v = valid ? __ldg(static_cast<const unsigned int*>(src)) : 0u;
    st_shared_b32(dst, v);
  } else {
    cp_async_4(dst, src, valid);
  }
}

// dst[0..1] += (a, b) in global memory, without a return value: one red.v2 on sm_90, two red
// elsewhere. dst must be 8-byte aligned.
__device__ __forceinline__ void red_add_f32x2(float* dst, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
#endif
}

// A counter other CTAs wait on: read with acquire, add with release (device scope), so that the
// writes before the add are visible to whoever reads the new value.
__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_add(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ float exp2(float x) { return exp2f(x); }  // ex2.approx with fast math

// 2^x without the MUFU, for a kernel whose MUFU is its bound (FlashAttention-4's balance): x =
// j + f with j = round(x) (the float-add trick: 1.5 * 2^23 + x holds j in its low bits), 2^f by
// a cubic (relative error 1.0e-4 on [-0.5, 0.5], 5 times below an fp16 rounding), 2^j added to
// its exponent bits. x is clamped to [-127, 127]: at -127 (-inf and NaN included) the result
// is exactly +0 (1.0's exponent bits less 127), as a masked logit's must be; just above it, a
// denormal that the kernels' FTZ arithmetic reads as 0 (ex2.approx.ftz gives 0 there too);
// at the top, at most 2^127.4.
__device__ __forceinline__ float exp2_on_fma(float x) {
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23
  x = fminf(fmaxf(x, -127.f), 127.f);
  const float r = x + kRound;
  const float f = x - (r - kRound);
  const float p = fmaf(fmaf(fmaf(0.05500905f, f, 0.24221098f), f, 0.69328291f), f, 1.f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(r) << 23));
}

// One MUFU op (sm_75+), relative error about 2^-11 (the soft cap scales it by the cap).
__device__ __forceinline__ float tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Reductions over the 32 lanes of a warp; every lane gets the result.
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int mask = 16; mask > 0; mask /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, mask));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int mask = 16; mask > 0; mask /= 2) x += __shfl_xor_sync(0xffffffff, x, mask);
  return x;
}

// Programmatic dependent launch (sm_90): a kernel launched with the programmatic-serialization
// attribute may start once every CTA of the kernel before it has called allow_dependent_grids
// (or exited), and must call wait_for_prior_grids before it reads what that kernel wrote. Both
// are no-ops on older GPUs, where the next kernel starts after the previous one anyway.
__device__ __forceinline__ void allow_dependent_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

}  // namespace jax_flash::ptx
