// The one switch from (element type, head dim, architecture) to a kernel instantiation.
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"
#include "decode/params.h"

namespace jax_flash {

enum class DType { kFloat16, kBFloat16 };

// Head dims with kernels; other sizes are padded up to the next one by the Python layer.
constexpr bool fwd_supports_head_dim(int d) {
  return d == 32 || d == 64 || d == 96 || d == 128 || d == 192 || d == 256;
}
constexpr bool bwd_supports_head_dim(int d) { return d == 32 || d == 64 || d == 96 || d == 128 || d == 256; }
// Head dims of the Hopper kernels; the others run the sm80 kernels on Hopper too.
constexpr bool fwd_sm90_supports_head_dim(int d) { return d == 64 || d == 128 || d == 192 || d == 256; }
// The sm90 backward's head dims: 64, 128 and 256 (bwd_wide_kernel.cuh), every variant (with a bias
// only where its tiles copy by TMA and fit or, at d = 256, in pairs of keys: dispatch.cu).
constexpr bool bwd_sm90_supports_head_dim(int d) { return d == 64 || d == 128 || d == 256; }

// Which kernel family a call may use: the fastest one for the device, or only the mma.sync
// (sm80) kernels, which run on every GPU from sm_80 on (to test them on Hopper).
enum class KernelFamily { kBest = 0, kSm80 = 80 };

// The launch status. Callers check the head dim first (cudaErrorInvalidValue otherwise).
cudaError_t run_fwd(DType dtype, const FwdParams& p, KernelFamily family, cudaStream_t stream);
cudaError_t run_bwd(DType dtype, const BwdParams& p, KernelFamily family, cudaStream_t stream);
// The split-KV decode kernels (mma.sync, every GPU from sm_80 on), at every forward head dim.
cudaError_t run_decode(DType dtype, const DecodeParams& p, cudaStream_t stream);

// Declarations of the instantiations in cuda/generated/ (one .cu each), a kernel variant
// (params.h) each.
template <typename T, int kHeadDim, Variant kVariant>
cudaError_t run_fwd_sm80(const FwdParams& p, cudaStream_t stream);
template <typename T, int kHeadDim, Variant kVariant>
cudaError_t run_bwd_sm80(const BwdParams& p, cudaStream_t stream);
template <typename T, int kHeadDim, Variant kVariant>
cudaError_t run_fwd_sm90(const FwdParams& p, cudaStream_t stream);
template <typename T, int kHeadDim, Variant kVariant>
cudaError_t run_bwd_sm90(const BwdParams& p, cudaStream_t stream);
template <typename T, int kHeadDim, Variant kVariant>
cudaError_t run_decode(const DecodeParams& p, cudaStream_t stream);

}  // namespace jax_flash
