"""Rotary position embeddings (RoPE) for `[batch..., length, heads, head_dim]` queries/keys."""

from __future__ import annotations

import jax.numpy as jnp


def apply_rotary(x, positions=None, base: float = 10000.0):
    """Rotate pairs (x[..., :H/2], x[..., H/2:]) by position-dependent angles.

    positions: int `[batch..., length]` or `[length]`; default `arange(length)`.
    """
    length, head_dim = x.shape[-3], x.shape[-1]
    if head_dim % 2:
        raise ValueError(f"apply_rotary needs an even head dim, got {head_dim}")
    if positions is None:
        positions = jnp.arange(length)
    half = head_dim // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.asarray(positions, jnp.float32)[..., None] * freq  # [..., length, half]
    sin, cos = jnp.sin(angles)[..., None, :], jnp.cos(angles)[..., None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
