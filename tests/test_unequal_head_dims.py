"""A value head dim Hv other than the query/key head dim H (DeepSeek's MLA: 192 and 128), which
jax.nn.dot_product_attention refuses: on CPU, the xla path (dense and blockwise) and the CUDA
path's plumbing through the stand-in for the kernels (which run it at the wider dim, the other
side zero-padded, but for (192, 128)'s forward of its own), forward and gradients against the
float64 reference, with the masks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _decode, dense_impl
from tests import fake_kernels, reference
from tests.cases import CASES, rng_for

DIMS = [(192, 128), (64, 128), (128, 64), (32, 48)]
MASKS = ["causal", "lengths_causal", "segments_causal", "softcap", "bias", "window"]


def _problem(rng, h, hv, b=2, t=24, s=40, n=4, kv_heads=2, dtype=jnp.bfloat16):
    q = jnp.asarray(rng.normal(size=(b, t, n, h)), dtype)
    k = jnp.asarray(rng.normal(size=(b, s, kv_heads, h)), dtype)
    v = jnp.asarray(rng.normal(size=(b, s, kv_heads, hv)), dtype)
    return q, k, v


PATHS = ["xla-dense", "xla-blockwise", "cuda-stand-in"]
# Every pair of (path, dims), (path, mask) and (dims, mask) once or more, in 24 cases instead of
# the 72 of the product: dims i with mask j on path (i + j) % 3.
CASES_PAIRWISE = [(PATHS[(i + j) % 3], dims, mask) for i, dims in enumerate(DIMS) for j, mask in enumerate(MASKS)]


def _take_path(name, monkeypatch):
    """The `implementation` that runs `name`, with the stand-in for the kernels where it needs one."""
    if name == "xla-blockwise":
        monkeypatch.setattr(dense_impl, "budget_bytes", lambda: -1)
    if name == "cuda-stand-in":
        fake_kernels.install(monkeypatch)
        monkeypatch.setattr(_decode, "sm_count", lambda: 132)
        monkeypatch.setattr(dense_impl, "budget_bytes", lambda: -1)
    return "cuda" if name == "cuda-stand-in" else "xla"


def test_the_cases_cover_every_pair():
    covered = [{(p, d) for p, d, _ in CASES_PAIRWISE}, {(p, m) for p, _, m in CASES_PAIRWISE},
               {(d, m) for _, d, m in CASES_PAIRWISE}]
    assert [len(c) for c in covered] == [len(PATHS) * len(DIMS), len(PATHS) * len(MASKS), len(DIMS) * len(MASKS)]


@pytest.mark.parametrize("path_name,dims,case", CASES_PAIRWISE,
                         ids=[f"{p}-{h}-{hv}-{m}" for p, (h, hv), m in CASES_PAIRWISE])
def test_forward_and_gradients(monkeypatch, path_name, dims, case):
    path = _take_path(path_name, monkeypatch)
    h, hv = dims
    rng = rng_for("unequal", h, hv, case)
    q, k, v = _problem(rng, h, hv)
    kw = CASES[case](rng, 2, 4, 24, 40)
    bias = kw.pop("bias", None)
    g = jnp.asarray(rng.normal(size=q.shape[:3] + (hv,)), jnp.float32)

    def loss(attend, q, k, v, bias):
        return jnp.sum(attend(q, k, v, bias).astype(jnp.float32) * g)

    ours = lambda q, k, v, bias: jax_flash.attention(q, k, v, bias, implementation=path, **kw)  # noqa: E731
    ref = lambda q, k, v, bias: reference.attention(q, k, v, bias, **kw)[0]  # noqa: E731
    with_lse = lambda *a: jax_flash.attention(*a, implementation=path, return_residual=True, **kw)  # noqa: E731
    out, lse = jax.jit(with_lse)(q, k, v, bias)
    ref_out, ref_lse = jax.jit(lambda *a: reference.attention(*a, **kw))(q, k, v, bias)
    assert out.shape == (2, 24, 4, hv) and out.dtype == q.dtype
    assert reference.rel_error(out, ref_out) < 1e-2 and reference.rel_error(lse, ref_lse) < 1e-4
    grads = jax.jit(jax.grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2)))(q, k, v, bias)
    ref_grads = jax.jit(jax.grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2)))(q, k, v, bias)
    for name, mine, expected in zip("qkv", grads, ref_grads):
        assert mine.shape == expected.shape, name
        assert reference.rel_error(mine, expected) < 2e-2, name


def test_decode_shapes_through_the_stand_in(monkeypatch):
    """A decode call (T = 2) with Hv != H takes the decode target at the wider dim."""
    fake_kernels.install(monkeypatch)
    monkeypatch.setattr(_decode, "sm_count", lambda: 132)
    q, k, v = _problem(rng_for("unequal-decode"), 192, 128, t=2)
    lengths = jnp.asarray([40, 17], jnp.int32)
    out = jax_flash.attention(q, k, v, key_value_seq_lengths=lengths, is_causal=True, implementation="cuda")
    ref, _ = reference.attention(q, k, v, key_value_seq_lengths=lengths, is_causal=True)
    assert out.shape == (2, 2, 4, 128) and reference.rel_error(out, ref) < 1e-2


def test_default_scale_is_the_query_head_dim():
    q, k, v = _problem(rng_for("unequal-scale"), 64, 16)
    out = jax_flash.attention(q, k, v, implementation="xla")
    expected = jax_flash.attention(q, k, v, scale=1 / 8, implementation="xla")
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))


def test_empty_keys_give_zeros_of_the_value_head_dim():
    q, k, v = _problem(rng_for("unequal-empty"), 64, 16, s=0)
    out, lse = jax_flash.attention(q, k, v, return_residual=True)
    assert out.shape == (2, 24, 4, 16) and not np.asarray(out, np.float32).any() and np.isneginf(lse).all()


@pytest.mark.parametrize("value_shape", [(2, 41, 2, 16), (3, 40, 2, 16), (2, 40, 4, 16)])
def test_value_must_match_key_but_for_its_head_dim(value_shape):
    q, k, _ = _problem(rng_for("unequal-bad"), 64, 16)
    with pytest.raises(ValueError, match="value must have key's batch, length and heads"):
        jax_flash.attention(q, k, jnp.zeros(value_shape, q.dtype))


def test_ring_attention_refuses_unequal_head_dims():
    q, k, v = _problem(rng_for("unequal-ring"), 64, 16)
    with pytest.raises(ValueError, match="ring_attention takes a value head dim"):
        jax_flash.ring_attention(q, k, v, axis_name="x")
