"""jit, grad, vmap, and jax.checkpoint inside lax.scan, on the xla path."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.test_util import check_grads

import jax_flash
from tests import reference
from tests.cases import qkv, rng_for


def _attn(q, k, v, bias=None, **kw):
    return jax_flash.attention(q, k, v, bias, implementation="xla", **kw)


def test_jit_equals_eager():
    q, k, v = qkv(rng_for("jit"), jnp.float32, 2, 33, 33, 2, 2, 16)
    eager = _attn(q, k, v, is_causal=True)
    jitted = jax.jit(lambda q, k, v: _attn(q, k, v, is_causal=True))(q, k, v)
    np.testing.assert_allclose(eager, jitted, rtol=1e-6, atol=1e-6)


def test_check_grads_numerically():
    q, k, v = qkv(rng_for("numgrad"), jnp.float64, 1, 9, 11, 2, 1, 4)
    bias = jnp.asarray(rng_for("numgrad-bias").normal(size=(1, 2, 9, 11)))
    f = lambda q, k, v, bias: _attn(q, k, v, bias, is_causal=True, softcap=4.0)  # noqa: E731
    check_grads(f, (q, k, v, bias), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


def test_vmap_over_extra_batch_axis():
    q, k, v = qkv(rng_for("vmap"), jnp.float64, 6, 17, 23, 2, 1, 8)
    stacked = [x.reshape(3, 2, *x.shape[1:]) for x in (q, k, v)]
    f = lambda q, k, v: _attn(q, k, v, is_causal=True)  # noqa: E731
    batched = jax.vmap(f)(*stacked).reshape(q.shape)
    assert reference.rel_error(batched, reference.attention(q, k, v, is_causal=True)[0]) < 1e-12
    g = jax.jit(jax.vmap(jax.grad(lambda q, k, v: f(q, k, v).sum())))(*stacked).reshape(q.shape)
    g_ref = jax.jit(jax.grad(lambda q: reference.attention(q, k, v, is_causal=True)[0].sum()))(q)
    assert reference.rel_error(g, g_ref) < 1e-10


def test_vmap_over_unbatched_inputs():
    q, k, v = qkv(rng_for("vmap3"), jnp.float64, 4, 12, 12, 2, 2, 8)
    out = jax.vmap(lambda q, k, v: _attn(q, k, v, local_window_size=3))(q, k, v)
    assert reference.rel_error(out, reference.attention(q, k, v, local_window_size=3)[0]) < 1e-12


def test_checkpoint_inside_scan():
    """A scanned stack of attention layers, rematerialised, differentiates like an unrolled one."""
    rng = rng_for("scan")
    q, _, _ = qkv(rng, jnp.float64, 2, 16, 16, 2, 2, 8)
    weights = jnp.asarray(rng.normal(size=(3, 8, 8)) / 3)

    def layer(x, w, attn):
        y = x @ w
        return x + attn(y, y, y, is_causal=True), None

    def model(x, weights, attn):
        body = jax.checkpoint(lambda x, w: layer(x, w, attn))
        return jax.lax.scan(body, x, weights)[0].sum()

    ref_attn = lambda q, k, v, **kw: reference.attention(q, k, v, **kw)[0]  # noqa: E731
    grads = jax.jit(jax.grad(model, argnums=(0, 1)), static_argnums=2)(q, weights, _attn)
    grads_ref = jax.grad(model, argnums=(0, 1))(q, weights, ref_attn)
    for g, g_ref in zip(grads, grads_ref):
        assert reference.rel_error(g, g_ref) < 1e-10
