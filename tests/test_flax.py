"""Flax integration: attention_fn as a drop-in for Flax's attention modules, the nnx and linen
modules, RoPE, and the GPT example training with the loss falling."""

import importlib.util
import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_flash.flax import apply_rotary, attention_fn
from jax_flash.flax import linen as jf_linen
from jax_flash.flax import nnx as jf_nnx
from tests import reference
from tests.cases import rng_for


def _x(*shape, seed="x"):
    return jnp.asarray(rng_for(seed, shape).normal(size=shape), jnp.float32)


@pytest.mark.parametrize("causal_mask", [False, True])
def test_attention_fn_in_flax_nnx_multi_head_attention(causal_mask):
    x = _x(2, 3, 20, 32)  # two batch axes
    mask = nnx.make_causal_mask(jnp.ones((2, 3, 20))) if causal_mask else None
    kw = dict(num_heads=4, in_features=32, qkv_features=32, decode=False)
    ours = nnx.MultiHeadAttention(**kw, attention_fn=attention_fn, rngs=nnx.Rngs(0))
    theirs = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
    assert reference.rel_error(ours(x, mask=mask), theirs(x, mask=mask)) < 1e-5


def test_attention_fn_in_flax_linen_attention():
    x = _x(2, 24, 32)
    mask = nn.make_causal_mask(jnp.ones((2, 24)))
    ours = nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=attention_fn)
    theirs = nn.MultiHeadDotProductAttention(num_heads=4)
    params = theirs.init(jax.random.key(0), x, mask=mask)
    assert reference.rel_error(ours.apply(params, x, mask=mask), theirs.apply(params, x, mask=mask)) < 1e-5


def test_attention_fn_refuses_what_it_cannot_honour():
    q = _x(1, 8, 2, 16)
    with pytest.raises(NotImplementedError, match="dropout"):
        attention_fn(q, q, q, dropout_rate=0.1, deterministic=False)
    with pytest.raises(NotImplementedError, match="sow"):
        attention_fn(q, q, q, module=object())
    out = attention_fn(q, q, q, dropout_rate=0.1, deterministic=True)  # dropout off: fine
    assert out.shape == q.shape


@pytest.mark.parametrize("make", ["nnx", "linen"])
def test_modules_are_causal_gqa_attention(make):
    """Changing future tokens never changes earlier outputs; K/V projections have K heads."""
    x = _x(2, 16, 32)
    later = x.at[:, 10:].set(_x(2, 6, 32, seed="later"))
    if make == "nnx":
        module = jf_nnx.MultiHeadAttention(32, 4, num_kv_heads=2, local_window_size=(8, 0),
                                           rngs=nnx.Rngs(0))
        run = module
        assert module.key.kernel[...].shape == (32, 2 * 8)
    else:
        module = jf_linen.MultiHeadAttention(num_heads=4, num_kv_heads=2, local_window_size=(8, 0))
        params = module.init(jax.random.key(0), x)
        run = lambda y: module.apply(params, y)  # noqa: E731
        assert params["params"]["key"]["kernel"].shape == (32, 2, 8)
    a, b = run(x), run(later)
    np.testing.assert_allclose(a[:, :10], b[:, :10], rtol=1e-6, atol=1e-6)
    assert not np.allclose(a[:, 10:], b[:, 10:])


def test_nnx_module_matches_a_direct_computation():
    x = _x(2, 12, 32)
    m = jf_nnx.MultiHeadAttention(32, 4, num_kv_heads=2, softcap=5.0, rngs=nnx.Rngs(1))
    q = apply_rotary((x @ m.query.kernel[...]).reshape(2, 12, 4, 8))
    k = apply_rotary((x @ m.key.kernel[...]).reshape(2, 12, 2, 8))
    v = (x @ m.value.kernel[...]).reshape(2, 12, 2, 8)
    attn = reference.attention(q, k, v, is_causal=True, softcap=5.0)[0]
    expected = attn.reshape(2, 12, 32) @ m.out.kernel[...]
    assert reference.rel_error(m(x), expected) < 1e-5


def test_rotary_depends_on_relative_position_only():
    q, k = _x(1, 1, 1, 16, seed="q"), _x(1, 1, 1, 16, seed="k")
    dot = lambda m, n: float(jnp.sum(apply_rotary(q, jnp.array([m])) * apply_rotary(k, jnp.array([n]))))  # noqa: E731
    assert abs(dot(3, 1) - dot(10, 8)) < 1e-4
    assert abs(dot(3, 1) - dot(3, 2)) > 1e-3
    np.testing.assert_allclose(jnp.linalg.norm(apply_rotary(q, jnp.array([7]))), jnp.linalg.norm(q), rtol=1e-6)


def test_gpt_example_trains():
    path = pathlib.Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"
    spec = importlib.util.spec_from_file_location("train_gpt", path)
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # dataclasses look their module up there
    spec.loader.exec_module(example)
    losses = example.main(["--steps", "40", "--seq", "64", "--batch", "8"])
    assert np.isfinite(losses).all()
    assert np.mean(losses[-5:]) < 0.7 * losses[0]
