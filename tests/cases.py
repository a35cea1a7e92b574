"""Random problems for the test grids: inputs plus the keyword arguments of one mask case.

Each case is a function (rng, b, n, t, s) -> kwargs for `jax_flash.attention` / the reference.
Inputs are drawn fresh for every test from a seed derived from its parameters.
"""

import zlib

import jax.numpy as jnp
import numpy as np


def _lengths(rng, b, full):
    # One full-length row, one short row, one row with length 0 (fully masked) when b > 2.
    lengths = rng.integers(1, full + 1, size=b)
    lengths[0] = full
    if b > 2:
        lengths[2] = 0
    return jnp.asarray(lengths, jnp.int32)


def _segments(rng, b, t, s):
    """Packed documents: 3 segments per row in both q and kv; q row 0 also has a segment id
    that appears nowhere in kv (fully masked rows)."""
    def ids(length):
        cuts = np.sort(rng.choice(np.arange(1, length), size=min(2, length - 1), replace=False))
        return np.searchsorted(cuts, np.arange(length), side="right")
    q = np.stack([ids(t) for _ in range(b)])
    kv = np.stack([ids(s) for _ in range(b)])
    q[0, : max(1, t // 8)] = 7
    return jnp.asarray(q, jnp.int32), jnp.asarray(kv, jnp.int32)


def _mask(rng, b, n, t, s):
    m = rng.random((b, 1, t, s)) < 0.7
    m[0, 0, 0, :] = False  # a fully masked row
    return jnp.asarray(m)


CASES = {
    "none": lambda rng, b, n, t, s: {},
    "causal": lambda rng, b, n, t, s: {"is_causal": True},
    "window": lambda rng, b, n, t, s: {"local_window_size": (5, 3)},
    "window_causal": lambda rng, b, n, t, s: {"local_window_size": (9, 4), "is_causal": True},
    "bias": lambda rng, b, n, t, s: {"bias": jnp.asarray(rng.normal(size=(b, n, t, s)))},
    "bias_broadcast": lambda rng, b, n, t, s: {"bias": jnp.asarray(rng.normal(size=(1, n, 1, s)))},
    "mask": lambda rng, b, n, t, s: {"mask": _mask(rng, b, n, t, s)},
    "q_lengths": lambda rng, b, n, t, s: {"query_seq_lengths": _lengths(rng, b, t)},
    "kv_lengths": lambda rng, b, n, t, s: {"key_value_seq_lengths": _lengths(rng, b, s)},
    "lengths_causal": lambda rng, b, n, t, s: {
        "query_seq_lengths": _lengths(rng, b, t), "key_value_seq_lengths": _lengths(rng, b, s),
        "is_causal": True},
    "segments": lambda rng, b, n, t, s: dict(
        zip(("q_segment_ids", "kv_segment_ids"), _segments(rng, b, t, s))),
    "segments_causal": lambda rng, b, n, t, s: dict(
        zip(("q_segment_ids", "kv_segment_ids"), _segments(rng, b, t, s)), is_causal=True),
    "softcap": lambda rng, b, n, t, s: {"softcap": 2.0, "scale": 0.9},
    "softcap_bias_window": lambda rng, b, n, t, s: {
        "softcap": 3.0, "bias": jnp.asarray(rng.normal(size=(b, 1, t, s))),
        "local_window_size": (7, 2)},
    "everything": lambda rng, b, n, t, s: {
        "is_causal": True, "local_window_size": 6, "softcap": 5.0,
        "bias": jnp.asarray(rng.normal(size=(1, n, t, 1))), "mask": _mask(rng, b, n, t, s),
        "key_value_seq_lengths": _lengths(rng, b, s),
        **dict(zip(("q_segment_ids", "kv_segment_ids"), _segments(rng, b, t, s)))},
}


def rng_for(*params):
    return np.random.default_rng(zlib.crc32(repr(params).encode()))


def qkv(rng, dtype, b, t, s, n, kv_heads, h):
    """Fresh normal q, k, v in `dtype` (never zeros)."""
    shapes = ((b, t, n, h), (b, s, kv_heads, h), (b, s, kv_heads, h))
    return tuple(jnp.asarray(rng.normal(size=shape), jnp.float64).astype(dtype) for shape in shapes)
