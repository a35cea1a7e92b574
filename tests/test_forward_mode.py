"""Forward-mode AD (jax.jvp, jax.jacfwd, forward over reverse) where the README says it works: the
xla path's dense formulation, against the float64 reference's jvp. The blockwise path and the
kernels are custom_vjps, which JAX refuses a jvp (README; docs/perf/log.md, "Forward-mode AD on
the blockwise path", for what was tried).
"""

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from tests import reference
from tests.cases import CASES, qkv, rng_for
from tests.test_xla_path import DENSE, run_xla

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


def test_the_blockwise_path_refuses_a_jvp_as_the_readme_says():
    primals, tangents, _ = _problem(jnp.float64, "causal")
    with pytest.raises(TypeError, match="forward-mode.*custom_vjp"):
        jax.jvp(lambda *a: run_xla(*a, block=16, is_causal=True)[0], primals, tangents)
