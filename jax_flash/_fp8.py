"""fp8 KV caches (DESIGN.md's contract): keys and values stored as float8_e4m3fn or float8_e5m2, each
with a float32 scale (a scalar or one per kv head), read as `x.astype(float32) * scale`.

`check` validates a call's pairing of dtypes and scales; `dequantize` is that reading in the
query's dtype (every fp8 value is exact in float16 and bfloat16, so the one rounding is the
product's); `forward_only` refuses to differentiate a call with an fp8 cache (a cache is not
trained); `quantize_kv` writes a cache from the absolute maximum of each kv head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flash._validation import INPUT_DTYPES, _as_array

FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)
_FP8_NAMES = ", ".join(jnp.dtype(d).name for d in FP8_DTYPES)


def is_fp8(x) -> bool:
    return hasattr(x, "dtype") and any(x.dtype == d for d in FP8_DTYPES)


def check(query, key, value, key_scale, value_scale, names=("key", "value")):
    """(key_scale, value_scale) as float32 arrays of shape [K] where `key` and `value` are fp8;
    (None, None) where they are not (and no scale is given). `key`/`value` are `[..., K, H]`
    arrays (or page pools); `names` name them in errors."""
    key_name, value_name = names
    fp8 = [is_fp8(x) for x in (key, value)]
    if not any(fp8):
        for scale, name in ((key_scale, "key_scale"), (value_scale, "value_scale")):
            if scale is not None:
                raise TypeError(f"{name} is for fp8 {key_name} and {value_name} ({_FP8_NAMES}); got "
                                f"{getattr(key, 'dtype', type(key).__name__)} and "
                                f"{getattr(value, 'dtype', type(value).__name__)}")  # fmt: skip
        return None, None
    if not all(fp8) or key.dtype != value.dtype:
        raise TypeError(f"{key_name} and {value_name} must share one fp8 dtype ({_FP8_NAMES}) when either is fp8, "
                        f"got {key.dtype} and {value.dtype}")  # fmt: skip
    query = _as_array(query, "query")
    if query.dtype not in INPUT_DTYPES:
        allowed = ", ".join(jnp.dtype(d).name for d in INPUT_DTYPES)
        raise TypeError(f"query dtype must be one of {allowed} with fp8 {key_name} and {value_name}, got {query.dtype}")
    if key.ndim < 2:
        raise ValueError(f"{key_name} must have shape [..., K, H], got shape {key.shape}")
    kv_heads = key.shape[-2]
    return tuple(_scale(s, name, kv_heads) for s, name in ((key_scale, "key_scale"), (value_scale, "value_scale")))


def _scale(scale, name: str, kv_heads: int) -> jax.Array:
    """A scale as float32 [K]; 1 where None."""
    if scale is None:
        return jnp.ones((kv_heads,), jnp.float32)
    scale = _as_array(scale, name)
    if not jnp.issubdtype(scale.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point scalar or [K] array, got dtype {scale.dtype}")
    if scale.shape not in ((), (1,), (kv_heads,)):
        raise ValueError(f"{name} must be a scalar or have shape [K] = ({kv_heads},), one per kv head, got {scale.shape}")
    return jnp.broadcast_to(scale.astype(jnp.float32).reshape(-1), (kv_heads,))


def dequantize(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """`x.astype(float32) * scale` over x's kv-head axis (-2), rounded once to `dtype`."""
    return (x.astype(jnp.float32) * scale[:, None]).astype(dtype)


def dequantize_pair(key, value, key_scale, value_scale, dtype) -> tuple[jax.Array, jax.Array]:
    """(key, value) of an fp8 cache, each `dequantize`d with its scales."""
    return dequantize(key, key_scale, dtype), dequantize(value, value_scale, dtype)


def forward_only(fn, *args, what: str | None = None):
    """fn(*args) (arrays, or pytrees of them), refusing every derivative: a call with an fp8 cache
    is forward only (or, named by `what`, a function that is)."""

    @jax.custom_jvp
    def call(*args):
        return fn(*args)

    @call.defjvp
    def _refuse(primals, tangents):
        if what is not None:
            raise ValueError(f"{what} is forward only: it has no derivative")
        raise ValueError("attention over fp8 keys and values is forward only (a KV cache is not trained): "
                         "differentiate a call with float16/bfloat16/float32 keys and values instead")  # fmt: skip

    return call(*args)


def quantize_kv(x, dtype=jnp.float8_e4m3fn) -> tuple[jax.Array, jax.Array]:
    """Keys or values `[..., K, H]` (a dense cache, or a pool of pages) as fp8, with one float32 scale
    per kv head from the absolute maximum over every other axis: `(x_q, scale)` with
    `x_q.astype(float32) * scale[:, None]` within the format's precision of `x` (e4m3: a relative
    error up to 2^-4 per element; e5m2: 2^-3), `scale` of shape `[K]`, ready for `key_scale` or
    `value_scale`. A head of zeros gets scale 1. Not differentiable (quantize a cache, not a
    training input). Pass `key_scale`/`value_scale` of one cache to every later write into it, so that
    new tokens share the scales (`jnp.clip(x / scale[:, None], -max, max).astype(dtype)`)."""
    x = _as_array(x, "x")
    if not any(jnp.dtype(dtype) == d for d in FP8_DTYPES):
        raise TypeError(f"dtype must be one of {_FP8_NAMES}, got {jnp.dtype(dtype).name}")
    if not jnp.issubdtype(x.dtype, jnp.floating) or is_fp8(x):
        raise TypeError(f"x must be a float16, bfloat16, float32 or float64 array, got dtype {x.dtype}")
    if x.ndim < 2:
        raise ValueError(f"x must have shape [..., K, H], got shape {x.shape}")
    x = jax.lax.stop_gradient(x).astype(jnp.float32)
    largest = jnp.finfo(dtype).max.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=tuple(a for a in range(x.ndim) if a != x.ndim - 2))
    scale = jnp.where(amax > 0, amax / largest, 1.0).astype(jnp.float32)
    return jnp.clip(x / scale[:, None], -largest, largest).astype(dtype), scale
