"""`jax_flash.ragged_paged_attention`: one call for a serving step, prefill chunks and decodes mixed
over one paged KV cache (DESIGN.md's contract; the layout of JAX's TPU `ragged_paged_attention`
and vLLM's).

On a GPU from sm_80 on, the split-KV decode kernels run it over a work list made on the device
(_ragged_work.py): every sequence's queries x query heads of a kv head packed into 16-row tiles,
so that a 1-token sequence costs one decode tile and a prefill chunk its own tiles, reading K/V
from the pages in place. Prefill chunks run there too, on those 16-row tiles (the forward
kernels' 128-row tiles reading pages are not written yet). Elsewhere, and for what the kernels do
not take (cuda_impl.ragged_reason), the `xla` path: the queries of all sequences at once, walking
their sequences' pages a chunk at a time with an online softmax (memory: the queries x one chunk
of pages).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_flash import _fp8, _search, _sinks, cuda_impl
from jax_flash._validation import (INPUT_DTYPES, _as_array, _check_window, as_clamped_int32, check_scale, check_softcap,
                                   check_starts)

# Bytes of keys and values (float32) one step of the walk gathers for all queries at most.
CHUNK_BYTES = 64 * 2**20


def _check(queries, key_pages, value_pages, kv_lengths, page_indices, query_starts, num_seqs, key_scale,
           value_scale):  # fmt: skip
    queries, key_pages, value_pages = (_as_array(x, name) for x, name in (
        (queries, "queries"), (key_pages, "key_pages"), (value_pages, "value_pages")))  # fmt: skip
    if queries.ndim != 3:
        raise ValueError(f"queries must have shape [Q, N, H], got shape {queries.shape}")
    if queries.dtype not in INPUT_DTYPES:
        allowed = ", ".join(jnp.dtype(d).name for d in INPUT_DTYPES)
        raise TypeError(f"queries dtype must be one of {allowed}, got {queries.dtype}")
    key_scale, value_scale = _fp8.check(queries, key_pages, value_pages, key_scale, value_scale,
                                        names=("key_pages", "value_pages"))  # fmt: skip
    for name, x in (("key_pages", key_pages), ("value_pages", value_pages)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have shape [P, page_size, K, H], got shape {x.shape}")
        if key_scale is None and x.dtype != queries.dtype:
            raise TypeError(f"queries and {name} must share one dtype (or the pools be fp8 with scales), got "
                            f"{queries.dtype} and {x.dtype}")  # fmt: skip
    if value_pages.shape != key_pages.shape:
        raise ValueError(f"value_pages shape must equal key_pages shape {key_pages.shape}, got {value_pages.shape}")
    n, h = queries.shape[1:]
    pool, page_size, kv_heads, kh = key_pages.shape
    if kh != h or pool == 0 or page_size == 0 or kv_heads == 0 or n % kv_heads:
        raise ValueError(f"key_pages must be [P >= 1, page_size >= 1, K, H = {h}] with the query heads ({n}) a "
                         f"multiple of K, got shape {key_pages.shape}")  # fmt: skip
    page_indices = as_clamped_int32(page_indices, "page_indices", 0, pool - 1)
    if page_indices.ndim != 2 or page_indices.shape[1] == 0:
        raise ValueError(f"page_indices must have shape [S, max_pages >= 1], got {page_indices.shape}")
    sequences, max_pages = page_indices.shape
    kv_lengths = as_clamped_int32(kv_lengths, "kv_lengths", 0, max_pages * page_size)
    if kv_lengths.shape != (sequences,):
        raise ValueError(f"kv_lengths must have shape [S] = ({sequences},), got {kv_lengths.shape}")
    query_starts = check_starts(query_starts, "query_starts", queries.shape[0], sequences)
    if num_seqs is None:
        num_seqs = jnp.int32(sequences)
    else:
        num_seqs = as_clamped_int32(num_seqs, "num_seqs", 0, sequences)
        if num_seqs.shape not in ((), (1,)):
            raise ValueError(f"num_seqs must be an int scalar, got shape {num_seqs.shape}")
        num_seqs = num_seqs.reshape(())
    return queries, key_pages, value_pages, kv_lengths, page_indices, query_starts, num_seqs, key_scale, value_scale


def ragged_paged_attention(queries, key_pages, value_pages, kv_lengths, page_indices, query_starts, num_seqs=None, *,
                           scale=None, local_window_size=None, softcap=None, sinks=None, key_scale=None,
                           value_scale=None, return_residual=False, implementation=None):  # fmt: skip
    """Causal attention of a ragged batch of sequences' new tokens over their paged caches.

    Args:
      queries: `[Q, N, H]`, the new tokens of every sequence, concatenated in order.
      key_pages, value_pages: `[P, page_size, K, H]`, one pool (fp8 with `key_scale` and
        `value_scale` as in `jax_flash.attention`).
      kv_lengths: int `[S]`: tokens in each sequence's cache, its new ones included; clipped into
        `[0, max_pages * page_size]`.
      page_indices: int `[S, max_pages]`, as in `jax_flash.paged_attention` (clamped into the pool).
      query_starts: int `[S + 1]`: sequence `i`'s queries are rows `query_starts[i]:query_starts[i + 1]`,
        its last `q_i` positions (causal, bottom-right). Runtime values are made valid: clamped
        into `[0, Q]`, the first taken as 0, then a running maximum (never decreasing).
      num_seqs: int scalar (an array: one compiled step serves every batch) `<= S`, or None for
        `S`: sequences past it, and rows past `query_starts[num_seqs]`, are padding (output 0,
        lse -inf or the sink).
      scale, softcap, sinks: as in `jax_flash.attention`. local_window_size: `w` or `(w, right)`
        (keys at most `w` before a query's position; causal, so `right` is 0).
      return_residual: also the log-sum-exp `[Q, N]` float32.
      implementation: None (the kernels where they take the call, else "xla"), "xla", or "cuda"
        (the kernels, or a ValueError saying why not).

    A query whose position sees no key (`kv_lengths[i] < q_i`) gets output 0. Forward only.

    Returns:
      `[Q, N, H]` in the queries' dtype (and the lse with `return_residual`).
    """
    if implementation not in (None, "xla", "cuda"):
        raise ValueError(f"implementation must be None, 'xla' or 'cuda', got {implementation!r}")
    args = _check(queries, key_pages, value_pages, kv_lengths, page_indices, query_starts, num_seqs, key_scale,
                  value_scale)  # fmt: skip
    queries = args[0]
    # Causal: a window's right side is 0 whatever is given. Sides past every position are clipped.
    left = _check_window(local_window_size, reach=queries.shape[0] + args[1].shape[1] * args[4].shape[1])[0]
    softcap = check_softcap(softcap)
    sinks = _sinks.check(sinks, queries.shape[1])
    scale = check_scale(scale, queries.shape[-1])

    reason = "implementation='xla'" if implementation == "xla" else cuda_impl.ragged_reason(
        queries, args[1], args[4].shape[0], scale)
    if implementation == "cuda" and reason is not None:
        raise ValueError(f"implementation='cuda' cannot run ragged_paged_attention: {reason}")

    def run(*arrays):
        if reason is None:
            # Under vmap, a batch of steps runs one kernel call after another.
            kernels = jax.custom_batching.sequential_vmap(functools.partial(
                cuda_impl.ragged_paged_attention, scale=scale, left=left, softcap=softcap))
            return kernels(*arrays)
        return _walk(*arrays[:5], *rows_of_starts(arrays[5], arrays[6], queries.shape[0]), *arrays[7:],
                     scale=scale, left=left, softcap=softcap)  # fmt: skip

    out, lse = _fp8.forward_only(run, *args[:7], args[7], args[8], sinks, what="ragged_paged_attention")
    return (out, lse) if return_residual else out


def rows_of_starts(query_starts, num_seqs, q_rows: int):
    """Each query row's (sequence, or -1 for padding; its index among the sequence's queries; the
    sequence's query count) from valid query starts."""
    rows = jnp.arange(q_rows, dtype=jnp.int32)
    seq = _search.searchsorted(query_starts[1:], rows)
    valid = (rows < query_starts[num_seqs]) & (seq < num_seqs)
    seq = jnp.minimum(seq, query_starts.shape[0] - 2)
    start = query_starts[seq]
    return jnp.where(valid, seq, -1), rows - start, query_starts[seq + 1] - start


def _walk(queries, key_pages, value_pages, kv_lengths, page_indices, row_seq, row_query, row_count, key_scale,
          value_scale, sinks, *, scale, left, softcap):  # fmt: skip
    """(out [Q, N, H], lse [Q, N]): every query row against its sequence's pages, `chunk` pages a
    step, with an online softmax; a row's sequence, index among its queries and their count as
    `rows_of_starts` gives them (sequence -1: a padding row, output 0)."""
    q_rows, n, h = queries.shape
    _, page_size, kv_heads, _ = key_pages.shape
    sequences, max_pages = page_indices.shape
    group = n // kv_heads
    valid = row_seq >= 0
    seq = jnp.maximum(row_seq, 0)
    kv_len = kv_lengths[seq]
    position = kv_len - row_count + row_query  # of each row among its sequence's keys
    chunk = max(1, min(max_pages, CHUNK_BYTES // max(1, 2 * q_rows * page_size * kv_heads * h * 4)))
    steps = -(-max_pages // chunk)
    table = jnp.pad(page_indices, ((0, 0), (0, steps * chunk - max_pages)))[seq]  # [Q, steps * chunk]
    dt = jnp.promote_types(queries.dtype, jnp.float32)  # float32 math (float64 for float64 queries)
    q = queries.astype(dt).reshape(q_rows, kv_heads, group, h) * scale
    scales = [None if s is None else s[None, None, :, None] for s in (key_scale, value_scale)]

    def step(i, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(table, i * chunk, chunk, axis=1)  # [Q, chunk]
        k, v = (jnp.take(pool, pages, axis=0).reshape(q_rows, chunk * page_size, kv_heads, h).astype(dt)
                for pool in (key_pages, value_pages))  # fmt: skip
        if scales[0] is not None:
            k, v = k * scales[0], v * scales[1]
        s = jnp.einsum("qkgh,qskh->qkgs", q, k)
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        keys = i * chunk * page_size + jnp.arange(chunk * page_size, dtype=jnp.int32)
        seen = (keys[None] < kv_len[:, None]) & (keys[None] <= position[:, None]) & valid[:, None]
        if left is not None:
            seen &= keys[None] >= position[:, None] - left
        s = jnp.where(seen[:, None, None, :], s, -jnp.inf)
        v = jnp.where(seen[:, :, None, None], v, 0)  # slots no row sees may hold anything, NaN included
        m_new = jnp.maximum(m, s.max(-1))
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - shift[..., None])
        correction = jnp.exp(jnp.where(jnp.isfinite(m), m, shift) - shift)
        l = l * correction + p.sum(-1)
        acc = acc * correction[..., None] + jnp.einsum("qkgs,qskh->qkgh", p, v)
        return m_new, l, acc

    init = (jnp.full((q_rows, kv_heads, group), -jnp.inf, dt), jnp.zeros((q_rows, kv_heads, group), dt),
            jnp.zeros((q_rows, kv_heads, group, h), dt))  # fmt: skip
    m, l, acc = jax.lax.fori_loop(0, steps, step, init)
    seen = l > 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0).reshape(q_rows, n, h)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf).reshape(q_rows, n)
    if sinks is not None:
        out, lse = _sinks.apply(out, lse, sinks)
        # Padding rows see no key and no sink: output 0 (the sink would give them its lse alone).
        lse = jnp.where(valid[:, None], lse, -jnp.inf)
    return out.astype(queries.dtype), lse
