"""The part the nnx and linen modules share: RoPE, then attention with only the extras set."""

from __future__ import annotations

import math

import jax.numpy as jnp

from jax_flash.flax.rotary import apply_rotary


def head_shape(in_features: int, num_heads: int, num_kv_heads: int | None, head_dim: int | None) -> tuple[int, int]:
    """(kv heads, head dim) of a module, checked: ValueError naming the argument otherwise."""
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if not isinstance(kv_heads, int) or kv_heads < 1 or num_heads % kv_heads:
        raise ValueError(f"num_kv_heads must be a positive int dividing num_heads ({num_heads}), got {num_kv_heads!r}")
    head_dim = in_features // num_heads if head_dim is None else head_dim
    if not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive int; by default it is in_features // num_heads "
                         f"({in_features} // {num_heads}): pass head_dim, or more features than heads; "
                         f"got {head_dim!r}")  # fmt: skip
    return kv_heads, head_dim


def attend(module, q, k, v, positions, segment_ids, sinks=None):
    """q: [batch..., T, N, H], k/v: [batch..., S, K, H] -> [batch..., T, N, H]; `sinks`: the
    module's learned [N] sink logits, or None. Extras that are unset are not passed, so
    `module.attention` may be jax.nn.dot_product_attention too. Any number of batch axes (none
    too): they are folded into one for the call."""
    if module.rope:
        q = apply_rotary(q, positions, module.rope_base)
        k = apply_rotary(k, positions, module.rope_base)
    extras = {}
    if module.softcap is not None:
        extras["softcap"] = module.softcap
    if sinks is not None:
        extras["sinks"] = sinks
    batch = q.shape[:-3]
    fold = lambda x: x.reshape((math.prod(batch),) + x.shape[-3:])  # noqa: E731
    if segment_ids is not None:
        segments = jnp.broadcast_to(segment_ids, batch + segment_ids.shape[-1:]).reshape(math.prod(batch), -1)
        extras.update(q_segment_ids=segments, kv_segment_ids=segments)
    out = module.attention(fold(q), fold(k), fold(v), is_causal=module.is_causal,
                           local_window_size=module.local_window_size, **extras)  # fmt: skip
    return out.reshape(batch + out.shape[-3:])
