"""vmap of the kernel calls folds the mapped axis into one call (jax_flash/_batching.py).

The kernels need a GPU, so a pure-JAX stand-in with the same calling convention takes their
place here: each test checks the values against a per-element loop, and that the traced program
calls the stand-in once, on the folded shapes."""

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash._batching import fold_into_batch, fold_queries_into_heads
from tests.cases import rng_for


def _forward_standin(q, k, v):
    """(q, k, v) -> (out [B, T, N, H], lse [B, N, T]), the convention of _ffi.forward."""
    out, lse = jax_flash.attention(q, k, v, is_causal=True, implementation="xla", return_residual=True)
    return out, lse.transpose(0, 2, 1)


def _calls(fn, *args):
    """Operand shapes of each call of a custom_vmap function in the traced program of fn."""
    eqns = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    return [tuple(v.aval.shape for v in e.invars) for e in eqns if e.primitive.name == "custom_vmap_call"]


def _normal(rng, shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _per_element(fn, args, in_axes):
    size = next(x.shape[a] for x, a in zip(args, in_axes) if a is not None)
    outs = [fn(*(x if a is None else jnp.take(x, i, axis=a) for x, a in zip(args, in_axes)))
            for i in range(size)]  # fmt: skip
    return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)


def test_all_mapped_folds_into_batch():
    rng = rng_for("fold-batch")
    q, k, v = (_normal(rng, (3, 2, 9, 4, 8)) for _ in range(3))
    batched = jax.vmap(fold_queries_into_heads(_forward_standin))
    want = _per_element(_forward_standin, (q, k, v), (0, 0, 0))
    for g, w in zip(batched(q, k, v), want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    assert _calls(batched, q, k, v) == [((6, 9, 4, 8),) * 3]


def test_queries_only_fold_into_heads():
    rng = rng_for("fold-heads")
    q = _normal(rng, (3, 2, 7, 4, 8))  # vmapped over 3 sets of queries; 4 heads over 2 kv heads
    k, v = _normal(rng, (2, 11, 2, 8)), _normal(rng, (2, 11, 2, 8))
    batched = jax.vmap(fold_queries_into_heads(_forward_standin), in_axes=(0, None, None))
    want = _per_element(_forward_standin, (q, k, v), (0, None, None))
    for g, w in zip(batched(q, k, v), want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    assert _calls(batched, q, k, v) == [((2, 7, 12, 8), (2, 11, 2, 8), (2, 11, 2, 8))]  # k, v not copied


def test_nested_vmap_is_one_call():
    rng = rng_for("fold-nested")
    q, k, v = (_normal(rng, (2, 3, 1, 5, 2, 8)) for _ in range(3))
    batched = jax.vmap(jax.vmap(fold_queries_into_heads(_forward_standin)))
    want = jax.vmap(lambda q, k, v: _per_element(_forward_standin, (q, k, v), (0, 0, 0)))(q, k, v)
    for g, w in zip(batched(q, k, v), want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    assert _calls(batched, q, k, v) == [((6, 5, 2, 8),) * 3]


def test_backward_convention_with_unmapped_operands():
    """Seven operands, three outputs, some operands not mapped: they are broadcast and folded."""
    def backward(q, k, v, d_out):
        _, vjp = jax.vjp(lambda q, k, v: jax_flash.attention(q, k, v, implementation="xla"), q, k, v)
        return vjp(d_out)

    rng = rng_for("fold-bwd")
    q, d_out = _normal(rng, (3, 1, 6, 2, 8)), _normal(rng, (3, 1, 6, 2, 8))
    k, v = _normal(rng, (1, 6, 2, 8)), _normal(rng, (1, 6, 2, 8))
    in_axes = (0, None, None, 0)
    batched = jax.vmap(fold_into_batch(backward), in_axes=in_axes)
    want = _per_element(backward, (q, k, v, d_out), in_axes)
    for g, w in zip(batched(q, k, v, d_out), want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    assert _calls(batched, q, k, v, d_out) == [((3, 6, 2, 8),) * 4]
