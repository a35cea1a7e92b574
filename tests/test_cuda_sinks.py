"""Attention sinks on the kernels (marked `gpu`): every kernel family the run takes (tests/test_cuda.py's
families_for), the forward and its gradients (d sinks included) against the float64 reference, at
the head dims of each kernel kind (the wide forwards above 256 and the unequal (192, 128) among
them), with each mask kind; gpt-oss's layout; rows that see no key; the decode kernels on dense
caches and paged ones. Outputs land on NaN-poisoned memory."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _ffi, _plan
from tests import reference
from tests.cases import qkv, rng_for
from tests.test_cuda import FWD_TOL, GRAD_TOL, families_for, forced_family, poison_free_memory, turing_dtype
from tests.test_cuda_wide import hopper_or_skip
from tests.test_paged import paged_problem

pytestmark = pytest.mark.gpu

B, T, S, N, K = 2, 129, 300, 4, 2
MASKS = {
    "causal": lambda rng: {"is_causal": True},
    "window 128": lambda rng: {"is_causal": True, "local_window_size": (127, 0)},
    "lengths": lambda rng: {"query_seq_lengths": jnp.asarray([T, 50], jnp.int32),
                            "key_value_seq_lengths": jnp.asarray([S, 77], jnp.int32)},
    "segments": lambda rng: {"q_segment_ids": jnp.asarray(np.sort(rng.integers(0, 3, size=(B, T))), jnp.int32),
                             "kv_segment_ids": jnp.asarray(np.sort(rng.integers(0, 3, size=(B, S))), jnp.int32)},
    "softcap": lambda rng: {"is_causal": True, "softcap": 20.0},
    "bias": lambda rng: {"bias": jnp.asarray(rng.normal(size=(B, N, T, S)), jnp.float32)},
}  # fmt: skip
# Every mask at d = 64 and 128; the causal one at the other kernel kinds' head dims.
CASES = [(h, mask) for h in (64, 128) for mask in sorted(MASKS)] + [(h, "causal") for h in (96, 192, 256)]


def _kernels(fn, *args) -> list[str]:
    """The custom calls `fn` (jitted) makes on `args`, recorded as it is traced."""
    recorded, call_kernel = [], _ffi.call_kernel
    with pytest.MonkeyPatch.context() as env:
        env.setattr(_ffi, "call_kernel", lambda target, *a: recorded.append(target) or call_kernel(target, *a))
        fn.lower(*args)
    return recorded


def _gradients(implementation, q, k, v, sinks, g_out, kw):
    def loss(q, k, v, sinks):
        out = jax_flash.attention(q, k, v, sinks=sinks, implementation=implementation, **kw)
        return jnp.sum(out.astype(jnp.float32) * g_out)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)


def _reference(q, k, v, sinks, g_out, kw):
    out, lse = reference.attention(q, k, v, sinks=sinks, **kw)
    grads = jax.grad(lambda *a: jnp.sum(reference.attention(*a[:3], sinks=a[3], **kw)[0] * g_out),
                     argnums=(0, 1, 2, 3))(q, k, v, sinks)  # fmt: skip
    return out, lse, grads


def _check_family(family, q, k, v, sinks, g_out, kw, ref, gradients=True):
    out_ref, lse_ref, grads_ref = ref
    with pytest.MonkeyPatch.context() as env:
        env.setenv(_plan.KERNELS_ENV, family)
        fwd = jax.jit(lambda q, k, v, s: jax_flash.attention(
            q, k, v, sinks=s, implementation="cuda", return_residual=True, **kw))  # fmt: skip
        assert "jax_flash_fwd" in _kernels(fwd, q, k, v, sinks)  # the kernels ran it
        poison_free_memory()
        out, lse = fwd(q, k, v, sinks)
        assert out.dtype == q.dtype
        assert reference.rel_error(out, out_ref) < FWD_TOL, family
        finite = np.isfinite(np.asarray(lse_ref))
        np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
        assert reference.rel_error(jnp.where(finite, lse, 0), jnp.where(finite, lse_ref, 0)) < 1e-4, family
        if gradients:
            poison_free_memory()
            try:
                grads = _gradients("cuda", q, k, v, sinks, g_out, kw)
            except ValueError as e:  # backward kernels beyond the run's shared-memory cap (JAX_FLASH_SMEM_LIMIT)
                assert "shared memory" in str(e), e
                grads = _gradients(None, q, k, v, sinks, g_out, kw)  # the kernels' forward, the xla backward
            for name, mine, want in zip(("dq", "dk", "dv", "dsinks"), grads, grads_ref, strict=True):
                assert np.isfinite(np.asarray(mine, np.float32)).all(), f"{family} {name}"
                assert reference.rel_error(mine, want) < GRAD_TOL, f"{family} {name}"


def _problem(name, dtype, b, t, s, n, kv_heads, h, hv=None):
    rng = rng_for("cuda-sinks", name, str(dtype), b, t, s, n, kv_heads, h, hv)
    q, k, v = qkv(rng, dtype, b, t, s, n, kv_heads, h)
    if hv is not None:
        v = v[..., :hv]
    sinks = jnp.asarray(rng.normal(size=(n,)) * 2, jnp.float32)
    g_out = jnp.asarray(rng.normal(size=q.shape[:3] + v.shape[-1:]), jnp.float32)
    return rng, q, k, v, sinks, g_out


@pytest.mark.parametrize("h,mask", CASES)
def test_forward_and_gradients(h, mask):
    dtype = turing_dtype(os.environ.get(_plan.KERNELS_ENV, ""))
    rng, q, k, v, sinks, g_out = _problem(mask, dtype, B, T, S, N, K, h)
    kw = MASKS[mask](rng)
    ref = _reference(q, k, v, sinks, g_out, kw)
    for family in families_for(dtype, h, **kw):
        if family == "sm75" and (dtype != jnp.float16 or h > 128 or "bias" in kw):
            continue  # Turing takes float16 up to 128 without a bias (tests/test_cuda.py's turing_takes)
        _check_family(family, q, k, v, sinks, g_out, kw, ref)


def test_gpt_oss_layout():
    """64 query heads over 8 kv heads, d = 64, a causal window of 128, 1024 tokens."""
    dtype = turing_dtype(os.environ.get(_plan.KERNELS_ENV, ""))
    _, q, k, v, sinks, g_out = _problem("gpt-oss", dtype, 1, 1024, 1024, 64, 8, 64)
    kw = {"is_causal": True, "local_window_size": (127, 0)}
    ref = _reference(q, k, v, sinks, g_out, kw)
    for family in families_for(dtype, 64, **kw):
        _check_family(family, q, k, v, sinks, g_out, kw, ref)


def test_unequal_head_dims_192_128():
    """MLA's (192, 128) on the Hopper kernels of its own."""
    hopper_or_skip("the (192, 128) kernels")
    _, q, k, v, sinks, g_out = _problem("mla", jnp.bfloat16, B, T, S, N, K, 192, hv=128)
    kw = {"is_causal": True}
    _check_family("best", q, k, v, sinks, g_out, kw, _reference(q, k, v, sinks, g_out, kw))


@pytest.mark.parametrize("h", [512, 1024])
def test_wide_forward(h):
    """The forward above head dim 256 (its gradients are the xla path's, tests/test_cuda_wide.py)."""
    if _plan.family() is _plan.Family.TURING:
        pytest.skip("the Turing kernels take head dims up to 128")
    _, q, k, v, sinks, g_out = _problem("wide", jnp.bfloat16, 1, 129, 300, 2, 1, h)
    kw = {"is_causal": True}
    out_ref, lse_ref = reference.attention(q, k, v, sinks=sinks, **kw)
    try:
        _check_family(forced_family(), q, k, v, sinks, g_out, kw, (out_ref, lse_ref, None), gradients=False)
    except ValueError as e:  # the mma.sync forward: beyond the run's shared-memory cap, or above 512
        assert "shared memory" in str(e) or "Hopper's kernels alone" in str(e), e


def test_a_row_that_sees_no_key_gives_0_and_its_sink():
    dtype = turing_dtype(os.environ.get(_plan.KERNELS_ENV, ""))
    _, q, k, v, sinks, g_out = _problem("empty rows", dtype, B, T, S, N, K, 64)
    sinks = sinks.at[0].set(-jnp.inf)  # a head without a sink: lse -inf, out 0, no NaN
    kw = {"query_seq_lengths": jnp.asarray([T, 0], jnp.int32), "key_value_seq_lengths": jnp.asarray([S, 0], jnp.int32)}
    out, lse = jax.jit(lambda q, k, v, s: jax_flash.attention(
        q, k, v, sinks=s, implementation="cuda", return_residual=True, **kw))(q, k, v, sinks)  # fmt: skip
    assert np.all(np.asarray(out[1], np.float32) == 0)
    np.testing.assert_array_equal(np.asarray(lse[1]), np.broadcast_to(np.asarray(sinks), (T, N)))
    grads = _gradients("cuda", q, k, v, sinks, g_out, kw)
    assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in grads)
    assert np.all(np.asarray(grads[0][1], np.float32) == 0) and np.all(np.asarray(grads[1][1], np.float32) == 0)


def _decode_or_skip():
    if _plan.family() is _plan.Family.TURING:
        pytest.skip("the Turing family has no decode kernels")


@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("n,kv_heads,h", [(64, 8, 64), (32, 8, 128)])
def test_decode_dense(t, n, kv_heads, h):
    """The split-KV decode kernels (many splits at 4k tokens): the sink enters once, after the combine."""
    _decode_or_skip()
    _, q, k, v, sinks, _ = _problem("decode", jnp.bfloat16, 2, t, 4096, n, kv_heads, h)
    kw = {"is_causal": True, "key_value_seq_lengths": jnp.asarray([4096, 1001], jnp.int32)}
    fn = jax.jit(lambda q, k, v, s: jax_flash.attention(q, k, v, sinks=s, implementation="cuda",
                                                        return_residual=True, **kw))  # fmt: skip
    assert _kernels(fn, q, k, v, sinks) == ["jax_flash_decode"]
    poison_free_memory()
    out, lse = fn(q, k, v, sinks)
    ref_out, ref_lse = reference.attention(q, k, v, sinks=sinks, **kw)
    assert reference.rel_error(out, ref_out) < FWD_TOL and reference.rel_error(lse, ref_lse) < 1e-4


@pytest.mark.parametrize("page_size", [16, 64])
def test_decode_paged(page_size):
    _decode_or_skip()
    rng = rng_for("cuda-sinks-paged", page_size)
    lengths = [2000, 37, page_size]
    max_pages = -(-max(lengths) // page_size)
    q, kp, vp, lens, table, dense_k, dense_v = paged_problem(rng, 3, 1, 32, 8, 128, page_size, max_pages, lengths)
    sinks = jnp.asarray(rng.normal(size=(32,)) * 2, jnp.float32)
    fn = jax.jit(lambda q, kp, vp, s: jax_flash.paged_attention(
        q, kp, vp, lens, table, sinks=s, implementation="cuda", return_residual=True))  # fmt: skip
    assert _kernels(fn, q, kp, vp, sinks) == ["jax_flash_decode"]
    poison_free_memory()
    out, lse = fn(q, kp, vp, sinks)
    ref_out, ref_lse = reference.attention(q, dense_k, dense_v, sinks=sinks, key_value_seq_lengths=lens,
                                           query_seq_lengths=jnp.full((3,), 1))  # fmt: skip
    assert reference.rel_error(out, ref_out) < FWD_TOL and reference.rel_error(lse, ref_lse) < 1e-4
