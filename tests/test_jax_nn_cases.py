"""JAX's own tests of `jax.nn.dot_product_attention` (tests/nn_test.py: the GQA, mask-mode and
bias-gradient cases), written again against jax_flash: `jax.nn`'s xla implementation is the
reference, our paths the answer, with the tolerances JAX's tests use for cuDNN. Every case passes
as it is, T == S with padding included (no deviation to document)."""

import functools

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash import dense_impl
from tests import fake_kernels

PATHS = ("xla-dense", "xla-blockwise", "cuda-on-cpu")


@pytest.fixture(params=PATHS)
def implementation(request, monkeypatch):
    if request.param == "cuda-on-cpu":
        fake_kernels.install(monkeypatch)
        return "cuda"
    monkeypatch.setattr(dense_impl, "budget_bytes", lambda: 2**40 if request.param == "xla-dense" else 0)
    return "xla"


def _close(ans, ref, tol):
    for a, r in zip(jax.tree.leaves(ans), jax.tree.leaves(ref)):
        assert a.shape == r.shape
        assert jnp.allclose(a.astype(jnp.float32), r.astype(jnp.float32), rtol=tol, atol=tol), float(
            jnp.abs(a.astype(jnp.float32) - r.astype(jnp.float32)).max())


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("use_vmap", [False, True])
def test_gqa(implementation, dtype, groups, use_vmap):
    b, s, t, n, h = 2, 128, 128, 4, 32
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, n, h), dtype)
    k = jax.random.normal(keys[1], (b, s, n // groups, h), dtype)
    v = jax.random.normal(keys[2], (b, s, n // groups, h), dtype)
    grad = jax.random.normal(keys[3], (b, t, n, h), dtype)
    ans_fn = functools.partial(jax_flash.attention, implementation=implementation)
    if use_vmap:
        ans_fn = jax.vmap(ans_fn, in_axes=(0, 0, 0, None, None), out_axes=0)
    k_ref, v_ref = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    out_ref, vjp_ref = jax.vjp(functools.partial(jax.nn.dot_product_attention, implementation="xla"),
                               q, k_ref, v_ref, None, None)  # fmt: skip
    out_ans, vjp_ans = jax.vjp(ans_fn, q, k, v, None, None)
    dq_ref, dk_ref, dv_ref = vjp_ref(grad)[:3]
    dq_ans, dk_ans, dv_ans = vjp_ans(grad)[:3]
    dk_ref = dk_ref.reshape(b, s, n // groups, groups, h).sum(axis=3)
    dv_ref = dv_ref.reshape(b, s, n // groups, groups, h).sum(axis=3)
    _close(out_ans, out_ref, 0.01)
    _close((dq_ans, dk_ans, dv_ans), (dq_ref, dk_ref, dv_ref), 0.01)


@pytest.mark.parametrize("mask_mode", ["bias", "causal", "padding", "custom", ("causal", "padding"),
                                       ("custom", "padding"), ("bias", "causal"), ("causal", "sliding_window")])  # fmt: skip
def test_mask_modes(implementation, mask_mode):
    mask_mode = (mask_mode,) if isinstance(mask_mode, str) else mask_mode
    dtype = jnp.bfloat16
    b, s, t, n, h = 2, 128, 128, 4, 32
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (b, t, n, h), dtype)
    k = jax.random.normal(keys[1], (b, s, n, h), dtype)
    v = jax.random.normal(keys[2], (b, s, n, h), dtype)
    grad = jax.random.normal(keys[3], (b, t, n, h), dtype)
    bias = mask = q_len = kv_len = window = None
    is_causal = "causal" in mask_mode
    if "padding" in mask_mode:
        q_len = jnp.array([t // 2, t // 4], jnp.int32)
        kv_len = jnp.array([s // 4, s // 2], jnp.int32)
    if "custom" in mask_mode:
        mask = jnp.tril(jnp.ones((t, s), jnp.bool_))[None, None]
    if "bias" in mask_mode:
        bias = jax.random.normal(keys[4], (1, n, t, s), dtype)
    if "sliding_window" in mask_mode:
        window = (3, 2) if is_causal else (3, 0)

    def fn(attention, q, k, v, bias, mask, **extra):
        return attention(q, k, v, bias, mask, is_causal=is_causal, query_seq_lengths=q_len,
                         key_value_seq_lengths=kv_len, local_window_size=window, **extra)  # fmt: skip

    ref = functools.partial(fn, jax.nn.dot_product_attention, implementation="xla")
    ans = functools.partial(fn, jax_flash.attention, implementation=implementation)
    out_ref, vjp_ref = jax.vjp(ref, q, k, v, bias, mask)
    out_ans, vjp_ans = jax.vjp(ans, q, k, v, bias, mask)
    dq_ref, dk_ref, dv_ref, dbias_ref = vjp_ref(grad)[:4]
    dq_ans, dk_ans, dv_ans, dbias_ans = vjp_ans(grad)[:4]
    _close(out_ans, out_ref, 0.01)
    _close((dq_ans, dk_ans), (dq_ref, dk_ref), 0.02)
    _close(dv_ans, dv_ref, 0.01)
    if bias is not None:
        _close(dbias_ans, dbias_ref, 0.02)


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("use_vmap", [False, True])
def test_bias_gradient(implementation, batch, use_vmap):
    dtype = jnp.bfloat16
    s, n, h = 128, 4, 32
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (batch, s, n, h), dtype)
    bias = jax.random.normal(keys[1], (batch, n, s, s), dtype)
    mask = jnp.ones((1, 1, s), jnp.bool_)

    def attend(attention, x, bias, mask, **extra):
        return attention(x, x, x, bias, mask, is_causal=False, **extra)

    ref = functools.partial(attend, jax.nn.dot_product_attention, implementation="xla")
    ans = functools.partial(attend, jax_flash.attention, implementation=implementation)
    if use_vmap:
        ref, ans = jax.vmap(ref, in_axes=(0, 0, None)), jax.vmap(ans, in_axes=(0, 0, None))
    _close(jax.jit(ans)(x, bias, mask), jax.jit(ref)(x, bias, mask), 0.01)
    grads = lambda f: jax.jit(lambda x, bias: jax.vjp(lambda x, b: f(x, b, mask), x, bias)[1](x))  # noqa: E731
    # Unlike cuDNN (batch 1 only), every path gives the bias gradient at any batch.
    _close(grads(ans)(x, bias), grads(ref)(x, bias), 0.1)


@pytest.mark.parametrize("is_causal", [False, True])
def test_the_dense_path_compiles_to_jax_nns_program(is_causal):
    """The quickstart's call (GQA 4/2, float32): the same fusions of the same shapes as jax.nn's
    xla attention, so their times differ only by the machine's noise."""
    import re

    q, k = jnp.ones((2, 512, 4, 64), jnp.float32), jnp.ones((2, 512, 2, 64), jnp.float32)

    def fusions(fn):
        text = jax.jit(fn).lower(q, k, k).compile().as_text()
        return sorted(re.findall(r"= (\S+) fusion\(.*kind=(\w+)", text))

    ours = fusions(lambda q, k, v: jax_flash.attention(q, k, v, is_causal=is_causal, implementation="xla"))
    theirs = fusions(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=is_causal, implementation="xla"))
    assert ours == theirs and ours
