"""The public function: agreement with jax.nn.dot_product_attention, shapes, the implementation
choice, and clear errors for bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _ffi, _plan, cuda_impl
from jax_flash._validation import validate
from tests import reference
from tests.cases import qkv, rng_for


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("window", [None, (4, 2)])
def test_matches_jax_nn(is_causal, window):
    """With T == S (where both align the diagonal the same way) we equal jax.nn."""
    q, k, v = qkv(rng_for("jaxnn", is_causal, window), jnp.float32, 2, 40, 40, 4, 2, 32)
    bias = jnp.asarray(rng_for("bias").normal(size=(1, 4, 40, 40)), jnp.float32)
    kw = dict(is_causal=is_causal, local_window_size=window)
    ours = jax_flash.attention(q, k, v, bias, implementation="xla", **kw)
    theirs = jax.nn.dot_product_attention(q, k, v, bias, implementation="xla", **kw)
    assert reference.rel_error(ours, theirs) < 1e-5


def test_unbatched_inputs_and_residual():
    q, k, v = qkv(rng_for("3d"), jnp.float64, 1, 20, 30, 4, 2, 16)
    out, lse = jax_flash.attention(q[0], k[0], v[0], is_causal=True, return_residual=True,
                                   implementation="xla")
    ref_out, ref_lse = reference.attention(q, k, v, is_causal=True)
    assert out.shape == (20, 4, 16) and lse.shape == (20, 4)
    assert reference.rel_error(out, ref_out[0]) < 1e-12
    assert reference.rel_error(lse, ref_lse[0]) < 1e-12


def test_unbatched_segment_ids_may_be_1d():
    q, k, v = qkv(rng_for("3dseg"), jnp.float64, 1, 12, 12, 2, 2, 8)
    seg = jnp.asarray([0] * 5 + [1] * 7, jnp.int32)
    out = jax_flash.attention(q[0], k[0], v[0], q_segment_ids=seg, kv_segment_ids=seg,
                              implementation="xla")
    ref = reference.attention(q, k, v, q_segment_ids=seg[None], kv_segment_ids=seg[None])[0]
    assert reference.rel_error(out, ref[0]) < 1e-12


def test_auto_falls_back_to_xla_when_cuda_cannot_run():
    q, k, v = qkv(rng_for("auto"), jnp.float32, 1, 16, 16, 2, 2, 16)
    call = validate(q, k, v, None, None, scale=None, is_causal=False, query_seq_lengths=None,
                    key_value_seq_lengths=None, local_window_size=None, implementation=None,
                    return_residual=False, softcap=None, q_segment_ids=None, kv_segment_ids=None)
    auto = jax_flash.attention(q, k, v)
    xla = jax_flash.attention(q, k, v, implementation="xla")
    if cuda_impl.unsupported_reason(call) is not None:  # float32 is never run by the kernels
        np.testing.assert_array_equal(auto, xla)
        with pytest.raises(ValueError, match="implementation='cuda' cannot run"):
            jax_flash.attention(q, k, v, implementation="cuda")


def _inputs():
    return qkv(rng_for("bad"), jnp.float32, 2, 8, 8, 4, 2, 16)


BAD_CALLS = [
    (dict(implementation="cudnn"), ValueError, "implementation"),
    (dict(implementation="CUDA"), ValueError, "implementation"),
    (dict(local_window_size=-1), ValueError, "local_window_size"),
    (dict(local_window_size=(1, 2, 3)), TypeError, "local_window_size"),
    (dict(local_window_size=1.5), TypeError, "local_window_size"),
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap="big"), TypeError, "softcap"),
    (dict(scale=float("nan")), ValueError, "scale"),
    (dict(scale="x"), TypeError, "scale"),
    (dict(is_causal="yes"), TypeError, "is_causal"),
    (dict(return_residual=1), TypeError, "return_residual"),
    (dict(query_seq_lengths=jnp.ones((3,), jnp.int32)), ValueError, "query_seq_lengths"),
    (dict(key_value_seq_lengths=jnp.ones((2,), jnp.float32)), TypeError, "key_value_seq_lengths"),
    (dict(q_segment_ids=jnp.zeros((2, 8), jnp.int32)), ValueError, "kv_segment_ids"),
    (dict(q_segment_ids=jnp.zeros((2, 7), jnp.int32), kv_segment_ids=jnp.zeros((2, 8), jnp.int32)),
     ValueError, "q_segment_ids"),
    (dict(q_segment_ids=jnp.zeros((2, 8)), kv_segment_ids=jnp.zeros((2, 8), jnp.int32)),
     TypeError, "q_segment_ids"),
    (dict(bias=jnp.zeros((2, 3, 8, 8))), ValueError, "bias"),
    (dict(bias=jnp.zeros((1, 1, 1, 1, 8))), ValueError, "bias"),
    (dict(bias=jnp.zeros((2, 4, 8, 8), jnp.int32)), TypeError, "bias"),
    (dict(mask=jnp.zeros((2, 4, 8, 8))), TypeError, "mask"),
    (dict(mask=jnp.zeros((2, 4, 9, 8), bool)), ValueError, "mask"),
]


@pytest.mark.parametrize("kwargs,error,name", BAD_CALLS)
def test_bad_arguments_raise_naming_the_argument(kwargs, error, name):
    q, k, v = _inputs()
    kwargs = dict(kwargs)
    bias, mask = kwargs.pop("bias", None), kwargs.pop("mask", None)
    with pytest.raises(error, match=name):
        jax_flash.attention(q, k, v, bias, mask, **kwargs)


@pytest.mark.parametrize(
    "shapes,error,name",
    [
        (((2, 8, 4, 16), (2, 8, 3, 16), (2, 8, 3, 16)), ValueError, "multiple"),
        (((2, 8, 4, 16), (2, 8, 2, 32), (2, 8, 2, 32)), ValueError, "head dim"),
        (((2, 8, 4, 16), (3, 8, 2, 16), (3, 8, 2, 16)), ValueError, "batch"),
        (((2, 8, 4, 16), (2, 8, 2, 16), (2, 9, 2, 16)), ValueError, "value must have key.s batch, length and heads"),
        (((8, 4, 16), (2, 8, 2, 16), (2, 8, 2, 16)), ValueError, "same rank"),
        (((4, 16), (4, 16), (4, 16)), ValueError, "query must have shape"),
        (((2, 8, 4, 16), (2, 8, 0, 16), (2, 8, 0, 16)), ValueError, "at least one head"),
    ],
)
def test_bad_shapes(shapes, error, name):
    q, k, v = (jnp.ones(s, jnp.float32) for s in shapes)
    with pytest.raises(error, match=name):
        jax_flash.attention(q, k, v)


def test_bad_dtypes():
    q, k, v = _inputs()
    with pytest.raises(TypeError, match="share one dtype"):
        jax_flash.attention(q, k.astype(jnp.bfloat16), v)
    with pytest.raises(TypeError, match="query dtype"):
        jax_flash.attention(q.astype(jnp.int32), k, v)
    with pytest.raises(TypeError, match="query must be an array"):
        jax_flash.attention("q", k, v)


@pytest.mark.parametrize("value,forced", [(None, None), ("best", None), ("sm80", 80), ("sm75", 75)])
def test_kernel_family_from_the_environment(monkeypatch, value, forced):
    if value is None:
        monkeypatch.delenv(_plan.KERNELS_ENV, raising=False)
    else:
        monkeypatch.setenv(_plan.KERNELS_ENV, value)
    assert _plan.forced_family() == forced


def test_unknown_kernel_family_names_the_variable(monkeypatch):
    monkeypatch.setenv(_plan.KERNELS_ENV, "sm90")
    with pytest.raises(ValueError, match="JAX_FLASH_KERNELS must be one of"):
        _plan.forced_family()


@pytest.mark.parametrize("value,expected", [(None, False), ("0", False), ("1", True)])
def test_deterministic_switch_from_the_environment(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(_ffi.DETERMINISTIC_ENV, raising=False)
    else:
        monkeypatch.setenv(_ffi.DETERMINISTIC_ENV, value)
    assert _ffi.deterministic() is expected


def test_unknown_deterministic_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(_ffi.DETERMINISTIC_ENV, "yes")
    with pytest.raises(ValueError, match="JAX_FLASH_DETERMINISTIC must be '0' or '1'"):
        _ffi.deterministic()
