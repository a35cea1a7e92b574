"""fp8 KV caches on the decode kernels (marked `gpu`): float8_e4m3fn and float8_e5m2 caches, dense
and paged, read as stored (cuda/decode/fp8.cuh), against the float64 reference on the dequantized
values: both query dtypes, head dims 64 and 128, 1-16 queries, GQA groups 1-16, lengths 0, 1 and
odd, windows, the soft cap, sinks, per-tensor and per-kv-head scales, one split and many. Outputs
land on NaN-poisoned memory; each call runs twice and must give the same bits (a race would move)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _decode, _ffi, _plan
from tests import reference
from tests.cases import rng_for
from tests.test_cuda import poison_free_memory
from tests.test_fp8 import FP8, _cache
from tests.test_paged import paged_problem

pytestmark = pytest.mark.gpu

TOL = 1e-2


@pytest.fixture(autouse=True)
def decode_kernels_or_skip():
    if _plan.family() is _plan.Family.TURING:
        pytest.skip("the Turing family has no decode kernels")


def _twice(fn, *args):
    """fn(*args) on poisoned memory twice (the same bits both times), with its kernel calls."""
    recorded, call_kernel = [], _ffi.call_kernel
    with pytest.MonkeyPatch.context() as env:
        env.setattr(_ffi, "call_kernel", lambda target, *a: recorded.append((target, a[1][1].dtype)) or call_kernel(
            target, *a))  # fmt: skip
        jax.jit(fn).lower(*args)
    results = []
    for _ in range(2):
        poison_free_memory()
        results.append(jax.jit(fn)(*args))
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    return results[0], recorded


def _check(out, lse, ref_out, ref_lse):
    assert not np.isnan(np.asarray(out, np.float32)).any()
    assert reference.rel_error(out, ref_out) < TOL
    finite = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    assert reference.rel_error(jnp.where(finite, lse, 0), jnp.where(finite, ref_lse, 0)) < 1e-3


@pytest.mark.parametrize("fmt", sorted(FP8))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("h", [64, 128])
@pytest.mark.parametrize("t,group", [(1, 1), (1, 8), (4, 16), (16, 4)])
@pytest.mark.parametrize("splits", ["1", "rule", "7"])
def test_dense(monkeypatch, fmt, dtype, h, t, group, splits):
    if splits != "rule":
        monkeypatch.setenv(_decode.SPLITS_ENV, splits)
    rng = rng_for("cuda-fp8", fmt, str(dtype), h, t, group, splits)
    b, s, kv_heads = 3, 1000, 2
    q = jnp.asarray(rng.normal(size=(b, t, kv_heads * group, h)), dtype)
    k, k_scale, k_values = _cache(rng, (b, s, kv_heads, h), fmt, per_head=t != 16)
    v, v_scale, v_values = _cache(rng, (b, s, kv_heads, h), fmt, per_head=t != 16)
    kw = dict(is_causal=True, key_value_seq_lengths=jnp.asarray([s, 1, 333], jnp.int32))
    fn = lambda q, k, v: jax_flash.attention(q, k, v, key_scale=k_scale, value_scale=v_scale, implementation="cuda",  # noqa: E731
                                             return_residual=True, **kw)  # fmt: skip
    (out, lse), calls = _twice(fn, q, k, v)
    assert calls == [("jax_flash_decode", jnp.dtype(FP8[fmt]))]  # the cache as stored
    _check(out, lse, *reference.attention(q, k_values, v_values, **kw))


@pytest.mark.parametrize("fmt", sorted(FP8))
@pytest.mark.parametrize("kw", [dict(is_causal=True, local_window_size=(100, 0)), dict(is_causal=True, softcap=5.0),
                                dict(is_causal=True, sinks=True)], ids=["window", "softcap", "sinks"])  # fmt: skip
def test_masks_and_sinks(fmt, kw):
    rng = rng_for("cuda-fp8-masks", fmt, tuple(kw))
    q = jnp.asarray(rng.normal(size=(2, 4, 8, 128)), jnp.bfloat16)
    k, k_scale, k_values = _cache(rng, (2, 2000, 2, 128), fmt, True)
    v, v_scale, v_values = _cache(rng, (2, 2000, 2, 128), fmt, True)
    kw = dict(kw, key_value_seq_lengths=jnp.asarray([2000, 0], jnp.int32))
    if kw.pop("sinks", False):
        kw["sinks"] = jnp.asarray(rng.normal(size=(8,)), jnp.float32)
    fn = lambda q, k, v: jax_flash.attention(q, k, v, key_scale=k_scale, value_scale=v_scale, implementation="cuda",  # noqa: E731
                                             return_residual=True, **kw)  # fmt: skip
    (out, lse), calls = _twice(fn, q, k, v)
    assert calls == [("jax_flash_decode", jnp.dtype(FP8[fmt]))]
    _check(out, lse, *reference.attention(q, k_values, v_values, **kw))


@pytest.mark.parametrize("fmt", sorted(FP8))
@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("t", [1, 5])
def test_paged(fmt, page_size, t):
    rng = rng_for("cuda-fp8-paged", fmt, page_size, t)
    lengths = [3000, 1, page_size, 0]
    max_pages = -(-max(lengths) // page_size)
    q, kp, vp, lens, table, _, _ = paged_problem(rng, 4, t, 32, 8, 128, page_size, max_pages, lengths)
    (kq, k_scale), (vq, v_scale) = (jax_flash.quantize_kv(x.astype(jnp.float32), FP8[fmt]) for x in (kp, vp))
    fn = lambda q, kq, vq: jax_flash.paged_attention(q, kq, vq, lens, table, key_scale=k_scale, value_scale=v_scale,  # noqa: E731
                                                     is_causal=True, return_residual=True, implementation="cuda")  # fmt: skip
    (out, lse), calls = _twice(fn, q, kq, vq)
    assert calls == [("jax_flash_decode", jnp.dtype(FP8[fmt]))]
    dense_k, dense_v = (jnp.take(x.astype(jnp.float64) * s[:, None], table, axis=0).reshape(4, -1, 8, 128)
                        for x, s in ((kq, k_scale), (vq, v_scale)))  # fmt: skip
    _check(out, lse, *reference.attention(q, dense_k, dense_v, is_causal=True, key_value_seq_lengths=lens,
                                          query_seq_lengths=jnp.full((4,), t), diagonal_by_lengths=True))  # fmt: skip
