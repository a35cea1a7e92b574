"""The work list of a ragged batch for the split-KV kernels (cuda/decode/params.h's
DecodeParams::work): one item per 16-row tile of one sequence's packed rows (its queries x the
query heads of a kv head), so that a 1-token sequence costs one tile of a decode step and a prefill
chunk its own tiles, never a tile of another sequence's padding.

It is made on the device, from the query starts and `num_seqs` (arrays: one compiled step serves
every batch), by a few XLA ops ahead of the kernel: no host synchronisation, a fixed number of
launches (no loop: _search.py). Its length is static: a bound on the tiles of any batch of the step's shapes; the
items past a batch's tiles name no sequence, and their CTAs exit at once.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_flash import _contract, _search

TILE_ROWS = _contract.DECODE_TILE_ROWS
FIELDS = _contract.RAGGED_WORK_FIELDS  # sequence (-1: none), first packed row, first query row, queries


def items_bound(q_rows: int, sequences: int, group: int) -> int:
    """Items enough for any batch of `q_rows` query rows over `sequences` sequences, `group` query
    heads a kv head: the tiles sum(ceil(q_i * group / 16)) are at most (Q * group + 15 * s) / 16
    with s <= min(S, Q) sequences holding queries."""
    return max(1, (q_rows * group + (TILE_ROWS - 1) * min(sequences, q_rows)) // TILE_ROWS)


def work_list(query_starts, num_seqs, group: int, items: int):
    """int32 [items, FIELDS]: the tiles of sequences [0, num_seqs) in order, then items of none.
    `query_starts` [S + 1] already made valid (nondecreasing from 0, within the queries)."""
    sequences = query_starts.shape[0] - 1
    queries = query_starts[1:] - query_starts[:-1]
    queries = jnp.where(jnp.arange(sequences) < num_seqs, queries, 0)  # sequences past num_seqs: padding
    tiles = (queries * group + TILE_ROWS - 1) // TILE_ROWS
    ends = jnp.cumsum(tiles)
    item = jnp.arange(items, dtype=jnp.int32)
    seq = jnp.minimum(_search.searchsorted(ends, item), sequences - 1)
    first_row = (item - (ends[seq] - tiles[seq])) * TILE_ROWS
    fields = (jnp.where(item < ends[-1], seq, -1), first_row, query_starts[seq], queries[seq])
    return jnp.stack(fields, axis=-1).astype(jnp.int32)


def rows_of(work, q_rows: int, group: int):
    """What the kernels read of a work list, row by row: (sequence [Q], or -1 for a row no item
    covers; the row's query index within its sequence; the sequence's query count). A row is
    covered where an item's tile holds one of its (query, head) pairs. For the CPU stand-in of the
    kernels (tests/fake_kernels.py)."""
    seq, first, row0, count = (work[:, i] for i in range(FIELDS))
    packed = first[:, None] + jnp.arange(TILE_ROWS)[None]  # [items, 16]
    live = (seq[:, None] >= 0) & (packed < (count * group)[:, None])
    query = packed // group
    rows = jnp.where(live, row0[:, None] + query, q_rows)  # q_rows: dropped by the scatter
    scatter = lambda values: jnp.full((q_rows,), -1, jnp.int32).at[rows.ravel()].set(  # noqa: E731
        jnp.broadcast_to(values, rows.shape).ravel().astype(jnp.int32), mode="drop")
    return scatter(seq[:, None]), scatter(query), scatter(count[:, None])
