"""Attention sinks (gpt-oss): a learned logit per query head that joins every row's softmax and
carries no value. With `lse` the log-sum-exp of a row's visible logits and `out` its output:

    lse' = logaddexp(lse, sink)        out' = out * exp(lse - lse')

which is `softmax([logits, sink])` over `[V, 0]` exactly. The kernels join the sink in their
softmax finish (cuda/common/row_total.cuh) and differentiate it themselves (cuda_impl's
_sinks_gradient); the other paths compute `(out, lse)` first and the sink enters here once, after
every merge of partial results (blocks, a ring's steps) as one more (_lse_merge), its gradients
through `out` and `lse`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flash import _lse_merge
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
    sink = jnp.broadcast_to(sinks.astype(lse.dtype), lse.shape)
    out_merged, total = _lse_merge.merge(out.astype(lse.dtype), lse, None, sink)
    return out_merged.astype(out.dtype), total
