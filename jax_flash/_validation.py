"""Argument checking for `jax_flash.attention`.

Turns the user's arguments into a `Call`: every array in the 4-D `BTNH` layout (a missing batch
axis added), every optional mask input either `None` or of a checked shape and dtype, and the static
settings in one hashable `AttentionConfig`. Both implementations take a `Call`; nothing past this
module re-checks arguments. Errors are `TypeError` (wrong kind or dtype) or `ValueError` (wrong
shape or value) and name the argument.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import _search

IMPLEMENTATIONS = (None, "xla", "cuda")
# The largest soft cap: caps are applied in float32, where softcap * tanh(x / softcap) equals x to
# rounding for every |x| << softcap, and a cap near float32's maximum overflows.
MAX_SOFTCAP = 1e30
INPUT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """The static settings of one call (hashable: it is a `custom_jvp` nondiff argument and a primitive's parameter).

    The mask band is kept as offsets from a diagonal: key `j` is visible to query `i` when
    `-window_left <= j - (i + offset) <= window_right`. `None` means unbounded; causal attention
    is `window_right = 0`. `offset` is `S - T` (bottom-right; 0 when T == S, as in `jax.nn`),
    except that with `diagonal_by_lengths` and sequence lengths it is the key length minus the
    query length of each batch row: the last valid query then sees the last valid key. `attention`
    sets it where T != S (a decode step against a dense cache); paged caches always.
    """

    scale: float
    window_left: int | None = None
    window_right: int | None = None
    softcap: float | None = None
    diagonal_by_lengths: bool = True

    def diagonal_offsets(self, t: int, s: int, q_len, kv_len):
        """int32 [B]: each batch row's diagonal offset, from its (clamped) query and key lengths."""
        if self.diagonal_by_lengths:
            return kv_len - q_len
        return jnp.full(q_len.shape, s - t, jnp.int32)


@dataclasses.dataclass(frozen=True)
class Call:
    """A validated call: arrays in `BTNH`, optional inputs `None` or checked."""

    query: jax.Array  # [B, T, N, H]
    key: jax.Array  # [B, S, K, H]
    value: jax.Array  # [B, S, K, Hv], Hv = H or not
    bias: jax.Array | None  # 4-D, each axis 1 or the full size of (B, N, T, S)
    mask: jax.Array | None  # bool, 4-D, like bias
    query_seq_lengths: jax.Array | None  # int32 [B]
    key_value_seq_lengths: jax.Array | None  # int32 [B]
    q_segment_ids: jax.Array | None  # int32 [B, T]
    kv_segment_ids: jax.Array | None  # int32 [B, S]
    config: AttentionConfig
    batched: bool  # False when the inputs came without a batch axis (TNH)


def _as_array(x: Any, name: str) -> jax.Array:
    if isinstance(x, (jax.Array, np.ndarray, np.generic)) or hasattr(x, "__jax_array__"):
        return jnp.asarray(x)
    if isinstance(x, (list, tuple, numbers.Number)):  # bool too, a numbers.Number
        return jnp.asarray(x)
    raise TypeError(f"{name} must be an array, got {type(x).__name__}")


def _check_qkv(query, key, value, fp8_cache: bool = False):
    """(query, key, value with a batch axis, batched). `fp8_cache`: key and value are an fp8 cache
    whose dtypes _fp8.check paired."""
    query, key, value = (_as_array(x, n) for x, n in ((query, "query"), (key, "key"), (value, "value")))
    if query.ndim not in (3, 4):
        raise ValueError(f"query must have shape [B, T, N, H] or [T, N, H], got shape {query.shape}")
    for name, x in (("key", key), ("value", value)):
        if x.ndim != query.ndim:
            raise ValueError(
                f"{name} must have the same rank as query ({query.ndim}), got shape {x.shape}"
            )
    for name, x in (("query", query),) + ((("key", key), ("value", value)) if not fp8_cache else ()):
        if x.dtype not in INPUT_DTYPES:
            allowed = ", ".join(jnp.dtype(d).name for d in INPUT_DTYPES)
            raise TypeError(f"{name} dtype must be one of {allowed}, got {x.dtype}")
    if not fp8_cache and (key.dtype != query.dtype or value.dtype != query.dtype):
        raise TypeError(
            f"query, key and value must share one dtype, got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    batched = query.ndim == 4
    if not batched:
        query, key, value = query[None], key[None], value[None]
    if value.shape[:3] != key.shape[:3]:
        raise ValueError(f"value must have key's batch, length and heads {key.shape[:3]} (its head dim may "
                         f"differ), got shape {value.shape}")  # fmt: skip
    b, t, n, h = query.shape
    if key.shape[0] != b:
        raise ValueError(f"key batch size must equal query's ({b}), got shape {key.shape}")
    if key.shape[3] != h:
        raise ValueError(f"key head dim must equal query's ({h}), got shape {key.shape}")
    if key.shape[2] == 0:
        raise ValueError(f"key must have at least one head, got shape {key.shape}")
    if n % key.shape[2] != 0:
        raise ValueError(
            f"the number of query heads ({n}) must be a multiple of the number of key/value "
            f"heads ({key.shape[2]})"
        )
    return query, key, value, batched


def _check_broadcastable(x, name: str, full_shape: tuple[int, ...]):
    """bias/mask: at most 4-D, each axis 1 or the matching axis of (B, N, T, S)."""
    if x.ndim > 4:
        raise ValueError(f"{name} must have at most 4 axes (B, N, T, S), got shape {x.shape}")
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    for size, full, axis in zip(x.shape, full_shape, "BNTS"):
        if size not in (1, full):
            raise ValueError(
                f"{name} of shape {x.shape} is not broadcastable to (B, N, T, S) = {full_shape}: "
                f"axis {axis} has size {size}, expected 1 or {full}"
            )
    return x


_INT32 = np.iinfo(np.int32)


def clamp_to_int32(x: jax.Array, low: int = _INT32.min, high: int = _INT32.max) -> jax.Array:
    """An integer array as int32, values clamped into [low, high] in their own dtype first (a cast
    alone would wrap: 2**32 + 3 would become 3)."""
    info = jnp.iinfo(x.dtype)
    low, high = max(low, info.min), min(high, info.max)
    return jnp.clip(x, jnp.asarray(low, x.dtype), jnp.asarray(high, x.dtype)).astype(jnp.int32)


def _host_integers(x):
    """A NumPy (or Python) integer array as it is, or None: converted by jnp.asarray, a 64-bit one
    would wrap to int32 where JAX's 64-bit mode is off, before any check could see it."""
    if isinstance(x, (np.ndarray, np.generic, list, tuple, numbers.Integral)) and not isinstance(x, bool):
        x = np.asarray(x)
        return x if np.issubdtype(x.dtype, np.integer) else None
    return None


def as_clamped_int32(x, name: str, low: int = 0, high: int = _INT32.max) -> jax.Array:
    """An integer array (NumPy's or JAX's) as int32, clamped into [low, high] before any cast."""
    host = _host_integers(x)
    if host is not None:
        info = np.iinfo(host.dtype)
        return jnp.asarray(np.clip(host, max(low, info.min), min(high, info.max)).astype(np.int32))
    x = _as_array(x, name)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {x.dtype}")
    return clamp_to_int32(x, low, high)


def _check_lengths(x, name: str, batch: int):
    """int32 [B]; values outside [0, int32's maximum] clamped into it before any cast (each path
    then clamps them into the sequence)."""
    if x is None:
        return None
    x = as_clamped_int32(x, name)
    if x.shape != (batch,):
        raise ValueError(f"{name} must have shape (B,) = ({batch},), got {x.shape}")
    return x


def _check_segments(x, name: str, batch: int, length: int, batched: bool):
    host = _host_integers(x)
    x = host if host is not None else _as_array(x, name)  # NumPy's ids stay NumPy's: no wrap
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {x.dtype}")
    if not batched and x.ndim == 1:
        x = x[None]
    if x.shape != (batch, length):
        raise ValueError(f"{name} must have shape (B, {'T' if name[0] == 'q' else 'S'}) = "
                         f"({batch}, {length}), got {x.shape}")
    return x


def _fits_int32(dtype) -> bool:
    info = jnp.iinfo(dtype)
    return info.min >= _INT32.min and info.max <= _INT32.max


def _segments_as_int32(q_seg: jax.Array, kv_seg: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Segment ids as int32. Ids of a wider type (int64, uint32, uint64) are replaced, row by row,
    by their rank among the row's query and key ids: equal ids stay equal, order is kept (the
    kernels' block skipping relies on sorted ids staying sorted), and nothing wraps."""
    if _fits_int32(q_seg.dtype) and _fits_int32(kv_seg.dtype):
        return jnp.asarray(q_seg).astype(jnp.int32), jnp.asarray(kv_seg).astype(jnp.int32)
    if isinstance(q_seg, np.ndarray) and isinstance(kv_seg, np.ndarray):
        ids = np.sort(np.concatenate([q_seg, kv_seg], axis=1), axis=1)
        rank = lambda x: np.stack([np.searchsorted(r, row) for r, row in zip(ids, x)]).astype(np.int32)  # noqa: E731
        return jnp.asarray(rank(q_seg)), jnp.asarray(rank(kv_seg))
    q_seg, kv_seg = jnp.asarray(q_seg), jnp.asarray(kv_seg)
    wide = jnp.promote_types(q_seg.dtype, kv_seg.dtype)
    q_seg, kv_seg = q_seg.astype(wide), kv_seg.astype(wide)
    ids = jnp.sort(jnp.concatenate([q_seg, kv_seg], axis=1), axis=1)
    rank = jax.vmap(lambda row, x: _search.searchsorted(row, x, side="left"))
    return rank(ids, q_seg), rank(ids, kv_seg)


def _is_int(x) -> bool:
    return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, bool)


def _check_window(local_window_size, reach: int):
    """(left, right) or None sides; a side past `reach` (S + T: no diagonal offset a batch row can
    have puts a key that far from a query) is clipped to it, so that the kernels' int32 band
    arithmetic cannot overflow (2**31 - 1, a natural "unbounded", acts as unbounded)."""
    if local_window_size is None:
        return None, None
    if _is_int(local_window_size):
        local_window_size = (local_window_size, local_window_size)
    if (
        not isinstance(local_window_size, (tuple, list))
        or len(local_window_size) != 2
        or not all(_is_int(w) for w in local_window_size)
    ):
        raise TypeError(
            "local_window_size must be None, an int or a (left, right) pair of ints, "
            f"got {local_window_size!r}"
        )
    left, right = (int(w) for w in local_window_size)
    if left < 0 or right < 0:
        raise ValueError(f"local_window_size values must be >= 0, got {(left, right)}")
    return min(left, reach), min(right, reach)


def check_scale(scale, head_dim: int) -> float:
    """The logit scale as a float: 1 / sqrt(head_dim) for None (1 where H = 0: an empty output, no
    logits to scale), else a finite real number."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim else 1.0
    if isinstance(scale, bool) or not isinstance(scale, (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"scale must be None or a real number, got {type(scale).__name__}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def check_softcap(softcap) -> float | None:
    """None, or a soft cap in (0, MAX_SOFTCAP]."""
    softcap = _check_positive_float(softcap, "softcap")
    if softcap is not None and softcap > MAX_SOFTCAP:
        raise ValueError(f"softcap must be at most {MAX_SOFTCAP:g} (a larger cap changes no float32 logit "
                         f"but overflows; pass None for no cap), got {softcap:g}")  # fmt: skip
    return softcap


def check_starts(starts, name: str, total: int, sequences: int | None = None) -> jax.Array:
    """Packed sequences' starts as int32 [S + 1] (S = `sequences` where given, else any S >= 1):
    clamped into [0, total], the first 0, then nondecreasing (a running maximum)."""
    starts = as_clamped_int32(starts, name, 0, total)
    if sequences is None and (starts.ndim != 1 or starts.shape[0] < 2):
        raise ValueError(f"{name} must have shape [S + 1] with S >= 1 sequences, got {starts.shape}")
    if sequences is not None and starts.shape != (sequences + 1,):
        raise ValueError(f"{name} must have shape [S + 1] = ({sequences + 1},), got {starts.shape}")
    return jax.lax.cummax(starts.at[0].set(0))


def _check_positive_float(x, name: str, allow_none: bool = True) -> float | None:
    if x is None and allow_none:
        return None
    if isinstance(x, bool) or not isinstance(x, (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"{name} must be a Python or NumPy real number, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {x}")
    return x


def validate(
    query,
    key,
    value,
    bias,
    mask,
    *,
    scale,
    is_causal,
    query_seq_lengths,
    key_value_seq_lengths,
    local_window_size,
    implementation,
    return_residual,
    softcap,
    q_segment_ids,
    kv_segment_ids,
    diagonal_by_lengths: bool | None = None,
    fp8_cache: bool = False,
) -> Call:
    """A checked `Call`. `diagonal_by_lengths` (AttentionConfig): None for `attention`'s rule
    (only where T != S); internal callers whose queries are always the last T tokens pass True.
    `fp8_cache`: key and value are an fp8 cache (_fp8.check paired their dtypes), for the decode
    kernels that read it."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be None, 'xla' or 'cuda', got {implementation!r}"
        )
    for name, flag in (("is_causal", is_causal), ("return_residual", return_residual)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    query, key, value, batched = _check_qkv(query, key, value, fp8_cache)
    b, t, n, h = query.shape
    s = key.shape[1]
    full = (b, n, t, s)

    if bias is not None:
        bias = _as_array(bias, "bias")
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise TypeError(f"bias must be a floating-point array, got dtype {bias.dtype}")
        bias = _check_broadcastable(bias, "bias", full)
    if mask is not None:
        mask = _as_array(mask, "mask")
        if mask.dtype != jnp.bool_:
            raise TypeError(
                f"mask must be a boolean array (True = attend; pass additive masks as bias), "
                f"got dtype {mask.dtype}"
            )
        mask = _check_broadcastable(mask, "mask", full)

    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    if q_segment_ids is not None:
        q_segment_ids = _check_segments(q_segment_ids, "q_segment_ids", b, t, batched)
        kv_segment_ids = _check_segments(kv_segment_ids, "kv_segment_ids", b, s, batched)
        q_segment_ids, kv_segment_ids = _segments_as_int32(q_segment_ids, kv_segment_ids)

    scale = check_scale(scale, h)
    left, right = _check_window(local_window_size, reach=s + t)
    if is_causal:
        right = 0 if right is None else min(right, 0)
    softcap = check_softcap(softcap)
    config = AttentionConfig(
        scale=float(scale),
        window_left=left,
        window_right=right,
        softcap=softcap,
        diagonal_by_lengths=t != s if diagonal_by_lengths is None else diagonal_by_lengths,
    )
    return Call(
        query=query,
        key=key,
        value=value,
        bias=bias,
        mask=mask,
        query_seq_lengths=_check_lengths(query_seq_lengths, "query_seq_lengths", b),
        key_value_seq_lengths=_check_lengths(key_value_seq_lengths, "key_value_seq_lengths", b),
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        config=config,
        batched=batched,
    )
