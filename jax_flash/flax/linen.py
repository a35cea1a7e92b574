"""Multi-head attention as a Flax linen module: projections, optional RoPE, jax_flash attention."""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

import jax_flash
from jax_flash.flax._attend import attend, head_shape


class MultiHeadAttention(nn.Module):
    """The linen twin of `jax_flash.flax.nnx.MultiHeadAttention` (same arguments and meaning)."""

    num_heads: int
    head_dim: int | None = None
    num_kv_heads: int | None = None
    is_causal: bool = True
    local_window_size: int | tuple[int, int] | None = None
    softcap: float | None = None
    sinks: bool = False  # a learned [num_heads] parameter "sinks", initialised to 0
    rope: bool = True
    rope_base: float = 10000.0
    dtype: Any = None
    param_dtype: Any = jnp.float32
    attention: Callable = jax_flash.attention

    @nn.compact
    def __call__(self, x, *, positions=None, segment_ids=None):
        features = x.shape[-1]
        kv_heads, head_dim = head_shape(features, self.num_heads, self.num_kv_heads, self.head_dim)
        dense = lambda heads, name: nn.DenseGeneral(  # noqa: E731
            (heads, head_dim), use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
            name=name)
        q, k, v = dense(self.num_heads, "query")(x), dense(kv_heads, "key")(x), dense(kv_heads, "value")(x)
        sinks = self.param("sinks", nn.initializers.zeros, (self.num_heads,), self.param_dtype) if self.sinks else None
        out = attend(self, q, k, v, positions, segment_ids, sinks)
        return nn.DenseGeneral(features, axis=(-2, -1), use_bias=False, dtype=self.dtype,
                               param_dtype=self.param_dtype, name="out")(out)  # fmt: skip
