// The one switch from (element type, head dim, architecture) to a kernel instantiation.
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"
#include "decode/params.h"

namespace jax_flash {

// The queries' and outputs' types, and for a decode cache also fp8 (float8_e4m3fn, float8_e5m2).
enum class DType { kFloat16, kBFloat16, kFp8E4m3, kFp8E5m2 };

// Head dims with kernels (the kernel contract, cuda/generated/contract.h); other sizes are padded
// up to the next one by the Python layer. The Hopper kernels' head dims are a subset: the others
// run the sm80 kernels on Hopper too. Above 256 only the forward runs (fwd_sm90_wide on Hopper,
// fwd_sm80_wide elsewhere: no bias or mask). Unequal query and value head dims (fwd_sm90_unequal
// and bwd_sm90_unequal pairs): the Hopper kernels only, without a bias or mask; the Python layer
// pads other pairs to equal dims.
// The sm90 backward takes every variant at bwd_sm90's dims (with a bias only where its tiles copy
// by TMA and fit or, at d = 256, in pairs of keys: dispatch.cu), and all but the bias one at
// bwd_sm90_no_bias's (192; with a bias the Python layer pads it to 256).
using contract::bwd_sm90_no_bias_supports_head_dim;
using contract::bwd_sm90_supports_head_dim;
using contract::bwd_sm90_unequal_supports_head_dims;
using contract::bwd_supports_head_dim;
using contract::fwd_sm90_supports_head_dim;
using contract::fwd_sm90_unequal_supports_head_dims;
using contract::fwd_sm90_wide_supports_head_dim;
using contract::fwd_supports_head_dim;

// The kernel family of the Python layer's plan (jax_flash/_plan.py's Family, the custom calls'
// `family` attribute), which the dispatch follows: the Turing kernels (fp16 at fwd_sm75's head
// dims, no bias; on sm_75, or forced on Hopper to test them), the mma.sync ones (every GPU from
// sm_80 on), or Hopper's, with the mma.sync kernels where Hopper has none (head dims 32 and 96)
// and for a bias or mask whose layout is not in pairs (bias_in_pairs).
enum class KernelFamily { kTuring = 75, kMmaSync = 80, kHopper = 90 };
// Why this module and the current GPU cannot run `family`, or nullptr where they can.
const char* family_unavailable(KernelFamily family);

// The plan's tiles (contract.h): the tile shapes that depend on the call, which jax_flash/_plan.py
// picks. Only the Hopper forward and backward and the mma.sync backward have more than kUsual.
using contract::Tiles;

// The launch status. Callers check the head dim first; cudaErrorInvalidValue where the plan's
// family, head dims and tiles name no kernel for the call.
cudaError_t run_fwd(DType dtype, const FwdParams& p, KernelFamily family, Tiles tiles, cudaStream_t stream);
cudaError_t run_bwd(DType dtype, const BwdParams& p, KernelFamily family, Tiles tiles, cudaStream_t stream);
// The split-KV decode kernels (mma.sync, every GPU from sm_80 on): q in `dtype` (16-bit), the
// cache's K and V in `kv_dtype`, the same at every decode head dim or fp8 at decode_fp8's
// (cudaErrorInvalidValue otherwise); over a ragged batch's work list where p has one (run_ragged).
cudaError_t run_decode(DType dtype, DType kv_dtype, const DecodeParams& p, cudaStream_t stream);

// Bytes of shared memory a block of the mma.sync backward takes at this head dim with its smallest
// tiles (the compact ones; 0: no kernel). The Python dispatch weighs it against
// the GPU's limit (sm_86 and sm_89 allow 99 KB a block, sm_80 163 KB).
int sm80_backward_smem_bytes(int head_dim);
// The same with its usual tiles (Tiles::kUsual; 0: no kernel), which _plan.py weighs likewise.
int sm80_backward_usual_smem_bytes(int head_dim);
// The same for the mma.sync forward: at most 96 KB at every head dim up to 256, the largest over
// its variants; above 256 (the wide kernel) 85-133 KB. 0: no kernel.
int sm80_forward_smem_bytes(int head_dim);
int sm80_wide_forward_smem_bytes(int head_dim);
// The Turing family's, forward and backward (0: no kernel); all within sm_75's 64 KB.
int sm75_forward_smem_bytes(int head_dim);
int sm75_backward_smem_bytes(int head_dim);

// Declarations of the instantiations in cuda/generated/ (one .cu each), a kernel variant
// (params.h) each.
template <typename T, int kHeadDim, Variant kVariant>
cudaError_t run_fwd_sm80(const FwdParams& p, cudaStream_t stream);
template <typename T, int kHeadDim, Variant kVariant>
cudaError_t run_bwd_sm80(const BwdParams& p, Tiles tiles, cudaStream_t stream);
template <typename T, int kHeadDim, Variant kVariant>
cudaError_t run_fwd_sm90(const FwdParams& p, Tiles tiles, cudaStream_t stream);
template <typename T, int kHeadDim, Variant kVariant>
cudaError_t run_bwd_sm90(const BwdParams& p, Tiles tiles, cudaStream_t stream);
template <typename T, int kHeadDim, Variant kVariant>
cudaError_t run_wide_fwd_sm90(const FwdParams& p, cudaStream_t stream);
template <typename T, int kHeadDim, Variant kVariant>
cudaError_t run_wide_fwd_sm80(const FwdParams& p, cudaStream_t stream);
template <typename T, int kHeadDim, int kValueDim, Variant kVariant>
cudaError_t run_unequal_fwd_sm90(const FwdParams& p, cudaStream_t stream);
template <typename T, int kHeadDim, int kValueDim, Variant kVariant>
cudaError_t run_unequal_bwd_sm90(const BwdParams& p, cudaStream_t stream);
template <typename T, typename KvT, int kHeadDim, Variant kVariant>
cudaError_t run_decode(const DecodeParams& p, cudaStream_t stream);
template <typename T, typename KvT, int kHeadDim, Variant kVariant>
cudaError_t run_ragged(const DecodeParams& p, cudaStream_t stream);
template <typename T, int kHeadDim, Variant kVariant>
cudaError_t run_fwd_sm75(const FwdParams& p, cudaStream_t stream);
template <typename T, int kHeadDim, Variant kVariant>
cudaError_t run_bwd_sm75(const BwdParams& p, cudaStream_t stream);

}  // namespace jax_flash
