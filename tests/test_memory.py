"""O(seqlen) memory: the compiled xla path holds no T x S buffer.

Compiled (not run) at T = S = 16384, where one float32 T x S matrix is 1 GiB; the temporary
memory XLA reports for the whole program must stay a small fraction of that.
"""

import jax
import jax.numpy as jnp
import pytest

import jax_flash

T = S = 16384
TS_BYTES = T * S * 4


def _temp_bytes(fn, *args):
    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    if analysis is None:
        pytest.fail("this backend gives no memory analysis")
    return analysis.temp_size_in_bytes


@pytest.mark.parametrize("is_causal", [False, True])
def test_no_seq_by_seq_buffer(is_causal):
    q = jax.ShapeDtypeStruct((1, T, 1, 64), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, 1, 1, S), jnp.float32)  # a broadcast bias stays O(S)

    def forward(q, k, v, bias):
        return jax_flash.attention(q, k, v, bias, is_causal=is_causal, implementation="xla")

    def loss(q, k, v, bias):
        return forward(q, k, v, bias).astype(jnp.float32).sum()

    fwd = _temp_bytes(forward, q, q, q, bias)
    bwd = _temp_bytes(jax.grad(loss, argnums=(0, 1, 2, 3)), q, q, q, bias)
    assert fwd < TS_BYTES / 16, fwd
    assert bwd < TS_BYTES / 16, bwd


def test_naive_attention_would_hold_it():
    """The check can fail: jax.nn's xla attention at the same size needs the T x S logits."""
    q = jax.ShapeDtypeStruct((1, T, 1, 64), jnp.bfloat16)
    naive = _temp_bytes(lambda q, k, v: jax.nn.dot_product_attention(q, k, v), q, q, q)
    assert naive >= TS_BYTES / 2
