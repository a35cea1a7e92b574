"""The pure-JAX paths against the naive float64 reference: outputs, log-sum-exp and gradients
over mask cases, dtypes, head dims, T != S and GQA/MQA; the blockwise path (xla_impl.py) and the
dense formulation (dense_impl.py) that `implementation="xla"` takes where the scores fit.

Small blocks (16) make every blockwise test cross several query and key blocks and their tails.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import dense_impl, xla_impl
from jax_flash._validation import validate
from tests import reference
from tests.cases import CASES, qkv, rng_for

TOL = {  # relative error bounds: (output, gradients)
    jnp.float64: (1e-10, 1e-10),
    jnp.float32: (1e-5, 1e-4),
    jnp.float16: (3e-3, 6e-3),
    jnp.bfloat16: (1e-2, 2e-2),
}
DIFF_ARGS = ("q", "k", "v", "bias")
DENSE = None  # run_xla's block for the dense formulation


def run_xla(q, k, v, block=16, **kwargs):
    defaults = dict(bias=None, mask=None, scale=None, is_causal=False, query_seq_lengths=None,
                    key_value_seq_lengths=None, local_window_size=None, implementation="xla",
                    return_residual=True, softcap=None, q_segment_ids=None, kv_segment_ids=None)
    kw = {**defaults, **kwargs}
    call = validate(q, k, v, kw.pop("bias"), kw.pop("mask"), **kw)
    if block is DENSE:
        return dense_impl.attention(call)
    return xla_impl.attention(call, block_q=block, block_k=block)


def loss_and_grads(fn, q, k, v, kwargs, rng):
    """(out, lse, gradients of sum(out * g_out) + sum(lse * g_lse) with respect to q, k, v (and
    bias)), in one jitted program: one compilation, where running it eagerly compiles every
    operation of the forward and the backward on its own (most of the suite's time, so)."""
    out_shape = q.shape
    g_out = jnp.asarray(rng.normal(size=out_shape))
    g_lse = jnp.asarray(rng.normal(size=out_shape[:-1]))
    bias = kwargs.pop("bias", None)

    def loss(q, k, v, bias):
        out, lse = fn(q, k, v, bias=bias, **kwargs)
        lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(jnp.float64) * g_out) + jnp.sum(lse.astype(jnp.float64) * g_lse)

    @jax.jit
    def outputs_and_grads(q, k, v, bias):
        grads = jax.grad(loss, argnums=(0, 1, 2, 3) if bias is not None else (0, 1, 2))(q, k, v, bias)
        return (*fn(q, k, v, bias=bias, **kwargs), grads)

    return outputs_and_grads(q, k, v, bias)


BOTH = (16, DENSE)  # the blockwise formulation (16-wide blocks) and the dense one


def check_against_reference(dtype, b, t, s, n, kv_heads, h, case, blocks=(16,)):
    """Each formulation of `blocks` against one float64 reference (compiled once for them all)."""
    rng = rng_for(dtype, b, t, s, n, kv_heads, h, case)
    q, k, v = qkv(rng, dtype, b, t, s, n, kv_heads, h)
    kwargs = CASES[case](rng, b, n, t, s)
    ref = loss_and_grads(reference.attention, q, k, v, dict(kwargs), rng_for("grad", dtype, case))
    out_tol, grad_tol = TOL[dtype]
    for block in blocks:
        ours = loss_and_grads(functools.partial(run_xla, block=block), q, k, v, dict(kwargs),
                              rng_for("grad", dtype, case))
        formulation = "dense" if block is DENSE else f"blocks of {block}"
        assert ours[0].dtype == dtype and ours[1].dtype == jnp.promote_types(dtype, jnp.float32), formulation
        assert reference.rel_error(ours[0], ref[0]) < out_tol, formulation
        assert reference.rel_error(ours[1], ref[1]) < max(out_tol, 1e-6), formulation
        for name, g, g_ref in zip(DIFF_ARGS, ours[2], ref[2]):
            assert g.dtype == (dtype if name != "bias" else kwargs["bias"].dtype), (formulation, name)
            assert reference.rel_error(g, g_ref) < grad_tol, (formulation, name)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("t,s", [(37, 37), (21, 50), (50, 19)])
def test_float64_every_case(case, t, s):
    check_against_reference(jnp.float64, 3, t, s, 4, 2, 16, case, blocks=BOTH)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("h", [32, 64, 128])
@pytest.mark.parametrize("case", ["none", "causal"])
def test_dtypes_and_head_dims(dtype, h, case):
    check_against_reference(dtype, 2, 45, 70, 4, 2, h, case, blocks=BOTH)


@pytest.mark.parametrize("h", [320, 448, 1000])
@pytest.mark.parametrize("case", ["causal", "segments_causal", "softcap_bias_window"])
def test_head_dims_past_256(h, case):
    """Head dims wider than the kernels' 256 (the xla path runs them in auto mode), odd multiples
    of 8 and 1000 among them. (Not "everything": its bias is broadcast over the keys, whose
    gradient is a difference of terms that grow with sqrt(head dim); from bf16 outputs its error
    reaches 4% at 1000, against 1.3% at 128.)"""
    check_against_reference(jnp.bfloat16, 1, 37, 50, 2, 1, h, case, blocks=BOTH)


def _has_loop(fn, *args) -> bool:
    jaxpr = str(jax.make_jaxpr(fn)(*args))
    return "while" in jaxpr or "scan" in jaxpr


def test_dense_below_the_budget_blockwise_above(monkeypatch):
    """`implementation="xla"` forms the scores whole where they fit the budget (1 x 4 x 45 x 70
    float32 here), and loops over blocks (O(seqlen) memory) where they do not, forward and
    backward."""
    q, k, v = qkv(rng_for("budget"), jnp.float32, 1, 45, 70, 4, 2, 16)

    def attn(q, k, v):
        return jax_flash.attention(q, k, v, is_causal=True, implementation="xla")

    def traced_have_loops():  # new functions each time: JAX caches traces by function
        fwd = lambda q, k, v: attn(q, k, v)  # noqa: E731
        grad = jax.grad(lambda q, k, v: attn(q, k, v).sum(), argnums=(0, 1, 2))
        return _has_loop(fwd, q, k, v), _has_loop(grad, q, k, v)

    assert dense_impl.fits(validate(q, k, v, None, None, **_NO_OPTIONS))
    assert traced_have_loops() == (False, False)
    assert jax_flash.chosen_implementation(q, k, v, implementation="xla") == "xla-dense"
    dense_out = attn(q, k, v)
    monkeypatch.setattr(dense_impl, "budget_bytes", lambda: 4 * 45 * 70 * 4 - 1)
    assert traced_have_loops() == (True, True)
    assert jax_flash.chosen_implementation(q, k, v, implementation="xla") == "xla-blockwise"
    np.testing.assert_allclose(attn(q, k, v), dense_out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t,s,causal,budget_rows,blocks", [
    (8192, 8192, False, 8192, (8192, 8192)),  # the whole scores fit: one block
    (8192, 8192, False, 4096, (4096, 8192)),  # every key, as many rows as fit
    (5000, 8192, False, 4096, (2504, 8192)),  # equal blocks, T padded by under 8 a block
    (8192, 8192, True, 8192, (2048, 2048)),  # banded: square blocks, key blocks outside skipped
    (300, 8192, False, 300, (304, 8192)),  # fewer rows than the default block, all of them
    (8192, 8192, False, 511, (512, 512)),  # the budget allows fewer rows than a default block
])  # fmt: skip
def test_backward_blocks_fill_the_budget(monkeypatch, t, s, causal, budget_rows, blocks):
    """The backward the kernel path takes where no kernel's runs (head dims above 256) uses blocks
    of float32 scores as large as the budget (B x N x rows x keys x 4 bytes)."""
    b, n = 1, 8
    q, k = jnp.zeros((b, t, n, 8), jnp.bfloat16), jnp.zeros((b, s, n, 8), jnp.bfloat16)
    block_k = min(s, 2048) if causal else s
    monkeypatch.setattr(dense_impl, "budget_bytes", lambda: 4 * b * n * budget_rows * block_k)
    call = validate(q, k, k, None, None, **{**_NO_OPTIONS, "is_causal": causal})
    assert dense_impl.backward_blocks(call) == blocks


@pytest.mark.parametrize("causal", [False, True])
def test_backward_in_budget_blocks_matches_small_blocks(monkeypatch, causal):
    """The backward in the budget's blocks (one block of every key, or square banded ones) gives
    the gradients of the default blockwise one."""
    monkeypatch.setattr(dense_impl, "budget_bytes", lambda: 2**30)
    rng = rng_for("budget-blocks", causal)
    q, k, v = qkv(rng, jnp.float64, 2, 100, 130, 4, 2, 16)
    out_grad = jnp.asarray(rng.standard_normal((2, 100, 4, 16)))
    call = validate(q, k, v, None, None, **{**_NO_OPTIONS, "is_causal": causal})
    out, lse = xla_impl.attention(call, block_q=16, block_k=16)
    small = xla_impl.backward(call, out, lse, out_grad, jnp.zeros_like(lse), 16, 16)
    assert dense_impl.backward_blocks(call)[0] >= 100
    large = xla_impl.backward(call, out, lse, out_grad, jnp.zeros_like(lse), *dense_impl.backward_blocks(call))
    for a, b in zip(small[:3], large[:3], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


_NO_OPTIONS = dict(scale=None, is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                   local_window_size=None, implementation="xla", return_residual=False, softcap=None,
                   q_segment_ids=None, kv_segment_ids=None)  # fmt: skip


@pytest.mark.parametrize("n,kv_heads", [(4, 4), (6, 3), (4, 1)])
@pytest.mark.parametrize("case", ["causal", "everything"])
def test_mha_gqa_mqa(n, kv_heads, case):
    check_against_reference(jnp.float64, 3, 33, 40, n, kv_heads, 8, case)


@pytest.mark.parametrize("t,s", [(1, 1), (1, 40), (40, 1), (7, 129)])
def test_odd_lengths(t, s):
    check_against_reference(jnp.float64, 3, t, s, 2, 1, 8, "causal", blocks=(8,))


def test_default_blocks_match_small_blocks():
    """The public default block sizes (single block here) give the same result as tiny blocks."""
    rng = rng_for("blocks")
    q, k, v = qkv(rng, jnp.float64, 2, 100, 130, 2, 2, 16)
    small = run_xla(q, k, v, block=16, is_causal=True)
    large = run_xla(q, k, v, block=512, is_causal=True)
    np.testing.assert_allclose(small[0], large[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(small[1], large[1], rtol=1e-6)


@pytest.mark.parametrize("block", [16, DENSE], ids=["blockwise", "dense"])
def test_fully_masked_rows_give_zero_and_no_nan(block):
    rng = rng_for("masked")
    q, k, v = qkv(rng, jnp.bfloat16, 2, 24, 24, 2, 2, 16)
    lengths = jnp.asarray([0, 10], jnp.int32)

    def loss(q, k, v):
        out = run_xla(q, k, v, block, query_seq_lengths=lengths, key_value_seq_lengths=lengths)[0]
        return jnp.sum(out.astype(jnp.float32) ** 2)

    out, lse = run_xla(q, k, v, block, query_seq_lengths=lengths, key_value_seq_lengths=lengths)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert jnp.all(out[0] == 0) and jnp.all(out[1, 10:] == 0)
    assert jnp.all(lse[0] == -jnp.inf) and jnp.all(jnp.isfinite(lse[1, :10]))
    for g in grads:
        assert not jnp.isnan(g.astype(jnp.float32)).any()
        assert jnp.all(g[0] == 0)
    assert jnp.any(grads[0][1, :10] != 0)
