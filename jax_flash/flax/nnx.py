"""Multi-head attention as a Flax nnx module: projections, optional RoPE, jax_flash attention."""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from flax import nnx

import jax_flash
from jax_flash.flax._attend import attend, head_shape


class MultiHeadAttention(nnx.Module):
    """Self-attention over `[batch..., length, features]` with GQA (`num_kv_heads` < `num_heads`),
    causal or windowed masks, soft-capped logits, packed documents (`segment_ids`), RoPE and, with
    `sinks=True`, a learned sink logit per query head (gpt-oss; `sink_logits`, initialised to 0).

    `attention` is the attention function: `jax_flash.attention` by default; anything with the
    signature of `jax.nn.dot_product_attention` (for comparisons) works when the extras are unset.
    """

    def __init__(self, in_features: int, num_heads: int, *, head_dim: int | None = None,
                 num_kv_heads: int | None = None, is_causal: bool = True,
                 local_window_size: int | tuple[int, int] | None = None,
                 softcap: float | None = None, sinks: bool = False, rope: bool = True, rope_base: float = 10000.0,
                 dtype=None, param_dtype=jnp.float32, attention: Callable = jax_flash.attention,
                 rngs: nnx.Rngs):  # fmt: skip
        self.num_heads = num_heads
        self.num_kv_heads, self.head_dim = head_shape(in_features, num_heads, num_kv_heads, head_dim)
        self.is_causal, self.local_window_size, self.softcap = is_causal, local_window_size, softcap
        self.rope, self.rope_base, self.attention = rope, rope_base, attention
        dense = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype,  # noqa: E731
                                        param_dtype=param_dtype, rngs=rngs)
        self.query = dense(in_features, self.num_heads * self.head_dim)
        self.key = dense(in_features, self.num_kv_heads * self.head_dim)
        self.value = dense(in_features, self.num_kv_heads * self.head_dim)
        self.out = dense(self.num_heads * self.head_dim, in_features)
        self.sink_logits = nnx.Param(jnp.zeros((num_heads,), param_dtype)) if sinks else None

    def __call__(self, x, *, positions=None, segment_ids=None):
        split = lambda y, heads: y.reshape(y.shape[:-1] + (heads, self.head_dim))  # noqa: E731
        q = split(self.query(x), self.num_heads)
        k = split(self.key(x), self.num_kv_heads)
        v = split(self.value(x), self.num_kv_heads)
        sinks = None if self.sink_logits is None else self.sink_logits[...]
        out = attend(self, q, k, v, positions, segment_ids, sinks)
        return self.out(out.reshape(out.shape[:-2] + (-1,)))
