"""Attention sinks (gpt-oss): a learned logit per query head that joins every row's softmax and
carries no value. With `lse` the log-sum-exp of a row's visible logits and `out` its output:

    lse' = logaddexp(lse, sink)        out' = out * exp(lse - lse')

which is `softmax([logits, sink])` over `[V, 0]` exactly. The kernels join the sink in their
softmax finish (cuda/common/row_total.cuh) and differentiate it themselves (cuda_impl's
_sinks_gradient); the other paths compute `(out, lse)` first and the sink enters here once, after
every merge of partial results (blocks, a ring's steps), its gradients through `out` and `lse`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flash._validation import _as_array


def check(sinks, heads: int) -> jax.Array | None:
    """The sinks as given, or None; a TypeError or ValueError naming `sinks` otherwise."""
    if sinks is None:
        return None
    sinks = _as_array(sinks, "sinks")
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise TypeError(f"sinks must be a floating-point array, got dtype {sinks.dtype}")
    if sinks.shape != (heads,):
        raise ValueError(f"sinks must have shape [N] = ({heads},), one logit per query head, got {sinks.shape}")
    return sinks


def apply(out: jax.Array, lse: jax.Array, sinks: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(out', lse') of rows whose softmax also spans their head's sink. `out`: [..., N, Hv], `lse`:
    [..., N] (float32 or float64); the sink is used as given (no scale, cap or bias), in `lse`'s
    dtype. A row that saw no key (lse -inf) gets output 0 and lse' = its sink; with a sink of -inf
    too, lse' stays -inf, never NaN."""
    sink = sinks.astype(lse.dtype)
    top = jnp.maximum(lse, sink)
    seen = top > -jnp.inf
    # Shifted by the larger of the two; a row where both are -inf takes 0 and a denominator of 1,
    # so that neither the value nor a gradient becomes NaN there.
    shift = jnp.where(seen, top, 0)
    rows, sink_term = jnp.exp(lse - shift), jnp.exp(sink - shift)
    denominator = jnp.where(seen, rows + sink_term, 1)
    total = jnp.where(seen, shift + jnp.log(denominator), -jnp.inf)
    weight = rows / denominator  # exp(lse - total)
    return (out.astype(weight.dtype) * weight[..., None]).astype(out.dtype), total
