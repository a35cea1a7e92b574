"""The soft cap in the CUDA kernels (marked `gpu`): logits softcap * tanh(scale * q.k / softcap),
forward and gradients, alone and with every mask the kernels take, in both kernel families,
against the float64 reference and the xla path (`test_cuda.check`)."""

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from tests.cases import qkv, rng_for
from tests.test_cuda import _custom_call_targets, check, forced_family, turing_dtype
from tests.test_cuda_masks import _lengths, _packed
from tests.timing import rested_seconds

pytestmark = pytest.mark.gpu

# scale 0.5 makes the raw logits ~N(0, 32) at H = 128, so that a cap of 5 saturates many of them
# (where the tanh's slope, and so the gradient, is small) and leaves others in its linear part.
SATURATING = dict(softcap=5.0, scale=0.5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("h", [64, 128, 256, 96, 192])
@pytest.mark.parametrize("is_causal", [False, True])
def test_softcap_head_dims(dtype, h, is_causal):
    check(dtype, 2, 300, 517, 4, 2, h, is_causal=is_causal, **SATURATING)


@pytest.mark.parametrize("h", [64, 128, 256])
@pytest.mark.parametrize("kw", ["gemma", "window_lengths", "segments_causal"])
def test_softcap_with_masks(h, kw):
    rng = rng_for("softcap_masks", h, kw)
    b, t = 3, 900
    masks = {
        "gemma": dict(softcap=50.0, is_causal=True, local_window_size=(255, 0)),  # Gemma 2's cap
        "window_lengths": dict(local_window_size=(100, 30), query_seq_lengths=_lengths(rng, b, t),
                               key_value_seq_lengths=_lengths(rng, b, t), **SATURATING),
        "segments_causal": dict(q_segment_ids=_packed(rng, b, t, 3), kv_segment_ids=_packed(rng, b, t, 3),
                                is_causal=True, **SATURATING),
    }[kw]
    check(jnp.bfloat16, b, t, t, 4, 1, h, **masks)


def test_auto_mode_runs_softcap_on_the_kernels():
    q, k, v = qkv(rng_for("auto_softcap"), turing_dtype(forced_family()), 1, 256, 256, 2, 2, 128)
    kw = dict(softcap=20.0, is_causal=True)
    fwd = _custom_call_targets(lambda q, k, v: jax_flash.attention(q, k, v, **kw), q, k, v)
    grad = _custom_call_targets(
        jax.grad(lambda q, k, v: jax_flash.attention(q, k, v, **kw).astype(jnp.float32).sum()), q, k, v)
    assert "jax_flash_fwd" in fwd and "jax_flash_bwd" in grad


@pytest.mark.timing
@pytest.mark.parametrize("h", [128, 256])
def test_softcap_costs_little(h):
    """Causal 16k tokens: forward + backward with a cap within 30% of without (issue 6 asks <= 10%,
    which `python -m jax_flash.bench --masks` measures: 1.20x at d = 128, 1.03x at d = 256; this
    bound leaves room for timing noise and catches a variant that spills, loses its overlap or
    falls back to the mma.sync backward, 1.73x at d = 256)."""
    q, k, v = qkv(rng_for("softcap_speed"), jnp.bfloat16, 1, 16384, 16384, 2048 // h, 2048 // h, h)

    def timed(**kw):
        step = jax.jit(jax.value_and_grad(
            lambda q, k, v: jax_flash.attention(q, k, v, implementation="cuda", is_causal=True, **kw)
            .astype(jnp.float32).sum(), argnums=(0, 1, 2)))
        return rested_seconds(step, (q, k, v))

    capped, plain = timed(softcap=30.0), timed()
    assert capped < 1.3 * plain, f"softcap {capped * 1e3:.1f} ms against {plain * 1e3:.1f} ms"
