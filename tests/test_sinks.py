"""Attention sinks (DESIGN.md's contract): a logit per query head in every row's softmax, with no
value, against the float64 reference on every path (the xla path dense and blockwise, the CUDA
path's Python on CPU through the fake kernels, paged caches), gradients included (d sinks too)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _decode, _operands, dense_impl
from jax_flash.flax import linen as flax_linen
from jax_flash.flax import nnx as flax_nnx
from tests import fake_kernels, reference
from tests.cases import qkv, rng_for

B, N, K, H = 2, 8, 2, 32
CASES = {
    "none": lambda t, s, rng: {},
    "causal": lambda t, s, rng: {"is_causal": True},
    "window 128 (gpt-oss)": lambda t, s, rng: {"is_causal": True, "local_window_size": (128, 0)},
    "lengths": lambda t, s, rng: {"query_seq_lengths": jnp.asarray([t, t // 2], jnp.int32),
                                  "key_value_seq_lengths": jnp.asarray([s, s // 3], jnp.int32)},
    "segments": lambda t, s, rng: dict(zip(("q_segment_ids", "kv_segment_ids"), (
        jnp.asarray(np.sort(rng.integers(0, 3, size=(B, n))), jnp.int32) for n in (t, s)))),
    "softcap": lambda t, s, rng: {"softcap": 5.0, "is_causal": True},
    "bias": lambda t, s, rng: {"bias": jnp.asarray(rng.normal(size=(B, N, t, s)), jnp.float32)},
}  # fmt: skip
PATHS = ["xla-dense", "xla-blockwise", "cuda (fake kernels)"]


@pytest.fixture
def path(request, monkeypatch):
    """Runs the test on one path: the xla path's dense or blockwise formulation, or the CUDA
    path's Python through the fake kernels."""
    name = request.param
    if name == "xla-blockwise":
        monkeypatch.setattr(dense_impl, "budget_bytes", lambda: -1)
    if name.startswith("cuda"):
        fake_kernels.record_calls(monkeypatch)
        monkeypatch.setattr(dense_impl, "budget_bytes", lambda: -1)
        monkeypatch.setenv(_decode.DECODE_ENV, "0")
        return "cuda"
    return "xla"


def _inputs(name, t, s, dtype):
    rng = rng_for("sinks", name, t, s, str(dtype))
    q, k, v = qkv(rng, dtype, B, t, s, N, K, H)
    sinks = jnp.asarray(rng.normal(size=(N,)) * 2, jnp.float32)
    return rng, q, k, v, sinks


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("t,s", [(48, 48), (24, 56)])
def test_forward_and_gradients_against_float64(path, case, t, s):
    dtype = jnp.float16 if path == "cuda" else jnp.float32
    rng, q, k, v, sinks = _inputs(case, t, s, dtype)
    kw = CASES[case](t, s, rng)
    out, lse = jax_flash.attention(q, k, v, sinks=sinks, implementation=path, return_residual=True, **kw)
    ref_out, ref_lse = reference.attention(q, k, v, sinks=sinks, **kw)
    tol = 2e-2 if dtype == jnp.float16 else 1e-5
    assert out.dtype == dtype and reference.rel_error(out, ref_out) < tol
    assert reference.rel_error(lse, ref_lse) < tol
    g_out = jnp.asarray(rng.normal(size=out.shape), jnp.float32)

    def loss(attend, q, k, v, sinks):
        return jnp.sum(attend(q, k, v, sinks).astype(jnp.float32) * g_out)

    ours = lambda q, k, v, sinks: jax_flash.attention(q, k, v, sinks=sinks, implementation=path, **kw)  # noqa: E731
    ref = lambda q, k, v, sinks: reference.attention(q, k, v, sinks=sinks, **kw)[0]  # noqa: E731
    grads = jax.grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    ref_grads = jax.grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for name, mine, want in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads, strict=True):
        assert reference.rel_error(mine, want) < 5 * tol, name


@pytest.mark.parametrize("path", PATHS[:2], indirect=True)
def test_gqa_64_over_8_at_head_dim_64(path):
    """gpt-oss's head layout: 64 query heads over 8 kv heads, d = 64, a causal window of 128."""
    rng = rng_for("sinks-gpt-oss")
    q, k, v = qkv(rng, jnp.float32, 1, 40, 40, 64, 8, 64)
    sinks = jnp.asarray(rng.normal(size=(64,)), jnp.float32)
    kw = dict(is_causal=True, local_window_size=(128, 0))
    out = jax_flash.attention(q, k, v, sinks=sinks, implementation=path, **kw)
    assert reference.rel_error(out, reference.attention(q, k, v, sinks=sinks, **kw)[0]) < 1e-5


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_a_row_that_sees_no_key_gives_0_and_its_sink(path):
    """Query rows past their length: output 0, lse = the sink, zero gradients for q, k and v of
    those rows, d sinks finite; a sink of -inf (no sink for that head) leaves lse -inf, no NaN."""
    dtype = jnp.float16 if path == "cuda" else jnp.float32
    rng, q, k, v, sinks = _inputs("empty rows", 32, 32, dtype)
    sinks = sinks.at[0].set(-jnp.inf)
    q_len = jnp.asarray([20, 0], jnp.int32)
    out, lse = jax_flash.attention(q, k, v, sinks=sinks, query_seq_lengths=q_len, implementation=path,
                                   return_residual=True)  # fmt: skip
    assert np.all(np.asarray(out[0, 20:]) == 0) and np.all(np.asarray(out[1]) == 0)
    want = np.broadcast_to(np.asarray(sinks), (12, N))
    np.testing.assert_array_equal(np.asarray(lse[0, 20:]), want)
    grads = jax.grad(lambda q, k, v, s: jnp.sum(jax_flash.attention(
        q, k, v, sinks=s, query_seq_lengths=q_len, implementation=path).astype(jnp.float32)), argnums=(0, 1, 2, 3))(
        q, k, v, sinks)  # fmt: skip
    assert all(np.isfinite(np.asarray(g, np.float64)).all() for g in grads)
    assert np.all(np.asarray(grads[0][0, 20:]) == 0) and np.all(np.asarray(grads[0][1]) == 0)


def test_without_sinks_nothing_changes():
    """sinks=None is the call without them, bit for bit (the sink enters only when given)."""
    rng, q, k, v, _ = _inputs("none", 32, 40, jnp.float32)
    a = jax_flash.attention(q, k, v, is_causal=True, implementation="xla")
    b = jax_flash.attention(q, k, v, is_causal=True, implementation="xla", sinks=None)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_sink_far_below_every_logit_changes_nothing_measurable():
    rng, q, k, v, _ = _inputs("low sink", 32, 32, jnp.float32)
    plain = jax_flash.attention(q, k, v, implementation="xla")
    low = jax_flash.attention(q, k, v, implementation="xla", sinks=jnp.full((N,), -1e4, jnp.float32))
    assert reference.rel_error(low, plain) < 1e-7


@pytest.mark.parametrize("sinks,error,match", [
    (jnp.zeros((N + 1,)), ValueError, r"sinks must have shape \[N\] = \(8,\)"),
    (jnp.zeros((1, N)), ValueError, "sinks must have shape"),
    (jnp.zeros((N,), jnp.int32), TypeError, "sinks must be a floating-point array"),
    ("sinks", TypeError, "sinks must be an array"),
])  # fmt: skip
def test_bad_sinks_are_refused_by_name(sinks, error, match):
    _, q, k, v, _ = _inputs("bad", 8, 8, jnp.float32)
    with pytest.raises(error, match=match):
        jax_flash.attention(q, k, v, sinks=sinks)
    with pytest.raises(error, match=match):
        jax_flash.chosen_implementation(q, k, v, sinks=sinks)


@pytest.mark.parametrize("page_size", [8, 16])
def test_paged_caches(page_size):
    """paged_attention with sinks equals attention with sinks on the sequences' tokens."""
    rng = rng_for("sinks-paged", page_size)
    b, t, pages_per_seq = 2, 4, 3
    q = jnp.asarray(rng.normal(size=(b, t, N, H)), jnp.float32)
    pool = 2 * pages_per_seq + 1
    key_pages, value_pages = (jnp.asarray(rng.normal(size=(pool, page_size, K, H)), jnp.float32) for _ in range(2))
    table = jnp.asarray(rng.permutation(pool)[: b * pages_per_seq].reshape(b, pages_per_seq), jnp.int32)
    lengths = jnp.asarray([pages_per_seq * page_size, page_size + 3], jnp.int32)
    sinks = jnp.asarray(rng.normal(size=(N,)), jnp.float32)
    out, lse = jax_flash.paged_attention(q, key_pages, value_pages, lengths, table, is_causal=True, sinks=sinks,
                                         return_residual=True)  # fmt: skip
    keys = jnp.take(key_pages, table, axis=0).reshape(b, -1, K, H)
    values = jnp.take(value_pages, table, axis=0).reshape(b, -1, K, H)
    ref_out, ref_lse = reference.attention(q, keys, values, sinks=sinks, is_causal=True, key_value_seq_lengths=lengths,
                                           query_seq_lengths=jnp.full((b,), t), diagonal_by_lengths=True)  # fmt: skip
    assert reference.rel_error(out, ref_out) < 1e-5 and reference.rel_error(lse, ref_lse) < 1e-5
    plain = jax_flash.paged_attention(q, key_pages, value_pages, lengths, table, is_causal=True)
    assert out.shape == plain.shape and reference.rel_error(plain, ref_out) > 1e-3  # the sink changed it


def test_the_flax_modules_learn_their_sinks():
    """sinks=True adds a [num_heads] parameter (0 at first: the softmax then spans one more logit
    of value 0) that receives a gradient; off by default."""
    from flax import nnx

    x = jnp.asarray(rng_for("sinks-flax").normal(size=(2, 16, 32)), jnp.float32)
    module = flax_nnx.MultiHeadAttention(32, 4, sinks=True, rngs=nnx.Rngs(0))
    assert module.sink_logits[...].shape == (4,) and np.all(np.asarray(module.sink_logits[...]) == 0)
    assert flax_nnx.MultiHeadAttention(32, 4, rngs=nnx.Rngs(0)).sink_logits is None
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(module)
    g = np.asarray(grads["sink_logits"][...])
    assert g.shape == (4,) and np.all(np.isfinite(g)) and np.any(g != 0)
    linen = flax_linen.MultiHeadAttention(num_heads=4, sinks=True)
    params = linen.init(jax.random.key(0), x)
    assert params["params"]["sinks"].shape == (4,)
    assert "sinks" not in flax_linen.MultiHeadAttention(num_heads=4).init(jax.random.key(0), x)["params"]
    g = jax.grad(lambda p: jnp.sum(linen.apply(p, x) ** 2))(params)["params"]["sinks"]
    assert np.any(np.asarray(g) != 0)


def test_decode_kernels_path(monkeypatch):
    """T = 1 against a cache on the CUDA path (the decode kernels, as the fake kernels stand in for
    them): the sink joins their output and lse once."""
    calls = fake_kernels.record_calls(monkeypatch)
    monkeypatch.setattr(_decode, "sm_count", lambda: 132)
    rng, q, k, v, sinks = _inputs("decode", 1, 64, jnp.float16)
    lengths = jnp.asarray([64, 23], jnp.int32)
    kw = dict(is_causal=True, key_value_seq_lengths=lengths)
    out, lse = jax_flash.attention(q, k, v, sinks=sinks, implementation="cuda", return_residual=True, **kw)
    assert [target for target, _ in calls] == ["jax_flash_decode"]
    ref_out, ref_lse = reference.attention(q, k, v, sinks=sinks, **kw)
    assert reference.rel_error(out, ref_out) < 2e-2 and reference.rel_error(lse, ref_lse) < 1e-3


def _sinks_operand(calls, target):
    """The shape of the sinks operand of each recorded call of `target`."""
    index = _operands.TARGETS[target][0]._fields.index("sinks")
    return [shapes[index] for name, shapes in calls if name == target]


@pytest.mark.parametrize("t,target", [(48, "jax_flash_fwd"), (1, "jax_flash_decode")])
def test_the_kernels_take_the_sinks_themselves(monkeypatch, t, target):
    """The sinks reach the forward and decode kernels as an operand, each batch row's [B, N] (their
    softmax finish joins them); without sinks the operand is empty. The answer is the reference's."""
    calls = fake_kernels.record_calls(monkeypatch)
    monkeypatch.setattr(_decode, "sm_count", lambda: 132)
    rng, q, k, v, sinks = _inputs("operand", t, 64, jnp.float16)
    out, lse = jax_flash.attention(q, k, v, sinks=sinks, implementation="cuda", return_residual=True)
    jax_flash.attention(q, k, v, implementation="cuda")
    assert _sinks_operand(calls, target) == [(B, N), (B, 0)]
    ref_out, ref_lse = reference.attention(q, k, v, sinks=sinks)
    assert reference.rel_error(out, ref_out) < 2e-2 and reference.rel_error(lse, ref_lse) < 1e-3


@pytest.mark.parametrize("mapped", ["queries", "queries and sinks"])
def test_vmap_folds_the_sinks_with_their_heads_or_rows(monkeypatch, mapped):
    """vmap over the queries alone runs one call with the mapped axis folded into the heads (the
    sinks repeated to follow them); with the sinks mapped too, folded into the batch. Either way
    each element's answer is its own call's."""
    calls = fake_kernels.record_calls(monkeypatch)
    rng, q, k, v, sinks = _inputs("vmap " + mapped, 32, 40, jnp.float16)
    qs = jnp.stack([q, q[:, ::-1]])
    many_sinks = jnp.stack([sinks, sinks[::-1] - 1.0])
    run = lambda q, s: jax_flash.attention(q, k, v, sinks=s, is_causal=True, implementation="cuda")  # noqa: E731
    if mapped == "queries":
        out = jax.vmap(run, in_axes=(0, None))(qs, sinks)
        want = [run(x, sinks) for x in qs]
        assert (B, 2 * N) in _sinks_operand(calls, "jax_flash_fwd")  # (custom_vmap also traces one element)
    else:
        out = jax.vmap(run)(qs, many_sinks)
        want = [run(x, s) for x, s in zip(qs, many_sinks)]
        assert (2 * B, N) in _sinks_operand(calls, "jax_flash_fwd")
    for got, ref in zip(out, want):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=2e-3)


def test_forward_mode_takes_the_sinks_tangent(monkeypatch):
    """jax.jvp on the CUDA path (its tangent by the xla path's formula, beside the kernels'
    forward) gives the xla path's tangent, the sinks' part included."""
    fake_kernels.record_calls(monkeypatch)
    rng, q, k, v, sinks = _inputs("jvp", 24, 40, jnp.float32)
    q, k, v = (x.astype(jnp.float16) for x in (q, k, v))
    tangents = tuple(jnp.asarray(rng.normal(size=x.shape), x.dtype) for x in (q, k, v, sinks))

    def f(implementation):
        return lambda q, k, v, s: jax_flash.attention(q, k, v, sinks=s, is_causal=True, return_residual=True,
                                                      implementation=implementation)  # fmt: skip

    (out, lse), (d_out, d_lse) = jax.jvp(f(None), (q, k, v, sinks), tangents)
    _, (want_out, want_lse) = jax.jvp(f("xla"), (q, k, v, sinks), tangents)
    assert reference.rel_error(d_out, want_out) < 2e-2 and reference.rel_error(d_lse, want_lse) < 2e-2
    only_sinks = tuple(jnp.zeros_like(x) for x in (q, k, v)) + (tangents[3],)
    _, (d_out, d_lse) = jax.jvp(f(None), (q, k, v, sinks), only_sinks)
    assert float(jnp.abs(d_lse).max()) > 0  # the sinks' own tangent reaches the lse
