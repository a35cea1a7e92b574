"""Forward-mode AD (jax.jvp, jax.jacfwd, jax.linearize, forward over reverse and reverse over
forward) on both formulations of the xla path, against the float64 reference's jvp. The blockwise
path is a custom_jvp whose tangent, one primitive (jax_flash/_tangent.py), reverse mode
transposes into the hand-written backward: its gradients stay the backward's, bit for bit. The
CUDA path's forward mode (the kernels' forward, the tangent by the xla formula) is tested through
the fake kernels (test_cuda_path_on_cpu.py).
"""

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from tests import reference
from tests.cases import CASES, qkv, rng_for
from jax_flash import xla_impl
from jax_flash._validation import validate
from tests.test_cuda import forced_family, turing_dtype
from tests.test_xla_path import _NO_OPTIONS, DENSE, run_xla

B, T, S, N, KV, H = 3, 37, 45, 4, 2, 16


def _problem(dtype, case, t=T, s=S):
    rng = rng_for("jvp", dtype, case, t, s)
    q, k, v = qkv(rng, dtype, B, t, s, N, KV, H)
    kwargs = CASES[case](rng, B, N, t, s)
    bias = kwargs.pop("bias", None)
    primals = (q, k, v) if bias is None else (q, k, v, bias)
    tangents = tuple(jnp.asarray(rng.normal(size=x.shape), x.dtype) for x in primals)
    return primals, tangents, kwargs


def _finite(lse):
    return jnp.where(jnp.isfinite(lse), lse, 0.0)


def _jvp(fn, primals, tangents, kwargs):
    def f(*args):
        out, lse = fn(*args[:3], bias=args[3] if len(args) > 3 else None, **kwargs)
        return out, _finite(lse)

    return jax.jit(lambda p, t: jax.jvp(f, p, t))(primals, tangents)  # one compilation, not one per operation


@pytest.mark.parametrize("case", sorted(CASES))
def test_dense_jvp_matches_the_reference(case):
    primals, tangents, kwargs = _problem(jnp.float64, case)
    (out, lse), (d_out, d_lse) = _jvp(lambda *a, **kw: run_xla(*a, block=DENSE, **kw), primals, tangents, kwargs)
    (ref_out, _), (ref_d_out, ref_d_lse) = _jvp(reference.attention, primals, tangents, kwargs)
    assert d_out.dtype == jnp.float64 and d_lse.dtype == lse.dtype
    assert reference.rel_error(out, ref_out) < 1e-10
    assert reference.rel_error(d_out, ref_d_out) < 1e-10
    assert reference.rel_error(d_lse, ref_d_lse) < 1e-10


def test_dense_forward_over_reverse_matches_the_reference():
    """A Hessian-vector product (jvp of grad) through the dense formulation."""
    (q, k, v), (dq, *_), kwargs = _problem(jnp.float64, "lengths_causal")

    def loss(fn):
        return lambda q: jnp.sum(jnp.sin(fn(q, k, v, **kwargs)[0]))

    hvp = jax.jit(lambda q, dq: jax.jvp(jax.grad(loss(lambda *a, **kw: run_xla(*a, block=DENSE, **kw))), (q,), (dq,))[1])(q, dq)
    ref = jax.jit(lambda q, dq: jax.jvp(jax.grad(loss(reference.attention)), (q,), (dq,))[1])(q, dq)
    assert reference.rel_error(hvp, ref) < 1e-9


def test_jacfwd_equals_jacrev_under_auto_mode_jit_and_vmap():
    (q, k, v), _, _ = _problem(jnp.float64, "none", t=9, s=11)
    assert jax_flash.chosen_implementation(q, k, v, is_causal=True) == "xla-dense"
    f = lambda q: jax_flash.attention(q, k, v, is_causal=True)[0, :, 0, :3]  # noqa: E731
    assert reference.rel_error(jax.jit(jax.jacfwd(f))(q), jax.jit(jax.jacrev(f))(q)) < 1e-12
    assert reference.rel_error(jax.jit(lambda t: jax.jvp(f, (q,), (t,))[1])(q), jax.jvp(f, (q,), (q,))[1]) < 1e-12
    batched = jax.vmap(lambda x: jax.jvp(f, (q,), (x,))[1])(jnp.stack([q, 2 * q]))
    assert reference.rel_error(batched[1], 2 * batched[0]) < 1e-12  # linear in the tangent


def _blockwise(*args, **kwargs):
    return run_xla(*args, block=16, **kwargs)  # several query and key blocks, tails included


@pytest.mark.parametrize("case", sorted(CASES))
def test_blockwise_jvp_matches_the_reference(case):
    primals, tangents, kwargs = _problem(jnp.float64, case)
    (out, lse), (d_out, d_lse) = _jvp(_blockwise, primals, tangents, kwargs)
    (ref_out, _), (ref_d_out, ref_d_lse) = _jvp(reference.attention, primals, tangents, kwargs)
    assert d_out.dtype == jnp.float64 and d_lse.dtype == lse.dtype
    assert reference.rel_error(out, ref_out) < 1e-10
    assert reference.rel_error(d_out, ref_d_out) < 1e-10
    assert reference.rel_error(d_lse, ref_d_lse) < 1e-10


@pytest.mark.parametrize("dtype,tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_blockwise_jvp_in_low_precision(dtype, tolerance):
    primals, tangents, kwargs = _problem(dtype, "lengths_causal")
    (_, _), (d_out, d_lse) = _jvp(_blockwise, primals, tangents, kwargs)
    wide = lambda xs: tuple(x.astype(jnp.float64) for x in xs)  # noqa: E731
    (_, _), (ref_d_out, ref_d_lse) = _jvp(reference.attention, wide(primals), wide(tangents), kwargs)
    assert d_out.dtype == dtype and d_lse.dtype == jnp.float32
    assert reference.rel_error(d_out, ref_d_out) < tolerance
    assert reference.rel_error(d_lse, ref_d_lse) < tolerance


def test_blockwise_gradients_are_the_hand_written_backwards():
    """Reverse mode transposes the tangent into xla_impl's backward: the same numbers as calling
    it on the forward's output and lse."""
    (q, k, v, bias), _, kwargs = _problem(jnp.float32, "softcap_bias_window")
    out, vjp = jax.vjp(lambda *a: _blockwise(*a[:3], bias=a[3], **kwargs)[0], q, k, v, bias)
    d_out = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
    call = validate(q, k, v, bias, None, **{**_NO_OPTIONS, **kwargs})
    out, lse = xla_impl.attention(call, block_q=16, block_k=16)
    expected = xla_impl.backward(call, out, lse, d_out, jnp.zeros_like(lse), block_q=16, block_k=16)
    for g, e in zip(vjp(d_out), expected, strict=True):
        assert g.dtype == e.dtype and bool(jnp.array_equal(g, e))


def test_blockwise_second_order_both_ways():
    (q, k, v), (dq, *_), kwargs = _problem(jnp.float64, "window_causal")

    def loss(fn):
        return lambda q: jnp.sum(jnp.sin(fn(q, k, v, **kwargs)[0]))

    def tangent_energy(fn):  # reverse over forward: a gradient of a jvp
        return lambda q: jnp.sum(jax.jvp(lambda q: fn(q, k, v, **kwargs)[0], (q,), (dq,))[1] ** 2)

    for second_order in (lambda f: jax.jvp(jax.grad(loss(f)), (q,), (dq,))[1], lambda f: jax.grad(tangent_energy(f))(q)):
        ours = jax.jit(lambda q: second_order(_blockwise))(q)
        ref = jax.jit(lambda q: second_order(reference.attention))(q)
        assert reference.rel_error(ours, ref) < 1e-9


def test_blockwise_jacfwd_linearize_and_vmap():
    (q, k, v), (dq, *_), kwargs = _problem(jnp.float64, "segments_causal", t=20, s=24)
    f = lambda q: _blockwise(q, k, v, **kwargs)[0]  # noqa: E731
    # a Jacobian along three directions of q (jacfwd of all of q would vmap over its every element)
    directions = jnp.stack([dq, jnp.cos(dq), jnp.sin(q)])
    along = lambda a: f(q + jnp.tensordot(a, directions, 1))[0, :3, 0, :2]  # noqa: E731
    a0 = jnp.zeros(3, q.dtype)
    assert reference.rel_error(jax.jit(jax.jacfwd(along))(a0), jax.jit(jax.jacrev(along))(a0)) < 1e-12
    _, linear = jax.linearize(f, q)
    ref = jax.jvp(lambda q: reference.attention(q, k, v, **kwargs)[0], (q,), (dq,))[1]
    assert reference.rel_error(linear(dq), ref) < 1e-10
    # vmap over the tangents, and over the primals (folded into the batch by the tangent's rule)
    batched = jax.vmap(lambda t: jax.jvp(f, (q,), (t,))[1])(jnp.stack([dq, 2 * dq]))
    assert reference.rel_error(batched[1], 2 * batched[0]) < 1e-12
    both = jax.jit(jax.vmap(lambda q, t: jax.jvp(f, (q,), (t,))[1]))(jnp.stack([q, 2 * q]), jnp.stack([dq, dq]))
    ref_both = jax.vmap(lambda q, t: jax.jvp(lambda q: reference.attention(q, k, v, **kwargs)[0], (q,), (t,))[1])(
        jnp.stack([q, 2 * q]), jnp.stack([dq, dq]))  # fmt: skip
    assert reference.rel_error(both, ref_both) < 1e-10


def test_blockwise_tangents_ignore_poisoned_slots():
    """NaN and inf in keys, values and their tangents past the key lengths reach no tangent."""
    (q, k, v), (dq, dk, dv), kwargs = _problem(jnp.float64, "kv_lengths")
    lengths = kwargs["key_value_seq_lengths"]
    past = jnp.arange(S)[None, :, None, None] >= lengths[:, None, None, None]
    poison = lambda x, value: jnp.where(past, value, x)  # noqa: E731
    clean = _jvp(_blockwise, (q, k, v), (dq, dk, dv), kwargs)[1]
    poisoned = _jvp(_blockwise, (q, poison(k, jnp.nan), poison(v, jnp.inf)),
                    (dq, poison(dk, jnp.inf), poison(dv, jnp.nan)), kwargs)[1]  # fmt: skip
    for a, b in zip(poisoned, clean, strict=True):
        assert bool(jnp.isfinite(a).all()) and reference.rel_error(a, b) < 1e-12


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["causal", "lengths_causal", "segments", "softcap"])
def test_kernel_path_jvp_matches_the_reference(case):
    """On a GPU, auto mode's jvp runs the forward kernel for the primal (bit for bit the plain
    call's output) and the xla formula for the tangent, within bf16's tolerance of the float64 jvp;
    jacfwd and jacrev (the backward kernel) agree along a direction."""
    rng = rng_for("jvp-kernels", case)
    b, t, s, n, kv_heads, h = 2, 200, 256, 4, 2, 64
    dtype = turing_dtype(forced_family())  # the grid run as a T4 (JAX_FLASH_KERNELS=sm75) takes float16
    q, k, v = (x.astype(dtype) for x in qkv(rng, jnp.float32, b, t, s, n, kv_heads, h))
    tangents = tuple(jnp.asarray(rng.normal(size=x.shape), dtype) for x in (q, k, v))
    kwargs = CASES[case](rng, b, n, t, s)
    f = lambda q, k, v: jax_flash.attention(q, k, v, **kwargs)  # noqa: E731
    jvp = jax.jit(lambda p, d: jax.jvp(f, p, d))
    assert "jax_flash_fwd" in jvp.lower((q, k, v), tangents).as_text()
    out, d_out = jvp((q, k, v), tangents)
    assert bool(jnp.array_equal(out, jax.jit(f)(q, k, v)))
    wide = lambda xs: tuple(x.astype(jnp.float64) for x in xs)  # noqa: E731
    ref = lambda *a: reference.attention(*a, **kwargs)[0]  # noqa: E731
    ref_out, ref_d_out = jax.jvp(ref, wide((q, k, v)), wide(tangents))
    assert reference.rel_error(out, ref_out) < 1e-2 and reference.rel_error(d_out, ref_d_out) < 2e-2
    # <g, J dq> by forward mode against <J^T g, dq> by the backward kernel.
    g = jnp.asarray(rng.normal(size=out.shape), jnp.float32)
    # Rounding error scales with the norms (the sums cancel), not with the product's size.
    along_q = jax.jvp(lambda q: f(q, k, v), (q,), (tangents[0],))[1].astype(jnp.float32)
    dq = jax.grad(lambda q: jnp.vdot(g, f(q, k, v).astype(jnp.float32)))(q)
    reverse = jnp.vdot(dq.astype(jnp.float32), tangents[0].astype(jnp.float32))
    assert abs(float(jnp.vdot(g, along_q) - reverse)) < 1e-2 * float(jnp.linalg.norm(g) * jnp.linalg.norm(along_q))
