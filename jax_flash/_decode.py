"""Which calls the split-KV decode kernels take (cuda/decode/), and into how many splits each
call's keys are cut.

A call with few queries (decode, speculative decoding) leaves most of a forward kernel's 128-row
tiles empty and reads each kv head's cache once per query head. The decode kernels pack the
queries x query heads of one kv head into 16-row tiles (one pass over its cache), and cut the keys
into splits so that every SM streams: enough CTAs for the GPU even at batch 1.
"""

from __future__ import annotations

import math
import os

from jax_flash import _contract, _device, _env

MAX_QUERIES = 16  # the decode kernels take calls of at most this many queries
TILE_ROWS = _contract.DECODE_TILE_ROWS
BLOCK_KEYS = _contract.DECODE_BLOCK_KEYS
MAX_SPLITS = _contract.MAX_DECODE_SPLITS
MAX_GRID_YZ = 65535
# CTAs of the split rule's waves: one an SM. Two fit (96 KB of shared memory each), but one an SM
# already streams at 88-90% of HBM, and 33 splits at 1 x 128k ran slower than 16 (docs/perf/log.md,
# decode D2 and D7).
CTAS_PER_SM = 1
# What one split kernel CTA streams, bytes a second, whatever the GPU: 64 CTAs read 3.0 TB/s on an
# H100 (decode D8) and 3.1 TB/s on an H200, where that is 65% of its HBM (decode D10). One split is
# enough once the tiles' CTAs together stream ONE_SPLIT_HBM_SHARE of the GPU's peak: fewer
# tiles are split (each split's CTA streams as fast), and the combine costs less than the gain.
# The rate is one of elements, not bytes: an fp8 cache's CTA (half the bytes an element, each
# dequantised) streamed 21 GB/s, 0.45x of that (H100, 8 x 32k, one split: 41% of HBM), so its
# tiles need twice as many CTAs to stream the peak.
CTA_STREAM_RATE = 47e9  # bytes of a 16-bit cache
ONE_SPLIT_HBM_SHARE = 0.85
# A paged cache needs more: each load waits for its page's index, which the CTAs of one split an
# SM do not hide (8 x 8k, pages of 64: one split 19% slower than the dense cache, two 6%; D8).
# Tiles (as a share of the slots) from which one split is enough there.
PAGED_ONE_SPLIT_SHARE = 0.8
# "0": never the decode kernels (the forward kernels take every call, to compare the two);
# "1" or unset: wherever `takes` says.
DECODE_ENV = "JAX_FLASH_DECODE"
# A number: every decode call cuts its keys into that many splits (for tuning the rule below).
SPLITS_ENV = "JAX_FLASH_DECODE_SPLITS"


def enabled() -> bool:
    return _env.flag(DECODE_ENV, default=True)


def row_tiles(queries: int, heads: int, kv_heads: int) -> int:
    """16-row tiles of one kv head's packed rows (its queries x query heads)."""
    return -(-queries * (heads // kv_heads) // TILE_ROWS)


def takes(batch: int, queries: int, heads: int, kv_heads: int, *, masks_beyond_key_lengths: bool) -> bool:
    """Whether the decode kernels run a forward call (already taken by the CUDA kernels) of these
    shapes: at most MAX_QUERIES queries, no query lengths, bias, boolean mask or segment ids
    (`masks_beyond_key_lengths`), and a grid within CUDA's limits."""
    if not enabled() or queries > MAX_QUERIES or masks_beyond_key_lengths:
        return False
    return batch <= MAX_GRID_YZ and kv_heads * row_tiles(queries, heads, kv_heads) <= MAX_GRID_YZ


def sm_count() -> int:
    return _device.sm_count()


def one_split_tiles(paged: bool, kv_bytes: int = 2) -> float:
    """Row tiles from which one split streams the cache (of `kv_bytes` an element) near the HBM's
    peak (at most a wave)."""
    slots = CTAS_PER_SM * sm_count()
    by_bandwidth = ONE_SPLIT_HBM_SHARE * _device.hbm_peak()[1] / (CTA_STREAM_RATE * kv_bytes / 2)
    return min(slots, max(by_bandwidth, PAGED_ONE_SPLIT_SHARE * slots) if paged else by_bandwidth)


def splits(batch: int, queries: int, heads: int, kv_heads: int, seqlen_k: int, head_dim: int,
           paged: bool = False, kv_bytes: int = 2) -> int:
    """Splits of each row tile's keys (a cache of `kv_bytes` an element), from the wave-efficiency
    of CTAS_PER_SM CTAs an SM. With `one_split_tiles` tiles or more, one. Otherwise as many as still fit one wave (every SM
    streams, and one wave has no tail), if that wave is at least 85% as efficient as the best split
    count's; else the fewest splits that are (FlashAttention's rule). Each warp keeps at least one
    block of keys."""
    return splits_of_tiles(batch * kv_heads * row_tiles(queries, heads, kv_heads), seqlen_k, head_dim, paged, kv_bytes)


def splits_of_tiles(tiles: int, seqlen_k: int, head_dim: int, paged: bool = False, kv_bytes: int = 2) -> int:
    """`splits`' rule for a grid of `tiles` row tiles (a ragged batch: its work list's items x kv
    heads) over keys of up to `seqlen_k`."""
    forced = os.environ.get(SPLITS_ENV)
    if forced:
        return max(1, min(MAX_SPLITS, int(forced)))
    slots = CTAS_PER_SM * sm_count()
    if tiles >= one_split_tiles(paged, kv_bytes):
        return 1
    warps = 4 if head_dim <= 128 else 2
    most = max(1, min(MAX_SPLITS, -(-seqlen_k // BLOCK_KEYS) // warps))

    def efficiency(n: int) -> float:
        ctas = tiles * n
        return ctas / (math.ceil(ctas / slots) * slots)

    best = max(efficiency(n) for n in range(1, most + 1))
    one_wave = min(most, slots // tiles)
    if efficiency(one_wave) >= 0.85 * best:
        return one_wave
    return next(n for n in range(1, most + 1) if efficiency(n) >= 0.85 * best)
