"""The mask operands of the kernel calls: sequence lengths, segment ids and their chunk summaries.

The kernels read (cuda/common/mask.cuh, cuda/common/params.h):
  seqlens     int32 [B, 2]: the valid query and key/value lengths of each batch row;
  q_segments  int32 [B, T] and kv_segments [B, S]: segment ids;
  q_chunks    int32 [B, ceil(T / 64), 4]: per 64 queries, the smallest and largest segment id and
              the keys [begin, end) whose chunks share a segment id range with it;
  kv_chunks   int32 [B, ceil(S / 64), 4]: the same per 64 keys, with a range of queries.
A chunk whose segment ranges meet no other chunk's gets an empty range, so that the kernels skip
the blocks of other documents instead of computing them and masking every element. An absent
input is an empty [B, 0] array (the batch stays on axis 0, as `_batching` needs).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

CHUNK = 64  # kMaskChunk in cuda/common/params.h


class KernelMasks(NamedTuple):
    seqlens: jax.Array
    q_segments: jax.Array
    kv_segments: jax.Array
    q_chunks: jax.Array
    kv_chunks: jax.Array


def _segment_ranges(segments, chunks: int):
    """Per chunk of CHUNK rows: (smallest, largest) segment id, rows past the end left out."""
    b, length = segments.shape
    pad = chunks * CHUNK - length
    info = jnp.iinfo(jnp.int32)
    low = jnp.pad(segments, ((0, 0), (0, pad)), constant_values=info.max).reshape(b, chunks, CHUNK)
    high = jnp.pad(segments, ((0, 0), (0, pad)), constant_values=info.min).reshape(b, chunks, CHUNK)
    return low.min(-1), high.max(-1)


def _first_last(meet, length: int):
    """[begin, end) of the other side's rows covering the chunks that `meet` marks, per row of
    `meet` [B, C, C_other]; (0, 0) where none."""
    other = meet.shape[-1]
    some = meet.any(-1)
    first = jnp.argmax(meet, -1)
    last = other - 1 - jnp.argmax(meet[..., ::-1], -1)
    begin = jnp.where(some, first * CHUNK, 0)
    end = jnp.where(some, jnp.minimum((last + 1) * CHUNK, length), 0)
    return begin.astype(jnp.int32), end.astype(jnp.int32)


def kernel_masks(batch: int, t: int, s: int, query_seq_lengths, key_value_seq_lengths, q_segment_ids,
                 kv_segment_ids) -> KernelMasks:  # fmt: skip
    """The kernel operands for these (validated) masks; absent ones as empty arrays."""
    empty = jnp.zeros((batch, 0), jnp.int32)
    empty_chunks = jnp.zeros((batch, 0, 4), jnp.int32)
    seqlens = empty
    if query_seq_lengths is not None or key_value_seq_lengths is not None:
        q_len = jnp.full((batch,), t, jnp.int32) if query_seq_lengths is None else query_seq_lengths
        kv_len = jnp.full((batch,), s, jnp.int32) if key_value_seq_lengths is None else key_value_seq_lengths
        seqlens = jnp.stack([jnp.clip(q_len, 0, t), jnp.clip(kv_len, 0, s)], -1).astype(jnp.int32)
    if q_segment_ids is None:
        return KernelMasks(seqlens, empty, empty, empty_chunks, empty_chunks)
    q_min, q_max = _segment_ranges(q_segment_ids, -(-t // CHUNK))
    kv_min, kv_max = _segment_ranges(kv_segment_ids, -(-s // CHUNK))
    # meet[b, i, j]: query chunk i and key chunk j have segment id ranges that overlap.
    meet = (q_min[:, :, None] <= kv_max[:, None, :]) & (kv_min[:, None, :] <= q_max[:, :, None])
    key_begin, key_end = _first_last(meet, s)
    query_begin, query_end = _first_last(jnp.swapaxes(meet, 1, 2), t)
    q_chunks = jnp.stack([q_min, q_max, key_begin, key_end], -1)
    kv_chunks = jnp.stack([kv_min, kv_max, query_begin, query_end], -1)
    return KernelMasks(seqlens, q_segment_ids, kv_segment_ids, q_chunks, kv_chunks)
