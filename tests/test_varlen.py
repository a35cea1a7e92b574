"""varlen_attention (DESIGN.md's contract): sequences packed along the first axis, each attending
within itself, causal and windows bottom-right per sequence, against the float64 reference run
on each sequence alone: the xla path dense and blockwise and the CUDA path's Python through the
fake kernels, gradients included; padding rows; runtime starts made valid; bad input by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _operands, dense_impl
from tests import fake_kernels, reference
from tests.cases import rng_for

PATHS = ["xla-dense", "xla-blockwise", "cuda (fake kernels)"]
N, K, H = 4, 2, 32


@pytest.fixture
def path(request, monkeypatch):
    if request.param != "xla-dense":
        monkeypatch.setattr(dense_impl, "budget_bytes", lambda: -1)
    if request.param.startswith("cuda"):
        return fake_kernels.record_calls(monkeypatch)
    return None


def _packed(rng, q_lengths, k_lengths, dtype, pad=(2, 3)):
    q_starts = np.concatenate([[0], np.cumsum(q_lengths)]).astype(np.int32)
    k_starts = np.concatenate([[0], np.cumsum(k_lengths)]).astype(np.int32)
    q = jnp.asarray(rng.normal(size=(q_starts[-1] + pad[0], N, H)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(k_starts[-1] + pad[1], K, H)), dtype) for _ in range(2))
    return q, k, v, q_starts, k_starts


def _per_sequence(q, k, v, q_starts, k_starts, sinks=None, **kw):
    """The float64 reference of each sequence alone, packed again; padding rows 0 (lse -inf)."""
    outs, lses = [], []
    for i in range(len(q_starts) - 1):
        rows, keys = slice(q_starts[i], q_starts[i + 1]), slice(k_starts[i], k_starts[i + 1])
        if rows.stop == rows.start:
            continue
        if keys.stop == keys.start:  # no keys: output 0, lse the sink (or -inf)
            outs.append(jnp.zeros((rows.stop - rows.start, N, H), jnp.float64))
            lse = jnp.full((rows.stop - rows.start, N), -jnp.inf) if sinks is None else jnp.broadcast_to(sinks, (rows.stop - rows.start, N))
            lses.append(lse.astype(jnp.float64))
            continue
        o, lse = reference.attention(q[None, rows], k[None, keys], v[None, keys], sinks=sinks, **kw)
        outs.append(o[0]), lses.append(lse[0])
    pad = q.shape[0] - q_starts[-1]
    outs.append(jnp.zeros((pad, N, H), jnp.float64))
    lses.append(jnp.full((pad, N), -jnp.inf, jnp.float64) if sinks is None else jnp.broadcast_to(
        jnp.asarray(sinks, jnp.float64), (pad, N)))  # fmt: skip
    return jnp.concatenate(outs), jnp.concatenate(lses)


MASKS = {"none": {}, "causal": {"is_causal": True}, "window": {"local_window_size": (5, 2)},
         "causal window": {"is_causal": True, "local_window_size": (6, 0)}}  # fmt: skip


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("packing", ["alike", "apart"])
def test_against_float64_per_sequence(path, mask, packing):
    dtype = jnp.float16 if path is not None else jnp.float32
    rng = rng_for("varlen", mask, packing, path is None)
    q_lengths = [7, 0, 20, 1, 13]
    k_lengths = q_lengths if packing == "alike" else [9, 4, 20, 30, 13]
    q, k, v, q_starts, k_starts = _packed(rng, q_lengths, k_lengths, dtype, pad=(2, 2) if packing == "alike" else (2, 3))
    starts = jnp.asarray(q_starts)
    ks = starts if packing == "alike" else jnp.asarray(k_starts)
    kw = MASKS[mask]
    impl = None if path is None else "cuda"
    out, lse = jax_flash.varlen_attention(q, k, v, starts, ks, return_residual=True, implementation=impl, **kw)
    ref_out, ref_lse = _per_sequence(q, k, v, q_starts, k_starts, **kw)
    tol = 2e-2 if dtype == jnp.float16 else 1e-5
    assert out.shape == q.shape and reference.rel_error(out, ref_out) < tol
    assert reference.rel_error(lse, ref_lse) < tol
    if path is not None:  # segment ids, and a mask operand only where the diagonals differ
        for target, shapes in path:
            fields = (_operands.FwdOperands if target == "jax_flash_fwd" else _operands.BwdOperands)._fields
            assert 0 not in shapes[fields.index("q_segments")]
            assert (0 in shapes[fields.index("mask")]) == (packing == "alike" or mask == "none")
    g_out = jnp.asarray(rng.normal(size=out.shape), jnp.float32)
    grads = jax.grad(lambda q, k, v: jnp.sum(jax_flash.varlen_attention(
        q, k, v, starts, ks, implementation=impl, **kw).astype(jnp.float32) * g_out), argnums=(0, 1, 2))(q, k, v)
    ref_grads = jax.grad(lambda q, k, v: jnp.sum(_per_sequence(q, k, v, q_starts, k_starts, **kw)[0] * g_out),
                         argnums=(0, 1, 2))(q, k, v)  # fmt: skip
    for name, mine, want in zip("qkv", grads, ref_grads):
        assert reference.rel_error(mine, want) < 5 * tol, name
    assert np.all(np.asarray(grads[0][q_starts[-1]:], np.float32) == 0)  # padding rows pass no gradient


def test_sinks_and_jit():
    rng = rng_for("varlen-sinks")
    q, k, v, q_starts, k_starts = _packed(rng, [5, 9], [5, 9], jnp.float32, pad=(1, 1))
    sinks = jnp.asarray(rng.normal(size=(N,)), jnp.float32)
    starts = jnp.asarray(q_starts)
    fn = jax.jit(lambda q, k, v, s, sinks: jax_flash.varlen_attention(q, k, v, s, s, is_causal=True, sinks=sinks,
                                                                      return_residual=True))  # fmt: skip
    out, lse = fn(q, k, v, starts, sinks)
    ref_out, ref_lse = _per_sequence(q, k, v, q_starts, k_starts, sinks=sinks, is_causal=True)
    assert reference.rel_error(out, ref_out) < 1e-5 and reference.rel_error(lse, ref_lse) < 1e-5
    # Different starts traced as separate arguments take the mask path: the same result.
    other = jax.jit(lambda q, k, v, a, b: jax_flash.varlen_attention(q, k, v, a, b, is_causal=True, sinks=sinks))(
        q, k, v, starts, jnp.asarray(k_starts))  # fmt: skip
    assert reference.rel_error(other, ref_out) < 1e-5


def test_runtime_starts_are_made_valid():
    """Decreasing starts take a running maximum, starts past the end are clipped, the first is 0."""
    rng = rng_for("varlen-clamp")
    q, k, v, _, _ = _packed(rng, [6, 6], [6, 6], jnp.float32, pad=(0, 0))
    bad = jnp.asarray([3, 6, 2, 99], jnp.int32)  # -> [0, 6, 6, 12]
    out = jax_flash.varlen_attention(q, k, v, bad, bad, is_causal=True)
    good = np.asarray([0, 6, 6, 12])
    ref, _ = _per_sequence(q, k, v, good, good, is_causal=True)
    assert reference.rel_error(out, ref) < 1e-5


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(query=jnp.zeros((1, 4, 8, 32))), ValueError, r"query and key must have shapes \[Tq, N, H\]"),
    (dict(query_starts=jnp.zeros((2, 2), jnp.int32)), ValueError, r"query_starts must have shape \[S \+ 1\]"),
    (dict(query_starts=jnp.zeros((3,), jnp.float32)), TypeError, "query_starts must be an integer array"),
    (dict(key_starts=jnp.asarray([0, 2, 4, 8], jnp.int32)), ValueError, "must both have shape"),
])  # fmt: skip
def test_bad_input_is_refused_by_name(kwargs, error, match):
    args = dict(query=jnp.zeros((8, 4, 32)), key=jnp.zeros((8, 2, 32)), value=jnp.zeros((8, 2, 32)),
                query_starts=jnp.asarray([0, 3, 8], jnp.int32), key_starts=jnp.asarray([0, 4, 8], jnp.int32))  # fmt: skip
    args.update(kwargs)
    with pytest.raises(error, match=match):
        jax_flash.varlen_attention(**args)
