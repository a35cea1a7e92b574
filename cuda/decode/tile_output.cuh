// The end of a decode CTA: its warps' softmax states and outputs (each over its own blocks of
// keys) merge through shared memory into the tile's result over the split, which is stored as
// the call's output and log-sum-exp (one split) or as this split's float32 part for the combine
// kernel (combine_kernel.cuh).
#pragma once

#include <cmath>

#include "common/online_softmax.cuh"
#include "common/ptx.cuh"
#include "common/row_total.cuh"
#include "decode/packed_rows.cuh"
#include "decode/params.h"

namespace jax_flash::decode {

template <typename Cfg, int kDTiles, typename Rows>
__device__ __forceinline__ void merge_and_store(const DecodeParams& p, const Rows& rows, int batch, int split,
                                                const OnlineSoftmax& softmax, const float (&acc_o)[kDTiles][4],
                                                float unit, char* smem) {
  using T = typename Cfg::T;
  constexpr int kHeadDim = Cfg::kHeadDim, kRowFloats = Cfg::kMergeRowFloats, kRows = kDecodeTileRows;
  constexpr float kLog2e = 1.4426950408889634f;
  float* merged_o = reinterpret_cast<float*>(smem);                  // [warp][row][kRowFloats]
  float* merged_stats = merged_o + Cfg::kWarps * kRows * kRowFloats;  // [warp][row]: max, sum
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  __syncthreads();  // every warp is done with its ring, which the merge area overlaps
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = lane / 4 + 8 * r;
    if constexpr (Cfg::kFp8) {
      // acc_o[2j] and [2j + 1]: chunk j's even and odd columns (split_kernel.cuh's fp8_values), a
      // thread's four consecutive columns 16j + 4 (lane % 4) + 0..3.
      float* o_row = merged_o + (warp * kRows + row) * kRowFloats + 4 * (lane % 4);
#pragma unroll
      for (int j = 0; j < kDTiles / 2; ++j) {
        *reinterpret_cast<float4*>(o_row + j * 16) =
            make_float4(acc_o[2 * j][2 * r], acc_o[2 * j + 1][2 * r], acc_o[2 * j][2 * r + 1], acc_o[2 * j + 1][2 * r + 1]);
      }
    } else {
      float* o_row = merged_o + (warp * kRows + row) * kRowFloats + 2 * (lane % 4);
#pragma unroll
      for (int d = 0; d < kDTiles; ++d) {
        *reinterpret_cast<float2*>(o_row + d * 8) = make_float2(acc_o[d][2 * r], acc_o[d][2 * r + 1]);
      }
    }
    const float sum = softmax.row_sum(r);
    if (lane % 4 == 0) {
      merged_stats[(warp * kRows + row) * 2] = softmax.max[r];
      merged_stats[(warp * kRows + row) * 2 + 1] = sum;
    }
  }
  __syncthreads();

  // Four columns a thread: weigh each warp's part by exp(its max - the tile's max).
  const float scale_log2 = unit * kLog2e;
  const int64_t rows_per_split = int64_t(p.batch) * p.seqlen_q * p.heads;
  for (int i = threadIdx.x; i < kRows * (kHeadDim / 4); i += Cfg::kThreads) {
    const int row = i / (kHeadDim / 4), col = (i % (kHeadDim / 4)) * 4;
    if (!rows.valid(row)) continue;
    float max = -INFINITY;
#pragma unroll
    for (int w = 0; w < Cfg::kWarps; ++w) max = fmaxf(max, merged_stats[(w * kRows + row) * 2]);
    float sum = 0.f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < Cfg::kWarps; ++w) {
      const float warp_max = merged_stats[(w * kRows + row) * 2];
      if (warp_max == -INFINITY) continue;  // saw no visible key
      const float weight = ptx::exp2((warp_max - max) * scale_log2);
      sum += weight * merged_stats[(w * kRows + row) * 2 + 1];
      const float4 x = *reinterpret_cast<const float4*>(merged_o + (w * kRows + row) * kRowFloats + col);
      o.x += weight * x.x, o.y += weight * x.y, o.z += weight * x.z, o.w += weight * x.w;
    }
    // With one split the row is whole and takes its sink here; a split's part leaves it to the
    // combine. The sink is read in place: through sink_of, ptxas held 20 more registers.
    const RowTotal total = RowTotal::whole(sum);
    float inv, lse;
    if (p.splits == 1 && p.sinks != nullptr) {
      total.finish_with_sink(max, unit, p.sinks[batch * p.heads + rows.head(row)], inv, lse);
    } else {
      total.finish_part(max, unit, inv, lse);
    }
    if constexpr (Cfg::kFp8) {
      inv *= __ldg(p.value_scale + batch * p.kv_heads + rows.kv_head);  // V was stored divided by it
    }
    const int64_t out_row = rows.output_row(p, batch, row);
    if (p.splits == 1) {
      const uint2 packed{ptx::pack2<T>(o.x * inv, o.y * inv), ptx::pack2<T>(o.z * inv, o.w * inv)};
      *reinterpret_cast<uint2*>(static_cast<T*>(p.o) + out_row * kHeadDim + col) = packed;
      if (col == 0) p.lse[rows.lse_index(p, batch, row)] = lse;
    } else {
      const int64_t part_row = split * rows_per_split + out_row;
      *reinterpret_cast<float4*>(p.o_partial + part_row * kHeadDim + col) =
          make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv);
      if (col == 0) p.lse_partial[part_row] = lse;
    }
  }
}

}  // namespace jax_flash::decode
