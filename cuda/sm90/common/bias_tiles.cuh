// The bias and boolean mask of the sm90 kernels' kBias variant, staged in shared memory a tile at
// a time ([kBlockM queries x kBlockN keys] of each) by TMA and read by the consumers with shared
// loads: what the forward (fwd_bias_tiles.cuh) and the backward (bwd_bias_tiles.cuh) share. Read
// from global memory by the consumers instead, the loads waited on L2 after each product landed
// (the backward took 5x the plain one; docs/perf/log.md, B22).
#pragma once

#include <cuda.h>

#include <cstdint>
#include <type_traits>

#include "common/params.h"
#include "common/ptx_sm90.cuh"

namespace jax_flash::sm90 {

// The arrays the tiles copy from: whole [T, S] rows (a broadcast over queries or keys is not one),
// unit key strides, 16-byte aligned rows (a bf16 S a multiple of 8, a float32 one of 4, a mask's of
// 16): as TMA copies them.
__host__ __device__ inline bool copies_by_rows(const void* array, const Strides4& s, int seqlen_k, int elem_bytes) {
  return s.col == 1 && s.row == seqlen_k && (seqlen_k * elem_bytes) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(array) % 16 == 0;
}

// A kernel's staging region and one call's use of it (host and device derive the same): a stage
// holds the bias tile, then the mask tile, each in boxes of kBlockM rows x 128 bytes with the
// 128-byte swizzle (launch/tensor_map.h, make_tensor_map_bnts).
template <int kBlockM_, int kBlockN_, int kRegionBytes_>
struct BiasTiles {
  static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_, kRegionBytes = kRegionBytes_;
  static constexpr int kBoxBytes = kBlockM * 128;
  static_assert(kBlockN % 64 == 0 && kBlockN <= 128, "a bf16 box of 64 keys, a mask box of 128");
  int bias_bytes;  // of one tile; 0: no bias
  int mask_bytes;  // 0: no mask
  int stages;      // 1 or 2; 0: the call cannot take the kernel (the launcher's choice)

  __host__ __device__ static BiasTiles of(const FwdParams& p, int elem_bytes) {
    const int bias_elem = p.bias_fp32 ? 4 : elem_bytes;
    const bool rows = (p.bias == nullptr || copies_by_rows(p.bias, p.bias_strides, p.seqlen_k, bias_elem)) &&
                      (p.mask == nullptr || copies_by_rows(p.mask, p.mask_strides, p.seqlen_k, 1));
    // A mask tile's rows are whole boxes of 128 keys (128 bytes) even where a block has 64 keys
    // (the forward at H > 128): the box's other keys go unread.
    BiasTiles t{p.bias ? kBlockM * kBlockN * bias_elem : 0, p.mask ? kBlockM * (kBlockN < 128 ? 128 : kBlockN) : 0,
                0};
    const int tile = t.bias_bytes + t.mask_bytes;
    t.stages = rows && tile > 0 ? (2 * tile <= kRegionBytes ? 2 : tile <= kRegionBytes ? 1 : 0) : 0;
    return t;
  }
  // The stage of the s-th tile copied, and how many times it was used before.
  __device__ uint32_t stage_of(int s) const { return stages == 1 ? 0 : s % 2; }
  __device__ uint32_t use_of(int s) const { return stages == 1 ? s : s / 2; }
  __device__ uint32_t tile_bytes() const { return bias_bytes + mask_bytes; }

  // Byte offset of element (row r, key column k) in a tile: 128-byte rows of kBlockM-row boxes,
  // their 16-byte chunks XOR-swizzled by the row (TMA's 128-byte swizzle).
  __device__ static __forceinline__ uint32_t offset(int r, int k, int elem_bytes) {
    const int byte = k * elem_bytes, in_row = byte % 128;
    return (byte / 128) * kBoxBytes + r * 128 + (((in_row >> 4) ^ (r % 8)) << 4) + (in_row & 15);
  }

  // The s-th tile copied (rows q_first.., keys k_first.. of `head`) into its stage of `region`,
  // by one thread: the n-th use of a stage waits for the consumers' release of use n - 1; `full`
  // and `empty` are the stages' barriers (stage i at + 8 i). Rows and keys past the arrays read
  // as zeros (the band masks them).
  __device__ __forceinline__ void load(const CUtensorMap* bias_map, const CUtensorMap* mask_map, const FwdParams& p,
                                       int s, uint32_t region, uint32_t full, uint32_t empty, int batch, int head,
                                       int q_first, int k_first) const {
    const uint32_t stage = stage_of(s), use = use_of(s);
    if (use > 0) ptx::mbarrier_wait(empty + 8 * stage, (use - 1) & 1);
    ptx::mbarrier_arrive_expect_tx(full + 8 * stage, tile_bytes());
    const uint32_t tile = region + stage * tile_bytes();
    if (p.bias != nullptr) {
      const int keys_per_box = p.bias_fp32 ? 32 : 64;
      const int b = p.bias_strides.batch ? batch : 0, h = p.bias_strides.head ? head : 0;
      for (int box = 0; box * kBoxBytes < bias_bytes; ++box) {
        ptx::tma_load_4d(tile + box * kBoxBytes, bias_map, full + 8 * stage, k_first + box * keys_per_box, q_first,
                         h, b);
      }
    }
    if (p.mask != nullptr) {
      ptx::tma_load_4d(tile + bias_bytes, mask_map, full + 8 * stage, k_first, q_first, p.mask_strides.head ? head : 0,
                       p.mask_strides.batch ? batch : 0);
    }
  }
};

// add(bias type, std::bool_constant<mask>) for a tile's layout, unswitched so that each layout's
// loads run straight (the bias type void* where there is no bias).
template <typename T, typename Add>
__device__ __forceinline__ void with_tile_layout(int bias_bytes, bool bias_fp32, bool has_mask, Add&& add) {
  if (bias_bytes == 0) {
    add(static_cast<void*>(nullptr), std::true_type{});
  } else if (bias_fp32) {
    has_mask ? add(float{}, std::true_type{}) : add(float{}, std::false_type{});
  } else {
    has_mask ? add(T{}, std::true_type{}) : add(T{}, std::false_type{});
  }
}

}  // namespace jax_flash::sm90
