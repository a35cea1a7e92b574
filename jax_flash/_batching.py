"""vmap of the kernel calls without a per-element loop: the mapped axis is folded into the batch.

Every kernel input and output of `_ffi` carries the batch on axis 0 ([B, T, N, H] tensors, [B, N, T]
row statistics, [B, N, T, S] biases), so under `vmap` a [V, B, ...] operand becomes [V * B, ...]
and the kernel runs once. Operands that are not mapped are broadcast first. The forward with only
the queries mapped folds the mapped axis into the query heads instead (GQA: every folded head keeps
its key/value head), so keys and values are not copied V times.

A bias or mask may have a batch axis of 1 that broadcasts over the batch (`broadcast` operands).
Not mapped, it still broadcasts over V * B rows and stays as it is; mapped, or when a result sums
over it (`summed`: the bias's gradient), it is broadcast to B rows first, and that result is
summed back over them.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import jax.numpy as jnp
from jax.custom_batching import custom_vmap


def _fold(x, batched: bool, size: int):
    x = x if batched else jnp.broadcast_to(x, (size,) + x.shape)
    return x.reshape((size * x.shape[1],) + x.shape[2:])


def _call_folded(fn: Callable, axis_size: int, in_batched, args, broadcast=(), summed=None):
    summed = summed or {}
    batch = args[0].shape[1] if in_batched[0] else args[0].shape[0]
    folded, expanded = [], set()
    for i, (x, mapped) in enumerate(zip(args, in_batched)):
        rows = x.shape[1] if mapped else x.shape[0]
        if i in broadcast and rows == 1 and batch > 1:
            if not mapped and i not in summed.values():
                folded.append(x)
                continue
            x = jnp.broadcast_to(x if mapped else x[None], (axis_size, batch) + x.shape[2 if mapped else 1 :])
            mapped = True
            expanded.add(i)
        folded.append(_fold(x, mapped, axis_size))
    outs = []
    for j, o in enumerate(fn(*folded)):
        # Not (axis_size, -1): an empty result ([B, 0, 0, 0], no dbias wanted) has no -1 to infer.
        o = o.reshape((axis_size, o.shape[0] // axis_size) + o.shape[1:])
        outs.append(o.sum(1, keepdims=True) if summed.get(j) in expanded else o)
    return tuple(outs), (True,) * len(outs)


def _indices(names: Sequence[str], of: Sequence[str]) -> tuple[int, ...]:
    return tuple(of.index(name) for name in names)


def fold_into_batch(fn: Callable, *, operands: Sequence[str] = (), results: Sequence[str] = (),
                    broadcast: Sequence[str] = (), summed: Mapping[str, str] | None = None) -> Callable:  # fmt: skip
    """fn(*arrays) -> tuple of arrays, each with its batch on axis 0, batched as one call.
    `operands` and `results` name fn's arguments and results in order; `broadcast`: the operands
    whose batch axis may be 1; `summed`: {result: operand} for results that sum over such an
    operand's batch axis."""
    broadcast = _indices(broadcast, operands)
    summed = {results.index(r): operands.index(o) for r, o in (summed or {}).items()}
    wrapped = custom_vmap(fn)

    @wrapped.def_vmap
    def rule(axis_size, in_batched, *args):
        # Through `wrapped` again, so that an enclosing vmap folds its own axis the same way.
        return _call_folded(wrapped, axis_size, in_batched, args, broadcast, summed)

    return wrapped


def _queries_into_heads(fn: Callable, axis_size: int, q, *rest, per_head=()):
    """fn's (out, lse) for q [V, B, T, N, H] run as [B, T, N * V, H]: head n * V + v, in kv head
    n // group, so that the rest (keys, values, masks) is not copied V times. The operands of
    `rest` at `per_head` ([B, N] per query head, or [B, 0]) follow their heads."""
    size, b, t, n, h = q.shape
    rest = [jnp.repeat(x, size, axis=1) if i in per_head else x for i, x in enumerate(rest)]
    out, lse = fn(jnp.moveaxis(q, 0, 3).reshape(b, t, n * size, h), *rest)
    out = jnp.moveaxis(out.reshape(b, t, n, size, -1), 3, 0)
    lse = jnp.moveaxis(lse.reshape(b, n, size, t), 2, 0)
    return (out, lse), (True, True)


def fold_queries_into_heads(forward: Callable, *, operands: Sequence[str] = (), broadcast: Sequence[str] = (),
                            per_head: Sequence[str] = ()) -> Callable:  # fmt: skip
    """forward(q, k, v, *rest) -> (out [B, T, N, H], lse [B, N, T]), batched as one call (operands
    named by `operands`, in order). With only q mapped and no `broadcast` operand (bias, mask)
    given, q [V, B, T, N, H] runs as [B, T, N * V, H] (head n * V + v, in kv head n // group;
    `per_head` operands, [B, N], repeated to follow); otherwise as `fold_into_batch`."""
    broadcast = _indices(broadcast, operands)
    per_head = tuple(i - 1 for i in _indices(per_head, operands))  # among the operands after q
    wrapped = custom_vmap(forward)

    @wrapped.def_vmap
    def rule(axis_size, in_batched, q, k, v, *masks):
        args = (q, k, v) + masks
        if not in_batched[0] or any(in_batched[1:]) or any(args[i].size for i in broadcast):
            return _call_folded(wrapped, axis_size, in_batched, args, broadcast)
        return _queries_into_heads(wrapped, axis_size, q, k, v, *masks, per_head=per_head)

    return wrapped


_DECODE_OPERANDS = ("q", "k", "v", "kv_lengths", "page_table", "key_scale", "value_scale", "sinks")


def fold_decode(decode: Callable, paged: bool) -> Callable:
    """decode(q, k, v, kv_lengths, page_table, key_scale, value_scale, sinks) -> (out, lse), batched
    as one call (the scales are per batch row, [B, K] or [B, 0]; the sinks [B, N] or [B, 0]). A dense cache folds as
    `fold_queries_into_heads`. A pool of pages [P, page_size, K, H] belongs to no batch row:
    mapped, [V, P, ...] becomes [V * P, ...], and each element's page indices (clamped into its own
    pool first, as unbatched) move to its pages."""
    if not paged:
        return fold_queries_into_heads(decode, operands=_DECODE_OPERANDS, per_head=("sinks",))
    wrapped = custom_vmap(decode)

    @wrapped.def_vmap
    def rule(axis_size, in_batched, q, k, v, kv_lengths, page_table, key_scale, value_scale, sinks):
        q_only, pool_mapped = not any(in_batched[1:]), in_batched[1] or in_batched[2]
        if in_batched[0] and q_only:
            return _queries_into_heads(wrapped, axis_size, q, k, v, kv_lengths, page_table, key_scale, value_scale, sinks,
                                       per_head=(_DECODE_OPERANDS.index("sinks") - 1,))  # fmt: skip
        if pool_mapped:
            k, v = (x if mapped else jnp.broadcast_to(x, (axis_size,) + x.shape) for x, mapped in zip((k, v), in_batched[1:3]))
            pool = k.shape[1]
            pages = page_table if in_batched[4] else jnp.broadcast_to(page_table, (axis_size,) + page_table.shape)
            offsets = (jnp.arange(axis_size, dtype=pages.dtype) * pool)[:, None, None]
            page_table = jnp.clip(pages, 0, pool - 1) + offsets
            k, v = (x.reshape((axis_size * pool,) + x.shape[2:]) for x in (k, v))
        folded = [_fold(x, mapped, axis_size) for x, mapped in ((q, in_batched[0]), (kv_lengths, in_batched[3]),
                                                                  (page_table, in_batched[4] or pool_mapped),
                                                                  (key_scale, in_batched[5]),
                                                                  (value_scale, in_batched[6]),
                                                                  (sinks, in_batched[7]))]  # fmt: skip
        out, lse = wrapped(folded[0], k, v, *folded[1:])
        return (out.reshape((axis_size, -1) + out.shape[1:]), lse.reshape((axis_size, -1) + lse.shape[1:])), (True, True)

    return wrapped
