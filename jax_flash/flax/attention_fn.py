"""`attention_fn`: jax_flash.attention behind the calling convention of Flax's
`dot_product_attention`, so `flax.nnx.MultiHeadAttention(attention_fn=...)` and
`flax.linen.MultiHeadDotProductAttention(attention_fn=...)` switch with one argument."""

from __future__ import annotations

import jax.numpy as jnp

import jax_flash


def _fold_batch(x, batch_shape, trailing: int):
    """[batch..., *trailing] -> [prod(batch), *trailing]; an input broadcast over every batch
    axis (size 1, or missing) keeps one batch row, which jax_flash broadcasts itself."""
    x = jnp.asarray(x)
    x = x.reshape((1,) * (len(batch_shape) + trailing - x.ndim) + x.shape)
    rest = x.shape[len(batch_shape):]
    if all(d == 1 for d in x.shape[: len(batch_shape)]):
        return x.reshape((1,) + rest)
    return jnp.broadcast_to(x, tuple(batch_shape) + rest).reshape((-1,) + rest)


def attention_fn(
    query,
    key,
    value,
    bias=None,
    mask=None,
    broadcast_dropout: bool = True,
    dropout_rng=None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype=None,
    precision=None,
    module=None,
    is_causal: bool = False,
    force_fp32_for_softmax: bool = False,
    qk_attn_weights_einsum=None,
    attn_weights_value_einsum=None,
):
    """Flax-style attention on jax_flash: `[batch..., length, heads, head_dim]`, K/V heads may be
    fewer than query heads (GQA). The softmax always runs in float32 (`force_fp32_for_softmax`
    is honoured by construction) and `precision` is left to the kernels. What it cannot honour
    raises: attention dropout, sowing the attention weights (`module`), custom einsums."""
    del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax
    if dropout_rate > 0.0 and not deterministic:
        raise NotImplementedError(
            "jax_flash.flax.attention_fn has no attention dropout: use dropout_rate=0 or "
            "deterministic=True")
    if module is not None:
        raise NotImplementedError(
            "jax_flash.flax.attention_fn never forms the attention weights, so it cannot sow "
            "them: use sow_weights=False")
    if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
        raise NotImplementedError("jax_flash.flax.attention_fn takes no custom einsums")
    if dtype is not None:
        query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    batch_shape = query.shape[:-3]
    q, k, v = (_fold_batch(x, batch_shape, 3) for x in (query, key, value))
    fold = lambda x: None if x is None else _fold_batch(x, batch_shape, 3)  # noqa: E731
    if mask is not None:  # Flax masks are float or bool; nonzero means attend
        mask = jnp.asarray(mask).astype(bool)
    out = jax_flash.attention(q, k, v, fold(bias), fold(mask), is_causal=is_causal)
    return out.reshape(query.shape[:-1] + (value.shape[-1],))
