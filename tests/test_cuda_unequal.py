"""Unequal query/key and value head dims on the GPU (marked `gpu`): the Hopper forward and backward
of their own at (192, 128) (V, O, dO and dV of 128 columns) against the float64 reference, with
every mask but a bias. With the sm80 family forced (as on an Ampere or Ada GPU), the same calls
take its kernels with V zero-padded to 192."""

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash import _ffi, _plan
from tests import reference
from tests.cases import rng_for
from tests.test_cuda import FWD_TOL, GRAD_TOL, poison_free_memory
from tests.test_cuda_wide import MASKS

pytestmark = pytest.mark.gpu


def _problem(rng, dtype, h=192, hv=128, b=2, t=200, s=300):
    """T != S and neither a multiple of the tiles; GQA 4 over 2."""
    q = jnp.asarray(rng.normal(size=(b, t, 4, h)), dtype)
    k = jnp.asarray(rng.normal(size=(b, s, 2, h)), dtype)
    v = jnp.asarray(rng.normal(size=(b, s, 2, hv)), dtype)
    return q, k, v


def kernel_head_dims(kernel: str) -> tuple[int, int] | None:
    """The (query, value) head dims the forward or backward `kernel` runs (192, 128) at: natively
    where the Hopper kernels run; else the sm80 family's, V zero-padded to 192 forward and both to
    256 backward, or None where that backward does not fit the shared-memory cap (the xla path's
    backward runs). Skips where no kernel of ours takes head dim 192 (Turing)."""
    if _plan.family() is _plan.Family.TURING:
        pytest.skip("the Turing kernels take head dims up to 128")
    if _plan.family() is _plan.Family.HOPPER:
        return (192, 128)
    if kernel == "forward":
        return (192, 192)
    return (256, 256) if _plan.backward_kernels_fit(_plan.family(), 256) else None


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
    dims = kernel_head_dims("forward")
    rng = rng_for("cuda-unequal", dtype, mask)
    s = 200 if mask == "segments" else 300
    q, k, v = _problem(rng, dtype, s=s)
    kw = MASKS[mask](2, 200, s, rng)
    attend = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, implementation="cuda", return_residual=True, **kw))
    attend.lower(q, k, v)
    assert calls and set(calls) == {("jax_flash_fwd", *dims)}  # V not padded where the kernels take 128
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
    dims = kernel_head_dims("backward")
    rng = rng_for("cuda-unequal-grad", dtype, mask)
    q, k, v = _problem(rng, dtype, t=150, s=150 if mask == "segments" else 170)
    kw = MASKS[mask](2, 150, k.shape[1], rng)
    g_out = jnp.asarray(rng.normal(size=q.shape[:3] + (128,)), jnp.float32)

    def loss(attend, q, k, v):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * g_out)

    grad = jax.jit(jax.grad(lambda *a: loss(lambda q, k, v: jax_flash.attention(q, k, v, **kw), *a),
                            argnums=(0, 1, 2)))  # fmt: skip
    grad.lower(q, k, v)
    want = {("jax_flash_bwd", *dims)} if dims else set()
    assert {call for call in calls if call[0] == "jax_flash_bwd"} == want
    poison_free_memory()
    grads = grad(q, k, v)
    ref = jax.grad(lambda *a: loss(lambda q, k, v: reference.attention(q, k, v, **kw)[0], *a), argnums=(0, 1, 2))(q, k, v)
    for mine, want in zip(grads, ref, strict=True):
        assert mine.shape == want.shape and reference.rel_error(mine, want) < GRAD_TOL
