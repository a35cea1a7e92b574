"""Flax integration: a drop-in `attention_fn` for Flax's attention modules, and multi-head
attention modules for nnx (`jax_flash.flax.nnx`) and linen (`jax_flash.flax.linen`).

    model = flax.nnx.MultiHeadAttention(..., attention_fn=jax_flash.flax.attention_fn)
"""

from jax_flash.flax.attention_fn import attention_fn
from jax_flash.flax.rotary import apply_rotary

__all__ = ["attention_fn", "apply_rotary"]
