"""The work lists of a ragged batch (cuda/decode/params.h's DecodeParams::work and prefill_work).
For the split-KV kernels, one item per 16-row tile of one sequence's packed rows (its queries x the
query heads of a kv head), so that a 1-token sequence costs one tile of a decode step, never a tile
of another sequence's padding. With a prefill list, a sequence of more than DECODE_QUERIES queries
(a prefill chunk) instead takes one item per PREFILL_ROWS of its queries on the forward kernels'
tiles, which read each visible key once per 64 queries of a head instead of once per 16 packed
rows (perf log R1: the L2 bound of a chunk on 16-row tiles).

It is made on the device, from the query starts and `num_seqs` (arrays: one compiled step serves
every batch), by a few XLA ops ahead of the kernel: no host synchronisation, a fixed number of
launches (no loop: _search.py). Its length is static: a bound on the tiles of any batch of the step's shapes; the
items past a batch's tiles name no sequence, and their CTAs exit at once.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_flash import _contract, _env, _search

TILE_ROWS = _contract.DECODE_TILE_ROWS
PREFILL_ROWS = _contract.PREFILL_BLOCK_ROWS
# sequence (-1: none), first packed row (a prefill item: first query), first query row, queries
FIELDS = _contract.RAGGED_WORK_FIELDS
DECODE_QUERIES = 16  # queries of a sequence that the split-KV kernels take at most where a prefill list exists
# "1": prefill chunks on the forward kernels' tiles (read when a call is traced). Off by default
# until those kernels have run on a GPU (built and tested on CPU only, 2026-12-08).
PREFILL_ENV = "JAX_FLASH_RAGGED_PREFILL"


def prefill_enabled() -> bool:
    return _env.flag(PREFILL_ENV, default=False)


def items_bound(q_rows: int, sequences: int, group: int) -> int:
    """Items enough for any batch of `q_rows` query rows over `sequences` sequences, `group` query
    heads a kv head: the tiles sum(ceil(q_i * group / 16)) are at most (Q * group + 15 * s) / 16
    with s <= min(S, Q) sequences holding queries."""
    return max(1, (q_rows * group + (TILE_ROWS - 1) * min(sequences, q_rows)) // TILE_ROWS)


def prefill_items_bound(q_rows: int, sequences: int) -> int:
    """Prefill items enough for any batch of `q_rows` query rows over `sequences` sequences: the
    sum of ceil(q_i / PREFILL_ROWS) over sequences of more than DECODE_QUERIES queries, at most
    (Q + (PREFILL_ROWS - 1) * s) / PREFILL_ROWS with s <= min(S, Q / (DECODE_QUERIES + 1)) such
    sequences (0: no batch of these shapes has one)."""
    s = min(sequences, q_rows // (DECODE_QUERIES + 1))
    return (q_rows + (PREFILL_ROWS - 1) * s) // PREFILL_ROWS if s else 0


def work_list(query_starts, num_seqs, group: int, items: int, prefill_items: int = 0):
    """(int32 [items, FIELDS], int32 [prefill_items, FIELDS]): the split kernels' tiles of
    sequences [0, num_seqs) in order, then items of none; and, where `prefill_items`, the
    prefill items of those of more than DECODE_QUERIES queries (which then have no tile in the
    first list). `query_starts` [S + 1] already made valid (nondecreasing from 0, within the
    queries)."""
    queries = query_starts[1:] - query_starts[:-1]
    queries = jnp.where(jnp.arange(queries.shape[0]) < num_seqs, queries, 0)  # sequences past num_seqs: padding
    prefill = queries > DECODE_QUERIES if prefill_items else jnp.zeros(queries.shape, bool)
    tiles = jnp.where(prefill, 0, (queries * group + TILE_ROWS - 1) // TILE_ROWS)
    blocks = jnp.where(prefill, (queries + PREFILL_ROWS - 1) // PREFILL_ROWS, 0)
    return (_items(tiles, items, TILE_ROWS, query_starts, queries),
            _items(blocks, prefill_items, PREFILL_ROWS, query_starts, queries))


def _items(units, count: int, rows: int, query_starts, queries):
    """int32 [count, FIELDS]: `units[i]` items of `rows` (packed rows or queries) each for
    sequence i, in order, then items of none."""
    ends = jnp.cumsum(units)
    item = jnp.arange(count, dtype=jnp.int32)
    seq = jnp.minimum(_search.searchsorted(ends, item), units.shape[0] - 1)
    first = (item - (ends[seq] - units[seq])) * rows
    fields = (jnp.where(item < ends[-1], seq, -1), first, query_starts[seq], queries[seq])
    return jnp.stack(fields, axis=-1).reshape(count, FIELDS).astype(jnp.int32)


def rows_of(work, q_rows: int, group: int, prefill_work=None):
    """What the kernels read of the work lists, row by row: (sequence [Q], or -1 for a row no item
    covers; the row's query index within its sequence; the sequence's query count). A row is
    covered where a split item's tile holds one of its (query, head) pairs, or a prefill item its
    query. For the CPU stand-in of the kernels (tests/fake_kernels.py)."""
    seq, first, row0, count = (work[:, i] for i in range(FIELDS))
    packed = first[:, None] + jnp.arange(TILE_ROWS)[None]  # [items, 16]
    live = (seq[:, None] >= 0) & (packed < (count * group)[:, None])
    query = packed // group
    if prefill_work is not None and prefill_work.shape[0]:
        p_seq, p_first, p_row0, p_count = (prefill_work[:, i] for i in range(FIELDS))
        p_query = p_first[:, None] + jnp.arange(PREFILL_ROWS)[None]  # [prefill items, 128]
        p_live = (p_seq[:, None] >= 0) & (p_query < p_count[:, None])
        seq, row0, count = (jnp.concatenate([a, b]) for a, b in ((seq, p_seq), (row0, p_row0), (count, p_count)))
        widen = lambda a: jnp.pad(a, [(0, 0), (0, PREFILL_ROWS - TILE_ROWS)])  # noqa: E731 (False, 0: not live)
        live, query = jnp.concatenate([widen(live), p_live]), jnp.concatenate([widen(query), p_query])
    rows = jnp.where(live, row0[:, None] + query, q_rows)  # q_rows: dropped by the scatter
    scatter = lambda values: jnp.full((q_rows,), -1, jnp.int32).at[rows.ravel()].set(  # noqa: E731
        jnp.broadcast_to(values, rows.shape).ravel().astype(jnp.int32), mode="drop")
    return scatter(seq[:, None]), scatter(query), scatter(count[:, None])
