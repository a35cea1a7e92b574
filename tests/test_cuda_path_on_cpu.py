"""The CUDA path's Python, on CPU: with a pure-JAX stand-in for the two custom calls
(tests/fake_kernels.py), `implementation="cuda"` runs its real plumbing (head-dim padding, the mask
operands and their chunk summaries, the custom_vjp, vmap folding, partitioning) and must give what
the xla path gives. What the kernels compute is tested on GPUs (test_cuda*.py)."""

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash import _ffi
from tests import fake_kernels, reference
from tests.cases import CASES, qkv, rng_for

KERNEL_CASES = ["none", "causal", "window_causal", "lengths_causal", "segments_causal", "softcap"]


@pytest.fixture
def kernel_calls(monkeypatch):
    """The operand shapes of every kernel call traced, by target."""
    fake_kernels.install(monkeypatch)
    calls = []

    def recording(target, result_types, operands, attrs):
        calls.append((target, [x.shape for x in operands]))
        return fake_kernels.call_kernel(target, result_types, operands, attrs)

    monkeypatch.setattr(_ffi, "call_kernel", recording)
    return calls


def _loss(implementation, kw):
    def loss(q, k, v):
        out = jax_flash.attention(q, k, v, implementation=implementation, **kw)
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.size).reshape(out.shape)))

    return loss


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_forward_and_gradients_equal_the_xla_path(kernel_calls, case):
    rng = rng_for("cuda-path-on-cpu", case)
    b, t, s, n, kv_heads, h = 3, 40, 56, 4, 2, 40  # head dim 40: padded to the kernels' 64
    q, k, v = qkv(rng, jnp.bfloat16, b, t, s, n, kv_heads, h)
    kw = CASES[case](rng, b, n, t, s)
    out, lse = jax_flash.attention(q, k, v, implementation="cuda", return_residual=True, **kw)
    ref_out, ref_lse = jax_flash.attention(q, k, v, implementation="xla", return_residual=True, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert reference.rel_error(out, ref_out) < 1e-2
    assert jnp.array_equal(jnp.isneginf(lse), jnp.isneginf(ref_lse))
    visible = ~jnp.isneginf(ref_lse)
    assert float(jnp.max(jnp.abs(jnp.where(visible, lse - ref_lse, 0.0)))) < 1e-3
    grads = jax.grad(_loss("cuda", kw), argnums=(0, 1, 2))(q, k, v)
    for mine, ref in zip(grads, jax.grad(_loss("xla", kw), argnums=(0, 1, 2))(q, k, v)):
        assert reference.rel_error(mine, ref) < 2e-2
    targets = [target for target, _ in kernel_calls]
    assert targets.count("jax_flash_fwd") >= 2 and targets.count("jax_flash_bwd") == 1
    assert all(shapes[0][-1] == 64 for _, shapes in kernel_calls)  # padded head dim


def test_head_dim_without_backward_kernels_pads_up(kernel_calls):
    """Head dim 160: the forward runs the 192 kernels, the backward the 256 ones (no 192 backward)."""
    q, k, v = qkv(rng_for("cuda-path-160"), jnp.bfloat16, 2, 24, 24, 2, 1, 160)
    grads = jax.grad(_loss("cuda", {"is_causal": True}), argnums=(0, 1, 2))(q, k, v)
    for mine, ref in zip(grads, jax.grad(_loss("xla", {"is_causal": True}), argnums=(0, 1, 2))(q, k, v)):
        assert mine.shape == ref.shape and reference.rel_error(mine, ref) < 2e-2
    head_dims = {target: shapes[0][-1] for target, shapes in kernel_calls}
    assert head_dims == {"jax_flash_fwd": 192, "jax_flash_bwd": 256}


def test_vmap_is_one_kernel_call(kernel_calls):
    """vmap over every input folds into the batch; over the queries alone, into the heads."""
    q, k, v = qkv(rng_for("cuda-path-vmap"), jnp.bfloat16, 6, 24, 24, 2, 1, 32)
    stacked = [x.reshape(3, 2, *x.shape[1:]) for x in (q, k, v)]
    attn = lambda q, k, v: jax_flash.attention(q, k, v, is_causal=True, implementation="cuda")  # noqa: E731
    ref = jax_flash.attention(q, k, v, is_causal=True, implementation="xla")
    assert reference.rel_error(jax.vmap(attn)(*stacked).reshape(q.shape), ref) < 1e-2
    # custom_vmap traces the call once unbatched for its types; the call that runs is the last.
    assert kernel_calls[-1][1][:3] == [(6, 24, 2, 32), (6, 24, 1, 32), (6, 24, 1, 32)]
    kernel_calls.clear()
    queries = q.reshape(3, 2, 24, 2, 32)
    out = jax.vmap(attn, in_axes=(0, None, None))(queries, k[:2], v[:2])
    for i in range(3):
        expected = jax_flash.attention(queries[i], k[:2], v[:2], is_causal=True, implementation="xla")
        assert reference.rel_error(out[i], expected) < 1e-2
    assert kernel_calls[-1][1][:3] == [(2, 24, 6, 32), (2, 24, 1, 32), (2, 24, 1, 32)]  # heads n * V


def test_auto_mode_takes_the_kernels_where_they_run(kernel_calls):
    q, k, v = qkv(rng_for("cuda-path-auto"), jnp.bfloat16, 2, 16, 16, 2, 2, 64)
    jax_flash.attention(q, k, v, is_causal=True, softcap=20.0)
    assert [target for target, _ in kernel_calls] == ["jax_flash_fwd"]
    kernel_calls.clear()
    jax_flash.attention(q, k, v, bias=jnp.zeros((1, 2, 16, 16), jnp.bfloat16))  # bias: the xla path
    jax_flash.attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))  # float32
    assert kernel_calls == []
