"""fp8 KV caches (DESIGN.md's contract): keys and values in float8_e4m3fn or float8_e5m2 with
per-tensor or per-kv-head scales, against the float64 reference on the dequantized values, dense
and paged, on every path that runs on a CPU (the xla path dense and blockwise, the CUDA path's
Python through the fake kernels); quantize_kv's round trip; forward only; bad input by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _decode, dense_impl
from tests import fake_kernels, reference
from tests.cases import rng_for
from tests.test_paged import paged_problem

FP8 = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
PATHS = ["xla-dense", "xla-blockwise", "cuda (fake kernels)"]
TOL = 1e-2  # bf16 queries, outputs rounded to bf16, keys and values converted to bf16
# The lse: the keys times their scale rounded to bf16 move each logit by up to 2^-9 of itself.
LSE_TOL = 3e-3


@pytest.fixture
def path(request, monkeypatch):
    name = request.param
    if name != "xla-dense":
        monkeypatch.setattr(dense_impl, "budget_bytes", lambda: -1)
    if name.startswith("cuda"):
        fake_kernels.record_calls(monkeypatch)
        monkeypatch.setattr(_decode, "sm_count", lambda: 132)
        return "cuda"
    return "xla"


def _cache(rng, shape, fmt, per_head):
    """An fp8 cache of normal values (a few heads far larger than others), its scale and the
    float64 values it stands for."""
    x = rng.normal(size=shape) * rng.uniform(0.2, 4, size=shape[-2])[:, None]
    if per_head:
        xq, scale = jax_flash.quantize_kv(jnp.asarray(x, jnp.float32), FP8[fmt])
    else:
        scale = jnp.asarray(np.abs(x).max() / float(jnp.finfo(FP8[fmt]).max), jnp.float32)
        xq = jnp.asarray(x / np.asarray(scale), jnp.float32).astype(FP8[fmt])
    values = np.asarray(xq.astype(jnp.float64)) * np.broadcast_to(np.asarray(scale, np.float64), (shape[-2],))[:, None]
    return xq, scale, jnp.asarray(values)


MASKS = {
    "none": {},
    "causal": {"is_causal": True},
    "window": {"is_causal": True, "local_window_size": (37, 0)},
    "softcap": {"is_causal": True, "softcap": 3.0},
}


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("fmt", sorted(FP8))
@pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "per-tensor"])
@pytest.mark.parametrize("t,group", [(1, 1), (1, 8), (4, 16), (16, 4)])
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_dense_cache_against_float64(path, fmt, per_head, t, group, mask):
    rng = rng_for("fp8-dense", fmt, per_head, t, group, mask)
    b, s, kv_heads, h = 3, 200, 2, 64
    q = jnp.asarray(rng.normal(size=(b, t, kv_heads * group, h)), jnp.bfloat16)
    k, k_scale, k_values = _cache(rng, (b, s, kv_heads, h), fmt, per_head)
    v, v_scale, v_values = _cache(rng, (b, s, kv_heads, h), fmt, per_head)
    lengths = jnp.asarray([s, 1, 77], jnp.int32)  # full, one token, odd
    kw = dict(MASKS[mask], key_value_seq_lengths=lengths)
    out, lse = jax_flash.attention(q, k, v, key_scale=k_scale, value_scale=v_scale, implementation=path,
                                   return_residual=True, **kw)  # fmt: skip
    ref_out, ref_lse = reference.attention(q, k_values, v_values, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert reference.rel_error(out, ref_out) < TOL
    assert reference.rel_error(lse, ref_lse) < LSE_TOL


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("fmt", sorted(FP8))
def test_sinks_and_empty_caches(path, fmt):
    """Sinks join the fp8 call's softmax; a cache of length 0 gives output 0 and lse = the sink."""
    rng = rng_for("fp8-sinks", fmt)
    q = jnp.asarray(rng.normal(size=(2, 2, 8, 32)), jnp.float16)
    k, k_scale, k_values = _cache(rng, (2, 64, 2, 32), fmt, True)
    v, v_scale, v_values = _cache(rng, (2, 64, 2, 32), fmt, True)
    sinks = jnp.asarray(rng.normal(size=(8,)), jnp.float32)
    kw = dict(is_causal=True, key_value_seq_lengths=jnp.asarray([64, 0], jnp.int32))
    out, lse = jax_flash.attention(q, k, v, key_scale=k_scale, value_scale=v_scale, sinks=sinks, implementation=path,
                                   return_residual=True, **kw)  # fmt: skip
    ref_out, ref_lse = reference.attention(q, k_values, v_values, sinks=sinks, **kw)
    assert reference.rel_error(out, ref_out) < TOL and reference.rel_error(lse, ref_lse) < LSE_TOL
    assert np.all(np.asarray(out[1], np.float32) == 0)
    np.testing.assert_allclose(np.asarray(lse[1]), np.broadcast_to(np.asarray(sinks), (2, 8)))


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("fmt", sorted(FP8))
@pytest.mark.parametrize("page_size", [8, 16, 64])
@pytest.mark.parametrize("t", [1, 5])
def test_paged_pools_against_float64(path, fmt, page_size, t):
    rng = rng_for("fp8-paged", fmt, page_size, t)
    lengths = [130, 1, page_size, 0]
    max_pages = -(-max(lengths) // page_size)
    q, kp, vp, lens, table, _, _ = paged_problem(rng, 4, t, 8, 2, 32, page_size, max_pages, lengths)
    (kq, k_scale), (vq, v_scale) = (jax_flash.quantize_kv(x.astype(jnp.float32) * 3, FP8[fmt]) for x in (kp, vp))
    sinks = jnp.asarray(rng.normal(size=(8,)), jnp.float32)
    out, lse = jax_flash.paged_attention(q, kq, vq, lens, table, key_scale=k_scale, value_scale=v_scale, sinks=sinks,
                                         is_causal=True, return_residual=True, implementation=path)  # fmt: skip
    dense_k, dense_v = (jnp.take(x.astype(jnp.float64) * s[:, None], table, axis=0).reshape(4, -1, 2, 32)
                        for x, s in ((kq, k_scale), (vq, v_scale)))  # fmt: skip
    ref_out, ref_lse = reference.attention(q, dense_k, dense_v, sinks=sinks, is_causal=True, key_value_seq_lengths=lens,
                                           query_seq_lengths=jnp.full((4,), t), diagonal_by_lengths=True)  # fmt: skip
    assert out.dtype == q.dtype and reference.rel_error(out, ref_out) < TOL
    assert reference.rel_error(lse, ref_lse) < LSE_TOL


@pytest.mark.parametrize("query_dtype", [jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64])
def test_the_output_has_the_querys_dtype(query_dtype):
    rng = rng_for("fp8-dtypes", str(query_dtype))
    q = jnp.asarray(rng.normal(size=(1, 3, 4, 16)), query_dtype)
    k, k_scale, k_values = _cache(rng, (1, 20, 2, 16), "e4m3", True)
    v, v_scale, v_values = _cache(rng, (1, 20, 2, 16), "e4m3", True)
    out = jax_flash.attention(q, k, v, key_scale=k_scale, value_scale=v_scale)
    assert out.dtype == query_dtype
    tol = {jnp.float16: TOL, jnp.bfloat16: TOL}.get(query_dtype, 1e-6)
    assert reference.rel_error(out, reference.attention(q, k_values, v_values)[0]) < tol


def test_default_scales_are_1_and_jit_and_vmap_take_the_call():
    rng = rng_for("fp8-default")
    q = jnp.asarray(rng.normal(size=(2, 3, 4, 16)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(2, 20, 2, 16)), jnp.float32).astype(jnp.float8_e4m3fn) for _ in range(2))
    out = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, is_causal=True))(q, k, v)
    ref = reference.attention(q, k.astype(jnp.float64), v.astype(jnp.float64), is_causal=True)[0]
    assert reference.rel_error(out, ref) < TOL
    mapped = jax.vmap(lambda q, k, v: jax_flash.attention(q, k, v, is_causal=True))(q, k, v)
    assert reference.rel_error(mapped, ref) < TOL
    assert jax_flash.chosen_implementation(q, k, v, key_scale=1.0) in ("xla-dense", "xla-blockwise")


def test_every_derivative_is_refused():
    rng = rng_for("fp8-grad")
    q = jnp.asarray(rng.normal(size=(1, 3, 4, 16)), jnp.float32)
    kq, ks = jax_flash.quantize_kv(jnp.asarray(rng.normal(size=(1, 20, 2, 16)), jnp.float32))
    sinks = jnp.zeros((4,), jnp.float32)
    with pytest.raises(ValueError, match="fp8 keys and values is forward only"):
        jax.grad(lambda q: jnp.sum(jax_flash.attention(q, kq, kq, key_scale=ks, value_scale=ks)))(q)
    with pytest.raises(ValueError, match="forward only"):
        jax.grad(lambda s: jnp.sum(jax_flash.attention(q, kq, kq, key_scale=s, value_scale=ks)))(ks)
    with pytest.raises(ValueError, match="forward only"):
        jax.jvp(lambda s: jax_flash.attention(q, kq, kq, key_scale=ks, sinks=s), (sinks,), (sinks,))
    pages, page_scale = jax_flash.quantize_kv(jnp.asarray(rng.normal(size=(4, 8, 2, 16)), jnp.float32))
    table, lengths = jnp.asarray([[0, 2]], jnp.int32), jnp.asarray([11], jnp.int32)
    with pytest.raises(ValueError, match="forward only"):
        jax.grad(lambda s: jnp.sum(jax_flash.paged_attention(q, pages, pages, lengths, table, key_scale=page_scale,
                                                             sinks=s)))(sinks)  # fmt: skip


@pytest.mark.parametrize("fmt", sorted(FP8))
def test_quantize_kv_round_trip(fmt):
    """Within the format's precision of each element (relative 2^-4 for e4m3, 2^-3 for e5m2, from
    the rounding to 3 or 2 mantissa bits), one scale per kv head from its absolute maximum; a head
    of zeros gets scale 1 and stays zeros."""
    rng = rng_for("fp8-round-trip", fmt)
    x = rng.normal(size=(3, 50, 4, 32)) * np.asarray([1e-3, 1.0, 500.0, 0.0])[:, None]
    xq, scale = jax_flash.quantize_kv(jnp.asarray(x, jnp.float32), FP8[fmt])
    assert xq.dtype == FP8[fmt] and xq.shape == x.shape and scale.shape == (4,) and scale.dtype == jnp.float32
    back = np.asarray(xq.astype(jnp.float32)) * np.asarray(scale)[:, None]
    largest = float(jnp.finfo(FP8[fmt]).max)
    np.testing.assert_allclose(np.asarray(scale[:3]), np.abs(x[..., :3, :]).max(axis=(0, 1, 3)) / largest, rtol=1e-6)
    assert float(scale[3]) == 1.0 and np.all(back[..., 3, :] == 0)
    bound = 2.0 ** -(4 if fmt == "e4m3" else 3)
    # Normal fp8 values keep that relative bound; the few subnormal ones (tiny against the head's
    # maximum) an absolute one of the format's smallest step.
    tiny = float(jnp.finfo(FP8[fmt]).smallest_subnormal) * np.asarray(scale)[:, None]
    assert np.all(np.abs(back - x) <= bound * np.abs(x) + tiny)
    assert np.abs(back[..., 2, :]).max() == pytest.approx(np.abs(x[..., 2, :]).max(), rel=1e-6)  # the maximum is exact


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(value=jnp.zeros((1, 4, 2, 8), jnp.float8_e5m2)), TypeError, "must share one fp8 dtype"),
    (dict(value=jnp.zeros((1, 4, 2, 8), jnp.bfloat16)), TypeError, "must share one fp8 dtype"),
    (dict(key_scale=jnp.ones((3,))), ValueError, r"key_scale must be a scalar or have shape \[K\] = \(2,\)"),
    (dict(value_scale=jnp.ones((2,), jnp.int32)), TypeError, "value_scale must be a floating-point"),
    (dict(query=jnp.zeros((1, 2, 4, 8), jnp.int8)), TypeError, "query dtype must be one of"),
    (dict(key=jnp.zeros((1, 4, 2, 8), jnp.bfloat16), value=jnp.zeros((1, 4, 2, 8), jnp.bfloat16)), TypeError,
     "key_scale is for fp8 key and value"),
])  # fmt: skip
def test_bad_input_is_refused_by_name(kwargs, error, match):
    args = dict(query=jnp.zeros((1, 2, 4, 8), jnp.bfloat16), key=jnp.zeros((1, 4, 2, 8), jnp.float8_e4m3fn),
                value=jnp.zeros((1, 4, 2, 8), jnp.float8_e4m3fn), key_scale=1.0)  # fmt: skip
    args.update(kwargs)
    with pytest.raises(error, match=match):
        jax_flash.attention(**args)


def test_quantize_kv_refuses_bad_input_by_name():
    with pytest.raises(TypeError, match="dtype must be one of float8_e4m3fn, float8_e5m2"):
        jax_flash.quantize_kv(jnp.ones((2, 3)), jnp.int8)
    with pytest.raises(TypeError, match="x must be a float16"):
        jax_flash.quantize_kv(jnp.ones((2, 3), jnp.int32))
    with pytest.raises(ValueError, match=r"x must have shape \[..., K, H\]"):
        jax_flash.quantize_kv(jnp.ones((3,)))


def test_the_decode_benchmark_times_fp8_caches():
    """`bench --decode --kv-dtype fp8`: the fp8 columns run (no gap) and count one byte a value."""
    from jax_flash.bench import decode

    impls = decode.implementations(on_gpu=False, kv_dtype="fp8")
    assert {"jax_flash fp8", "paged 64 fp8"} <= set(impls)
    times = decode.measure(decode.DecodeShape(1, 256, 1), jnp.float32, impls, rounds=1, calls_per_dispatch=1)
    assert all(seconds is not None and seconds > 0 for seconds in times.values()), times
    shape = decode.DecodeShape(1, 256, 1)
    assert shape.kv_bytes(decode.cache_dtype("jax_flash fp8", jnp.bfloat16)) * 2 == shape.kv_bytes(jnp.bfloat16)


def test_the_generate_example_with_fp8_caches(capsys, monkeypatch):
    """examples/generate.py --kv-dtype fp8: fp8 caches written as generation goes, their tokens/s
    against the model dtype's and how far the logits moved (a little, not at all would mean the
    cache was not fp8)."""
    import pathlib
    import sys

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent.parent / "examples"))
    import generate

    results = generate.main(["--kv-dtype", "fp8", "--train-steps", "2", "--new-tokens", "4", "--rounds", "1"])
    out = capsys.readouterr().out
    assert "jax_flash fp8 / jax_flash tokens/s" in out and "jax_flash paged fp8 / jax_flash paged tokens/s" in out
    moved = np.abs(results["jax_flash fp8"][2] - results["jax_flash"][2]).max()
    assert 0 < moved < 0.5
    sys.modules.pop("generate", None)


def _recorded_decode_calls(monkeypatch):
    calls = fake_kernels.record_calls(monkeypatch)
    monkeypatch.setattr(_decode, "sm_count", lambda: 132)
    return calls


@pytest.mark.parametrize("h,reads_fp8", [(64, True), (128, True), (32, False)])
def test_the_decode_kernels_read_fp8_as_stored(monkeypatch, h, reads_fp8):
    """On the CUDA path (through the fake kernels) a decode call at head dims 64 and 128 hands the
    fp8 cache and its scales, per batch row [B, K], to the decode kernels; elsewhere the cache is
    converted first and the kernels see the query's dtype."""
    calls = _recorded_decode_calls(monkeypatch)
    rng = rng_for("fp8-route", h)
    q = jnp.asarray(rng.normal(size=(3, 2, 8, h)), jnp.bfloat16)
    k, k_scale, k_values = _cache(rng, (3, 100, 2, h), "e4m3", True)
    v, v_scale, v_values = _cache(rng, (3, 100, 2, h), "e4m3", True)
    kw = dict(is_causal=True, key_value_seq_lengths=jnp.asarray([100, 0, 33], jnp.int32))
    out = jax_flash.attention(q, k, v, key_scale=k_scale, value_scale=v_scale, implementation="cuda", **kw)
    assert [target for target, _ in calls] == ["jax_flash_decode"]
    shapes = calls[0][1]
    assert (shapes[5], shapes[6]) == (((3, 2), (3, 2)) if reads_fp8 else ((3, 0), (3, 0)))
    assert jax_flash.chosen_implementation(q, k, v, key_scale=k_scale, value_scale=v_scale, **kw) == "cuda"
    assert reference.rel_error(out, reference.attention(q, k_values, v_values, **kw)[0]) < TOL


def test_fp8_pages_are_read_in_place_and_vmap_folds_their_scales(monkeypatch):
    calls = _recorded_decode_calls(monkeypatch)
    rng = rng_for("fp8-paged-route")
    q, kp, vp, lens, table, _, _ = paged_problem(rng, 2, 1, 8, 2, 64, 16, 4, [64, 17])
    (kq, k_scale), (vq, v_scale) = (jax_flash.quantize_kv(x.astype(jnp.float32), jnp.float8_e5m2) for x in (kp, vp))
    out = jax_flash.paged_attention(q, kq, vq, lens, table, key_scale=k_scale, value_scale=v_scale, implementation="cuda")
    assert [target for target, _ in calls] == ["jax_flash_decode"] and calls[0][1][1] == kq.shape
    dense_k, dense_v = (jnp.take(x.astype(jnp.float64) * s[:, None], table, axis=0).reshape(2, -1, 2, 64)
                        for x, s in ((kq, k_scale), (vq, v_scale)))  # fmt: skip
    ref = reference.attention(q, dense_k, dense_v, key_value_seq_lengths=lens, query_seq_lengths=jnp.full((2,), 1),
                              diagonal_by_lengths=True)[0]  # fmt: skip
    assert reference.rel_error(out, ref) < TOL
    # Two caches of their own scales under vmap: one call, the scales folded with the batch rows.
    calls.clear()
    scales = jnp.stack([k_scale, 2 * k_scale]), jnp.stack([v_scale, v_scale / 2])
    mapped = jax.vmap(lambda q, ks, vs: jax_flash.paged_attention(q, kq, vq, lens, table, key_scale=ks, value_scale=vs,
                                                                  implementation="cuda"))(jnp.stack([q, q]), *scales)
    # (custom_vmap traces the call unbatched first: the folded call is the last)
    assert {target for target, _ in calls} == {"jax_flash_decode"} and calls[-1][1][5] == (4, 2)
    second = jax_flash.paged_attention(q, kq, vq, lens, table, key_scale=2 * k_scale, value_scale=v_scale / 2,
                                       implementation="xla")  # fmt: skip
    assert reference.rel_error(mapped[0], out) < 1e-6 and reference.rel_error(mapped[1], second) < TOL
