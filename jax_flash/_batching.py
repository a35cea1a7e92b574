"""vmap of the kernel calls without a per-element loop: the mapped axis is folded into the batch.

Every kernel input and output of `_ffi` carries the batch on axis 0 ([B, T, N, H] tensors and
[B, N, T] row statistics), so under `vmap` a [V, B, ...] operand becomes [V * B, ...] and the
kernel runs once. Operands that are not mapped are broadcast first. The forward with only the
queries mapped folds the mapped axis into the query heads instead (GQA: every folded head keeps
its key/value head), so keys and values are not copied V times.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from jax.custom_batching import custom_vmap


def _fold(x, batched: bool, size: int):
    x = x if batched else jnp.broadcast_to(x, (size,) + x.shape)
    return x.reshape((size * x.shape[1],) + x.shape[2:])


def _call_folded(fn: Callable, axis_size: int, in_batched, args):
    outs = fn(*(_fold(x, b, axis_size) for x, b in zip(args, in_batched)))
    return tuple(o.reshape((axis_size, -1) + o.shape[1:]) for o in outs), (True,) * len(outs)


def fold_into_batch(fn: Callable) -> Callable:
    """fn(*arrays) -> tuple of arrays, each with its batch on axis 0, batched as one call."""
    wrapped = custom_vmap(fn)

    @wrapped.def_vmap
    def rule(axis_size, in_batched, *args):
        # Through `wrapped` again, so that an enclosing vmap folds its own axis the same way.
        return _call_folded(wrapped, axis_size, in_batched, args)

    return wrapped


def fold_queries_into_heads(forward: Callable) -> Callable:
    """forward(q, k, v, *masks) -> (out [B, T, N, H], lse [B, N, T]), batched as one call, where
    the masks are per batch row (the same for every head). With only q mapped, q [V, B, T, N, H]
    runs as [B, T, N * V, H] (head n * V + v, in kv head n // group); otherwise as
    `fold_into_batch`."""
    wrapped = custom_vmap(forward)

    @wrapped.def_vmap
    def rule(axis_size, in_batched, q, k, v, *masks):
        if not in_batched[0] or any(in_batched[1:]):
            return _call_folded(wrapped, axis_size, in_batched, (q, k, v) + masks)
        size, b, t, n, h = q.shape
        out, lse = wrapped(jnp.moveaxis(q, 0, 3).reshape(b, t, n * size, h), k, v, *masks)
        out = jnp.moveaxis(out.reshape(b, t, n, size, -1), 3, 0)
        lse = jnp.moveaxis(lse.reshape(b, n, size, t), 2, 0)
        return (out, lse), (True, True)

    return wrapped
