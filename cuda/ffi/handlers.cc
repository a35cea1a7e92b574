// XLA FFI handlers: check the buffers XLA hands over, fill the kernel parameters, launch on XLA's
// stream. Launch errors come back as ffi::Error, never as a crash. The handlers neither allocate
// nor synchronise (scratch memory is an extra output of the call), so they are declared
// compatible with XLA command buffers (CUDA graphs).
#include "ffi/handlers.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/params.h"
#include "generated/ffi_operands.h"
#include "launch/dispatch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_flash {
namespace {

std::string shape_string(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Fills the shape fields of `p` from q [B, T, N, H] and k/v [B, S, K, H], checking what the
// Python layer guarantees, so that a misuse of the raw target fails cleanly.
// `key_batch`: the keys' first axis when it is not the batch (a paged pool), else -1.
// `value_dim_may_differ`: v's head dim may differ from k's (the forward; it checks the pair).
// The kernels' element type of an FFI dtype.
ffi::Error dtype_of(ffi::DataType type, DType* dtype) {
  switch (type) {
    case ffi::DataType::F16: *dtype = DType::kFloat16; return ffi::Error::Success();
    case ffi::DataType::BF16: *dtype = DType::kBFloat16; return ffi::Error::Success();
    default: return ffi::Error::InvalidArgument("jax_flash: kernels take float16 or bfloat16");
  }
}

// A decode cache's element type: q's, or fp8.
ffi::Error kv_dtype_of(ffi::DataType type, DType* dtype) {
  switch (type) {
    case ffi::DataType::F8E4M3FN: *dtype = DType::kFp8E4m3; return ffi::Error::Success();
    case ffi::DataType::F8E5M2: *dtype = DType::kFp8E5m2; return ffi::Error::Success();
    default: return dtype_of(type, dtype);
  }
}

// `kv_dtype`: where given (decode), k and v may have a dtype of their own, written there.
ffi::Error fill_shapes(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, DType* dtype,
                       FwdParams* p, int64_t key_batch = -1, bool value_dim_may_differ = false,
                       DType* kv_dtype = nullptr) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return ffi::Error::InvalidArgument("jax_flash: q, k, v must be rank 4 (BTNH), got " +
                                       shape_string(qd) + ", " + shape_string(kd) + ", " +
                                       shape_string(vd));
  }
  if (v.element_type() != k.element_type() || (kv_dtype == nullptr && k.element_type() != q.element_type())) {
    return ffi::Error::InvalidArgument(kv_dtype ? "jax_flash: k and v must share one dtype"
                                                : "jax_flash: q, k, v must share one dtype");
  }
  if (ffi::Error e = dtype_of(q.element_type(), dtype); e.failure()) return e;
  if (kv_dtype != nullptr) {
    if (ffi::Error e = kv_dtype_of(k.element_type(), kv_dtype); e.failure()) return e;
  }
  for (size_t i = 0; i < 4; ++i) {
    if (kd[i] != vd[i] && !(i == 3 && value_dim_may_differ)) {
      return ffi::Error::InvalidArgument("jax_flash: k and v shapes differ");
    }
  }
  if (kd[0] != (key_batch < 0 ? qd[0] : key_batch) || kd[3] != qd[3] || kd[2] == 0 || qd[2] % kd[2] != 0) {
    return ffi::Error::InvalidArgument("jax_flash: incompatible q " + shape_string(qd) +
                                       " and k " + shape_string(kd));
  }
  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->batch = static_cast<int>(qd[0]);
  p->seqlen_q = static_cast<int>(qd[1]);
  p->heads = static_cast<int>(qd[2]);
  p->head_dim = static_cast<int>(qd[3]);
  p->value_dim = static_cast<int>(vd[3]);
  p->seqlen_k = static_cast<int>(kd[1]);
  p->kv_heads = static_cast<int>(kd[2]);
  return ffi::Error::Success();
}

ffi::Error fill_attributes(float scale, float softcap, int32_t window_left, int32_t window_right,
                           int32_t diagonal_by_lengths, FwdParams* p) {
  if (!(scale > 0.f) || !(softcap >= 0.f)) {
    return ffi::Error::InvalidArgument("jax_flash: scale must be > 0 and softcap >= 0 (0: none), got " +
                                       std::to_string(scale) + ", " + std::to_string(softcap));
  }
  p->scale = scale;
  p->softcap = softcap;
  p->window_left = window_left;
  p->window_right = window_right;
  p->diagonal_by_lengths = diagonal_by_lengths != 0;
  return ffi::Error::Success();
}

template <typename Buffer>
bool has_shape(const Buffer& b, std::initializer_list<int64_t> shape) {
  const auto d = b.dimensions();
  if (d.size() != shape.size()) return false;
  size_t i = 0;
  for (int64_t n : shape) if (d[i++] != n) return false;
  return true;
}

// The optional sequence lengths (an empty buffer: none), seqlens [B, 2] int32.
ffi::Error fill_seqlens(ffi::Buffer<ffi::S32> seqlens, FwdParams* p) {
  if (seqlens.element_count() > 0) {
    if (!has_shape(seqlens, {p->batch, 2})) {
      return ffi::Error::InvalidArgument("jax_flash: seqlens must be [B, 2], got " + shape_string(seqlens.dimensions()));
    }
    p->seqlens = seqlens.typed_data();
  }
  return ffi::Error::Success();
}

// The optional masks (an empty buffer: none): seqlens as above; segment ids q [B, T] and
// kv [B, S] int32 with their chunk summaries [B, ceil(T / 64), 6] and [B, ceil(S / 64), 6].
ffi::Error fill_masks(ffi::Buffer<ffi::S32> seqlens, ffi::Buffer<ffi::S32> q_segments,
                      ffi::Buffer<ffi::S32> kv_segments, ffi::Buffer<ffi::S32> q_chunks,
                      ffi::Buffer<ffi::S32> kv_chunks, FwdParams* p) {
  if (ffi::Error e = fill_seqlens(seqlens, p); e.failure()) return e;
  if (q_segments.element_count() > 0 || kv_segments.element_count() > 0) {
    const int64_t q_chunk_count = (p->seqlen_q + kMaskChunk - 1) / kMaskChunk;
    const int64_t kv_chunk_count = (p->seqlen_k + kMaskChunk - 1) / kMaskChunk;
    if (!has_shape(q_segments, {p->batch, p->seqlen_q}) || !has_shape(kv_segments, {p->batch, p->seqlen_k}) ||
        !has_shape(q_chunks, {p->batch, q_chunk_count, kMaskChunkFields}) ||
        !has_shape(kv_chunks, {p->batch, kv_chunk_count, kMaskChunkFields})) {
      const std::string fields = std::to_string(kMaskChunkFields);
      return ffi::Error::InvalidArgument("jax_flash: segment ids must be [B, T] and [B, S] with chunks [B, T / " +
                                         std::to_string(kMaskChunk) + ", " + fields + "] and [B, S / " +
                                         std::to_string(kMaskChunk) + ", " + fields + "]");
    }
    p->q_segments = q_segments.typed_data();
    p->kv_segments = kv_segments.typed_data();
    p->q_chunks = reinterpret_cast<const MaskChunk*>(q_chunks.typed_data());
    p->kv_chunks = reinterpret_cast<const MaskChunk*>(kv_chunks.typed_data());
  }
  return ffi::Error::Success();
}

// The element strides of `name`, an array broadcastable to [B, N, T, S] (0 along its axes of
// size 1); an error unless it is rank 4 with each axis 1 or the full size.
ffi::Error broadcast_strides(ffi::AnyBuffer::Dimensions d, const char* name, const FwdParams& p,
                             Strides4* strides) {
  const auto invalid = [&] {
    return ffi::Error::InvalidArgument(std::string("jax_flash: ") + name +
                                       " must broadcast to [B, N, T, S] (each axis 1 or full), got " + shape_string(d));
  };
  const int64_t full[4] = {p.batch, p.heads, p.seqlen_q, p.seqlen_k};
  if (d.size() != 4) return invalid();
  int64_t s[4], stride = 1;
  for (int i = 3; i >= 0; --i) {
    if (d[i] != 1 && d[i] != full[i]) return invalid();
    s[i] = d[i] == 1 ? 0 : stride;
    stride *= d[i];
  }
  *strides = {s[0], s[1], s[2], s[3]};
  return ffi::Error::Success();
}

// The optional additive bias (float32 or q's dtype) and boolean mask (an empty buffer: none).
ffi::Error fill_bias(ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::DataType dtype, FwdParams* p) {
  if (bias.element_count() > 0) {
    if (bias.element_type() != ffi::DataType::F32 && bias.element_type() != dtype) {
      return ffi::Error::InvalidArgument("jax_flash: bias must be float32 or the dtype of q");
    }
    if (ffi::Error e = broadcast_strides(bias.dimensions(), "bias", *p, &p->bias_strides); e.failure()) return e;
    p->bias = bias.untyped_data();
    p->bias_fp32 = bias.element_type() == ffi::DataType::F32;
  }
  if (mask.element_count() > 0) {
    if (mask.element_type() != ffi::DataType::PRED) {
      return ffi::Error::InvalidArgument("jax_flash: mask must be boolean");
    }
    if (ffi::Error e = broadcast_strides(mask.dimensions(), "mask", *p, &p->mask_strides); e.failure()) return e;
    p->mask = static_cast<const bool*>(mask.untyped_data());
  }
  return ffi::Error::Success();
}

// The plan's family (jax_flash/_plan.py), refused where this module or GPU cannot run it.
ffi::Error check_kernel_family(int32_t family) {
  if (family != int32_t(KernelFamily::kTuring) && family != int32_t(KernelFamily::kMmaSync) &&
      family != int32_t(KernelFamily::kHopper)) {
    return ffi::Error::InvalidArgument("jax_flash: family must be 75 (Turing), 80 (mma.sync) or 90 (Hopper), got " +
                                       std::to_string(family));
  }
  if (const char* why = family_unavailable(KernelFamily(family))) {
    return ffi::Error::InvalidArgument(std::string("jax_flash: ") + why);
  }
  return ffi::Error::Success();
}

// The sinks operand: float32 [rows, N] (each batch row's, or a ragged batch's sequence's, query
// heads'), or empty for none. `rows_name` names the rows in the error.
ffi::Error fill_sinks(const ffi::Buffer<ffi::F32>& sinks, int64_t rows, const char* rows_name, FwdParams* p) {
  if (sinks.element_count() == 0) return ffi::Error::Success();
  if (!has_shape(sinks, {rows, p->heads})) {
    return ffi::Error::InvalidArgument(std::string("jax_flash: sinks must be [") + rows_name + ", N] = [" +
                                       std::to_string(rows) + ", " + std::to_string(p->heads) + "] or empty, got " +
                                       shape_string(sinks.dimensions()));
  }
  p->sinks = sinks.typed_data();
  return ffi::Error::Success();
}

// The split-KV kernels' fp8 scales: float32 [rows, K] each over an fp8 cache, else [rows, 0].
ffi::Error fill_fp8_scales(const ffi::Buffer<ffi::F32>& key_scale, const ffi::Buffer<ffi::F32>& value_scale,
                           int64_t rows, const char* rows_name, bool fp8, DecodeParams* p) {
  for (const auto* scale : {&key_scale, &value_scale}) {
    if (!has_shape(*scale, {rows, fp8 ? p->kv_heads : 0})) {
      return ffi::Error::InvalidArgument(std::string("jax_flash: key_scale and value_scale must be [") + rows_name +
                                         ", K] over an fp8 cache, else [" + rows_name + ", 0], got " +
                                         shape_string(scale->dimensions()));
    }
  }
  if (fp8) {
    p->key_scale = key_scale.typed_data();
    p->value_scale = value_scale.typed_data();
  }
  return ffi::Error::Success();
}

ffi::Error launch_status(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    return ffi::Error::Internal(std::string("jax_flash: ") + what + " launch failed: " +
                                cudaGetErrorString(status));
  }
  return ffi::Error::Success();
}

// The plan's family and tiles (jax_flash/_plan.py): checked here, then the launch's status, which
// names the plan where it had no kernel for the call (cudaErrorInvalidValue) or tiles beyond
// this GPU's shared memory (cudaErrorInvalidConfiguration).
template <typename Run>
ffi::Error launch_plan(int32_t family, int32_t tiles, const char* what, Run&& run) {
  if (ffi::Error e = check_kernel_family(family); e.failure()) return e;
  if (tiles < 0 || tiles >= contract::kTilesCount) {
    return ffi::Error::InvalidArgument("jax_flash: tiles must be one of contract.h's Tiles (0-" +
                                       std::to_string(contract::kTilesCount - 1) + "), got " + std::to_string(tiles));
  }
  const cudaError_t status = run(KernelFamily(family), Tiles(tiles));
  if (status == cudaErrorInvalidValue || status == cudaErrorInvalidConfiguration) {
    return ffi::Error::InvalidArgument(std::string("jax_flash: the plan (family ") + std::to_string(family) +
                                       ", tiles " + std::to_string(tiles) + ") or its operands cannot run this " +
                                       what + ": " + cudaGetErrorString(status));
  }
  return launch_status(status, what);
}

ffi::Error fwd_impl(JAX_FLASH_FWD_PARAMS) {
  FwdParams p{};
  DType dtype;
  if (ffi::Error e = fill_shapes(q, k, v, &dtype, &p, -1, /*value_dim_may_differ=*/true); e.failure()) return e;
  if (ffi::Error e = fill_attributes(scale, softcap, window_left, window_right, diagonal_by_lengths, &p); e.failure()) return e;
  if (p.value_dim != p.head_dim ? !fwd_sm90_unequal_supports_head_dims(p.head_dim, p.value_dim)
                                : !fwd_supports_head_dim(p.head_dim) && !fwd_sm90_wide_supports_head_dim(p.head_dim)) {
    return ffi::Error::InvalidArgument("jax_flash: no forward kernel for head dims " + std::to_string(p.head_dim) +
                                       " (query, key) and " + std::to_string(p.value_dim) + " (value)");
  }
  if (ffi::Error e = fill_masks(seqlens, q_segments, kv_segments, q_chunks, kv_chunks, &p); e.failure()) return e;
  if (ffi::Error e = fill_bias(bias, mask, q.element_type(), &p); e.failure()) return e;
  if (ffi::Error e = fill_sinks(sinks, p.batch, "B", &p); e.failure()) return e;
  p.o = o->untyped_data();
  p.lse = lse->typed_data();
  const int64_t scratch_size = FwdScratch::size_for(p.batch, p.seqlen_q, p.heads);
  if (int64_t(tile_scratch->element_count()) != scratch_size) {
    return ffi::Error::InvalidArgument("jax_flash: the tile scratch must have " + std::to_string(scratch_size) +
                                       " elements, got " + shape_string(tile_scratch->dimensions()));
  }
  p.tile_scratch = tile_scratch->typed_data();
  p.tile_scratch_size = scratch_size;
  return launch_plan(family, tiles, "forward",
                     [&](KernelFamily f, Tiles t) { return run_fwd(dtype, p, f, t, stream); });
}

ffi::Error bwd_impl(JAX_FLASH_BWD_PARAMS) {
  BwdParams p{};
  DType dtype;
  if (ffi::Error e = fill_shapes(q, k, v, &dtype, &p, -1, /*value_dim_may_differ=*/true); e.failure()) return e;
  if (ffi::Error e = fill_attributes(scale, softcap, window_left, window_right, diagonal_by_lengths, &p); e.failure()) return e;
  const bool equal_dims_ok = bwd_supports_head_dim(p.head_dim) || bwd_sm90_no_bias_supports_head_dim(p.head_dim);
  if (p.value_dim != p.head_dim ? !bwd_sm90_unequal_supports_head_dims(p.head_dim, p.value_dim) : !equal_dims_ok) {
    return ffi::Error::InvalidArgument("jax_flash: no backward kernel for head dims " + std::to_string(p.head_dim) +
                                       " (query, key) and " + std::to_string(p.value_dim) + " (value)");
  }
  if (ffi::Error e = fill_masks(seqlens, q_segments, kv_segments, q_chunks, kv_chunks, &p); e.failure()) return e;
  if (ffi::Error e = fill_bias(bias, mask, q.element_type(), &p); e.failure()) return e;
  p.o = const_cast<void*>(o.untyped_data());
  p.lse = const_cast<float*>(lse.typed_data());
  p.dout = dout.untyped_data();
  // An empty dlse ([B, N, 0]): the lse was not used, and its cotangent is zero.
  const auto dd = dlse.dimensions();
  if (dlse.element_count() == 0) {
    p.dlse = nullptr;
  } else if (dd.size() != 3 || dd[0] != p.batch || dd[1] != p.heads || dd[2] != p.seqlen_q) {
    return ffi::Error::InvalidArgument("jax_flash: dlse must be [B, N, T] or empty, got " + shape_string(dd));
  } else {
    p.dlse = dlse.typed_data();
  }
  p.dq = dq->untyped_data();
  p.dk = dk->untyped_data();
  p.dv = dv->untyped_data();
  // The statistics scratch: [B, N, stats_stride], rows padded to whole query blocks.
  const auto sd = delta->dimensions(), ld = lse_log2->dimensions();
  if (sd.size() != 3 || sd[0] != p.batch || sd[1] != p.heads || sd[2] < p.seqlen_q ||
      sd[2] % kStatsRowMultiple != 0 || ld.size() != 3 || ld[0] != sd[0] || ld[1] != sd[1] || ld[2] != sd[2]) {
    return ffi::Error::InvalidArgument("jax_flash: the delta and lse_log2 scratch must be [B, N, T rounded up to " +
                                       std::to_string(kStatsRowMultiple) + "], got " + shape_string(sd));
  }
  p.delta = delta->typed_data();
  p.lse_log2 = lse_log2->typed_data();
  p.stats_stride = static_cast<int>(sd[2]);
  if (dq_accum->element_count() != size_t(p.batch) * p.stats_stride * p.heads * p.head_dim) {
    return ffi::Error::InvalidArgument("jax_flash: the dQ accumulator scratch must be [B, padded T, N, H], got " +
                                       shape_string(dq_accum->dimensions()));
  }
  p.dq_accum = dq_accum->typed_data();
  const auto td = dq_turns->dimensions();
  if (td.size() != 3 || td[0] != sd[0] || td[1] != sd[1] || td[2] != sd[2] / contract::kDqCounterRows) {
    return ffi::Error::InvalidArgument("jax_flash: the dq_turns scratch must be [B, N, padded T / " +
                                       std::to_string(contract::kDqCounterRows) + "], got " +
                                       shape_string(td));
  }
  p.dq_counters = dq_turns->typed_data();
  p.dq_turns = deterministic != 0 ? p.dq_counters : nullptr;
  p.smem_limit = smem_limit;
  if (dbias->element_count() > 0) {
    // An empty dbias: not wanted. Otherwise the kernels add into it: zero it first.
    if (p.bias == nullptr) return ffi::Error::InvalidArgument("jax_flash: dbias needs a bias");
    if (ffi::Error e = broadcast_strides(dbias->dimensions(), "dbias", p, &p.dbias_strides); e.failure()) return e;
    p.dbias = dbias->typed_data();
    if (cudaError_t e = cudaMemsetAsync(p.dbias, 0, dbias->size_bytes(), stream); e != cudaSuccess) {
      return launch_status(e, "dbias zeroing");
    }
  }
  return launch_plan(family, tiles, "backward",
                     [&](KernelFamily f, Tiles t) { return run_bwd(dtype, p, f, t, stream); });
}


// The split-KV kernels' outputs: o and lse, and with several splits the scratch of each split's
// part, float32 [splits, rows of o (B x T x N), H] and [splits, rows of o].
ffi::Error fill_split_outputs(ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                              ffi::Result<ffi::Buffer<ffi::F32>> o_partial, ffi::Result<ffi::Buffer<ffi::F32>> lse_partial,
                              int32_t splits, DecodeParams* p) {
  if (splits < 1 || splits > kMaxDecodeSplits) {
    return ffi::Error::InvalidArgument("jax_flash: splits must be in [1, " + std::to_string(kMaxDecodeSplits) +
                                       "], got " + std::to_string(splits));
  }
  const int64_t rows = int64_t(p->batch) * p->seqlen_q * p->heads;
  if (splits > 1 && (int64_t(o_partial->element_count()) != splits * rows * p->head_dim ||
                     int64_t(lse_partial->element_count()) != splits * rows)) {
    return ffi::Error::InvalidArgument("jax_flash: the split scratch must be [splits, o's rows, H] and [splits, o's "
                                       "rows] (" + std::to_string(rows) + " rows), got " +
                                       shape_string(o_partial->dimensions()) + " and " +
                                       shape_string(lse_partial->dimensions()));
  }
  p->o = o->untyped_data();
  p->lse = lse->typed_data();
  p->splits = splits;
  p->o_partial = o_partial->typed_data();
  p->lse_partial = lse_partial->typed_data();
  return ffi::Error::Success();
}

// Decode: q [B, T, N, H] against a dense cache k, v [B, S, K, H] or, with a page table
// [B, max_pages], a pool of pages [P, page_size, K, H]; the split scratch [splits, B, T, N, H] and
// [splits, B, T, N] float32 (each empty with one split).
ffi::Error decode_impl(JAX_FLASH_DECODE_PARAMS) {
  DecodeParams p{};
  DType dtype, kv_dtype;
  const bool paged = page_table.element_count() > 0;
  const auto qd = q.dimensions(), kd = k.dimensions(), td = page_table.dimensions();
  if (paged) {
    // fill_shapes checks a dense cache; a pool's first two axes are pages and slots instead.
    if (qd.size() != 4 || kd.size() != 4 || td.size() != 2 || td[0] != qd[0] || kd[0] == 0 ||
        kd[1] % kDecodeBlockKeys != 0) {
      return ffi::Error::InvalidArgument("jax_flash: paged decode takes q [B, T, N, H], pages [P, page_size (a multiple of " +
                                         std::to_string(kDecodeBlockKeys) + "), K, H] and a page table [B, max_pages], got " +
                                         shape_string(qd) + ", " + shape_string(kd) + ", " + shape_string(td));
    }
    if (ffi::Error e = fill_shapes(q, k, v, &dtype, &p, /*key_batch=*/kd[0], false, &kv_dtype); e.failure()) return e;
    p.page_table = page_table.typed_data();
    p.page_size = static_cast<int>(kd[1]);
    p.max_pages = static_cast<int>(td[1]);
    p.pool_pages = static_cast<int>(kd[0]);
    p.seqlen_k = p.page_size * p.max_pages;
  } else if (ffi::Error e = fill_shapes(q, k, v, &dtype, &p, -1, false, &kv_dtype); e.failure()) {
    return e;
  }
  const bool fp8 = kv_dtype == DType::kFp8E4m3 || kv_dtype == DType::kFp8E5m2;
  if (kv_dtype != dtype && !fp8) {
    return ffi::Error::InvalidArgument("jax_flash: the decode kernels take k and v in q's dtype or in fp8");
  }
  if (fp8 && !contract::decode_fp8_supports_head_dim(static_cast<int>(qd[3]))) {
    return ffi::Error::InvalidArgument("jax_flash: no fp8 decode kernel for head dim " + std::to_string(qd[3]));
  }
  if (ffi::Error e = fill_fp8_scales(key_scale, value_scale, p.batch, "B", fp8, &p); e.failure()) return e;
  if (ffi::Error e = fill_attributes(scale, softcap, window_left, window_right, diagonal_by_lengths, &p); e.failure()) return e;
  if (!contract::decode_supports_head_dim(p.head_dim)) {
    return ffi::Error::InvalidArgument("jax_flash: no decode kernel for head dim " + std::to_string(p.head_dim));
  }
  if (kv_lengths.element_count() > 0) {
    if (!has_shape(kv_lengths, {p.batch, 1})) {
      return ffi::Error::InvalidArgument("jax_flash: kv_lengths must be [B, 1] or empty, got " +
                                         shape_string(kv_lengths.dimensions()));
    }
    p.kv_lengths = kv_lengths.typed_data();
  }
  if (ffi::Error e = fill_sinks(sinks, p.batch, "B", &p); e.failure()) return e;
  if (ffi::Error e = fill_split_outputs(o, lse, o_partial, lse_partial, splits, &p); e.failure()) return e;
  return launch_status(run_decode(dtype, kv_dtype, p, stream), "decode");
}

// A ragged batch (jax_flash.ragged_paged_attention): q [Q, N, H] holds every sequence's queries,
// the pages [P, page_size, K, H] every sequence's cache; kv_lengths [S], page_table [S, max_pages],
// the work list [W, 4] (DecodeParams::work) and the prefill list [W2, 4] (DecodeParams::prefill_work;
// W2 = 0: none; 16-bit pages only), scales and sinks a row per sequence; o [Q, N, H],
// lse [N, Q], and the split scratch [splits, Q, N, H] and [splits, Q, N] (each empty with one split).
ffi::Error ragged_impl(JAX_FLASH_RAGGED_PARAMS) {
  DecodeParams p{};
  DType dtype, kv_dtype;
  const auto qd = q.dimensions(), kd = k.dimensions(), td = page_table.dimensions(), wd = work.dimensions();
  const auto pd = prefill_work.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || wd.size() != 2 || wd[1] != contract::kRaggedWorkFields ||
      pd.size() != 2 || pd[1] != contract::kRaggedWorkFields || kd[0] == 0 || kd[1] % kDecodeBlockKeys != 0 ||
      td[1] == 0 || !has_shape(kv_lengths, {td[0]})) {
    return ffi::Error::InvalidArgument(
        "jax_flash: ragged attention takes q [Q, N, H], pages [P, page_size (a multiple of " +
        std::to_string(kDecodeBlockKeys) + "), K, H], kv_lengths [S], a page table [S, max_pages >= 1] and work "
        "lists [W, " + std::to_string(contract::kRaggedWorkFields) + "] and [W2, " +
        std::to_string(contract::kRaggedWorkFields) + "], got " + shape_string(qd) + ", " + shape_string(kd) + ", " +
        shape_string(kv_lengths.dimensions()) + ", " + shape_string(td) + ", " + shape_string(wd) + ", " +
        shape_string(pd));
  }
  const int64_t sequences = td[0];
  if (ffi::Error e = dtype_of(q.element_type(), &dtype); e.failure()) return e;
  if (ffi::Error e = kv_dtype_of(k.element_type(), &kv_dtype); e.failure()) return e;
  if (v.element_type() != k.element_type() || !has_shape(v, {kd[0], kd[1], kd[2], kd[3]}) || kd[3] != qd[2] ||
      kd[2] == 0 || qd[1] % kd[2] != 0) {
    return ffi::Error::InvalidArgument("jax_flash: ragged attention's q " + shape_string(qd) + ", k " +
                                       shape_string(kd) + " and v " + shape_string(v.dimensions()) + " do not match");
  }
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.batch = 1;
  p.seqlen_q = static_cast<int>(qd[0]);
  p.heads = static_cast<int>(qd[1]);
  p.head_dim = p.value_dim = static_cast<int>(qd[2]);
  p.kv_heads = static_cast<int>(kd[2]);
  p.page_table = page_table.typed_data();
  p.page_size = static_cast<int>(kd[1]);
  p.max_pages = static_cast<int>(td[1]);
  p.pool_pages = static_cast<int>(kd[0]);
  p.seqlen_k = p.page_size * p.max_pages;
  p.kv_lengths = kv_lengths.typed_data();
  p.work = work.typed_data();
  p.work_items = static_cast<int>(wd[0]);
  if (pd[0] > 0) {
    p.prefill_work = prefill_work.typed_data();
    p.prefill_items = static_cast<int>(pd[0]);
  }
  const bool fp8 = kv_dtype == DType::kFp8E4m3 || kv_dtype == DType::kFp8E5m2;
  if (kv_dtype != dtype && !fp8) {
    return ffi::Error::InvalidArgument("jax_flash: ragged attention takes pages in q's dtype or in fp8");
  }
  if (fp8 && p.prefill_items > 0) {
    return ffi::Error::InvalidArgument("jax_flash: ragged attention's prefill items take 16-bit pages (the "
                                       "forward kernels read no fp8), got fp8 pages and " +
                                       shape_string(pd) + " items");
  }
  // The decode kernels' head dims (generate_instantiations.py instantiates ragged at the same).
  if (fp8 ? !contract::decode_fp8_supports_head_dim(p.head_dim) : !contract::decode_supports_head_dim(p.head_dim)) {
    return ffi::Error::InvalidArgument("jax_flash: no ragged kernel for head dim " + std::to_string(p.head_dim) +
                                       (fp8 ? " over fp8 pages" : ""));
  }
  if (ffi::Error e = fill_fp8_scales(key_scale, value_scale, sequences, "S", fp8, &p); e.failure()) return e;
  if (ffi::Error e = fill_sinks(sinks, sequences, "S", &p); e.failure()) return e;
  if (ffi::Error e = fill_attributes(scale, softcap, window_left, window_right, diagonal_by_lengths, &p); e.failure()) return e;
  if (ffi::Error e = fill_split_outputs(o, lse, o_partial, lse_partial, splits, &p); e.failure()) return e;
  return launch_status(run_decode(dtype, kv_dtype, p, stream), "ragged");
}

}  // namespace
}  // namespace jax_flash

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_flash_fwd_handler, jax_flash::fwd_impl, JAX_FLASH_FWD_BIND,
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_flash_bwd_handler, jax_flash::bwd_impl, JAX_FLASH_BWD_BIND,
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_flash_decode_handler, jax_flash::decode_impl, JAX_FLASH_DECODE_BIND,
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_flash_ragged_handler, jax_flash::ragged_impl, JAX_FLASH_RAGGED_BIND,
                              {ffi::Traits::kCmdBufferCompatible});

namespace jax_flash {

std::vector<FfiTarget> ffi_targets() {
  return {
      {"jax_flash_fwd", reinterpret_cast<void*>(jax_flash_fwd_handler)},
      {"jax_flash_bwd", reinterpret_cast<void*>(jax_flash_bwd_handler)},
      {"jax_flash_decode", reinterpret_cast<void*>(jax_flash_decode_handler)},
      {"jax_flash_ragged", reinterpret_cast<void*>(jax_flash_ragged_handler)},
  };
}

}  // namespace jax_flash
