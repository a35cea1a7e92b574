"""Flax integration: a drop-in `attention_fn` for Flax's attention modules, and multi-head
attention modules for nnx (`jax_flash.flax.nnx`) and linen (`jax_flash.flax.linen`).

    model = flax.nnx.MultiHeadAttention(..., attention_fn=jax_flash.flax.attention_fn)
    attn = jax_flash.flax.nnx.MultiHeadAttention(512, num_heads=8, rngs=flax.nnx.Rngs(0))
"""

import importlib

from jax_flash.flax.attention_fn import attention_fn
from jax_flash.flax.rotary import apply_rotary

__all__ = ["attention_fn", "apply_rotary", "linen", "nnx"]


def __getattr__(name: str):
    # The module submodules import on first use: each imports its part of Flax.
    if name in ("nnx", "linen"):
        return importlib.import_module(f"jax_flash.flax.{name}")
    raise AttributeError(f"module 'jax_flash.flax' has no attribute {name!r}")
