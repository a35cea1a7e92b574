"""`jax_flash.varlen_attention`: FlashAttention's `flash_attn_varlen_func` in JAX's layout.

Sequences packed along the first axis, each attending only within itself. It runs as
`jax_flash.attention` over one packed row with segment ids (one segment a sequence), so the
kernels skip the key blocks of other sequences and nothing is copied. The causal diagonal and
windows align bottom-right per sequence: where queries and keys are packed alike (the same
`query_starts` and `key_starts`, as in training on packed documents) that is the packed row's own
diagonal; otherwise each sequence's offset differs, and the call takes a boolean mask of the
packed [Tq, Tk] visibility (memory Tq x Tk bytes; on the kernels, the bias variant).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import _search
from jax_flash._validation import _as_array, check_starts
from jax_flash.attention import attention


def _same_starts(query_starts, key_starts) -> bool:
    """Whether queries and keys are packed alike, as known when traced: the same array, or equal
    concrete values."""
    if query_starts is key_starts:
        return True
    try:
        return bool(np.array_equal(np.asarray(query_starts), np.asarray(key_starts)))
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError, TypeError):
        return False  # traced: not known


def _segments(starts: jax.Array, length: int, padding: int) -> jax.Array:
    """Each packed row's sequence [length]: i for rows starts[i]:starts[i + 1], `padding` past starts[S]."""
    rows = jnp.arange(length, dtype=jnp.int32)
    seq = _search.searchsorted(starts[1:], rows)
    return jnp.where(rows < starts[-1], seq, padding)


def _visibility(q_starts, k_starts, q_seq, k_seq, is_causal, window) -> jax.Array:
    """[1, 1, Tq, Tk]: same sequence, and the diagonal (bottom-right per sequence) and window."""
    last = q_starts.shape[0] - 2  # padding rows' sequence (S or S + 1) read as the last one's: masked anyway
    qi, ki = jnp.minimum(q_seq, last), jnp.minimum(k_seq, last)
    # Query r of sequence i sits at key position r - q_start + (k_len - q_len) within it.
    q_pos = jnp.arange(q_seq.shape[0]) - q_starts[qi] + (k_starts[qi + 1] - k_starts[qi]) - (q_starts[qi + 1] - q_starts[qi])
    k_pos = jnp.arange(k_seq.shape[0]) - k_starts[ki]
    vis = q_seq[:, None] == k_seq[None, :]
    offset = k_pos[None, :] - q_pos[:, None]
    left, right = window if window is not None else (None, None)
    if is_causal:
        right = 0 if right is None else min(right, 0)
    if right is not None:
        vis &= offset <= right
    if left is not None:
        vis &= offset >= -left
    return vis[None, None]


def varlen_attention(query, key, value, query_starts, key_starts, *, scale=None, is_causal=False,
                     local_window_size=None, softcap=None, sinks=None, return_residual=False,
                     implementation=None):  # fmt: skip
    """Attention of sequences packed along the first axis, each within itself.

    Args:
      query: `[Tq, N, H]`; key, value: `[Tk, K, H]` and `[Tk, K, Hv]` (dtypes and GQA as in
        `jax_flash.attention`).
      query_starts, key_starts: int `[S + 1]`: sequence `i` is query rows
        `query_starts[i]:query_starts[i + 1]` and key rows `key_starts[i]:key_starts[i + 1]`
        (FlashAttention's `cu_seqlens_q`, `cu_seqlens_k`). Runtime values are made valid: clamped
        into `[0, T]`, the first taken as 0, then made nondecreasing (a running maximum). Rows past the
        last start are padding: output 0, no gradient; keys past it are never read.
      is_causal, local_window_size: aligned bottom-right per sequence (its last query sees its
        last key), as FlashAttention's varlen. Pass the same array for both starts where queries
        and keys are packed alike (inside `jit`, the same traced argument; outside, equal values are
        recognised): the call then runs on segment ids alone; with different starts
        and a causal mask or window it builds a `[Tq, Tk]` boolean mask (memory Tq x Tk bytes).
      scale, softcap, sinks, return_residual, implementation: as in `jax_flash.attention`.

    Returns:
      `[Tq, N, Hv]`, and with `return_residual` the log-sum-exp `[Tq, N]`. Differentiable in
      query, key, value and sinks.
    """
    query, key = _as_array(query, "query"), _as_array(key, "key")
    if query.ndim != 3 or key.ndim != 3:
        raise ValueError(f"query and key must have shapes [Tq, N, H] and [Tk, K, H], got {query.shape} and {key.shape}")
    same_packing = _same_starts(query_starts, key_starts)
    q_starts = check_starts(query_starts, "query_starts", query.shape[0])
    k_starts = q_starts if same_packing else check_starts(key_starts, "key_starts", key.shape[0])
    if k_starts.shape != q_starts.shape:
        raise ValueError(f"query_starts and key_starts must both have shape [S + 1], got {q_starts.shape} and "
                         f"{k_starts.shape}")  # fmt: skip
    sequences = q_starts.shape[0] - 1
    # Padding rows and keys in segments of their own (S and S + 1): they see nothing and are never seen.
    q_seq = _segments(q_starts, query.shape[0], sequences)
    k_seq = _segments(k_starts, key.shape[0], sequences + 1)
    window = None
    if local_window_size is not None:
        window = (local_window_size,) * 2 if isinstance(local_window_size, int) else tuple(local_window_size)
    kw = dict(scale=scale, softcap=softcap, sinks=sinks, return_residual=return_residual,
              implementation=implementation)  # fmt: skip
    aligned = same_packing and query.shape[0] == key.shape[0]  # every sequence on the packed row's diagonal
    if aligned or (not is_causal and window is None):
        return attention(query, key, value, is_causal=is_causal, local_window_size=local_window_size,
                         q_segment_ids=q_seq, kv_segment_ids=k_seq, **kw)  # fmt: skip
    mask = _visibility(q_starts, k_starts, q_seq, k_seq, is_causal, window)
    return attention(query, key, value, mask=mask, q_segment_ids=q_seq, kv_segment_ids=k_seq, **kw)
