"""Auto mode on a CUDA GPU whose calls the kernels cannot run (cudnn_fallback.py), on CPU: the GPU
and its capability are stand-ins (fake_kernels), and `jax.nn.dot_product_attention` records what
it is asked for cuDNN and computes it with XLA, so that the arguments' meaning is checked against
the float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _ffi
from tests import fake_kernels, reference

_JAX_NN = jax.nn.dot_product_attention


@pytest.fixture
def cudnn_calls(monkeypatch):
    """A GPU of compute capability 10.0 with an install that has no code for it (machine code for
    sm_80 and sm_90a, no PTX), whose cuDNN attention runs as jax.nn's XLA one; the kwargs of every
    cuDNN call traced."""
    fake_kernels.install(monkeypatch)
    monkeypatch.setattr(_ffi, "device_capability", lambda: (10, 0))
    monkeypatch.setattr(_ffi, "built_archs", lambda: ("80", "90a"))
    calls = []

    def fake(q, k, v, bias=None, mask=None, *, implementation=None, **kwargs):
        assert implementation == "cudnn" and bias is None and mask is None
        calls.append(kwargs)
        return _JAX_NN(q, k, v, implementation="xla", **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", fake)
    return calls


def _inputs(t=64, s=64, n=4, kv_heads=2, h=64, dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(2, t, n, h)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(2, s, kv_heads, h)), dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("capability,archs,path", [
    ((7, 0), _ffi.PORTABLE_BUILT_ARCHS, "cudnn"), ((7, 5), _ffi.PORTABLE_BUILT_ARCHS, "cudnn"),  # bf16 on Turing
    ((8, 0), _ffi.PORTABLE_BUILT_ARCHS, "cuda"),
    ((8, 9), _ffi.PORTABLE_BUILT_ARCHS, "cuda"), ((9, 0), _ffi.PORTABLE_BUILT_ARCHS, "cuda"),
    ((10, 0), _ffi.PORTABLE_BUILT_ARCHS, "cudnn"),  # cuDNN first on 10.x, where ours would be PTX
    ((12, 0), _ffi.PORTABLE_BUILT_ARCHS, "cuda"),  # from the PTX
    ((10, 0), ("80", "90a"), "cudnn"), ((12, 0), ("80", "90a"), "cudnn"),  # an install without it
])  # fmt: skip
def test_each_capability_takes_the_kernels_or_cudnn(monkeypatch, cudnn_calls, capability, archs, path):
    monkeypatch.setattr(_ffi, "device_capability", lambda: capability)
    monkeypatch.setattr(_ffi, "built_archs", lambda: archs)
    q, k, v = _inputs()
    assert jax_flash.chosen_implementation(q, k, v, is_causal=True) == path
    assert bool(cudnn_calls) == (path == "cudnn")
    # On 10.x with PTX built the kernels run (implementation="cuda"); auto mode just asks cuDNN first.
    kernels_run = capability[0] == 10 and "80-virtual" in archs
    if path == "cudnn" and not kernels_run:  # implementation="cuda" still refuses, naming the GPU
        named = f"{capability[0]}\\.{capability[1]}"
        # Too old for the kernels, Turing's take no bf16, or an install without code for the GPU.
        message = {(7, 0): f"this GPU is {named}", (7, 5): "float16 only"}.get(capability, f"this GPU \\({named}\\)")
        with pytest.raises(ValueError, match=message):
            jax_flash.attention(q, k, v, implementation="cuda")
    elif kernels_run:
        assert jax_flash.chosen_implementation(q, k, v, is_causal=True, implementation="cuda") == "cuda"


@pytest.mark.parametrize("kwargs,expected", [
    ({}, {"is_causal": False, "local_window_size": None}),
    ({"is_causal": True}, {"is_causal": True, "local_window_size": None}),
    ({"local_window_size": (8, 3)}, {"is_causal": False, "local_window_size": (8, 3)}),
    ({"local_window_size": 5, "is_causal": True}, {"is_causal": False, "local_window_size": (5, 0)}),
])  # fmt: skip
def test_cudnn_computes_what_we_define(cudnn_calls, kwargs, expected):
    q, k, v = _inputs()
    out = jax_flash.attention(q, k, v, scale=0.2, **kwargs)
    assert len(cudnn_calls) == 1 and {key: cudnn_calls[0][key] for key in expected} == expected
    assert cudnn_calls[0]["scale"] == 0.2
    ref, _ = reference.attention(q, k, v, scale=0.2, **kwargs)
    err = np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref)
    assert out.dtype == q.dtype and err < 1e-2
    grads = jax.grad(lambda q, k, v: jax_flash.attention(q, k, v, **kwargs).astype(jnp.float32).sum(),
                     argnums=(0, 1, 2))(q, k, v)  # fmt: skip
    assert all(g.shape == x.shape and np.isfinite(np.asarray(g, np.float32)).all() for g, x in zip(grads, (q, k, v)))


def test_calls_whose_meaning_jax_nn_lacks_stay_on_the_xla_path(cudnn_calls):
    q, k, v = _inputs()
    q_long, k_long, v_long = _inputs(t=16, s=64)
    lengths = jnp.array([64, 40], jnp.int32)
    segments = jnp.zeros((2, 64), jnp.int32)
    cases = [
        ((q, k, v), {"softcap": 30.0}),
        ((q, k, v), {"q_segment_ids": segments, "kv_segment_ids": segments}),
        ((q, k, v), {"bias": jnp.zeros((1, 1, 64, 64), jnp.bfloat16)}),
        ((q, k, v), {"mask": jnp.ones((1, 1, 64, 64), bool)}),
        ((q, k, v), {"key_value_seq_lengths": lengths}),
        ((q, k, v), {"query_seq_lengths": lengths}),
        ((q_long, k_long, v_long), {"is_causal": True}),  # T != S: the diagonals differ
        ((q, k, v), {"return_residual": True}),
        (tuple(x.astype(jnp.float32) for x in (q, k, v)), {}),
        ((q, k, v[..., :32]), {}),  # value head dim 32 under 64
    ]
    for args, kwargs in cases:
        assert jax_flash.chosen_implementation(*args, **kwargs) == "xla-dense", kwargs
        assert not cudnn_calls, kwargs
    # T != S without a band: no diagonal to align, so cuDNN takes it
    assert jax_flash.chosen_implementation(q_long, k_long, v_long) == "cudnn"
    # implementation="xla" is never rerouted
    assert jax_flash.chosen_implementation(q, k, v, implementation="xla") == "xla-dense"


def test_what_cudnn_refuses_when_traced_takes_the_xla_path(monkeypatch, cudnn_calls):
    def refuses(*args, **kwargs):
        raise NotImplementedError("Unsupported head_dim")

    monkeypatch.setattr(jax.nn, "dot_product_attention", refuses)
    q, k, v = _inputs()
    assert jax_flash.chosen_implementation(q, k, v) == "xla-dense"
    ref, _ = reference.attention(q, k, v)
    out = jax_flash.attention(q, k, v)
    assert np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref) < 1e-2
