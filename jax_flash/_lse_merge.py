"""Two softmax results over disjoint logits of the same rows as one, by their log-sum-exps: the
ring's steps (ring.py) and a sink, which is a result of output 0 and lse = its logit (_sinks.py).

    lse' = logaddexp(lse_a, lse_b)        out' = out_a exp(lse_a - lse') + out_b exp(lse_b - lse')

A row with neither (both -inf) stays output 0 and lse -inf, and takes no NaN in a gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def merge(out_a, lse_a, out_b, lse_b) -> tuple[jax.Array, jax.Array]:
    """(out', lse') in the dtype of `out_a` (the accumulation's) and of the lse's: `out_*` [..., Hv]
    (`out_b` None: zero, a sink's), `lse_*` [...] broadcasting against each other."""
    top = jnp.maximum(lse_a, lse_b)
    seen = top > -jnp.inf
    # Shifted by the larger of the two; a row where both are -inf takes 0 and a denominator of 1.
    shift = jnp.where(seen, top, 0)
    w_a, w_b = jnp.exp(lse_a - shift), jnp.exp(lse_b - shift)
    denominator = jnp.where(seen, w_a + w_b, 1)
    total = jnp.where(seen, shift + jnp.log(denominator), -jnp.inf)
    out = out_a * (w_a / denominator)[..., None].astype(out_a.dtype)
    if out_b is not None:
        out = out + out_b.astype(out_a.dtype) * (w_b / denominator)[..., None].astype(out_a.dtype)
    return out, total
