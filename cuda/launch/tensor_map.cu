// cuTensorMapEncodeTiled is a driver API function: reached through the runtime's entry-point query
// so that the module links only the (static) runtime, not libcuda.
#include "launch/tensor_map.h"

#include <cudaTypedefs.h>

namespace jax_flash {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      ptr = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

}  // namespace

cudaError_t make_tensor_map_bthd(CUtensorMap* map, const void* data, int batch, int rows, int heads,
                                 int head_dim, int box_rows) {
  constexpr cuuint64_t elem_bytes = 2;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = encode_tiled();
  if (encode == nullptr) return cudaErrorNotSupported;
  // Innermost dimension first: column, head, row, batch.
  const cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(heads), cuuint64_t(rows), cuuint64_t(batch)};
  const cuuint64_t strides[3] = {head_dim * elem_bytes, cuuint64_t(heads) * head_dim * elem_bytes,
                                 cuuint64_t(rows) * heads * head_dim * elem_bytes};
  const cuuint32_t box[4] = {cuuint32_t(128 / elem_bytes), 1, cuuint32_t(box_rows), 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult status = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(data), dims, strides,
                                 box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return status == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t make_tensor_map_bnts(CUtensorMap* map, const void* data, int elem_bytes, int batch, int heads, int rows,
                                 int keys, int box_rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = encode_tiled();
  if (encode == nullptr) return cudaErrorNotSupported;
  const CUtensorMapDataType type = elem_bytes == 4   ? CU_TENSOR_MAP_DATA_TYPE_UINT32
                                   : elem_bytes == 2 ? CU_TENSOR_MAP_DATA_TYPE_UINT16
                                                     : CU_TENSOR_MAP_DATA_TYPE_UINT8;
  // Innermost dimension first: key, row, head, batch.
  const cuuint64_t row_bytes = cuuint64_t(keys) * elem_bytes;
  const cuuint64_t dims[4] = {cuuint64_t(keys), cuuint64_t(rows), cuuint64_t(heads), cuuint64_t(batch)};
  const cuuint64_t strides[3] = {row_bytes, rows * row_bytes, heads * rows * row_bytes};
  const cuuint32_t box[4] = {cuuint32_t(128 / elem_bytes), cuuint32_t(box_rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult status = encode(map, type, 4, const_cast<void*>(data), dims, strides, box, element_strides,
                                 CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return status == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace jax_flash
