"""Bias and boolean masks in the CUDA kernels (marked `gpu`): broadcast or full, float32 or the
inputs' dtype, alone and with every other mask and the soft cap; forward and gradients (the bias's
included) against the float64 reference and the xla path, in both kernel families."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _ffi, _plan
from tests import reference
from tests.cases import qkv, rng_for
from tests.test_cuda import (
    GRAD_TOL,
    _custom_call_targets,
    check,
    families_for,
    forced_family,
    gradients_within_the_cap,
    poison_free_memory,
)
from tests.test_cuda_masks import _lengths, _packed
from tests.timing import rested_seconds

pytestmark = pytest.mark.gpu


def _bias(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.normal(size=shape), jnp.float32).astype(dtype)


def _mask(rng, shape):
    mask = rng.random(shape) < 0.75
    mask[0, 0, 0, :] = False  # a fully masked row
    return jnp.asarray(mask)


def _bias_grad(implementation, q, k, v, g_out, bias, **kw):
    def gradient(implementation):
        def loss(bias):
            out = jax_flash.attention(q, k, v, bias, implementation=implementation, **kw)
            return jnp.sum(out.astype(jnp.float32) * g_out)

        poison_free_memory()
        return jax.jit(jax.grad(loss))(bias)

    return gradients_within_the_cap(implementation, gradient)


def check_with_bias(dtype, b, t, s, n, kv_heads, h, bias, **kw):
    """`test_cuda.check` (output, lse, dq, dk, dv), then the bias's gradient against the float64
    reference and the xla path."""
    (q, k, v, g_out), _ = check(dtype, b, t, s, n, kv_heads, h, bias=bias, **kw)
    ref = jax.grad(lambda bias: jnp.sum(reference.attention(q, k, v, bias, **kw)[0] * g_out))(bias)
    xla = _bias_grad("xla", q, k, v, g_out, bias, **kw)
    # The families that take a bias: best and sm80, or the one the grid forces (not Turing's, which
    # takes none). A grid run under a shared-memory cap forces sm80: the Hopper family under a cap
    # is no real GPU.
    for family in (f for f in families_for(dtype, h, bias=bias, **kw) if f != "sm75"):
        with pytest.MonkeyPatch.context() as env:
            env.setenv(_plan.KERNELS_ENV, family)
            mine = _bias_grad("cuda", q, k, v, g_out, bias, **kw)
        assert mine.shape == bias.shape and mine.dtype == bias.dtype
        err, xla_err = reference.rel_error(mine, ref), reference.rel_error(xla, ref)
        assert err < GRAD_TOL, f"{family} dbias: {err:.2e}"
        assert err <= 2 * xla_err + 1e-3, f"{family} dbias: {err:.2e} vs xla path {xla_err:.2e}"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("h", [32, 64, 128, 256, 192])
@pytest.mark.parametrize("shape", ["full", "heads_keys"])
def test_bias_head_dims(dtype, h, shape):
    # S odd: the kernels load the bias key by key; even (and unit key strides): in pairs (bias.cuh).
    b, t, s, n = 2, 300, 518 if shape == "full" else 517, 4
    rng = rng_for("bias", dtype, h, shape)
    bias_shape = {"full": (b, n, t, s), "heads_keys": (1, n, 1, s)}[shape]
    check_with_bias(dtype, b, t, s, n, 2, h, _bias(rng, bias_shape, jnp.float32 if shape == "full" else dtype))


@pytest.mark.parametrize("h", [64, 128])
@pytest.mark.parametrize("kw", ["mask", "mask_causal_gqa", "bias_mask_rows", "everything"])
def test_bias_and_mask_with_other_masks(h, kw):
    rng = rng_for("bias_masks", h, kw)
    b, t, s, n = 3, 700, 900, 4
    cases = {
        "mask": dict(mask=_mask(rng, (b, n, t, s))),
        "mask_causal_gqa": dict(mask=_mask(rng, (b, 1, t, s)), is_causal=True),
        # (A bias broadcast over the keys has a zero gradient: softmax ignores a row's constant.)
        "bias_mask_rows": dict(bias=_bias(rng, (b, 1, 1, s)), mask=_mask(rng, (1, n, t, 1)), local_window_size=(90, 20)),
        "everything": dict(bias=_bias(rng, (1, n, t, s), jnp.bfloat16), mask=_mask(rng, (b, 1, t, s)),
                           is_causal=True, softcap=5.0, scale=0.5, key_value_seq_lengths=_lengths(rng, b, s),
                           q_segment_ids=_packed(rng, b, t, 3), kv_segment_ids=_packed(rng, b, s, 3)),
    }[kw]
    bias = cases.pop("bias", None)
    kv_heads = 1 if kw == "mask_causal_gqa" else 2
    if bias is None:
        check(jnp.bfloat16, b, t, s, n, kv_heads, h, **cases)
    else:
        check_with_bias(jnp.bfloat16, b, t, s, n, kv_heads, h, bias, **cases)


@pytest.mark.parametrize("h", [64, 128])
@pytest.mark.parametrize("shape", ["keys", "keys_shared", "queries"])
def test_key_and_query_masks(h, shape):
    """Masks along the keys alone (padding) or the queries alone, which the kernels take as
    segment ids (cuda_impl.mask_as_segments); batch row 0 sees no key where the mask has rows."""
    rng = rng_for("mask_as_segments", h, shape)
    b, t, s, n = 2, 300, 517, 4
    mask_shape = {"keys": (b, 1, 1, s), "keys_shared": (1, 1, 1, s), "queries": (b, 1, t, 1)}[shape]
    mask = rng.random(mask_shape) < 0.6
    mask[..., :8] = True
    if mask_shape[0] == b:
        mask[0] = False
    check(jnp.bfloat16, b, t, s, n, 2, h, mask=jnp.asarray(mask), is_causal=shape != "queries")


@pytest.mark.parametrize("h", [64, 128, 192, 256])
@pytest.mark.parametrize("case", ["bf16_bias_causal", "fp16_bias_and_mask", "fp32_bias_window", "mask_lengths_gqa"])
def test_bias_tiles_of_the_hopper_kernels(h, case):
    """Layouts whose tiles the sm90 kernels stage with TMA (sm90/bias_tiles.cuh: unit key strides,
    whole [T, S] rows of 16-byte multiples; the forward at every head dim, the backward at d = 64
    and 128 where the tiles fit), one or two stages of them: S = 720 ends in a part key block,
    T = 333 in a part query tile (rows and keys past the arrays read as zeros)."""
    rng = rng_for("bias_tiles", case, h)
    b, t, s, n = 2, 333, 720, 4
    cases = {
        "bf16_bias_causal": dict(bias=_bias(rng, (b, n, t, s), jnp.bfloat16), is_causal=True),
        "fp16_bias_and_mask": dict(bias=_bias(rng, (1, n, t, s), jnp.float16), mask=_mask(rng, (b, 1, t, s))),
        "fp32_bias_window": dict(bias=_bias(rng, (b, 1, t, s)), local_window_size=(100, 30)),
        "mask_lengths_gqa": dict(mask=_mask(rng, (b, n, t, s)), key_value_seq_lengths=_lengths(rng, b, s),
                                 is_causal=True),
    }[case]
    dtype = jnp.float16 if case.startswith("fp16") else jnp.bfloat16
    bias = cases.pop("bias", None)
    kv_heads = 1 if case == "mask_lengths_gqa" else 2
    if bias is None:
        check(dtype, b, t, s, n, kv_heads, h, **cases)
    else:
        check_with_bias(dtype, b, t, s, n, kv_heads, h, bias, **cases)


@pytest.mark.parametrize("h", [64, 128, 192, 256])
@pytest.mark.parametrize("case", ["learned_bias_causal", "fixed_bias_window", "mask_lengths"])
def test_bias_with_softcap_on_the_hopper_backward(h, case):
    """Bias or mask together with a soft cap, in layouts the sm90 backward takes (its capped bias
    kernels: the cap before the bias, whose gradient takes d logit without the tanh's slopes);
    Gemma 2's cap with a [B, 1, T, S] mask is the common case. SATURATING's cap of 5 at scale 0.5
    puts many logits on the tanh's flat part."""
    rng = rng_for("bias_softcap", case, h)
    b, t, s, n = 2, 333, 720, 4
    cases = {
        "learned_bias_causal": dict(bias=_bias(rng, (1, n, t, s), jnp.bfloat16), is_causal=True),
        "fixed_bias_window": dict(bias=_bias(rng, (b, 1, t, s)), local_window_size=(100, 30)),
        "mask_lengths": dict(mask=_mask(rng, (b, 1, t, s)), key_value_seq_lengths=_lengths(rng, b, s)),
    }[case]
    bias = cases.pop("bias", None)
    if bias is None:
        check(jnp.bfloat16, b, t, s, n, 2, h, softcap=5.0, scale=0.5, **cases)
    elif case == "learned_bias_causal":
        check_with_bias(jnp.bfloat16, b, t, s, n, 2, h, bias, softcap=5.0, scale=0.5, **cases)
    else:  # the bias not differentiated: the kernels without dbias
        check(jnp.bfloat16, b, t, s, n, 2, h, bias=bias, softcap=5.0, scale=0.5, **cases)


@pytest.mark.timing
@pytest.mark.parametrize("h", [128, 256])
def test_softcap_with_bias_costs_little(h):
    """A [T, S] bias at 8k causal tokens: forward + backward with a soft cap within 1.3x of
    without. Catches the capped bias backward falling back to the mma.sync kernels (2-3x the
    wgmma ones with a bias) or losing its registers to spills."""
    t = 8192
    rng = rng_for("bias_softcap_speed", h)
    q, k, v = qkv(rng, jnp.bfloat16, 1, t, t, 2048 // h, 2048 // h, h)
    bias = _bias(rng, (1, 1, t, t), jnp.bfloat16)

    def timed(**kw):
        step = jax.jit(jax.value_and_grad(
            lambda q, k, v: jax_flash.attention(q, k, v, bias, implementation="cuda", is_causal=True, **kw)
            .astype(jnp.float32).sum(), argnums=(0, 1, 2)))
        return rested_seconds(step, (q, k, v))

    capped, plain = timed(softcap=30.0), timed()
    assert capped < 1.3 * plain, f"softcap with bias {capped * 1e3:.1f} ms against {plain * 1e3:.1f} ms"


def _turing_refuses(fn, *args) -> bool:
    """Under the grid run as a T4 (JAX_FLASH_KERNELS=sm75, whose kernels take no bias), whether
    `implementation="cuda"` refused `fn(*args)` naming Turing (else it raises); False elsewhere."""
    if forced_family() != "sm75":
        return False
    with pytest.raises(ValueError, match="on Turing"):
        fn(*args)
    return True


def test_fully_masked_rows_give_zero_and_no_nan():
    rng = rng_for("bias_empty_rows")
    q, k, v = qkv(rng, jnp.bfloat16, 2, 130, 200, 2, 2, 64)
    mask = np.ones((2, 2, 130, 200), bool)
    mask[:, :, 5:70] = False
    bias = _bias(rng, (1, 2, 130, 200))

    def loss(q, k, v, bias):
        out = jax_flash.attention(q, k, v, bias, jnp.asarray(mask), implementation="cuda")
        return jnp.sum(out.astype(jnp.float32) ** 2), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    if _turing_refuses(step, q, k, v, bias):
        return
    (_, out), grads = step(q, k, v, bias)
    assert not np.any(np.asarray(out[:, 5:70], np.float32))
    for g in grads:
        assert not np.isnan(np.asarray(g, np.float32)).any()
    assert not np.any(np.asarray(grads[0][:, 5:70], np.float32))  # dQ of the empty rows
    assert not np.any(np.asarray(grads[3][:, :, 5:70]))  # and their dbias


def test_deterministic_bias_gradient(monkeypatch):
    """Deterministic mode: a broadcast bias's gradient bit-identical over 5 runs."""
    monkeypatch.setenv(_ffi.DETERMINISTIC_ENV, "1")
    rng = rng_for("bias_deterministic")
    q, k, v = qkv(rng, jnp.bfloat16, 2, 600, 600, 4, 2, 128)
    g_out = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    bias = _bias(rng, (1, 1, 600, 600))
    if _turing_refuses(lambda: _bias_grad("cuda", q, k, v, g_out, bias, is_causal=True)):
        return
    first = _bias_grad("cuda", q, k, v, g_out, bias, is_causal=True)
    for _ in range(4):
        np.testing.assert_array_equal(_bias_grad("cuda", q, k, v, g_out, bias, is_causal=True), first)


def test_auto_mode_runs_bias_and_mask_on_the_kernels():
    rng = rng_for("auto_bias")
    q, k, v = qkv(rng, jnp.bfloat16, 1, 256, 256, 2, 2, 128)
    bias, mask = _bias(rng, (1, 2, 256, 256)), _mask(rng, (1, 1, 256, 256))
    loss = lambda q, k, v, bias: jax_flash.attention(q, k, v, bias, mask).astype(jnp.float32).sum()  # noqa: E731
    fwd = _custom_call_targets(lambda q, k, v: jax_flash.attention(q, k, v, bias, mask), q, k, v)
    grad = _custom_call_targets(jax.grad(loss, argnums=(0, 1, 2, 3)), q, k, v, bias)
    on_kernels = forced_family() != "sm75"  # the grid run as a T4: auto mode takes cuDNN or xla there
    assert ("jax_flash_fwd" in fwd) == on_kernels and ("jax_flash_bwd" in grad) == on_kernels
