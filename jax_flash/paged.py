"""`jax_flash.paged_attention`: attention of each sequence's last queries over a paged KV cache.

The cache is one pool of pages shared by every sequence (`[P, page_size, K, H]`); a sequence's
tokens are the pages its row of `page_indices` names, in order. On a GPU the decode kernels read
the pages in place (up to 16 queries, pages of a multiple of 16 tokens); every other call gathers
each sequence's pages into a dense `[B, S, K, H]` cache and runs `jax_flash.attention` on it with
the sequence lengths (the CUDA kernels where they take the call, e.g. a chunked prefill; the xla
path elsewhere).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flash import _fp8, _partition, _sinks, cuda_impl
from jax_flash._validation import INPUT_DTYPES, Call, _as_array, _check_lengths, as_clamped_int32, validate
from jax_flash.attention import attend


def _check_pages(query, key_pages, value_pages, lengths, page_indices, fp8: bool):
    """The arguments checked (the pools' dtype against the query's unless `fp8`: _fp8.check
    paired them)."""
    query, key_pages, value_pages = (
        _as_array(x, name) for x, name in ((query, "query"), (key_pages, "key_pages"), (value_pages, "value_pages"))
    )
    if query.ndim != 4:
        raise ValueError(f"query must have shape [B, T, N, H], got shape {query.shape}")
    for name, x in (("key_pages", key_pages), ("value_pages", value_pages)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have shape [P, page_size, K, H], got shape {x.shape}")
        if not fp8 and (x.dtype != query.dtype or query.dtype not in INPUT_DTYPES):
            allowed = ", ".join(jnp.dtype(d).name for d in INPUT_DTYPES)
            raise TypeError(f"query and {name} must share one dtype of {allowed}, got {query.dtype} and {x.dtype}")
    if value_pages.shape != key_pages.shape:
        raise ValueError(f"value_pages shape must equal key_pages shape {key_pages.shape}, got {value_pages.shape}")
    b, _, n, h = query.shape
    pool, page_size, kv_heads, kh = key_pages.shape
    if kh != h:
        raise ValueError(f"key_pages head dim must equal query's ({h}), got shape {key_pages.shape}")
    if pool == 0 or page_size == 0 or kv_heads == 0 or n % kv_heads != 0:
        raise ValueError(f"key_pages must have at least one page, token and kv head, with the query heads ({n}) a "
                         f"multiple of the kv heads; got shape {key_pages.shape}")  # fmt: skip
    lengths = _check_lengths(lengths, "lengths", b)
    if lengths is None:
        raise TypeError("lengths must be an int array of shape (B,)")
    # Clamped into the pool before the cast to int32: a 64-bit index would wrap onto another page.
    page_indices = as_clamped_int32(page_indices, "page_indices", low=0, high=pool - 1)
    if page_indices.ndim != 2 or page_indices.shape[0] != b or page_indices.shape[1] == 0:
        raise ValueError(f"page_indices must have shape (B, max_pages) = ({b}, >= 1), got {page_indices.shape}")
    return query, key_pages, value_pages, lengths, page_indices


def _gathered_sharding(pages, page_indices):
    """Over explicit mesh axes, the gathered tokens' sharding: the batch split as the page table's,
    the kv heads as the pool's (JAX asks for it: a gather's result sharding is not inferred there).
    None otherwise."""
    pool, table = _partition.explicit_sharding(pages), _partition.explicit_sharding(page_indices)
    if pool is None and table is None:
        return None
    mesh = (pool or table).mesh
    batch = table.spec[0] if table is not None and len(table.spec) else None
    kv_heads = pool.spec[2] if pool is not None and len(pool.spec) > 2 else None
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(batch, None, None, kv_heads, None))


def gather_pages(pages: jax.Array, page_indices: jax.Array) -> jax.Array:
    """[P, page_size, K, H] pages -> [B, max_pages * page_size, K, H], each sequence's pages in
    order. Indices outside [0, P) are clamped into it (they read a page of the pool, never memory
    outside it)."""
    sharding = _gathered_sharding(pages, page_indices)
    if sharding is None:
        tokens = jnp.take(pages, page_indices, axis=0, mode="clip")  # [B, max_pages, page_size, K, H]
    else:
        tokens = pages.at[page_indices].get(mode="clip", out_sharding=sharding)
    b, max_pages, page_size = tokens.shape[:3]
    return tokens.reshape(b, max_pages * page_size, *pages.shape[2:])


def _cache_call(query, keys, values, lengths, options: dict, fp8_cache: bool = False) -> Call:
    """The validated call of `attention` on gathered caches. The queries are the last T tokens,
    also where T equals the gathered length (diagonal_by_lengths)."""
    return validate(query, keys, values, None, None, key_value_seq_lengths=lengths, query_seq_lengths=None,
                    q_segment_ids=None, kv_segment_ids=None, diagonal_by_lengths=True, fp8_cache=fp8_cache,
                    **options)  # fmt: skip


def _gathered_call(query, key_pages, value_pages, lengths, page_indices, options: dict, fp8_cache: bool = False) -> Call:
    """`_cache_call` on the gathered caches, traced for its shapes and settings only (no gather
    runs)."""
    calls = []

    def trace(query, key_pages, value_pages, lengths, page_indices):
        keys, values = gather_pages(key_pages, page_indices), gather_pages(value_pages, page_indices)
        calls.append(_cache_call(query, keys, values, lengths, options, fp8_cache))
        return query

    jax.eval_shape(trace, query, key_pages, value_pages, lengths, page_indices)
    return calls[0]


def paged_attention(query, key_pages, value_pages, lengths, page_indices, *, scale=None, is_causal=False,
                    local_window_size=None, softcap=None, return_residual=False, implementation=None,
                    sinks=None, key_scale=None, value_scale=None):  # fmt: skip
    """Attention of each sequence's last `T` queries over its tokens in a paged KV cache.

    Shape letters as in `jax_flash.attention`; P pages of `page_size` tokens in one pool.

    Args:
      query: `[B, T, N, H]`: query `i` of sequence `b` sits at position `lengths[b] - T + i`.
      key_pages, value_pages: `[P, page_size, K, H]`, the pool shared by every sequence (write the
        new tokens' keys and values into it first, e.g. `key_pages.at[page, slot].set(k_new)`).
      lengths: int `[B]`: tokens in each sequence's cache, the new ones included; at most
        `max_pages * page_size` (larger values are clipped to it).
      page_indices: int `[B, max_pages]`: token `s` of sequence `b` is
        `key_pages[page_indices[b, s // page_size], s % page_size]`. Entries past
        `ceil(lengths[b] / page_size)` are ignored. Indices outside `[0, P)` are clamped into it:
        such a page's tokens come from page 0 or `P - 1`, never from outside the pool.
      scale, is_causal, local_window_size, softcap, return_residual, implementation, sinks,
        key_scale, value_scale: as in `jax_flash.attention` (the causal diagonal puts the last query
        on the last token). fp8 pools (`key_scale`, `value_scale`) are read in place by the decode
        kernels where they take the call (head dims 64 and 128); elsewhere each sequence's pages
        are gathered in fp8 and converted to the query's dtype, then attended. Forward only.

    Returns:
      `[B, T, N, H]`, and with `return_residual` the log-sum-exp `[B, T, N]` float32. A query with
      no token to attend to (`lengths[b] <= T - 1 - i` under a causal mask) gives 0.
    """
    key_scale, value_scale = _fp8.check(query, key_pages, value_pages, key_scale, value_scale,
                                        names=("key_pages", "value_pages"))  # fmt: skip
    query, key_pages, value_pages, lengths, page_indices = _check_pages(
        query, key_pages, value_pages, lengths, page_indices, fp8=key_scale is not None)  # fmt: skip
    sinks = _sinks.check(sinks, query.shape[2])
    # Every path returns its lse here (a gathered cache's lengths keep cuDNN out anyway).
    options = dict(scale=scale, is_causal=is_causal, local_window_size=local_window_size, softcap=softcap,
                   implementation=implementation, return_residual=True)  # fmt: skip
    if key_scale is None:
        out, lse = _over_pages(query, key_pages, value_pages, lengths, page_indices, sinks, options)
    else:  # every derivative refused, the sinks' too (as attention's)
        out, lse = _fp8.forward_only(lambda q, kp, vp, ks, vs, sinks: _over_fp8_pages(
            q, kp, vp, ks, vs, lengths, page_indices, sinks, options), query, key_pages, value_pages, key_scale,
            value_scale, sinks)  # fmt: skip
    return (out, lse) if return_residual else out


def _over_pages(query, key_pages, value_pages, lengths, page_indices, sinks, options: dict):
    """(out, lse): the decode kernels on the pages in place where they take the call, else
    `attend` on the gathered caches; the sinks (or None) joined either way."""
    call = _gathered_call(query, key_pages, value_pages, lengths, page_indices, options)
    implementation = options["implementation"]
    if implementation != "xla" and cuda_impl.paged_reason(call, key_pages.shape[1]) is None:
        out, lse = cuda_impl.paged_attention(call.config, query, key_pages, value_pages, lengths, page_indices,
                                             sinks=sinks)  # fmt: skip
    else:
        keys, values = gather_pages(key_pages, page_indices), gather_pages(value_pages, page_indices)
        call = _cache_call(query, keys, values, jnp.clip(lengths, 0, keys.shape[1]), options)
        out, lse = attend(call, implementation, True, sinks)
    return out, lse


def _over_fp8_pages(query, key_pages, value_pages, key_scale, value_scale, lengths, page_indices, sinks,
                    options: dict):  # fmt: skip
    """(out, lse) over fp8 pools: the decode kernels on the pages in place where they read fp8
    (cuda_impl.fp8_decode_reason), else each sequence's pages gathered (1 byte an element),
    converted to the query's dtype, attended; the sinks (or None) joined either way."""
    if options["implementation"] != "xla":
        call = _gathered_call(query, key_pages, value_pages, lengths, page_indices, options, fp8_cache=True)
        if cuda_impl.fp8_decode_reason(call, key_pages.shape[1]) is None:
            return cuda_impl.paged_attention(call.config, query, key_pages, value_pages, lengths, page_indices,
                                             key_scale, value_scale, sinks)  # fmt: skip
    keys, values = _fp8.dequantize_pair(gather_pages(key_pages, page_indices), gather_pages(value_pages, page_indices),
                                        key_scale, value_scale, query.dtype)  # fmt: skip
    call = _cache_call(query, keys, values, jnp.clip(lengths, 0, keys.shape[1]), options)
    return attend(call, options["implementation"], True, sinks)
