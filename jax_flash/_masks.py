"""The mask operands of the kernel calls: sequence lengths, segment ids and their chunk summaries.

The kernels read (cuda/common/mask.cuh, cuda/common/params.h):
  seqlens     int32 [B, 2]: the valid query and key/value lengths of each batch row;
  q_segments  int32 [B, T] and kv_segments [B, S]: segment ids;
  q_chunks    int32 [B, ceil(T / 64), 6]: per 64 queries, the smallest and largest segment id,
              the keys [begin, end) whose chunks share a segment id range with it, and the keys
              [begin, end) whose chunks hold only this chunk's one segment id;
  kv_chunks   int32 [B, ceil(S / 64), 6]: the same per 64 keys, with ranges of queries.
A chunk whose segment ranges meet no other chunk's gets an empty range, so that the kernels skip
the blocks of other documents instead of computing them and masking every element; a block inside
the one-segment range compares no ids (a kernel tests it by arithmetic, with no loads a block).
An absent input is an empty [B, 0] array (the batch stays on axis 0, as `_batching` needs).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_flash import _contract

CHUNK = _contract.MASK_CHUNK
CHUNK_FIELDS = len(_contract.MASK_CHUNK_FIELDS)  # the int32 fields of MaskChunk, in this order


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


def _first_and_last(chunk_pairs):
    """For [B, C, C'] booleans over (this side's chunk, other side's chunk): the first and last
    other chunk where true ([B, C]; C' and -1 where none), by min and max reductions along the
    last axis: XLA took 10-12 us on an H100 at 256 x 256 chunks for an argmax (a two-operand
    reduce), or for a reduction along the middle axis."""
    index = jax.lax.broadcasted_iota(jnp.int32, chunk_pairs.shape, 2)
    first = jnp.min(jnp.where(chunk_pairs, index, chunk_pairs.shape[2]), 2)
    last = jnp.max(jnp.where(chunk_pairs, index, -1), 2)
    return first, last


def _rows(first, last, keep, other_length: int):
    """The other side's rows [begin, end) of chunks first..last where keep, (0, 0) elsewhere."""
    begin = jnp.where(keep, first * CHUNK, 0)
    end = jnp.where(keep, jnp.minimum((last + 1) * CHUNK, other_length), 0)
    return begin, end


def _other_rows(low, high, other_low, other_high, other_length: int):
    """For each chunk of one side (segment ids low..high, [B, C]), the other side's rows [begin,
    end) covering its chunks whose segment id ranges meet this chunk's; (0, 0) where none."""
    meet = (low[:, :, None] <= other_high[:, None, :]) & (other_low[:, None, :] <= high[:, :, None])
    first, last = _first_and_last(meet)
    return _rows(first, last, last >= 0, other_length)


def _one_segment_rows(low, high, other_low, other_high, other_length: int):
    """For each chunk of one side holding one segment id (low == high), the other side's rows
    [begin, end) of the run of its chunks that hold only that id; (0, 0) for a chunk of several
    ids, or where those chunks are not one run (unsorted ids: no block is then taken as one
    segment, and the kernels compare ids, as they must)."""
    same = (low == high)[:, :, None] & (other_low[:, None, :] == low[:, :, None]) & (other_high[:, None, :] == low[:, :, None])
    first, last = _first_and_last(same)
    one_run = (last >= 0) & (jnp.sum(same, 2, dtype=jnp.int32) == last - first + 1)
    return _rows(first, last, one_run, other_length)


def _chunk_summaries(**fields) -> jax.Array:
    """[B, C, CHUNK_FIELDS] int32: the fields of each chunk in MaskChunk's order (the contract)."""
    return jnp.stack([fields[name] for name in _contract.MASK_CHUNK_FIELDS], -1).astype(jnp.int32)


def kernel_masks(batch: int, t: int, s: int, query_seq_lengths, key_value_seq_lengths, q_segment_ids,
                 kv_segment_ids) -> KernelMasks:  # fmt: skip
    """The kernel operands for these (validated) masks; absent ones as empty arrays."""
    empty = jnp.zeros((batch, 0), jnp.int32)
    empty_chunks = jnp.zeros((batch, 0, CHUNK_FIELDS), jnp.int32)
    seqlens = empty
    if query_seq_lengths is not None or key_value_seq_lengths is not None:
        q_len = jnp.full((batch,), t, jnp.int32) if query_seq_lengths is None else query_seq_lengths
        kv_len = jnp.full((batch,), s, jnp.int32) if key_value_seq_lengths is None else key_value_seq_lengths
        seqlens = jnp.stack([jnp.clip(q_len, 0, t), jnp.clip(kv_len, 0, s)], -1).astype(jnp.int32)
    if q_segment_ids is None:
        return KernelMasks(seqlens, empty, empty, empty_chunks, empty_chunks)
    q_min, q_max = _segment_ranges(q_segment_ids, -(-t // CHUNK))
    kv_min, kv_max = _segment_ranges(kv_segment_ids, -(-s // CHUNK))
    key_begin, key_end = _other_rows(q_min, q_max, kv_min, kv_max, s)
    query_begin, query_end = _other_rows(kv_min, kv_max, q_min, q_max, t)
    one_key_begin, one_key_end = _one_segment_rows(q_min, q_max, kv_min, kv_max, s)
    one_query_begin, one_query_end = _one_segment_rows(kv_min, kv_max, q_min, q_max, t)
    q_chunks = _chunk_summaries(segment_min=q_min, segment_max=q_max, other_begin=key_begin, other_end=key_end,
                                one_begin=one_key_begin, one_end=one_key_end)  # fmt: skip
    kv_chunks = _chunk_summaries(segment_min=kv_min, segment_max=kv_max, other_begin=query_begin, other_end=query_end,
                                 one_begin=one_query_begin, one_end=one_query_end)  # fmt: skip
    return KernelMasks(seqlens, q_segment_ids, kv_segment_ids, q_chunks, kv_chunks)
