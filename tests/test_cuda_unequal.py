"""Unequal query/key and value head dims on the GPU (marked `gpu`): the Hopper forward and backward
of their own at (192, 128) (V, O, dO and dV of 128 columns) against the float64 reference, with
every mask but a bias."""

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash import _ffi
from tests import reference
from tests.cases import rng_for
from tests.test_cuda import FWD_TOL, GRAD_TOL, poison_free_memory
from tests.test_cuda_wide import MASKS, hopper_or_skip

pytestmark = pytest.mark.gpu


def _problem(rng, dtype, h=192, hv=128, b=2, t=200, s=300):
    """T != S and neither a multiple of the tiles; GQA 4 over 2."""
    q = jnp.asarray(rng.normal(size=(b, t, 4, h)), dtype)
    k = jnp.asarray(rng.normal(size=(b, s, 2, h)), dtype)
    v = jnp.asarray(rng.normal(size=(b, s, 2, hv)), dtype)
    return q, k, v


@pytest.fixture
def calls(monkeypatch):
    """(target, q's and v's head dims) of each kernel call, recorded as the calls are traced."""
    recorded, call_kernel = [], _ffi.call_kernel
    monkeypatch.setattr(_ffi, "call_kernel", lambda target, *args: recorded.append(
        (target, args[1][0].shape[-1], args[1][2].shape[-1])) or call_kernel(target, *args))  # fmt: skip
    return recorded


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_forward(calls, dtype, mask):
    hopper_or_skip("the (192, 128) forward")
    rng = rng_for("cuda-unequal", dtype, mask)
    s = 200 if mask == "segments" else 300
    q, k, v = _problem(rng, dtype, s=s)
    kw = MASKS[mask](2, 200, s, rng)
    attend = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, implementation="cuda", return_residual=True, **kw))
    attend.lower(q, k, v)
    assert calls and set(calls) == {("jax_flash_fwd", 192, 128)}  # V not padded
    poison_free_memory()
    out, lse = attend(q, k, v)
    ref_out, ref_lse = reference.attention(q, k, v, **kw)
    assert out.dtype == dtype and out.shape == (2, 200, 4, 128)
    assert reference.rel_error(out, ref_out) < FWD_TOL
    assert reference.rel_error(lse, ref_lse) < 1e-4


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_gradients(calls, dtype, mask):
    """The (192, 128) backward of its own (V, dO and dV of 128 columns)."""
    hopper_or_skip("the (192, 128) kernels")
    rng = rng_for("cuda-unequal-grad", dtype, mask)
    q, k, v = _problem(rng, dtype, t=150, s=150 if mask == "segments" else 170)
    kw = MASKS[mask](2, 150, k.shape[1], rng)
    g_out = jnp.asarray(rng.normal(size=q.shape[:3] + (128,)), jnp.float32)

    def loss(attend, q, k, v):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * g_out)

    grad = jax.jit(jax.grad(lambda *a: loss(lambda q, k, v: jax_flash.attention(q, k, v, **kw), *a),
                            argnums=(0, 1, 2)))  # fmt: skip
    grad.lower(q, k, v)
    assert ("jax_flash_bwd", 192, 128) in calls and ("jax_flash_bwd", 192, 192) not in calls
    poison_free_memory()
    grads = grad(q, k, v)
    ref = jax.grad(lambda *a: loss(lambda q, k, v: reference.attention(q, k, v, **kw)[0], *a), argnums=(0, 1, 2))(q, k, v)
    for mine, want in zip(grads, ref, strict=True):
        assert mine.shape == want.shape and reference.rel_error(mine, want) < GRAD_TOL
