"""Context parallelism: attention over a sequence sharded along a mesh axis (ring attention).

Called inside `jax.shard_map`, each device holds a slice of the queries and of the keys/values.
The key/value slices travel round the ring with `ppermute` (the next one is sent while this one is
computed); each device attends its queries to every slice and merges the partial results through
their log-sum-exp. The backward walks the ring again: every slice's share of the gradients comes
from the kernels' backward fed with the final output and log-sum-exp (the FlashAttention identity
that makes a block's gradient independent of the other blocks), and dK/dV travel with their slice
until they are back home. Memory per device is one local slice of each array, whatever the ring.

Causal attention needs a balanced layout: with contiguous slices the last device would attend to
every slice and the first to one. `zigzag` orders the sequence so that device r holds chunks r
and 2P-1-r of 2P equal chunks; then every device computes the same amount at every ring step.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_flash import _lse_merge, _sinks, _tangent, cuda_impl, xla_impl
from jax_flash._validation import Call, validate
from jax_flash.attention import uses_cuda


def _check_shards(x, num_shards, axis: int) -> int:
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards must be a positive int, got {num_shards!r}")
    if x.shape[axis] % (2 * num_shards):
        raise ValueError(f"the sequence axis ({axis}, of length {x.shape[axis]}) must split into 2 * num_shards = "
                         f"{2 * num_shards} equal chunks")  # fmt: skip
    return num_shards


def zigzag(x: jax.Array, num_shards: int, axis: int = 1) -> jax.Array:
    """Reorders `axis` (the sequence) so that contiguous sharding over `num_shards` devices gives
    device r the chunks r and 2P-1-r of 2P equal chunks: the layout causal `ring_attention`
    expects. `unzigzag` undoes it."""
    chunks = jnp.split(x, 2 * _check_shards(x, num_shards, axis), axis=axis)
    order = [c for r in range(num_shards) for c in (r, 2 * num_shards - 1 - r)]
    return jnp.concatenate([chunks[c] for c in order], axis=axis)


def unzigzag(x: jax.Array, num_shards: int, axis: int = 1) -> jax.Array:
    """The inverse of `zigzag`."""
    chunks = jnp.split(x, 2 * _check_shards(x, num_shards, axis), axis=axis)
    order = [c for r in range(num_shards) for c in (r, 2 * num_shards - 1 - r)]
    inverse = sorted(range(2 * num_shards), key=lambda i: order[i])
    return jnp.concatenate([chunks[i] for i in inverse], axis=axis)


class _Static(NamedTuple):
    axis_name: str
    axis_size: int
    is_causal: bool
    scale: float | None
    implementation: str | None


def ring_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    axis_name: str,
    is_causal: bool = False,
    scale: float | None = None,
    implementation: str | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Attention of a sequence sharded along mesh axis `axis_name`; call it inside `jax.shard_map`.

    Args:
      query: this device's `[B, T, N, H]` slice of the queries.
      key, value: this device's `[B, S, K, H]` slices of the keys and values (GQA when K < N).
      axis_name: the mesh axis the sequence is sharded over (the ring).
      is_causal: causal attention over the whole sequence. The sequence must then be in `zigzag`
        order over the ring (apply `zigzag` before sharding, `unzigzag` to the output), and T == S
        with T even.
      scale, implementation: as in `jax_flash.attention`, applied to every block.
      sinks: as in `jax_flash.attention` (`[N]`, one logit per query head, replicated), joined
        once after the ring's last merge.

    Returns:
      This device's slice of the output, `[B, T, N, H]`, like `query`. Differentiable in query,
      key and value.
    """
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError(
            "ring_attention takes batched [B, T, N, H] slices; got query, key, value of ranks "
            f"{query.ndim}, {key.ndim}, {value.ndim}"
        )
    if is_causal and (query.shape[1] != key.shape[1] or query.shape[1] % 2):
        raise ValueError(
            "causal ring_attention needs equal, even query and key slice lengths (zigzag layout); "
            f"got T={query.shape[1]}, S={key.shape[1]}"
        )
    _validate(query, key, value, is_causal, scale, implementation)  # as jax_flash.attention does
    if value.shape[-1] != query.shape[-1]:
        raise ValueError(f"ring_attention takes a value head dim equal to the query's ({query.shape[-1]}), "
                         f"got {value.shape[-1]}")  # fmt: skip
    sinks = _sinks.check(sinks, query.shape[2])
    static = _Static(axis_name, _axis_size(axis_name), is_causal, scale, implementation)
    out, lse = _ring(static, query, key, value)
    # The sink joins once, after the ring's last merge.
    return out if sinks is None else _sinks.apply(out, lse, sinks)[0]


def _axis_size(axis_name: str) -> int:
    if hasattr(jax.lax, "axis_size"):
        return jax.lax.axis_size(axis_name)
    return jax.lax.psum(1, axis_name)  # a Python int inside shard_map on older jax


# ---- one block pair ------------------------------------------------------------------------


def _validate(q, k, v, causal: bool, scale, implementation) -> Call:
    return validate(q, k, v, None, None, scale=scale, is_causal=causal, query_seq_lengths=None,
                    key_value_seq_lengths=None, local_window_size=None,
                    implementation=implementation, return_residual=True, softcap=None,
                    q_segment_ids=None, kv_segment_ids=None)  # fmt: skip


def _block_forward(static: _Static, q, k, v, causal: bool):
    """(out, lse [B, T, N]) of q against one key/value block."""
    call = _validate(q, k, v, causal, static.scale, static.implementation)
    if uses_cuda(call, static.implementation):
        return cuda_impl.attention(call)
    return xla_impl.attention(call)


def _block_backward(static: _Static, q, k, v, causal: bool, out, lse, d_out, d_lse):
    """One block's share of (dq, dk, dv), from the final out, lse and their cotangents of q's
    rows (the whole row's softmax: each block's share of d lse is its probabilities' part)."""
    call = _validate(q, k, v, causal, static.scale, static.implementation)
    if uses_cuda(call, static.implementation):
        return cuda_impl.backward(call, out, lse, d_out, d_lse)
    return xla_impl.backward(call, out, lse, d_out, d_lse)[:3]


# ---- the ring ------------------------------------------------------------------------------


def _shift(static: _Static, *xs):
    """Each array to the next device of the ring."""
    perm = [(j, (j + 1) % static.axis_size) for j in range(static.axis_size)]
    return jax.lax.ppermute(xs, static.axis_name, perm)


def _step_forward(static: _Static, q, k, v, step: int, rank):
    """(out, lse) of q against the slice that arrived `step` hops ago, from device rank - step."""
    if step == 0:
        return _block_forward(static, q, k, v, static.is_causal)
    if not static.is_causal:
        return _block_forward(static, q, k, v, False)
    # Zigzag: device s holds chunks (s, 2P-1-s). From an earlier device (s < rank) both of this
    # device's query chunks see the slice's first chunk and neither its second; from a later one
    # only the second query chunk sees anything, and all of the slice.
    c = q.shape[1] // 2
    source = (rank - step) % static.axis_size

    def from_earlier():
        return _block_forward(static, q, k[:, :c], v[:, :c], False)

    def from_later():
        out, lse = _block_forward(static, q[:, c:], k, v, False)
        return (jnp.concatenate([jnp.zeros_like(out), out], axis=1),
                jnp.concatenate([jnp.full_like(lse, -jnp.inf), lse], axis=1))  # fmt: skip

    return jax.lax.cond(source < rank, from_earlier, from_later)


def _step_backward(static: _Static, q, k, v, out, lse, d_out, d_lse, step: int, rank):
    if step == 0 or not static.is_causal:
        return _block_backward(static, q, k, v, static.is_causal and step == 0, out, lse, d_out, d_lse)
    c = q.shape[1] // 2
    source = (rank - step) % static.axis_size

    def from_earlier():
        dq, dk, dv = _block_backward(static, q, k[:, :c], v[:, :c], False, out, lse, d_out, d_lse)
        pad = lambda x: jnp.concatenate([x, jnp.zeros_like(x)], axis=1)  # noqa: E731
        return dq, pad(dk), pad(dv)

    def from_later():
        dq, dk, dv = _block_backward(static, q[:, c:], k, v, False, out[:, c:], lse[:, c:], d_out[:, c:],
                                     d_lse[:, c:])
        return jnp.concatenate([jnp.zeros_like(dq), dq], axis=1), dk, dv

    return jax.lax.cond(source < rank, from_earlier, from_later)


def _acc_dtype(x):
    return jnp.float64 if x.dtype == jnp.float64 else jnp.float32


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _ring(static: _Static, q, k, v):
    """(out, lse [B, T, N]) of the ring, both differentiable (the sinks join from the lse)."""
    return _ring_forward(static, q, k, v)


@_ring.defjvp
def _ring_jvp(static: _Static, primals, tangents):
    # Reverse mode transposes the tangent into the ring's own backward (_ring_bwd); forward mode
    # evaluates it as the forward's jvp (each block's tangent by its attention's own rule).
    out, lse = _ring_forward(static, *primals)
    d_out, d_lse = _TANGENT(static, _RING_LAYOUT, primals, out, lse, tangents)
    return (out, lse), (d_out, d_lse)


def _ring_tangent(static: _Static, primals, out, lse, tangents):
    return jax.jvp(functools.partial(_ring_forward, static), tuple(primals), tuple(tangents))[1]


def _ring_forward(static: _Static, q, k, v):
    """(out, lse) of the whole ring: each slice of keys and values visits every device."""
    rank = jax.lax.axis_index(static.axis_name)
    acc_dtype = _acc_dtype(q)
    out = jnp.zeros(q.shape, acc_dtype)
    lse = jnp.full(q.shape[:3], -jnp.inf, acc_dtype)
    for step in range(static.axis_size):
        # The next slice is sent before this one is used, so the transfer overlaps the compute.
        arriving = _shift(static, k, v) if step + 1 < static.axis_size else None
        block_out, block_lse = _step_forward(static, q, k, v, step, rank)
        out, lse = _lse_merge.merge(out, lse, block_out, block_lse.astype(acc_dtype))
        if arriving is not None:
            k, v = arriving
    return out.astype(q.dtype), lse


def _ring_bwd(static: _Static, primals, out, lse, d_out, d_lse, needed):
    """(dq, dk, dv) from the cotangents of the ring's output and lse."""
    q, k, v = primals
    rank = jax.lax.axis_index(static.axis_name)
    acc_dtype = _acc_dtype(q)
    dq = jnp.zeros(q.shape, acc_dtype)
    dk, dv = jnp.zeros(k.shape, acc_dtype), jnp.zeros(v.shape, acc_dtype)
    for step in range(static.axis_size):
        arriving = _shift(static, k, v) if step + 1 < static.axis_size else None
        dq_b, dk_b, dv_b = _step_backward(static, q, k, v, out, lse, d_out, d_lse, step, rank)
        dq, dk, dv = dq + dq_b, dk + dk_b, dv + dv_b
        # dK and dV travel with their slice; after the last step one hop takes them home.
        dk, dv = _shift(static, dk, dv)
        if arriving is not None:
            k, v = arriving
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_RING_LAYOUT = _tangent.Layout((True, True, True), (0, 1, 2))
_TANGENT = _tangent.TangentMap("jax_flash_ring_attention_tangent", _ring_tangent, _ring_bwd)
